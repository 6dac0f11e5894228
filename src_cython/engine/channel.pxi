# The narrow interface between the algorithms and a channel.
#
# An algorithm publishes *records*: the payload of one block of one slot
# (a partial sum, a final result) together with its contributor count.  It
# consumes records of its peers through *streams*: a stream is the sequence
# of blocks of one slot of one peer, resolved in block order.  A channel
# moves records; it never decides what they mean.

cdef enum:
    POLL_WAIT = 0    # not there yet
    POLL_READY = 1   # `Incoming` describes the payload
    POLL_GONE = 2    # the producer moved past this call: the record will never come
    POLL_FAIL = 3    # the producer reported an error or disagrees on the call

# How often a waiting call looks for a signal (Ctrl-C): a call without
# deadline may wait for a peer forever, and its loops run without the GIL.
cdef double SIGNAL_CHECK_INTERVAL = 0.05

# Error kinds carried between ranks; the Python layer maps them to exceptions.
cdef enum:
    ERR_NONE = 0
    ERR_TYPE = 1
    ERR_VALUE = 2
    ERR_BUFFER = 3
    ERR_MISMATCH = 4
    ERR_PROTOCOL = 5
    ERR_MPI = 6
    ERR_INTERRUPTED = 7   # a signal (Ctrl-C) stopped a call that waits without deadline
    ERR_LAST = 7

cdef enum:
    ALGO_RING = 0
    ALGO_TREE = 1
    ALGO_DIRECT = 2       # one hop to the owner of each chunk (and the allgather)

# The collectives; each chunk of a reduce-scatter/allgather vector of
# `count` elements belongs to rank c = its index (chunk_bounds, below).
cdef enum:
    COLL_ALLREDUCE = 0
    COLL_REDUCE_SCATTER = 1
    COLL_ALLGATHER = 2

# Names for error messages, indexed by DT_*, OP_*, ALGO_* and COLL_*.  An
# index that came from a peer is untrusted: look it up through the *_name
# functions, which answer "?" out of range.
cdef const char* DTYPE_NAMES[NUM_DTYPES]
DTYPE_NAMES[:] = [b"float16", b"float32", b"float64", b"int32", b"int64", b"bfloat16"]
cdef const char* OP_NAMES[3]
OP_NAMES[:] = [b"sum", b"avg", b"avg(weight=)"]      # the last: announced_op
cdef const char* ALGO_NAMES[3]
ALGO_NAMES[:] = [b"ring", b"tree", b"direct"]
cdef const char* COLL_NAMES[3]
COLL_NAMES[:] = [b"allreduce", b"reduce_scatter", b"allgather"]


cdef inline const char* dtype_name(uint32_t i) noexcept nogil:
    if i < NUM_DTYPES:
        return DTYPE_NAMES[i]
    return b"?"


cdef inline const char* op_name(uint32_t i) noexcept nogil:
    if i < 3:
        return OP_NAMES[i]
    return b"?"


cdef inline const char* algo_name(uint32_t i) noexcept nogil:
    if i < 3:
        return ALGO_NAMES[i]
    return b"?"


cdef inline const char* coll_name(uint32_t i) noexcept nogil:
    if i < 3:
        return COLL_NAMES[i]
    return b"?"


cdef struct ErrorInfo:
    int kind
    int rank          # rank that detected the error first
    char msg[MPL_MSG_LEN]

cdef struct Payload:
    # How a contribution travels: what only the direct algorithm does.
    double weight         # > 0: weighted average, this rank's weight; 0: every
                          # contribution weighs one
    int qbits             # 8 or 4: float32 payloads travel quantised
                          # (mpilossy_quant.h); 0: as they are
    Py_ssize_t qgroup     # values per quantisation scale
    float* residual       # not NULL: where the quantisation error of each sent
                          # contribution goes (x - what travelled), float32

