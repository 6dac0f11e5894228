# The datagram channel's protocol, over its endpoint (dgram_endpoint.pxi)
# and wire format (dgram_wire.pxi).  No acknowledgements and, when the call
# has a deadline, no retransmissions: a lost datagram is gone.
#
# One block is one datagram, so the per-block contributor counts of the
# algorithms are the per-range counts of the packets that arrived, and the
# unbiased scaling works unchanged on whatever fraction arrived.  Records are
# pushed: `publish` sends a record to its readers from this rank's outbox
# (two, by call parity, so that a record stays intact while a peer may still
# ask for it).  Received datagrams are validated (check_packet) and copied
# into an inbox indexed by stream and block, where `poll` finds them.
#
# A rank entering a call sends a HELLO with the call's signature to every
# peer: that is how peers see it enter (the deadline anchor) and how
# disagreements between ranks show.  Datagrams of the next call, sent by a
# peer that is ahead, are stashed and replayed when this rank gets there.
# Errors go to every peer as ERROR datagrams and, since those may be lost,
# as an MPI message too (reliable), which a waiting rank looks for every
# millisecond.  A DATA of this call with another call signature is a
# disagreement as sure as a HELLO that says so (a lost HELLO hides none);
# waiting without a deadline a rank repeats its HELLO with every NACK.  A
# NACK carries a number that grows with each one a rank sends in a call, so
# that a replayed NACK makes no resends.  Without a deadline
# (timeout=None) a reader asks again (NACK) for blocks that do not come, so
# that the result is exact even on a lossy network; with a deadline it never
# does.  After the last block of a slot the sender sends END, twice, to the
# slot's readers: a reader that has it stops waiting for what is still
# missing after a short grace (early close, schedule.pxi).  A burst of loss
# can take both copies, and the reader would then wait for its stage's
# deadline; so while a rank waits in its call it says END again to the
# readers that are in the call (entered it, not yet seen in a later one),
# after END_REPEAT, then at doubling intervals up to END_REPEAT_MAX: nothing
# acknowledges an END, and at 2(N-1) datagrams a round a fixed period would
# cost each waiting rank thousands of datagrams a second at 16 ranks.  A
# call of T seconds repeats at most about log2(T / END_REPEAT) + T /
# END_REPEAT_MAX rounds.
#
# Without a deadline a rank that has its result stays in the call, answering
# NACKs, until every peer has said over MPI that it has its own (a note of
# kind ERR_NONE; an error note says the same) or is seen in a later call.
# Returning earlier, to an MPI collective say, would leave a peer that lost a
# datagram asking a rank that no longer listens: a deadlock.

cdef enum:
    STASH_PACKETS = 512            # datagrams of the next call kept for it...
    STASH_CONTROL_PER_PEER = 8     # ...and room beyond them for its HELLO, ERROR, END

# How often a rank in a call looks for errors told over MPI (seconds).
cdef double ERROR_PROBE_INTERVAL = 1e-3
# When a waiting rank first repeats the END of its finished slots (seconds):
# well under a burst of loss, far above a datagram's time on the wire; the
# interval then doubles up to END_REPEAT_MAX.
cdef double END_REPEAT = 2e-3
cdef double END_REPEAT_MAX = 64e-3
# A peer seen in a later call has sent what it will send for this one, but
# FI_EP_DGRAM does not promise order: its last datagrams of this call may
# still be behind its first of the next.  Wait this long before giving up.
cdef double REORDER_GRACE = 200e-6


