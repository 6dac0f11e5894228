# Unreliable-datagram channel: libfabric FI_EP_DGRAM endpoints (verbs UD on
# InfiniBand/RoCE, efa on AWS, udp elsewhere).  No acknowledgements and, when
# the call has a deadline, no retransmissions: a lost datagram is gone.
#
# One block is one datagram, so the per-block contributor counts of the
# algorithms are the per-range counts of the packets that arrived, and the
# unbiased scaling works unchanged on whatever fraction arrived.  Records are
# pushed: `publish` sends a record to its readers from this rank's outbox
# (two, by call parity, so that a record stays intact while a peer may still
# ask for it).  Received datagrams are validated (mpilossy_native.h) and
# copied into an inbox indexed by stream and block, where `poll` finds them.
#
# Every datagram carries a MAC (SipHash-2-4, 128-bit tag, mpilossy_mac.h)
# keyed with a secret that rank 0 draws from the OS at construction and
# broadcasts over MPI: a datagram nobody with the key made is dropped and
# counted as `forged`, before anything in it is believed.
#
# A rank entering a call sends a HELLO with the call's signature to every
# peer: that is how peers see it enter (the deadline anchor) and how
# disagreements between ranks show.  Datagrams of the next call, sent by a
# peer that is ahead, are stashed and replayed when this rank gets there.
# Errors go to every peer as ERROR datagrams.  Without a deadline
# (timeout=None) a reader asks again (NACK) for blocks that do not come, so
# that the result is exact even on a lossy network; with a deadline it never
# does.  After the last block of a slot the sender sends END, twice, to the
# slot's readers: a reader that has it stops waiting for what is still
# missing after a short grace (early close, schedule.pxi).

cdef enum:
    HEADER_BYTES = 64              # sizeof(mpl_packet_t)
    MIN_PAYLOAD = 256              # >= sizeof(mpl_error_t), rounded to 64: errors must fit
    DEFAULT_RECV_BUFFERS = 512
    SEND_SLOTS = 1024
    CONTROL_BUFFERS = 256
    STASH_PACKETS = 512
    MAX_EVENTS = 256

cdef double NACK_INTERVAL = 0.05   # seconds between repeated requests (no deadline)
# A peer seen in a later call has sent what it will send for this one, but
# FI_EP_DGRAM does not promise order: its last datagrams of this call may
# still be behind its first of the next.  Wait this long before giving up.
cdef double REORDER_GRACE = 200e-6
# Without a deadline, how long a full send queue or the sends of an earlier
# call may hold a call up before the channel gives up on them (an error for
# the call; with a deadline, the call's own end is the bound).
cdef double STALL_LIMIT = 5.0