cdef struct CallInfo:
    uint64_t seq
    uint64_t sig          # hash of everything the record layout depends on
    int dtype
    int op
    int algo
    int coll              # COLL_*
    int scaling           # SCALE_UNBIASED or SCALE_ZERO_FILL
    bint rotate           # move chain starts / tree roots with every call
    Payload payload       # how contributions travel (the direct algorithm only)
    Py_ssize_t count      # elements of the whole vector
    Py_ssize_t itemsize
    int nslots            # records a rank publishes per block index
    int nblocks           # data blocks per slot
    Py_ssize_t block_elems
    Py_ssize_t block_bytes
    int fec_k             # redundancy: data blocks per group of a slot (0: none)
    int fec_m             # parity records per group
    int part              # PART_*: a whole call or a segment of a pipelined one
    int ngroups           # groups per slot: ceil(nblocks / fec_k)
    int records           # records a slot holds: nblocks data, then ngroups * fec_m parity
    Py_ssize_t record_bytes   # largest record payload: block_bytes (+ 8 with redundancy)
    Py_ssize_t max_block  # largest record payload the channel moves as one unit
    double start
    double timeout        # < 0: no deadline
    bint injected         # injected loss may drop records of this call
    double anchor         # when every peer was seen in this call (or patience
                          # ran out); < 0 until then
    double seen           # when every peer was seen, also past patience; < 0:
                          # not in this call (the learned deadline's skew)
    int nstages
    double* stage_end     # fraction of the budget at which each stage gives up
    # The engine's settings, the communicator's (MPILOSSY_SPIN, _EARLY_CLOSE):
    int spin              # idle passes of the polling loop before it yields the core
    double early_close    # seconds a block missing after its producer's end mark is
                          # still waited for (reordering); < 0: no early close

cdef struct Incoming:
    const char* data
    uint32_t count
    uint32_t nbytes

cdef struct GetBuffers:
    # Targets of in-flight MPI_Rget; owned by a stream, or by the zombie list
    # when a call ends before the get completes.
    mpl_record_t hdr
    mpl_record_t hdr2
    mpl_status_t status
    char* payload
    Py_ssize_t capacity

cdef struct Stream:
    # Filled by the algorithm.
    int peer              # producer rank
    int slot              # producer's slot
    int nblocks
    int stage             # deadline stage
    int tag               # the algorithm's own index
    bint stable           # payload must be copied out and validated before use
    # Engine.
    int cursor            # first block not resolved yet
    unsigned char* drop   # injected loss, one flag per block
    unsigned char* done   # blocks resolved ahead of the cursor
    int scan              # where the next look-ahead pass resumes
    bint drop_end         # injected loss of the producer's end mark
    double end_at         # when the end mark was seen (< 0: not yet)
    bint note_looked      # the producer left: its note was looked for (told_failure)
    # Channel.
    int index             # the stream's number in the call (set by the channel)
    int cstate
    MPI_Request req
    GetBuffers* gb
    int gblock            # (one-sided network path) the block its gets are for
    double hdr_at         # when the header get in flight was issued
    double miss_at        # when the header get of the last "not there" was issued
    # Redundancy (engine, coding.pxi): the stream's groups, row by row.
    char* rows            # ngroups * (fec_k + fec_m) rows of record_bytes
    unsigned char* have   # per row: ROW_KEPT (arrived and kept, rebuilt, or padding),
                          # ROW_IN_PLACE, or 0
    unsigned char* rebuilt    # per data block: its row holds it, rebuilt
    Py_ssize_t rows_cap, have_cap, rebuilt_cap


# A row of a stream's group (Stream.have): a data record that arrived on a
# channel that reads in place (random_access) is not copied into its row
# when it is taken, only when a rebuild of its group needs it (it is read
# again then; most groups lose nothing, and the copy doubled the memory
# traffic of a call).  Any other row in hand is kept in its row.
cdef enum:
    ROW_KEPT = 1
    ROW_IN_PLACE = 2