cdef class DgramChannel(DgramEndpoint):
    """The channel interface (channel.pxi) over datagrams."""
    cdef CallInfo cur                 # the call datagrams are judged against: a
                                      # copy, since the core reuses its CallInfo
    # what each outbox holds (by call parity), for answering NACKs
    cdef uint64_t out_seq[2]
    cdef int out_slot_records[2]
    cdef int out_records[2]
    cdef unsigned char* published[2]
    cdef Py_ssize_t published_cap_of[2]
    cdef int* published_blocks        # per slot, in this call
    cdef Py_ssize_t published_cap
    cdef int* end_readers             # per slot: the readers its END went to...
    cdef int* end_nreaders            # ...and how many (0: no END yet)
    cdef Py_ssize_t end_caps[2]
    cdef double next_end_repeat
    cdef double end_repeat_gap        # the interval before the next repeat
    # inbox of the current call
    cdef char* inbox
    cdef Py_ssize_t inbox_cap
    cdef unsigned char* arrived
    cdef uint32_t* counts
    cdef uint32_t* sizes
    cdef double* last_nack
    cdef double* ahead_since          # per stream: when its peer was first seen in a later call
    cdef unsigned char* ended         # per stream: END arrived
    cdef Py_ssize_t caps[6]           # items in arrived, counts, sizes, last_nack,
                                      # ahead_since, ended
    cdef int* stream_of               # peer * nslots + slot -> stream, or -1
    cdef Py_ssize_t stream_of_cap
    cdef int nstreams
    # peers
    cdef uint64_t* peer_seq           # the latest call each peer was seen in
    cdef unsigned char* told_done     # per peer: sent this call's done note (end)
    cdef bint armed                   # the current call's streams are known
    cdef char* stash                  # datagrams that came too early
    cdef char* replaying              # the stash being replayed
    cdef int nstash
    cdef int stash_cap                # STASH_PACKETS, and the room for control datagrams
    cdef double next_probe            # when to look for notes over MPI (outcome.pxi)
    # NACKs: per peer and call parity, the call and number of the last one
    # answered; the numbers of this rank's own
    cdef Requests requests            # NACK numbers (dgram_recovery.pxi)
    cdef bint failed_call
    # counters of datagrams judged, for the whole life of the channel
    cdef uint64_t n_foreign, n_forged, n_malformed, n_stale, n_future, n_unexpected
    cdef uint64_t n_duplicate, n_mismatch, n_nacks, n_resent
    cdef uint64_t n_nack_replayed, n_nack_deferred, n_end_repeats

    def __cinit__(self):
        memset(&self.cur, 0, sizeof(CallInfo))
        self.next_end_repeat = -1.0     # (no call begun: nothing to repeat)

    cdef int allocate_fixed(self) except -1:
        DgramEndpoint.allocate_fixed(self)
        self.stash_cap = STASH_PACKETS + STASH_CONTROL_PER_PEER * self.size
        self.peer_seq = <uint64_t*>calloc(self.size, sizeof(uint64_t))
        self.told_done = <unsigned char*>calloc(self.size, 1)
        self.stash = <char*>aligned(self.stash_cap * self.pkt)
        self.replaying = <char*>aligned(self.stash_cap * self.pkt)
        self.requests = Requests(self.size)
        if not (self.peer_seq and self.told_done and self.stash and self.replaying):
            raise MemoryError()
        self.outcomes = Outcomes()
        self.outcomes.setup(self.comm)
        return 0

    cdef void close(self):
        if self.outcomes is not None:
            self.outcomes.close()
        DgramEndpoint.close(self)

    def __dealloc__(self):
        # Close first: the endpoint's close reaps completions, which hands
        # datagrams to accept(), and accept needs what is freed below.
        DgramEndpoint.close(self)
        free(self.peer_seq)
        free(self.told_done)
        free(self.stash)
        free(self.replaying)
        free(self.published[0])
        free(self.published[1])
        free(self.inbox)
        free(self.arrived)
        free(self.counts)
        free(self.sizes)
        free(self.last_nack)
        free(self.ahead_since)
        free(self.ended)
        free(self.published_blocks)
        free(self.end_readers)
        free(self.end_nreaders)
        free(self.stream_of)

    def info(self) -> dict:
        return {"channel": "ud",
                "provider": mpl_dg_provider(self.fab).decode() if self.fab != NULL else "",
                "domain": mpl_dg_domain_name(self.fab).decode() if self.fab != NULL else "",
                "datagram_payload": self.payload_max, "token": self.token,
                "address": self.address(), **self.counters()}

    def mac_key(self) -> bytes:
        return (<char*>self.key)[:MPL_MAC_KEY_BYTES]

    def counters(self) -> dict:
        """Datagrams by fate: sent, received, and dropped by cause (docs/ud.md)."""
        return {**DgramEndpoint.counters(self), "foreign": self.n_foreign,
                "forged": self.n_forged, "malformed": self.n_malformed, "stale": self.n_stale,
                "future": self.n_future, "unexpected": self.n_unexpected,
                "duplicate": self.n_duplicate, "mismatch": self.n_mismatch,
                "nacks": self.n_nacks, "resent": self.n_resent,
                "nacks_replayed": self.n_nack_replayed, "nacks_deferred": self.n_nack_deferred,
                "end_repeats": self.n_end_repeats,
                "done_notes": self.n_done_notes, "note_waits_out": self.n_note_waits_out,
                "errors_heard_over_mpi": self.outcomes.heard if self.outcomes is not None
                else 0}

    # -- per call ------------------------------------------------------------
    cdef int begin(self, CallInfo* call) except -1:
        cdef int parity = call.seq & 1
        cdef Py_ssize_t records = <Py_ssize_t>call.nslots * call.records
        cdef double limit = mpl_now() + (min(call.timeout, STALL_LIMIT) if call.timeout >= 0
                                         else STALL_LIMIT)
        # Datagrams that arrive now belong to this call or later: judge them
        # against the previous call, which stashes those of the next one.
        self.drain()
        # Every step below may fail (memory, a send queue that never
        # drains); each leaves its buffer and its recorded size in
        # agreement, and the layout of this call is installed only at the
        # end (fail() installs none), so that no datagram is ever placed
        # by a layout its buffers were not sized for.
        self.out_seq[parity] = 0        # (what it held, call seq-2, is given up)
        self.next_end_repeat = -1.0     # (the last call's ENDs: not this one's)
        # This outbox held call seq-2; its sends must be done before reuse.
        self.reserve_outbox(parity, records, limit)
        grow_buffer(<void**>&self.published[parity], &self.published_cap_of[parity], records, 1)
        memset(self.published[parity], 0, records)
        grow_buffer(<void**>&self.published_blocks, &self.published_cap, call.nslots, sizeof(int))
        memset(self.published_blocks, 0, call.nslots * sizeof(int))
        grow_buffer(<void**>&self.end_readers, &self.end_caps[0],
                    <Py_ssize_t>call.nslots * self.size, sizeof(int))
        grow_buffer(<void**>&self.end_nreaders, &self.end_caps[1], call.nslots, sizeof(int))
        memset(self.end_nreaders, 0, call.nslots * sizeof(int))
        self.out_seq[parity] = call.seq
        self.out_slot_records[parity] = call.records
        self.out_records[parity] = <int>records
        cdef Py_ssize_t mapping = <Py_ssize_t>self.size * call.nslots
        grow_buffer(<void**>&self.stream_of, &self.stream_of_cap, mapping, sizeof(int))
        for i in range(mapping):
            self.stream_of[i] = -1
        self.nstreams = 0
        self.failed_call = False
        self.error.kind = ERR_NONE
        self.cur = call[0]
        self.armed = False           # until the streams are known: stash, don't place
        self.requests.new_call()
        self.hear_errors()              # (an error of this call told before this rank got here)
        self.send_hello()
        return 0

    cdef int prepare(self, Stream* s) except -1:
        """Room in the inbox for stream number nstreams, then map it: a
        failure leaves every buffer as big as its recorded size, and the
        stream unmapped (its datagrams are refused as unexpected)."""
        cdef CallInfo* c = &self.cur
        cdef int i = self.nstreams
        cdef Py_ssize_t blocks = <Py_ssize_t>(i + 1) * c.records
        grow_buffer(<void**>&self.inbox, &self.inbox_cap, blocks * c.record_bytes, 1, keep=False)
        grow_buffer(<void**>&self.arrived, &self.caps[0], blocks, 1)
        grow_buffer(<void**>&self.counts, &self.caps[1], blocks, sizeof(uint32_t))
        grow_buffer(<void**>&self.sizes, &self.caps[2], blocks, sizeof(uint32_t))
        grow_buffer(<void**>&self.last_nack, &self.caps[3], i + 1, sizeof(double))
        grow_buffer(<void**>&self.ahead_since, &self.caps[4], i + 1, sizeof(double))
        grow_buffer(<void**>&self.ended, &self.caps[5], i + 1, 1)
        self.nstreams += 1
        s.index = i
        self.stream_of[s.peer * c.nslots + s.slot] = i
        self.ended[i] = 0
        self.ahead_since[i] = -1.0
        memset(self.arrived + <Py_ssize_t>i * c.records, 0, c.records)
        self.last_nack[i] = mpl_now()
        return 0

    cdef char* claim(self, int slot, int block) noexcept nogil:
        return self.mine(slot, block)

    cdef char* mine(self, int slot, int block) noexcept nogil:
        cdef int parity = self.cur.seq & 1
        return (self.packet(parity, <Py_ssize_t>slot * self.cur.records + block)
                + self.prefix + HEADER_BYTES)

    cdef void publish(self, int slot, int block, uint32_t count, uint32_t nbytes,
                      const int* dests, int ndests) noexcept nogil:
        cdef int parity = self.cur.seq & 1, i
        cdef Py_ssize_t record = <Py_ssize_t>slot * self.cur.records + block
        cdef char* buf = self.packet(parity, record)
        cdef mpl_packet_t* hdr = <mpl_packet_t*>(buf + self.prefix)
        self.fill_header(hdr, MPL_PKT_DATA, self.cur.seq, slot, block, count, nbytes)
        hdr.sig = <uint32_t>self.cur.sig
        self.seal(hdr)                  # (a NACK may still ask for it)
        self.published[parity][record] = 1
        if self.past_cap():
            # Past the deadline every reader has stopped waiting: sending
            # would only make this call later.
            self.n_unsent += ndests
            ndests = 0
        for i in range(ndests):
            self.send(dests[i], buf, self.prefix + HEADER_BYTES + nbytes, parity)
        self.published_blocks[slot] += 1
        if self.published_blocks[slot] == self.cur.records and ndests:
            for i in range(2):          # datagrams get lost: say it twice
                self.send_control_to(MPL_PKT_END, self.cur.seq, slot, 0, NULL, 0, dests, ndests)
            if self.end_nreaders == NULL:
                return                  # (a layout installed without begin: the tests' judge)
            memcpy(self.end_readers + <Py_ssize_t>slot * self.size, dests, ndests * sizeof(int))
            self.end_nreaders[slot] = ndests
            if self.next_end_repeat < 0:
                self.end_repeat_gap = END_REPEAT
                self.next_end_repeat = mpl_now() + END_REPEAT

    cdef void repeat_ends(self) noexcept nogil:
        """END again for every finished slot, to its readers that are in this
        call (one that has not entered it would only stash it, one seen in a
        later call is done with it)."""
        cdef int slot, i, n, reader
        cdef int* readers
        self.end_repeat_gap = min(2 * self.end_repeat_gap, END_REPEAT_MAX)
        self.next_end_repeat = mpl_now() + self.end_repeat_gap
        if self.end_nreaders == NULL:
            return
        for slot in range(self.cur.nslots):
            readers = self.end_readers + <Py_ssize_t>slot * self.size
            n = 0
            for i in range(self.end_nreaders[slot]):
                reader = readers[i]
                if self.peer_seq[reader] == self.cur.seq:
                    readers[i] = readers[n]
                    readers[n] = reader
                    n += 1
            if n:
                self.n_end_repeats += n
                self.send_control_to(MPL_PKT_END, self.cur.seq, slot, 0, NULL, 0, readers, n)

    cdef inline bint past_cap(self) noexcept nogil:
        """Is the current call past its hard cap (start + timeout)?"""
        return self.cur.timeout >= 0 and mpl_now() > self.cur.start + self.cur.timeout

    cdef double stall_limit(self) noexcept nogil:
        """Until when a send may wait for room: the call's end with a
        deadline, STALL_LIMIT from now without."""
        cdef double now = mpl_now()
        if self.cur.timeout >= 0:
            return max(self.cur.start + self.cur.timeout, now + 1e-3)
        return now + STALL_LIMIT

    cdef void send_hello(self, int peer=-1) noexcept nogil:
        """This rank's HELLO of the current call, to `peer` or to every peer."""
        cdef mpl_hello_t hello
        cdef CallInfo* c = &self.cur
        hello.sig = c.sig
        hello.count = c.count
        hello.dtype = c.dtype
        hello.op = announced_op(c)
        hello.algo = announced_layout(c)
        hello.block = <uint32_t>c.record_bytes
        self.send_control(MPL_PKT_HELLO, c.seq, 0, 0, &hello, sizeof(mpl_hello_t), peer)

    # -- receiving -------------------------------------------------------------
    cdef void accept(self, const char* data, Py_ssize_t length, bint may_stash) noexcept nogil:
        """Judge one datagram (header + payload) and act on it."""
        cdef mpl_packet_t hdr
        cdef uint64_t cur = self.cur.seq
        self.n_received += 1
        cdef int verdict = check_packet(data, length, self.token, self.size, self.rank,
                                        self.payload_max, &self.mac, &hdr)
        if verdict == PACKET_FOREIGN:
            self.n_foreign += 1
            return
        if verdict == PACKET_TRUNCATED:
            self.n_truncated += 1
            return
        if verdict == PACKET_MALFORMED:
            self.n_malformed += 1
            return
        if verdict == PACKET_FORGED:
            self.n_forged += 1
            return
        if hdr.seq > self.peer_seq[hdr.src]:
            self.peer_seq[hdr.src] = hdr.seq
        if (hdr.seq == cur + 1 or (hdr.seq == cur and not self.armed)) and may_stash:
            if self.nstash < STASH_PACKETS or (hdr.kind != MPL_PKT_DATA
                                               and self.nstash < self.stash_cap):
                memcpy(self.stash + <Py_ssize_t>self.nstash * self.pkt, data, length)
                self.nstash += 1
            else:
                self.n_future += 1
            return
        if hdr.kind == MPL_PKT_NACK:
            self.answer_nack(&hdr, data + HEADER_BYTES)
            return
        cdef mpl_hello_t hello
        cdef mpl_error_t err
        if hdr.seq != cur:
            if hdr.seq < cur:
                self.n_stale += 1
                if hdr.kind == MPL_PKT_HELLO and self.armed:
                    # (a late peer entering a call this rank left: made otherwise?)
                    memcpy(&hello, data + HEADER_BYTES, sizeof(mpl_hello_t))
                    self.made_otherwise(hdr.src, hdr.seq, hello.sig, hello.algo, hello.count,
                                        hello.dtype, hello.op)
            else:
                self.n_future += 1
            return
        # check_packet made sure that a HELLO or ERROR payload has its
        # record's size; copy it out (the buffer may be unaligned).
        if hdr.kind == MPL_PKT_HELLO:
            memcpy(&hello, data + HEADER_BYTES, sizeof(mpl_hello_t))
            self.check_hello(&hdr, &hello)
        elif hdr.kind == MPL_PKT_ERROR:
            memcpy(&err, data + HEADER_BYTES, sizeof(mpl_error_t))
            self.take_error(&err)
        elif hdr.kind == MPL_PKT_DATA:
            self.place(&hdr, data + HEADER_BYTES)
        elif hdr.kind == MPL_PKT_END:
            self.mark_end(&hdr)

    cdef void mark_end(self, const mpl_packet_t* hdr) noexcept nogil:
        cdef int stream
        if hdr.slot >= <uint32_t>self.cur.nslots or hdr.nbytes:
            self.n_unexpected += 1
            return
        stream = self.stream_of[hdr.src * self.cur.nslots + hdr.slot]
        if stream < 0:
            self.n_unexpected += 1
            return
        self.ended[stream] = 1

    cdef void place(self, const mpl_packet_t* hdr, const char* payload) noexcept nogil:
        cdef CallInfo* c = &self.cur
        cdef int stream
        cdef Py_ssize_t at
        if hdr.sig != <uint32_t>c.sig:
            # This call's data, authentic, laid out for another call: the
            # ranks disagree, whether or not a HELLO said so.
            self.n_mismatch += 1
            if self.error.kind == ERR_NONE:
                self.error.kind = ERR_MISMATCH
                self.error.rank = self.rank
                snprintf(self.error.msg, MPL_MSG_LEN,
                         b"ranks disagree on call %llu: rank %d sent data laid out for another "
                         b"call (collective, count, dtype, op, algorithm, block size or "
                         b"redundancy); rank %d: ",
                         <unsigned long long>c.seq, hdr.src, self.rank)
                describe_call(self.error.msg + strlen(self.error.msg),
                              MPL_MSG_LEN - strlen(self.error.msg), announced_layout(c),
                              <uint64_t>c.count, <uint32_t>c.dtype, announced_op(c))
            return
        if (hdr.slot >= <uint32_t>c.nslots or hdr.block >= <uint32_t>c.records
                or hdr.nbytes > <uint32_t>c.record_bytes or hdr.count > <uint32_t>self.size):
            self.n_unexpected += 1
            return
        stream = self.stream_of[hdr.src * c.nslots + hdr.slot]
        if stream < 0:
            self.n_unexpected += 1
            return
        at = <Py_ssize_t>stream * c.records + hdr.block
        if self.arrived[at]:
            self.n_duplicate += 1
            return
        memcpy(self.inbox + at * c.record_bytes, payload, hdr.nbytes)
        self.counts[at] = hdr.count
        self.sizes[at] = hdr.nbytes
        self.arrived[at] = 1

    cdef void check_hello(self, const mpl_packet_t* hdr, const mpl_hello_t* hello) noexcept nogil:
        cdef CallInfo* c = &self.cur
        if hello.sig == c.sig or self.error.kind:
            return
        describe_mismatch(&self.error, c, self.rank, hdr.src, hello.algo, hello.count,
                          hello.dtype, hello.op)

    cdef void take_error(self, const mpl_error_t* e) noexcept nogil:
        if self.error.kind == ERR_NONE:
            # A kind this rank does not know still fails the call, as a
            # protocol error: never ERR_NONE, never an index out of range.
            self.error.kind = e.kind if ERR_NONE < e.kind <= ERR_LAST else ERR_PROTOCOL
            self.error.rank = e.rank
            memcpy(self.error.msg, e.msg, MPL_MSG_LEN)
            self.error.msg[MPL_MSG_LEN - 1] = 0

    cdef void answer_nack(self, const mpl_packet_t* hdr, const char* blocks) noexcept nogil:
        """A reader that waits without deadline asks again for the blocks
        listed in the payload (of slot hdr.slot)."""
        cdef int parity = hdr.seq & 1, i
        cdef uint32_t block
        cdef Py_ssize_t record
        cdef char* buf
        if self.out_seq[parity] != hdr.seq:
            return
        if self.requests.replayed(hdr.src, hdr.seq, hdr.block):
            self.n_nack_replayed += 1       # answered already: a replay makes no resends
            return
        if self.draining > 1:
            # Inside a send that waits for room: answering would nest sends
            # and drains without bound.  The reader asks again.
            self.n_nack_deferred += 1
            return
        self.requests.answered(hdr.src, hdr.seq, hdr.block)
        for i in range(hdr.nbytes // 4):
            memcpy(&block, blocks + 4 * i, 4)       # (the buffer may be unaligned)
            if block >= <uint32_t>self.out_slot_records[parity]:
                continue
            record = <Py_ssize_t>hdr.slot * self.out_slot_records[parity] + block
            if record >= self.out_records[parity] or not self.published[parity][record]:
                continue    # not written yet: it will be sent when it is
            buf = self.packet(parity, record)
            self.n_resent += 1
            self.send(hdr.src, buf, self.prefix + HEADER_BYTES + (<mpl_packet_t*>(buf + self.prefix)).nbytes,
                      parity)

    cdef void service(self) noexcept nogil:
        """Replay what arrived early for this call, then reap completions."""
        cdef int k, n
        cdef char* early
        cdef double now
        if not self.armed:
            # The streams are known now (bind ran): swap the stash out and
            # judge its datagrams again; those of the next call stash anew.
            self.armed = True
            early = self.stash
            self.stash = self.replaying
            self.replaying = early
            n = self.nstash
            self.nstash = 0
            for k in range(n):
                early = self.replaying + <Py_ssize_t>k * self.pkt
                self.accept(early, HEADER_BYTES + (<mpl_packet_t*>early).nbytes, True)
        self.drain()
        now = mpl_now()
        if now >= self.next_probe:
            self.hear_errors()
        if 0 <= self.next_end_repeat <= now and not self.past_cap():
            self.repeat_ends()

    cdef int poll(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef CallInfo* c = &self.cur
        cdef Py_ssize_t at = <Py_ssize_t>s.index * c.records + block
        cdef double now
        if not self.arrived[at] and block == s.cursor and not self.past_cap():
            # Drain for the cursor only: a look-ahead over many missing
            # blocks would otherwise make a system call per block.  Past the
            # call's hard cap nothing new is taken: the engine is only
            # resolving what is in hand, and each drain costs system calls.
            self.service()
        if self.error.kind != ERR_NONE:
            return POLL_FAIL
        if self.arrived[at]:
            inc.data = self.inbox + at * c.record_bytes
            inc.count = self.counts[at]
            inc.nbytes = self.sizes[at]
            return POLL_READY
        # A producer that moved on sent everything it will send.  Without a
        # deadline it still answers requests: its outbox holds this call until
        # its call seq+2, which it cannot reach before this rank takes part.
        if self.peer_seq[s.peer] > c.seq and c.timeout >= 0:
            now = mpl_now()
            if self.ahead_since[s.index] < 0:
                self.ahead_since[s.index] = now
            if now >= self.ahead_since[s.index] + REORDER_GRACE:
                return POLL_GONE
            self.service()
            return POLL_WAIT
        if c.timeout < 0:
            if self.peer_seq[s.peer] > c.seq + 1:
                # Two calls ahead: its outbox of this call is reused, nothing
                # will answer a request.  Ranks that agree on the call's
                # signature never get here (a peer without deadline that has
                # its result stays until this rank has its own).
                return POLL_GONE
            now = mpl_now()
            if now - self.last_nack[s.index] > NACK_INTERVAL:
                self.last_nack[s.index] = now
                self.request_missing(s)
        return POLL_WAIT

    cdef void request_missing(self, Stream* s) noexcept nogil:
        """No deadline: ask the producer again for what this rank still needs
        of `s` (dgram_recovery.pxi), as much as fits in one datagram."""
        cdef CallInfo* c = &self.cur
        cdef uint32_t missing[512]
        cdef int n = records_to_ask_for(c, s, self.arrived + <Py_ssize_t>s.index * c.records,
                                        missing, <int>min(512, self.payload_max // 4))
        if n:
            self.n_nacks += 1
            self.send_control(MPL_PKT_NACK, c.seq, s.slot, self.requests.next_number(), missing,
                              4 * n, s.peer)
        self.send_hello(s.peer)         # (if the first was lost, a disagreement would hide)

    cdef bint random_access(self, Stream* s) noexcept nogil:
        return True

    cdef bint confirm(self, Stream* s, int block) noexcept nogil:
        # A placed block stays as it is until the next call: place() never
        # writes a block twice.
        return True

    cdef bint closed(self, Stream* s) noexcept nogil:
        if not self.ended[s.index] and not self.past_cap():
            self.service()
        # A producer's note over MPI that it is done with the call says what
        # END says, and a burst of loss cannot take it (see end()).
        return self.ended[s.index] or (self.cur.timeout >= 0 and self.outcomes is not None
                                       and self.outcomes.said_done(s.peer, self.cur.seq))

    cdef int entered(self) noexcept nogil:
        cdef int p, k = 1
        self.service()
        for p in range(self.size):
            if p != self.rank and self.peer_seq[p] >= self.cur.seq:
                k += 1
        return k

    cdef void progress(self) noexcept nogil:
        self.service()

    cdef void end(self, CallInfo* call, bint failed) noexcept nogil:
        cdef double limit
        self.drain()
        if self.fab == NULL:
            return
        mpl_dg_flush(self.fab)          # nothing of this call may wait for the next...
        # ...and paced datagrams leave at the port's rate: peers wait for
        # them, until the call's end (or the stall limit without deadline).
        if mpl_dg_queued(self.fab):
            limit = call.start + call.timeout if call.timeout >= 0 else mpl_now() + STALL_LIMIT
            while mpl_dg_queued(self.fab) and mpl_now() < limit:
                self.drain()
                mpl_dg_flush(self.fab)
            if mpl_dg_queued(self.fab):
                self.n_unsent += mpl_dg_queued(self.fab)
                mpl_dg_discard_queued(self.fab)
                self.drain()            # (their slots back)
        if call.timeout < 0 and not failed:
            self.stay_for_readers(call)
        elif call.timeout >= 0 and not failed:
            self.tell_readers_done(call)

    cdef void tell_readers_done(self, CallInfo* call) noexcept nogil:
        """With a deadline: this rank leaves the call, and has sent all it
        will send.  Say so over MPI to the readers of its slots that are in
        the call (seen in it, not in a later one): a burst of loss can take
        every END, and the repeats stop now, so a reader missing blocks would
        otherwise wait for its stage's deadline (the hierarchy's stage across
        nodes under microbursts: 0.35 of the call's deadline).  (Not to
        readers behind, as the rma channel does: tried, a rank behind still
        waited out a note now and then at 4 ranks; not understood.)"""
        cdef int slot, i, reader
        cdef int* readers
        if self.outcomes is None or self.end_nreaders == NULL or self.cur.seq != call.seq:
            return
        memset(self.told_done, 0, self.size)
        self.outcomes.reap()
        for slot in range(self.cur.nslots):
            readers = self.end_readers + <Py_ssize_t>slot * self.size
            for i in range(self.end_nreaders[slot]):
                reader = readers[i]
                if self.told_done[reader] or self.peer_seq[reader] != call.seq:
                    continue            # (told; or, as for END's repeats, not in this call)
                self.told_done[reader] = 1
                if not self.tell_done(call.seq, reader):
                    return              # no memory: END and its repeats will have to do

    cdef void stay_for_readers(self, CallInfo* call) noexcept nogil:
        """No deadline: this rank has its result.  Say so to every peer, then
        answer NACKs until every peer is done with the call too (a failed
        peer told its error, which says the same).  A signal ends the wait
        early; its exception is left set for the core to raise."""
        cdef ErrorInfo done
        cdef int p = 0
        cdef double next_signal_check = mpl_now() + SIGNAL_CHECK_INTERVAL
        memset(&done, 0, sizeof(ErrorInfo))
        done.kind = ERR_NONE
        done.rank = self.rank
        if self.outcomes is None:
            return
        self.outcomes.tell(call.seq, &done)
        while True:
            self.hear_errors()
            while p < self.size and (p == self.rank or self.outcomes.done_seq[p] >= call.seq
                                     or self.peer_seq[p] > call.seq):
                p += 1                  # (a peer found done stays done: resume after it)
            if p == self.size:
                return
            self.drain()                # answers the NACKs of peers still reading
            mpl_dg_flush(self.fab)
            if mpl_now() >= next_signal_check:
                next_signal_check = mpl_now() + SIGNAL_CHECK_INTERVAL
                with gil:
                    if PyErr_CheckSignals() != 0:
                        return
            mpl_yield()

    cdef void fail(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        cdef mpl_error_t e
        cdef int repeat
        if self.cur.seq != call.seq:
            # Failed before begin completed: the call, but no layout (its
            # buffers may be sized for an earlier call): every DATA and END
            # of it is refused as unexpected, none stashed for good.
            self.cur = call[0]
            self.cur.nslots = self.cur.nblocks = self.cur.records = 0
            self.cur.block_bytes = self.cur.record_bytes = 0
            self.nstreams = 0
            self.armed = True
        e.kind = err.kind
        e.rank = err.rank
        memcpy(e.msg, err.msg, MPL_MSG_LEN)
        for repeat in range(2):         # datagrams get lost: say it twice...
            self.send_control(MPL_PKT_ERROR, call.seq, 0, 0, &e, sizeof(mpl_error_t), -1)
        if self.fab != NULL:
            mpl_dg_flush(self.fab)
        if self.outcomes is not None:
            self.outcomes.tell(call.seq, err)   # ...and once over MPI, which loses nothing

    # -- errors over MPI ---------------------------------------------------------
    cdef void hear_errors(self) noexcept nogil:
        """Take the notes peers told over MPI (outcome.pxi): one that fails
        this call fails it here."""
        if self.outcomes is None:
            return
        self.next_probe = mpl_now() + ERROR_PROBE_INTERVAL
        self.outcomes.hear()
        if self.error.kind == ERR_NONE:
            self.outcomes.pending(self.cur.seq, &self.error)