cdef class DgramChannel(Channel):
    cdef mpl_dg_t* fab
    cdef MPI_Comm comm
    cdef uint64_t token
    cdef mpl_mac_t mac                # keyed with the communicator's secret
    cdef bint mac_ready
    cdef unsigned char key[MPL_MAC_KEY_BYTES]
    cdef CallInfo cur                 # the call datagrams are judged against: a
                                      # copy, since the core reuses its CallInfo
    cdef char errbuf[256]
    cdef bytes provider_name, domain_name
    cdef char local_addr[256]         # this endpoint's address (udp: a sockaddr)
    cdef size_t local_len
    cdef int socket_bytes             # udp: kernel receive buffer in effect
    # sizes
    cdef Py_ssize_t prefix            # bytes the provider reserves before a message
    cdef Py_ssize_t payload_max       # payload bytes per datagram: the largest block
    cdef Py_ssize_t pkt               # bytes of one packet buffer
    # receive buffers, posted all the time
    cdef char* rbuf
    cdef int nrecv
    cdef void* rbuf_mr
    cdef void* rbuf_desc
    # outboxes, by call parity
    cdef char* outbox[2]
    cdef Py_ssize_t outbox_cap[2]     # packets
    cdef void* out_mr[2]
    cdef void* out_desc[2]
    cdef int pending[2]               # sends in flight from each outbox
    cdef uint64_t out_seq[2]
    cdef int out_nblocks[2]
    cdef int out_records[2]
    cdef unsigned char* published[2]
    cdef int* published_blocks        # per slot, in this call
    cdef Py_ssize_t published_cap
    # control datagrams (HELLO, ERROR, NACK)
    cdef char* cbuf
    cdef void* cbuf_mr
    cdef void* cbuf_desc
    cdef int* cbuf_busy
    cdef int cnext
    # send slots: which buffer each in-flight send uses (0/1 outbox, 2+k control)
    cdef int* slot_owner
    cdef int* free_slots
    cdef int nfree
    # inbox of the current call
    cdef char* inbox
    cdef Py_ssize_t inbox_cap
    cdef unsigned char* arrived
    cdef uint32_t* counts
    cdef uint32_t* sizes
    cdef double* last_nack
    cdef double* ahead_since          # per stream: when its peer was first seen in a later call
    cdef unsigned char* ended         # per stream: END arrived
    cdef Py_ssize_t state_cap
    cdef int* stream_of               # peer * nslots + slot -> stream, or -1
    cdef Py_ssize_t stream_of_cap
    cdef int nstreams
    # peers
    cdef uint64_t* peer_seq           # the latest call each peer was seen in
    cdef bint armed                   # the current call's streams are known
    cdef char* stash                  # datagrams that came too early
    cdef char* replaying              # the stash being replayed
    cdef int nstash
    cdef bint failed_call
    # counters, for the whole life of the channel
    cdef uint64_t n_sent, n_received, n_foreign, n_truncated, n_forged, n_malformed, n_stale
    cdef uint64_t n_future, n_unexpected, n_duplicate, n_mismatch, n_nacks, n_resent, n_unsent

    def __cinit__(self):
        self.fab = NULL
        self.mac_ready = False
        memset(&self.cur, 0, sizeof(CallInfo))

    cdef int open_mac(self, const unsigned char* key) except -1:
        memcpy(self.key, key, MPL_MAC_KEY_BYTES)
        if mpl_mac_open(&self.mac, self.key, self.errbuf, 256):
            raise MPILossyChannelError("channel='ud': " + self.errbuf.decode(errors="replace"))
        self.mac_ready = True
        return 0

    cdef int setup(self, MPI_Comm comm, str provider, str domain, Py_ssize_t payload,
                   int nrecv, int socket_bytes) except -1:
        cdef int rank, size, bad, i
        cdef size_t addrlen = 0
        cdef char* addrs
        cdef unsigned char secret[MPL_MAC_KEY_BYTES + 8]
        MPI_Comm_rank(comm, &rank)
        MPI_Comm_size(comm, &size)
        self.comm = comm
        self.rank = rank
        self.size = size
        if not MPL_HAVE_MAC:        # the same build on every rank: the same answer
            mpl_mac_open(&self.mac, secret, self.errbuf, 256)
            raise MPILossyChannelError("channel='ud' is unavailable: "
                                       + self.errbuf.decode(errors="replace"))
        # The MAC key and the token, from the OS's random source on rank 0,
        # over MPI: the key never appears in a datagram.
        if rank == 0:
            drawn = os.urandom(MPL_MAC_KEY_BYTES + 8)
            memcpy(secret, <const char*>drawn, MPL_MAC_KEY_BYTES + 8)
        chk(MPI_Bcast(secret, MPL_MAC_KEY_BYTES + 8, MPI_BYTE, 0, comm))
        memcpy(&self.token, secret + MPL_MAC_KEY_BYTES, 8)
        failure = None
        try:
            self.open_mac(secret)       # (OpenSSL's configuration may differ per node)
        except Exception as exc:
            failure = exc
        memset(secret, 0, MPL_MAC_KEY_BYTES + 8)
        agree_or_raise(comm, failure)
        # On one host the loopback interface will do (and must: only loopback
        # traffic is allowed in tests); across hosts the provider's first match.
        if not domain and provider in ("", "udp", "native") and one_host(comm, size):
            domain = "lo"
        self.provider_name = provider.encode()
        self.domain_name = domain.encode()
        self.nrecv = nrecv
        cdef const char* prov = NULL
        cdef const char* dom = NULL
        if provider:
            prov = self.provider_name
        if domain:
            dom = self.domain_name
        bad = mpl_dg_open(&self.fab, prov, dom, nrecv + SEND_SLOTS, 2 * (nrecv + SEND_SLOTS),
                           self.errbuf, 256)
        cdef int any_bad = 0
        chk(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MIN, comm))
        if any_bad:
            reason = self.errbuf.decode(errors="replace") if bad else "failed on another rank"
            raise MPILossyChannelError(f"channel='ud' is unavailable: {reason}")
        # Every rank uses the same datagram size: the smallest.
        self.prefix = mpl_dg_prefix(self.fab)
        cdef long mine = <long>min(<size_t>payload, mpl_dg_max_msg(self.fab) - self.prefix - HEADER_BYTES)
        cdef long agreed
        mine = (mine // 64) * 64
        chk(MPI_Allreduce(&mine, &agreed, 1, MPI_LONG, MPI_MIN, comm))
        if agreed < MIN_PAYLOAD:
            raise MPILossyChannelError(
                f"channel='ud': datagrams too small ({agreed} bytes of payload; at least "
                f"{MIN_PAYLOAD}, so that an error record fits: MPILOSSY_UD_MTU)")
        self.payload_max = agreed
        self.pkt = round_up(self.prefix + HEADER_BYTES + self.payload_max, MPL_CACHELINE)
        # Local steps that can fail are agreed on before the next collective:
        # a rank that raised alone would leave the others waiting in it.
        addrlen = 256
        cdef char local[256]
        failure = None
        try:
            self.allocate_fixed()
            if mpl_dg_getname(self.fab, local, &addrlen, self.errbuf, 256):
                raise MPILossyChannelError(self.errbuf.decode(errors="replace"))
        except Exception as exc:
            failure = exc
        agree_or_raise(comm, failure)
        memcpy(self.local_addr, local, addrlen)
        self.local_len = addrlen
        if mpl_dg_provider(self.fab) in (b"udp", b"native"):
            self.socket_bytes = mpl_udp_tune(local, addrlen, socket_bytes)
        # fi_av_insert wants the addresses packed, each of the provider's length.
        cdef int mylen = <int>addrlen, minlen = 0, maxlen_i = 0
        chk(MPI_Allreduce(&mylen, &minlen, 1, MPI_INT, MPI_MIN, comm))
        chk(MPI_Allreduce(&mylen, &maxlen_i, 1, MPI_INT, MPI_MAX, comm))
        if minlen != maxlen_i:
            raise MPILossyChannelError("channel='ud': ranks opened different kinds of endpoints "
                                       f"(address lengths {minlen}..{maxlen_i})")
        addrs = <char*>calloc(size, addrlen)
        chk(MPI_Allgather(local, mylen, MPI_BYTE, addrs, mylen, MPI_BYTE, comm))
        bad = mpl_dg_insert(self.fab, addrs, size, self.errbuf, 256)
        free(addrs)
        chk(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MIN, comm))
        if any_bad:
            raise MPILossyChannelError("channel='ud': cannot insert peer addresses: "
                                       + self.errbuf.decode(errors="replace"))
        failure = None
        try:
            self.post_receives()
        except Exception as exc:
            failure = exc
        # (An allreduce: it also keeps anyone from sending before every
        # receive is posted.)
        agree_or_raise(comm, failure)
        return 0

    cdef int allocate_fixed(self) except -1:
        cdef int i
        self.rbuf = <char*>aligned(self.nrecv * self.pkt)
        self.cbuf = <char*>aligned(CONTROL_BUFFERS * self.pkt)
        self.cbuf_busy = <int*>calloc(CONTROL_BUFFERS, sizeof(int))
        self.slot_owner = <int*>calloc(SEND_SLOTS, sizeof(int))
        self.free_slots = <int*>calloc(SEND_SLOTS, sizeof(int))
        self.peer_seq = <uint64_t*>calloc(self.size, sizeof(uint64_t))
        self.stash = <char*>aligned(STASH_PACKETS * self.pkt)
        self.replaying = <char*>aligned(STASH_PACKETS * self.pkt)
        if not (self.rbuf and self.cbuf and self.cbuf_busy and self.slot_owner
                and self.free_slots and self.peer_seq and self.stash and self.replaying):
            raise MemoryError()
        for i in range(SEND_SLOTS):
            self.free_slots[i] = SEND_SLOTS - 1 - i
        self.nfree = SEND_SLOTS
        if (mpl_dg_register(self.fab, self.rbuf, self.nrecv * self.pkt, &self.rbuf_mr,
                             &self.rbuf_desc, self.errbuf, 256)
                or mpl_dg_register(self.fab, self.cbuf, CONTROL_BUFFERS * self.pkt, &self.cbuf_mr,
                                    &self.cbuf_desc, self.errbuf, 256)):
            raise MPILossyChannelError(self.errbuf.decode(errors="replace"))
        return 0

    cdef int post_receives(self) except -1:
        cdef int k, rc
        for k in range(self.nrecv):
            rc = mpl_dg_recv(self.fab, self.rbuf + k * self.pkt, self.pkt, self.rbuf_desc,
                              k, <void*><intptr_t>k)
            if rc:
                raise MPILossyChannelError(f"fi_recv: {mpl_dg_strerror(self.fab, rc).decode()}")
        return 0

    cdef void close(self):
        cdef double limit = mpl_now() + 1.0
        if self.fab == NULL:
            return
        while (self.pending[0] or self.pending[1] or self.nfree < SEND_SLOTS) and mpl_now() < limit:
            self.drain()
        mpl_dg_flush(self.fab)
        mpl_dg_deregister(self.out_mr[0])
        mpl_dg_deregister(self.out_mr[1])
        mpl_dg_deregister(self.rbuf_mr)
        mpl_dg_deregister(self.cbuf_mr)
        mpl_dg_close(self.fab)
        self.fab = NULL

    cdef void close_mac(self) noexcept nogil:
        if self.mac_ready:
            mpl_mac_close(&self.mac)
            self.mac_ready = False
        memset(self.key, 0, MPL_MAC_KEY_BYTES)

    def __dealloc__(self):
        self.close()
        self.close_mac()
        free(self.rbuf)
        free(self.cbuf)
        free(self.cbuf_busy)
        free(self.slot_owner)
        free(self.free_slots)
        free(self.peer_seq)
        free(self.stash)
        free(self.replaying)
        free(self.outbox[0])
        free(self.outbox[1])
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
        free(self.stream_of)

    cdef Py_ssize_t max_block_bytes(self) noexcept nogil:
        return self.payload_max

    def address(self) -> str:
        """This endpoint's address, "ip:port" for the udp provider (IPv4)."""
        cdef const unsigned char* a = <const unsigned char*>self.local_addr
        if self.local_len >= 8 and a[0] | (a[1] << 8) == 2:     # AF_INET, native order
            return f"{a[4]}.{a[5]}.{a[6]}.{a[7]}:{(a[2] << 8) | a[3]}"
        return self.local_addr[:self.local_len].hex()

    def counters(self) -> dict:
        cdef long queue = -1
        if self.fab != NULL:
            queue = mpl_udp_drops(self.local_addr, self.local_len)
        return {"queue_drops": queue, "socket_bytes": self.socket_bytes, "sent": self.n_sent, "received": self.n_received, "foreign": self.n_foreign,
                "truncated": self.n_truncated, "forged": self.n_forged,
                "malformed": self.n_malformed, "stale": self.n_stale,
                "future": self.n_future, "unexpected": self.n_unexpected,
                "duplicate": self.n_duplicate, "mismatch": self.n_mismatch,
                "nacks": self.n_nacks, "resent": self.n_resent, "unsent": self.n_unsent,
                **self.transport_costs()}

    def transport_costs(self) -> dict:
        """The native transport's system calls and datagrams (empty for
        libfabric, which does not count them)."""
        cdef uint64_t c[6]
        if self.fab == NULL or not mpl_dg_is_native(mpl_dg_provider(self.fab)):
            return {}
        mpl_dg_costs(self.fab, c)
        return {"send_calls": c[0], "recv_calls": c[1], "transport_sent": c[2],
                "transport_received": c[3], "send_refused": c[4],
                "largest_send_batch": c[5]}

    # -- per call ------------------------------------------------------------
    cdef int begin(self, CallInfo* call) except -1:
        cdef int parity = call.seq & 1
        cdef Py_ssize_t records = <Py_ssize_t>call.nslots * call.nblocks
        cdef double limit = mpl_now() + (min(call.timeout, STALL_LIMIT) if call.timeout >= 0
                                         else STALL_LIMIT)
        # Datagrams that arrive now belong to this call or later: judge them
        # against the previous call, which stashes those of the next one.
        self.drain()
        # This outbox held call seq-2; its sends must be done before reuse.
        while self.pending[parity]:
            self.drain()
            if mpl_now() > limit:
                raise MPILossyChannelError("channel='ud': sends of an earlier call never completed")
        if records > self.outbox_cap[parity]:
            mpl_dg_deregister(self.out_mr[parity])
            free(self.outbox[parity])
            free(self.published[parity])
            self.outbox[parity] = <char*>aligned(records * self.pkt)
            self.published[parity] = <unsigned char*>calloc(records, 1)
            if self.outbox[parity] == NULL or self.published[parity] == NULL:
                raise MemoryError()
            self.outbox_cap[parity] = records
            if mpl_dg_register(self.fab, self.outbox[parity], records * self.pkt,
                                &self.out_mr[parity], &self.out_desc[parity], self.errbuf, 256):
                raise MPILossyChannelError(self.errbuf.decode(errors="replace"))
        memset(self.published[parity], 0, records)
        if call.nslots > self.published_cap:
            free(self.published_blocks)
            self.published_blocks = <int*>malloc(call.nslots * sizeof(int))
            if self.published_blocks == NULL:
                self.published_cap = 0
                raise MemoryError()
            self.published_cap = call.nslots
        memset(self.published_blocks, 0, call.nslots * sizeof(int))
        self.out_seq[parity] = call.seq
        self.out_nblocks[parity] = call.nblocks
        self.out_records[parity] = <int>records
        cdef Py_ssize_t mapping = <Py_ssize_t>self.size * call.nslots
        if mapping > self.stream_of_cap:
            free(self.stream_of)
            self.stream_of = <int*>malloc(mapping * sizeof(int))
            if self.stream_of == NULL:
                raise MemoryError()
            self.stream_of_cap = mapping
        for i in range(mapping):
            self.stream_of[i] = -1
        self.nstreams = 0
        self.failed_call = False
        self.error.kind = ERR_NONE
        self.cur = call[0]
        self.armed = False           # until the streams are known: stash, don't place
        self.send_hello()
        return 0

    cdef int prepare(self, Stream* s) except -1:
        cdef CallInfo* c = &self.cur
        cdef int i = self.nstreams
        cdef Py_ssize_t blocks = <Py_ssize_t>(i + 1) * c.nblocks
        self.nstreams += 1
        s.index = i
        self.stream_of[s.peer * c.nslots + s.slot] = i
        if blocks * c.block_bytes > self.inbox_cap:
            free(self.inbox)
            self.inbox = <char*>malloc(max(blocks * c.block_bytes, 64))
            if self.inbox == NULL:
                raise MemoryError()
            self.inbox_cap = blocks * c.block_bytes
        if blocks > self.state_cap:
            self.arrived = <unsigned char*>realloc(self.arrived, blocks)
            self.counts = <uint32_t*>realloc(self.counts, blocks * sizeof(uint32_t))
            self.sizes = <uint32_t*>realloc(self.sizes, blocks * sizeof(uint32_t))
            if not (self.arrived and self.counts and self.sizes):
                raise MemoryError()
            self.state_cap = blocks
        self.last_nack = <double*>realloc(self.last_nack, (i + 1) * sizeof(double))
        self.ahead_since = <double*>realloc(self.ahead_since, (i + 1) * sizeof(double))
        self.ended = <unsigned char*>realloc(self.ended, i + 1)
        if self.last_nack == NULL or self.ahead_since == NULL or self.ended == NULL:
            raise MemoryError()
        self.ended[i] = 0
        self.ahead_since[i] = -1.0
        memset(self.arrived + <Py_ssize_t>i * c.nblocks, 0, c.nblocks)
        self.last_nack[i] = mpl_now()
        return 0

    cdef char* packet(self, int parity, Py_ssize_t record) noexcept nogil:
        return self.outbox[parity] + record * self.pkt

    cdef char* claim(self, int slot, int block) noexcept nogil:
        return self.mine(slot, block)

    cdef char* mine(self, int slot, int block) noexcept nogil:
        cdef int parity = self.cur.seq & 1
        return (self.packet(parity, <Py_ssize_t>slot * self.cur.nblocks + block)
                + self.prefix + HEADER_BYTES)

    cdef void publish(self, int slot, int block, uint32_t count, uint32_t nbytes,
                      const int* dests, int ndests) noexcept nogil:
        cdef int parity = self.cur.seq & 1, i
        cdef Py_ssize_t record = <Py_ssize_t>slot * self.cur.nblocks + block
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
        if self.published_blocks[slot] == self.cur.nblocks and ndests:
            for i in range(2):          # datagrams get lost: say it twice
                self.send_control_to(MPL_PKT_END, self.cur.seq, slot, 0, NULL, 0, dests, ndests)

    cdef void fill_header(self, mpl_packet_t* hdr, int kind, uint64_t seq, uint32_t slot,
                          uint32_t block, uint32_t count, uint32_t nbytes) noexcept nogil:
        memset(hdr, 0, HEADER_BYTES)
        hdr.magic = MPL_PKT_MAGIC
        hdr.version = MPL_PKT_VERSION
        hdr.kind = kind
        hdr.token = self.token
        hdr.seq = seq
        hdr.src = self.rank
        hdr.slot = slot
        hdr.block = block
        hdr.count = count
        hdr.nbytes = nbytes

    cdef void seal(self, mpl_packet_t* hdr) noexcept nogil:
        """Write the MAC of a filled header and the payload that follows it."""
        mpl_mac_tag(&self.mac, hdr, MPL_PKT_MAC_OFFSET, (<const char*>hdr) + HEADER_BYTES,
                    hdr.nbytes, hdr.mac)

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

    cdef void send(self, int peer, char* buf, Py_ssize_t length, int owner) noexcept nogil:
        """Post a send; `owner` is 0/1 (an outbox) or 2 + control buffer."""
        cdef int slot, rc
        cdef double limit = -1.0
        if self.fab == NULL:            # offline (DatagramJudge): nothing to send
            return
        while self.nfree == 0:
            self.drain()
            if limit < 0:
                limit = self.stall_limit()
            elif mpl_now() > limit:
                self.n_unsent += 1      # the queue never drained: count it lost
                return
        slot = self.free_slots[self.nfree - 1]
        while True:
            rc = mpl_dg_send(self.fab, peer, buf, length,
                              self.out_desc[owner] if owner < 2 else self.cbuf_desc,
                              self.nrecv + slot, <void*><intptr_t>slot)
            if rc != MPL_FAB_EAGAIN:
                break
            self.drain()
            if limit < 0:
                limit = self.stall_limit()
            elif mpl_now() > limit:
                self.n_unsent += 1      # the transport refuses: count it lost
                return
        if rc:
            self.n_unsent += 1
            return
        self.nfree -= 1
        self.slot_owner[slot] = owner
        if owner < 2:
            self.pending[owner] += 1
        else:
            self.cbuf_busy[owner - 2] += 1
        self.n_sent += 1

    cdef char* control_buffer(self, int* owner) noexcept nogil:
        cdef int k, tries
        for tries in range(2 * CONTROL_BUFFERS):
            k = self.cnext
            self.cnext = (self.cnext + 1) % CONTROL_BUFFERS
            if self.cbuf_busy[k] == 0:
                owner[0] = 2 + k
                return self.cbuf + k * self.pkt
            if tries == CONTROL_BUFFERS:
                self.drain()
        return NULL

    cdef void send_control(self, int kind, uint64_t seq, uint32_t slot, uint32_t block,
                           const void* payload, uint32_t nbytes, int peer) noexcept nogil:
        """A HELLO/ERROR/NACK to `peer`, or to every peer when peer < 0."""
        self.send_control_to(kind, seq, slot, block, payload, nbytes, &peer, 1 if peer >= 0 else -1)

    cdef void send_control_to(self, int kind, uint64_t seq, uint32_t slot, uint32_t block,
                              const void* payload, uint32_t nbytes, const int* peers,
                              int npeers) noexcept nogil:
        """A control datagram to `npeers` peers, or to every peer when npeers < 0."""
        cdef int owner, p
        if nbytes > <uint32_t>self.payload_max:    # cannot happen (setup): never overflow
            return
        cdef char* buf = self.control_buffer(&owner)
        if buf == NULL:
            return
        cdef mpl_packet_t* hdr = <mpl_packet_t*>(buf + self.prefix)
        self.fill_header(hdr, kind, seq, slot, block, 0, nbytes)
        if nbytes:
            memcpy(buf + self.prefix + HEADER_BYTES, payload, nbytes)
        self.seal(hdr)
        if npeers >= 0:
            for p in range(npeers):
                self.send(peers[p], buf, self.prefix + HEADER_BYTES + nbytes, owner)
            return
        for p in range(self.size):
            if p != self.rank:
                self.send(p, buf, self.prefix + HEADER_BYTES + nbytes, owner)

    cdef void send_hello(self) noexcept nogil:
        cdef mpl_hello_t hello
        cdef CallInfo* c = &self.cur
        hello.sig = c.sig
        hello.count = c.count
        hello.dtype = c.dtype
        hello.op = announced_op(c)
        hello.algo = c.algo | c.coll << 4
        hello.block = <uint32_t>c.block_bytes
        self.send_control(MPL_PKT_HELLO, c.seq, 0, 0, &hello, sizeof(mpl_hello_t), -1)

    # -- receiving -------------------------------------------------------------
    cdef void drain(self) noexcept nogil:
        """Reap completions: recycle send slots, judge received datagrams."""
        cdef mpl_fab_event_t events[MAX_EVENTS]
        cdef int n, i, k, slot, owner
        if self.fab == NULL:            # offline (DatagramJudge): nothing to reap
            return
        n = mpl_dg_poll(self.fab, events, MAX_EVENTS)
        for i in range(n):
            k = <int><intptr_t>events[i].context
            if events[i].is_recv:
                if events[i].len > <size_t>self.prefix:
                    self.accept(self.rbuf + k * self.pkt + self.prefix,
                                <Py_ssize_t>events[i].len - self.prefix, True)
                else:
                    self.n_truncated += 1
                mpl_dg_recv(self.fab, self.rbuf + k * self.pkt, self.pkt, self.rbuf_desc,
                             k, <void*><intptr_t>k)
            else:
                slot = k
                owner = self.slot_owner[slot]
                if owner < 2:
                    self.pending[owner] -= 1
                else:
                    self.cbuf_busy[owner - 2] -= 1
                self.free_slots[self.nfree] = slot
                self.nfree += 1

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
            if self.nstash < STASH_PACKETS:
                memcpy(self.stash + <Py_ssize_t>self.nstash * self.pkt, data, length)
                self.nstash += 1
            else:
                self.n_future += 1
            return
        if hdr.kind == MPL_PKT_NACK:
            self.answer_nack(&hdr, data + HEADER_BYTES)
            return
        if hdr.seq != cur:
            if hdr.seq < cur:
                self.n_stale += 1
            else:
                self.n_future += 1
            return
        # check_packet made sure that a HELLO or ERROR payload has its
        # record's size; copy it out (the buffer may be unaligned).
        cdef mpl_hello_t hello
        cdef mpl_error_t err
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
            self.n_mismatch += 1
            return
        if (hdr.slot >= <uint32_t>c.nslots or hdr.block >= <uint32_t>c.nblocks
                or hdr.nbytes > <uint32_t>c.block_bytes or hdr.count > <uint32_t>self.size):
            self.n_unexpected += 1
            return
        stream = self.stream_of[hdr.src * c.nslots + hdr.slot]
        if stream < 0:
            self.n_unexpected += 1
            return
        at = <Py_ssize_t>stream * c.nblocks + hdr.block
        if self.arrived[at]:
            self.n_duplicate += 1
            return
        memcpy(self.inbox + at * c.block_bytes, payload, hdr.nbytes)
        self.counts[at] = hdr.count
        self.sizes[at] = hdr.nbytes
        self.arrived[at] = 1

    cdef void check_hello(self, const mpl_packet_t* hdr, const mpl_hello_t* hello) noexcept nogil:
        cdef CallInfo* c = &self.cur
        if hello.sig == c.sig or self.error.kind:
            return
        self.error.kind = ERR_MISMATCH
        self.error.rank = self.rank
        snprintf(self.error.msg, MPL_MSG_LEN,
                 b"ranks disagree on call %llu: rank %d: %s of %llu x %s op=%s algorithm=%s; "
                 b"rank %d: %s of %llu x %s op=%s algorithm=%s",
                 <unsigned long long>c.seq, hdr.src, coll_name(hello.algo >> 4),
                 <unsigned long long>hello.count, dtype_name(hello.dtype),
                 op_name(hello.op), algo_name(hello.algo & 15),
                 self.rank, coll_name(c.coll), <unsigned long long>c.count,
                 dtype_name(c.dtype), op_name(announced_op(c)), algo_name(c.algo))

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
        for i in range(hdr.nbytes // 4):
            memcpy(&block, blocks + 4 * i, 4)       # (the buffer may be unaligned)
            if block >= <uint32_t>self.out_nblocks[parity]:
                continue
            record = <Py_ssize_t>hdr.slot * self.out_nblocks[parity] + block
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

    cdef int poll(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef CallInfo* c = &self.cur
        cdef Py_ssize_t at = <Py_ssize_t>s.index * c.nblocks + block
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
            inc.data = self.inbox + at * c.block_bytes
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
            now = mpl_now()
            if now - self.last_nack[s.index] > NACK_INTERVAL:
                self.last_nack[s.index] = now
                self.request_missing(s)
        return POLL_WAIT

    cdef void request_missing(self, Stream* s) noexcept nogil:
        """No deadline: ask the producer again for every block of `s` that has
        not arrived (as many as fit in one datagram)."""
        cdef CallInfo* c = &self.cur
        cdef uint32_t missing[512]
        cdef int n = 0, b, cap = <int>min(512, self.payload_max // 4)
        cdef Py_ssize_t base = <Py_ssize_t>s.index * c.nblocks
        for b in range(s.cursor, s.nblocks):
            if not self.arrived[base + b] and not s.done[b]:
                missing[n] = b
                n += 1
                if n == cap:
                    break
        if n:
            self.n_nacks += 1
            self.send_control(MPL_PKT_NACK, c.seq, s.slot, 0, missing, 4 * n, s.peer)

    cdef bint random_access(self, Stream* s) noexcept nogil:
        return True

    cdef bint confirm(self, Stream* s, int block) noexcept nogil:
        # A placed block stays as it is until the next call: place() never
        # writes a block twice.
        return True

    cdef bint closed(self, Stream* s) noexcept nogil:
        if not self.ended[s.index] and not self.past_cap():
            self.service()
        return self.ended[s.index]

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
        self.drain()
        if self.fab != NULL:
            mpl_dg_flush(self.fab)      # nothing of this call may wait for the next

    cdef void fail(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        cdef mpl_error_t e
        cdef int repeat
        if self.cur.seq != call.seq:      # failed before begin: no layout
            self.cur = call[0]
        e.kind = err.kind
        e.rank = err.rank
        memcpy(e.msg, err.msg, MPL_MSG_LEN)
        for repeat in range(2):         # datagrams get lost: say it twice
            self.send_control(MPL_PKT_ERROR, call.seq, 0, 0, &e, sizeof(mpl_error_t), -1)
        if self.fab != NULL:
            mpl_dg_flush(self.fab)


cdef enum:
    PACKET_OK = 0
    PACKET_FOREIGN = 1
    PACKET_TRUNCATED = 2
    PACKET_MALFORMED = 3
    PACKET_FORGED = 4


cdef int check_packet(const char* data, Py_ssize_t length, uint64_t token, int size, int me,
                      Py_ssize_t payload_max, mpl_mac_t* mac, mpl_packet_t* hdr) noexcept nogil:
    """Is this an authentic, well-formed datagram of this communicator from a
    peer?  Copies the header out once (the buffer may be unaligned); every
    later decision uses the copy."""
    cdef unsigned char tag[MPL_MAC_TAG_BYTES]
    cdef uint32_t n
    if length < HEADER_BYTES:
        return PACKET_TRUNCATED
    memcpy(hdr, data, sizeof(mpl_packet_t))
    if hdr.magic != MPL_PKT_MAGIC or hdr.version != MPL_PKT_VERSION or hdr.token != token:
        return PACKET_FOREIGN
    if hdr.src >= <uint32_t>size or hdr.src == <uint32_t>me or hdr.kind < MPL_PKT_DATA \
            or hdr.kind > MPL_PKT_END:
        return PACKET_FOREIGN
    if <Py_ssize_t>hdr.nbytes != length - HEADER_BYTES:
        return PACKET_TRUNCATED
    n = hdr.nbytes
    if n > <uint64_t>payload_max \
            or (hdr.kind == MPL_PKT_HELLO and n != sizeof(mpl_hello_t)) \
            or (hdr.kind == MPL_PKT_ERROR and n != sizeof(mpl_error_t)) \
            or (hdr.kind == MPL_PKT_NACK and n % 4) \
            or (hdr.kind == MPL_PKT_END and n):
        return PACKET_MALFORMED
    if mpl_mac_tag(mac, data, MPL_PKT_MAC_OFFSET, data + HEADER_BYTES, n, tag) \
            or not mpl_mac_equal(tag, hdr.mac):
        return PACKET_FORGED
    return PACKET_OK


cdef void* aligned(Py_ssize_t nbytes) noexcept nogil:
    cdef void* p = NULL
    if posix_memalign(&p, 4096, <size_t>max(nbytes, 64)) != 0:
        return NULL
    return p


cdef int agree_or_raise(MPI_Comm comm, object failure) except -1:
    """Collective: raise `failure` on the rank that had it, and an error that
    names the ranks on every other rank; return 0 if nobody failed."""
    cdef int mine = 0 if failure is None else 1, anyone = 0
    chk(MPI_Allreduce(&mine, &anyone, 1, MPI_INT, MPI_MAX, comm))
    if not anyone:
        return 0
    if failure is not None:
        raise failure
    raise MPILossyChannelError("channel='ud' could not be set up on another rank")


cdef bint one_host(MPI_Comm comm, int size) except -1:
    """Do all ranks run on the same host (same processor name)?"""
    cdef char name[MPI_MAX_PROCESSOR_NAME]
    cdef int length = 0, p
    cdef bint same = True
    memset(name, 0, MPI_MAX_PROCESSOR_NAME)
    chk(MPI_Get_processor_name(name, &length))
    cdef char* names = <char*>calloc(size, MPI_MAX_PROCESSOR_NAME)
    if names == NULL:
        raise MemoryError()
    try:
        chk(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names,
                          MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm))
        for p in range(1, size):
            if strncmp(names, names + p * MPI_MAX_PROCESSOR_NAME, MPI_MAX_PROCESSOR_NAME):
                same = False
    finally:
        free(names)
    return same


# -- for benchmarks ------------------------------------------------------------

def mac_seconds(Py_ssize_t payload, int count) -> float:
    """Seconds to seal and to check (two MACs) `count` datagrams of `payload`
    bytes, as a sender and a receiver do: the cost of authentication per
    datagram, for python -m mpilossy.bench.kernels."""
    cdef mpl_mac_t mac
    cdef char err[256]
    cdef unsigned char key[MPL_MAC_KEY_BYTES]
    cdef unsigned char tag[MPL_MAC_TAG_BYTES]
    cdef char* buf = <char*>calloc(HEADER_BYTES + max(payload, 1), 1)
    cdef int i
    cdef double t0, t1
    if buf == NULL:
        raise MemoryError()
    memset(key, 7, MPL_MAC_KEY_BYTES)
    if mpl_mac_open(&mac, key, err, 256):
        free(buf)
        raise MPILossyChannelError(err.decode(errors="replace"))
    with nogil:
        t0 = mpl_now()
        for i in range(count):
            (<mpl_packet_t*>buf).seq = i
            mpl_mac_tag(&mac, buf, MPL_PKT_MAC_OFFSET, buf + HEADER_BYTES, payload,
                        (<mpl_packet_t*>buf).mac)
            mpl_mac_tag(&mac, buf, MPL_PKT_MAC_OFFSET, buf + HEADER_BYTES, payload, tag)
            if not mpl_mac_equal(tag, (<mpl_packet_t*>buf).mac):
                break
        t1 = mpl_now()
    mpl_mac_close(&mac)
    free(buf)
    return t1 - t0