# Deadlines.  `start + timeout` is the hard cap of a call.  Inside it, stage
# deadlines are counted from the *anchor*: the moment this rank has seen every
# peer enter the call.  A peer that enters late (it finished the previous
# call later, or computed longer) shifts the stages instead of losing its data
# in the early ones.  Ranks wait for late peers until start + (1 - BUDGET) of
# the timeout; then the stages run in the remaining budget without them.
# After the anchor the stages are spread over BUDGET of the timeout, so a call
# that loses data ends at most that long after the anchor, and the skew it
# leaves for the next call stays within that call's patience.  The same
# fractions on every rank keep the stages of producers and consumers aligned.
cdef double BUDGET = 0.4


cdef inline double stage_deadline(const CallInfo* call, int stage) noexcept nogil:
    cdef double end = call.start + call.timeout
    if call.anchor < 0:
        return end
    return min(end, call.anchor + BUDGET * call.timeout * call.stage_end[stage])


cdef inline double patience_end(const CallInfo* call) noexcept nogil:
    """When to stop waiting for peers that have not entered the call."""
    return call.start + (1.0 - BUDGET) * call.timeout


cdef inline void chunk_bounds(Py_ssize_t count, int size, int chunk,
                              Py_ssize_t* first, Py_ssize_t* length) noexcept nogil:
    """Chunk `chunk` of a vector of `count` elements cut into `size` chunks:
    the first count % size chunks hold one element more."""
    cdef Py_ssize_t base = count // size, extra = count % size
    first[0] = chunk * base + min(<Py_ssize_t>chunk, extra)
    length[0] = base + (1 if chunk < extra else 0)


cdef inline uint32_t announced_op(const CallInfo* call) noexcept nogil:
    """The op as peers see it: a weighted average is an op of its own (for
    the mismatch message; the signature tells them apart already)."""
    return 2 if call.payload.weight > 0 else <uint32_t>call.op


# A call without deadline and one with a deadline cannot meet: the first
# waits for (and asks again for) every record, the second leaves when its
# deadline ends and reuses what the first still reads.  So whether a call
# has a deadline is part of its signature, and ranks that differ fail the
# call as a disagreement (its value may differ between ranks: it bounds only
# the rank's own wait).
cdef enum:
    LAYOUT_EXACT_BIT = 24
    LAYOUT_PART_BIT = 25      # two bits: PART_*


# A GPU all-reduce staged in segments (mpilossy/call/pipeline.py) is one
# core call per segment.  Which part of a call this is belongs to its
# signature: ranks that cut the same call differently (or one not at all)
# then fail on the first call where they differ instead of pairing one
# rank's segment with another's next call.
cpdef enum:
    PART_WHOLE = 0
    PART_SEGMENT = 1          # a segment followed by others
    PART_LAST = 2             # the last segment


cdef inline uint32_t announced_layout(const CallInfo* call) noexcept nogil:
    """Algorithm, collective, redundancy and whether the call has a deadline
    in one word, as peers see them."""
    return (<uint32_t>call.algo | <uint32_t>call.coll << 4 | <uint32_t>call.fec_k << 8
            | <uint32_t>call.fec_m << 16 | <uint32_t>(call.timeout < 0) << LAYOUT_EXACT_BIT
            | <uint32_t>call.part << LAYOUT_PART_BIT)



cdef void describe_call(char* out, size_t size, uint32_t layout, uint64_t count,
                        uint32_t dtype, uint32_t op) noexcept nogil:
    """"allreduce of 10 x float32 op=sum algorithm=ring redundancy=(8, 2)"
    from a peer's announced (untrusted) fields."""
    cdef int n = snprintf(out, size, b"%s of %llu x %s op=%s algorithm=%s",
                          coll_name((layout >> 4) & 15), <unsigned long long>count,
                          dtype_name(dtype), op_name(op), algo_name(layout & 15))
    if (layout >> 8) & 255 and 0 <= n < <int>size:
        n += snprintf(out + n, size - n, b" redundancy=(%u, %u)", (layout >> 8) & 255,
                      (layout >> 16) & 255)
    if 0 <= n < <int>size:
        n += snprintf(out + n, size - n, b" timeout=None" if (layout >> LAYOUT_EXACT_BIT) & 1
                      else b" with a deadline")
    cdef uint32_t part = (layout >> LAYOUT_PART_BIT) & 3
    if part and 0 <= n < <int>size:
        snprintf(out + n, size - n, b" (a pipeline segment)" if part == PART_SEGMENT
                 else b" (the last pipeline segment)")


cdef void describe_mismatch(ErrorInfo* err, const CallInfo* call, int me, int peer,
                            uint32_t layout, uint64_t count, uint32_t dtype,
                            uint32_t op) noexcept nogil:
    """The error of ranks that disagree on a call: the peer's announcement
    against this rank's call."""
    cdef char theirs[160]
    cdef char mine[160]
    describe_call(theirs, 160, layout, count, dtype, op)
    describe_call(mine, 160, announced_layout(call), <uint64_t>call.count,
                  <uint32_t>call.dtype, announced_op(call))
    err.kind = ERR_MISMATCH
    err.rank = me
    snprintf(err.msg, MPL_MSG_LEN, b"ranks disagree on call %llu: rank %d: %s; rank %d: %s",
             <unsigned long long>call.seq, peer, theirs, me, mine)


cdef inline double call_scale(const CallInfo* call, uint32_t count, int nranks) noexcept nogil:
    return scale_factor(call.scaling, call.op, count, nranks)


# How long a rank without deadline waits for the note of a producer that
# moved past its call, before it calls that a protocol error (seconds).
cdef double NOTE_WAIT = 1.0
# The same with a deadline, where a producer also leaves when its deadline
# ends (then no note comes): once per call.
cdef double NOTE_WAIT_LOSSY = 0.005
cdef enum:                    # Channel.told_failure(wait=)
    NOTE_LOOK, NOTE_WAIT_ONCE, NOTE_WAIT_EXACT


# Signatures of this rank's last calls, kept to compare with a peer that
# arrives in one of them after this rank has moved on (a late rank): its
# status or HELLO says which call it is in and how it made it.
cdef enum:
    PAST_CALLS = 64


cdef class Channel:
    """What an algorithm needs from a channel (all methods but setup nogil).

    claim, mine, publish and poll have no sensible default: a subclass that
    does not override one of them would lose or corrupt data without a word
    (NULL payloads, records nobody sees, streams that wait forever).  They
    are nogil and cannot raise, so the base versions abort the process with
    a message naming the method (mpl_unimplemented)."""
    cdef int rank, size
    cdef ErrorInfo error          # set when a poll returns POLL_FAIL
    cdef Outcomes outcomes        # errors told over MPI (outcome.pxi); None offline
    cdef uint64_t gone_waited     # the last call that waited for a gone producer's note
                                  # (the test suite's judges)
    # Done notes (tell_done) to readers not in the call (rma): a rank behind
    # (a straggler) then knows at once that a producer that moved on did not
    # fail the call, instead of waiting NOTE_WAIT_LOSSY for a note.  Off on
    # an elastic communicator: a reader not seen may have exited, and MPICH
    # crashed sending to one (docs/ud.md).
    cdef bint notes_to_absent
    cdef uint64_t n_done_notes
    cdef uint64_t n_note_waits_out    # waits for a gone producer's note that ran out
    cdef uint64_t past_seq[PAST_CALLS]  # this rank's last calls and their signatures
    cdef uint64_t past_sig[PAST_CALLS]  # (0: failed before its layout; never compared)

    cdef void remember(self, uint64_t seq, uint64_t sig) noexcept nogil:
        """This rank makes call `seq` with signature `sig`."""
        self.past_seq[seq % PAST_CALLS] = seq
        self.past_sig[seq % PAST_CALLS] = sig

    cdef bint made_otherwise(self, int peer, uint64_t seq, uint64_t sig, uint32_t layout,
                             uint64_t count, uint32_t dtype, uint32_t op) noexcept nogil:
        """A peer is in call `seq`, which this rank made and left, with
        signature `sig` (and these announced fields): if this rank made it
        otherwise, the error that fails the current call (the rule for a
        call a rank returned from that failed elsewhere: its next one fails
        on every rank, naming it).  False where this rank cannot tell, and
        where the call, or one since, failed here already: every rank has
        raised for it then (a late HELLO of a call that failed as a
        mismatch would fail a good call after it).  Once per call."""
        cdef char theirs[160]
        cdef int k = seq % PAST_CALLS
        if (sig == 0 or seq == 0 or self.past_seq[k] != seq or self.past_sig[k] == 0
                or self.past_sig[k] == sig or self.error.kind != ERR_NONE):
            return False
        if self.outcomes is not None and self.outcomes.last_failed >= seq:
            return False
        self.past_sig[k] = 0
        describe_call(theirs, 160, layout, count, dtype, op)
        self.error.kind = ERR_MISMATCH
        self.error.rank = self.rank
        snprintf(self.error.msg, MPL_MSG_LEN,
                 b"ranks disagree on call %llu: rank %d arrived late and made it as %s, not "
                 b"as rank %d had (found at rank %d's next calls)",
                 <unsigned long long>seq, peer, theirs, self.rank, self.rank)
        return True

    cdef int begin(self, CallInfo* call) except -1:
        """Prepare a call: announce it to peers, make room for its records."""
        raise NotImplementedError

    cdef int prepare(self, Stream* s) except -1:
        """Get a stream ready for the current call (buffers, state)."""
        return 0

    cdef char* claim(self, int slot, int block) noexcept nogil:
        """Payload memory of my record (slot, block), withdrawn from readers."""
        mpl_unimplemented(b"Channel.claim")
        return NULL

    cdef char* mine(self, int slot, int block) noexcept nogil:
        """Payload memory of my record (slot, block), as last written."""
        mpl_unimplemented(b"Channel.mine")
        return NULL

    cdef void publish(self, int slot, int block, uint32_t count, uint32_t nbytes,
                      const int* dests, int ndests) noexcept nogil:
        """Make my record (slot, block) available to `dests`."""
        mpl_unimplemented(b"Channel.publish")

    cdef int poll(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        """Look for `block` of stream `s`; never blocks."""
        mpl_unimplemented(b"Channel.poll")
        return POLL_FAIL

    cdef bint random_access(self, Stream* s) noexcept nogil:
        """Can blocks of `s` be polled out of order (ahead of the cursor)?"""
        return False

    cdef bint seeks(self, Stream* s) noexcept nogil:
        """Can `s` poll the first block after a run of injected-lost (never
        polled) blocks at its cursor, one block at a time?"""
        return False

    cdef void abandon(self, Stream* s) noexcept nogil:
        """Stop waiting for the block in flight on `s`."""
        pass

    cdef bint confirm(self, Stream* s, int block) noexcept nogil:
        """After using a READY payload in place: was it stable meanwhile?"""
        mpl_unimplemented(b"Channel.confirm")
        return False

    cdef bint closed(self, Stream* s) noexcept nogil:
        """Has the producer of `s` marked its slot complete in this call
        (every block of it sent; what has not come may still be in flight)?"""
        return False

    cdef void progress(self) noexcept nogil:
        """Drive the transport while nothing else happens."""
        pass

    cdef int entered(self) noexcept nogil:
        """How many ranks (me included) are known to have entered this call."""
        return self.size

    cdef void end(self, CallInfo* call, bint failed) noexcept nogil:
        """Finish a call (give peers what they still read from us)."""
        pass

    cdef void fail(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        """Tell peers that this call failed, and why."""
        pass

    cdef bint late_error(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        """Before `call` begins: did a call this rank returned from fail on
        another rank?  Then `err` fails this call on every rank (outcome.pxi)."""
        if self.outcomes is None:
            return False
        return self.outcomes.take_late(call, err)

    cdef bint failed_elsewhere(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        """While in `call` (the engine asks now and then): did a peer tell
        over MPI that this call failed, or that a call this rank returned
        from did?  Then `err` says why."""
        if self.outcomes is None:
            return False
        return self.outcomes.failed_elsewhere(call, err)

    cdef bint told_failure(self, CallInfo* call, Stream* s, ErrorInfo* err,
                           int wait) noexcept nogil:
        """The producer of `s` left `call` before this rank read all of it.
        If it failed the call, its note over MPI left before it moved on (a
        rank that fails calls back to back overwrites its in-band error of
        the first with the second's): look for it, once per stream, and
        wait for it (`wait`): NOTE_WAIT_EXACT, up to NOTE_WAIT seconds where
        the alternative is a protocol error (no deadline); NOTE_WAIT_ONCE,
        up to NOTE_WAIT_LOSSY once per call and never past the deadline;
        NOTE_LOOK, not at all (a stream that ended: the usual way of a lossy
        call).  True, with `err`, if it came."""
        cdef double now, seconds = 0.0
        if self.outcomes is None or s.note_looked:
            return False
        s.note_looked = True
        now = mpl_now()
        if wait == NOTE_WAIT_EXACT:
            seconds = NOTE_WAIT
        elif wait == NOTE_WAIT_ONCE and self.gone_waited != call.seq:
            self.gone_waited = call.seq
            seconds = min(NOTE_WAIT_LOSSY, call.start + call.timeout - now)
        cdef double limit = now + seconds
        while not self.failed_elsewhere(call, err):
            if mpl_now() >= limit:
                self.n_note_waits_out += seconds > 0
                return False
            if wait == NOTE_WAIT_ONCE and self.outcomes.said_done(s.peer, call.seq):
                return False            # (its done note: after any error note of the call)
            mpl_yield()
        return True

    cdef bint tell_done(self, uint64_t seq, int reader) noexcept nogil:
        """With a deadline, leaving call `seq` without failing it: tell
        `reader` over MPI that this rank sent all it will send of the call
        (ends a reader's wait for END, and for a failure note; the notes of
        one pair arrive in order, so any error note of the call comes first).
        False where memory ran out."""
        cdef ErrorInfo done
        memset(&done, 0, sizeof(ErrorInfo))
        done.kind = ERR_NONE
        done.rank = self.rank
        if not self.outcomes.tell_one(seq, &done, reader):
            return False
        self.n_done_notes += 1
        return True

    cdef void settle(self, CallInfo* call, bint failed) noexcept nogil:
        """This rank has its outcome of `call` (before end: a rank that waits
        there for its readers has its result already)."""
        if self.outcomes is not None:
            self.outcomes.settle(call.seq, failed)

    cdef Py_ssize_t max_block_bytes(self) noexcept nogil:
        """Largest block the channel can move as one unit."""
        return 1 << 30

    cdef void close(self):
        pass

    # -- what the Python layer asks of a channel (Core forwards) ------------
    def info(self) -> dict:
        """What the channel is and what it has seen."""
        raise NotImplementedError

    def set_rate(self, double rate, double burst, bytes local=None):
        """Pace this rank's sends at `rate` bytes per second, at most `burst`
        bytes at once, charging nothing for peers on this node (`local`: a
        byte per peer; datagram channels)."""
        raise MPILossyChannelError(f"channel={self.info()['channel']!r} is not paced")

    def set_offload(self, bint on) -> bool:
        """Segmentation and receive offload on or off (the native datagram
        transport); whether receive offload is on."""
        raise MPILossyChannelError(f"channel={self.info()['channel']!r} has no datagram offload")

    def mac_key(self) -> bytes:
        """The datagram MAC key (tests make authentic replays with it)."""
        raise MPILossyChannelError(f"channel={self.info()['channel']!r} has no datagram key")
