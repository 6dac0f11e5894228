# The engine shared by all algorithms.
#
# An algorithm describes a call as streams (what it reads from whom, in which
# deadline stage) and reacts to each block of each stream: `take` it when it
# arrives, `commit` it once the channel confirms it was not overwritten
# meanwhile, or `lose` it when it is lost, late or torn.  `run_streams`
# polls every stream until all blocks are resolved; no block waits past the
# end of its stage, so a call never outlives its deadline by more than the
# time to finish the blocks already in hand.
#
# Early close: a producer marks a slot complete once it has sent every block
# of it (Channel.closed).  A block still missing EARLY_CLOSE_GRACE after the
# mark was seen will not come: it is lost then, not at the stage deadline.
# The mark can be lost too (injected loss drops it as it would drop both of
# the two datagrams that carry it on the datagram channel); then the block
# waits for its deadline as before.  A producer that is late has not set its
# mark, so its data is still waited for until the deadline.

cdef class Algorithm:
    cdef int rank, size
    cdef Channel chan
    cdef CallInfo* call
    cdef Stream* streams
    cdef int nstreams, max_streams
    cdef Py_ssize_t* drop_cap
    cdef char* send
    cdef char* recv
    cdef bint inplace
    cdef Py_ssize_t result_elems   # elements of this rank's result
    # results of the call, as this rank sees them
    cdef double weighted           # sum over result blocks of count * elements
    cdef double weighted_blocks    # sum over result blocks of count
    cdef double agreed_weighted    # the same over blocks whose reduced value arrived
    cdef Py_ssize_t agreed_elems
    cdef Py_ssize_t result_blocks
    cdef Py_ssize_t fallback_elems
    cdef uint32_t min_count
    cdef bint deadline_hit
    cdef int lost_injected, lost_late, lost_gone, lost_torn   # blocks, by cause
    # redundancy (coding.pxi): the call's code, and what this rank published
    cdef int rebuilt_blocks        # blocks rebuilt from their group
    cdef mpl_fec_t code
    cdef int* group_published      # per slot x group: data blocks published
    cdef uint32_t* published_as    # per slot x block: count and length published
    cdef char* encoding            # k rows: the group being encoded
    cdef Py_ssize_t fec_caps[3]

    def __cinit__(self, int rank, int size):
        self.rank = rank
        self.size = size
        self.max_streams = 2 * size + 2
        self.streams = <Stream*>calloc(self.max_streams, sizeof(Stream))
        self.drop_cap = <Py_ssize_t*>calloc(self.max_streams, sizeof(Py_ssize_t))
        if self.streams == NULL or self.drop_cap == NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef int i
        if self.streams != NULL:
            for i in range(self.max_streams):
                free(self.streams[i].drop)
                free(self.streams[i].done)
                free(self.streams[i].rows)
                free(self.streams[i].have)
                free(self.streams[i].rebuilt)
                free_getbuffers(self.streams[i].gb)
        free(self.streams)
        free(self.drop_cap)
        free(self.group_published)
        free(self.published_as)
        free(self.encoding)

    # -- set-up, with the GIL ----------------------------------------------
    cdef int layout(self, CallInfo* call) except -1:
        """Fill call.nslots, nblocks, block_elems, block_bytes, nstages, stage_end."""
        raise NotImplementedError

    cdef int plan(self) except -1:
        """Fill the streams of the current call."""
        raise NotImplementedError

    cdef int bind(self, Channel chan, CallInfo* call, char* send, char* recv) except -1:
        self.chan = chan
        self.call = call
        self.send = send
        self.recv = recv
        self.inplace = send == recv
        self.result_elems = call.count
        self.weighted = 0
        self.weighted_blocks = 0
        self.agreed_weighted = 0
        self.agreed_elems = 0
        self.result_blocks = 0
        self.fallback_elems = 0
        self.min_count = <uint32_t>self.size
        self.deadline_hit = False
        self.lost_injected = self.lost_late = self.lost_gone = self.lost_torn = 0
        self.rebuilt_blocks = 0
        self.nstreams = 0
        self.plan()
        cdef int i
        cdef Stream* s
        # drop and done cover every record of a slot, parity included
        for i in range(self.nstreams):
            s = &self.streams[i]
            s.cursor = 0
            s.scan = 0
            if self.drop_cap[i] < call.records:
                free(s.drop)
                free(s.done)
                s.drop = <unsigned char*>malloc(call.records)
                s.done = <unsigned char*>malloc(call.records)
                if s.drop == NULL or s.done == NULL:
                    raise MemoryError()
                self.drop_cap[i] = call.records
            memset(s.drop, 0, call.records)
            memset(s.done, 0, call.records)
            s.drop_end = False
            s.end_at = -1.0
            s.note_looked = False
            chan.prepare(s)
        if call.fec_k:
            fec_bind(self)
        return 0

    cdef inline void emit(self, int slot, int block, uint32_t count, uint32_t nbytes,
                          const int* dests, int ndests) noexcept nogil:
        """Publish my record (slot, block) to `dests`, and with redundancy the
        parity of its group once the group is complete."""
        self.chan.publish(slot, block, count, nbytes, dests, ndests)
        if self.call.fec_k:
            fec_published(self, slot, block, count, nbytes, dests, ndests)

    cdef Stream* add_stream(self, int peer, int slot, int stage, int tag, bint stable) noexcept:
        cdef Stream* s = &self.streams[self.nstreams]
        self.nstreams += 1
        s.peer = peer
        s.slot = slot
        s.nblocks = self.call.nblocks
        s.stage = stage
        s.tag = tag
        s.stable = stable
        return s

    # -- reactions, outside the GIL -----------------------------------------
    cdef void start(self) noexcept nogil:
        pass

    cdef bint produce(self) noexcept nogil:
        """Publish more of what this rank sends, a piece per pass of the
        polling loop (so reading starts before all is sent).  True if it did."""
        return False

    cdef bint ready(self, Stream* s, int block) noexcept nogil:
        return True

    cdef bint take(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        return False

    cdef void commit(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        pass

    cdef void lose(self, Stream* s, int block) noexcept nogil:
        pass

    cdef inline bint resolved(self, int stream, int block) noexcept nogil:
        """Has `block` of stream number `stream` been resolved in this call?"""
        cdef Stream* s = &self.streams[stream]
        return block < s.cursor or s.done[block]

    cdef inline void add_result(self, uint32_t count, Py_ssize_t elems,
                                bint agreed=True) noexcept nogil:
        """A block of my result holds `count` contributions; `agreed`: it is
        the reduced value every rank gets, not my own fallback."""
        self.weighted += <double>count * elems
        self.weighted_blocks += count
        self.result_blocks += 1
        if agreed:
            self.agreed_weighted += <double>count * elems
            self.agreed_elems += elems
        if count < self.min_count:
            self.min_count = count

    cdef double agreed(self) noexcept nogil:
        """Fraction of contributions in the reduced values that arrived."""
        if self.agreed_elems > 0:
            return self.agreed_weighted / (<double>self.size * self.agreed_elems)
        return self.delivered() if self.fallback_elems == 0 else 0.0

    cdef double delivered(self) noexcept nogil:
        if self.result_elems > 0:
            return self.weighted / (<double>self.size * self.result_elems)
        if self.result_blocks > 0:
            return self.weighted_blocks / (<double>self.size * self.result_blocks)
        return 1.0


cdef class Chunked(Algorithm):
    """An algorithm over the vector cut into `size` chunks (chunk_bounds),
    each cut into blocks of call.block_elems: ring, direct, the all-gather.
    Direct and the all-gather also record who is in each block of the
    result: a bitmap of ceil(size / 64) words per block."""
    cdef Py_ssize_t* chunk_lo
    cdef Py_ssize_t* chunk_len
    cdef int words
    cdef uint64_t* result_members
    cdef Py_ssize_t result_entries, result_cap

    def __cinit__(self, int rank, int size):
        self.chunk_lo = <Py_ssize_t*>calloc(size, sizeof(Py_ssize_t))
        self.chunk_len = <Py_ssize_t*>calloc(size, sizeof(Py_ssize_t))
        if self.chunk_lo == NULL or self.chunk_len == NULL:
            raise MemoryError()
        self.words = (size + 63) // 64

    def __dealloc__(self):
        free(self.chunk_lo)
        free(self.chunk_len)
        free(self.result_members)

    cdef int reserve_members(self, Py_ssize_t entries) except -1:
        """Room for the bitmaps of `entries` result blocks, all cleared."""
        if entries > self.result_cap:
            free(self.result_members)
            self.result_members = <uint64_t*>malloc(entries * self.words * 8)
            self.result_cap = 0
            if self.result_members == NULL:
                raise MemoryError()
            self.result_cap = entries
        self.result_entries = entries
        memset(self.result_members, 0, entries * self.words * 8)
        return 0

    cdef object contributors(self):
        """(bitmap bytes, entries, nblocks, block_elems, words) of the last call."""
        return ((<char*>self.result_members)[:self.result_entries * self.words * 8],
                self.result_entries, self.call.nblocks, self.call.block_elems, self.words)

    cdef void cut(self, CallInfo* call) noexcept nogil:
        """Chunks of this call, and its blocks: call.block_elems (at most the
        longest chunk), nblocks (of the longest chunk), block_bytes."""
        cdef int c
        for c in range(self.size):
            chunk_bounds(call.count, self.size, c, &self.chunk_lo[c], &self.chunk_len[c])
        call.block_elems = max(1, min(call.block_elems, self.chunk_len[0]))
        call.nblocks = <int>max(1, (self.chunk_len[0] + call.block_elems - 1) // call.block_elems)
        call.block_bytes = call.block_elems * call.itemsize

    cdef inline Py_ssize_t block_first(self, int chunk, int block) noexcept nogil:
        return self.chunk_lo[chunk] + <Py_ssize_t>block * self.call.block_elems

    cdef inline Py_ssize_t block_len(self, int chunk, int block) noexcept nogil:
        cdef Py_ssize_t rest = self.chunk_len[chunk] - <Py_ssize_t>block * self.call.block_elems
        if rest <= 0:
            return 0
        return min(rest, self.call.block_elems)


cdef int settle(Algorithm alg, Channel chan, CallInfo* call, Stream* s, int block,
                int verdict, Incoming* inc, bint lossy, ErrorInfo* err) noexcept nogil:
    """Resolve `block` of `s` by what the poll said (WAIT is not passed here).
    0, or 1 when the call fails (err set and announced)."""
    cdef bint rebuilt = call.fec_k and s.rebuilt[block]
    cdef bint in_place = call.fec_k and not rebuilt and chan.random_access(s)
    if verdict == POLL_READY:
        if call.fec_k and not rebuilt and not in_place:
            fec_keep(call, s, block, inc)       # (confirmed below with the take)
        if alg.take(s, block, inc) and (rebuilt or chan.confirm(s, block)):
            alg.commit(s, block, inc)
            if call.fec_k:
                fec_taken(call, s, block, in_place)
                alg.rebuilt_blocks += rebuilt
        else:
            alg.lost_torn += 1
            alg.lose(s, block)
    elif verdict == POLL_GONE:
        # The producer left this call.  If it failed it, its note over MPI
        # left first (its in-band error may already be a later call's).
        if chan.told_failure(call, s, err, NOTE_WAIT_EXACT if call.timeout < 0 and not lossy
                             else NOTE_WAIT_ONCE):
            chan.fail(call, err)
            return 1
        if call.timeout < 0 and not lossy:
            err.kind = ERR_PROTOCOL
            err.rank = alg.rank
            snprintf(err.msg, MPL_MSG_LEN,
                     b"rank %d moved past call %llu before rank %d, which waits "
                     b"without deadline, read its data; give every rank the same timeout",
                     s.peer, <unsigned long long>call.seq, alg.rank)
            chan.fail(call, err)
            return 1
        if s.drop[block]:
            alg.lost_injected += 1
        else:
            alg.lost_gone += 1
        alg.lose(s, block)
    else:
        memcpy(err, &chan.error, sizeof(ErrorInfo))
        chan.fail(call, err)
        return 1
    return 0


# Blocks a look-ahead pass examines at most: with the cursor stuck at a lost
# block of a long stream, looking at every block behind it on every poll made
# each poll cost the stream's length (a 16 MiB call under 1% drops took 1.7x
# its lossless time); a pass now resumes where the last one stopped.
cdef int LOOK_AHEAD_SPAN = 64


cdef enum:
    TAKE_SKIPPED = -2    # try_take: nothing to do for this block
    TAKE_FAILED = -1     # try_take: settling it failed the call


cdef inline int try_take(Algorithm alg, Channel chan, CallInfo* call, Stream* s, int block,
                         bint lossy, ErrorInfo* err) noexcept nogil:
    """Poll a block ahead of the cursor and settle it if it is there.  The
    channel's verdict, TAKE_SKIPPED or TAKE_FAILED."""
    cdef Incoming inc
    cdef int verdict
    if block >= s.nblocks:
        return fec_take_parity(chan, call, s, block)
    if s.done[block] or (s.drop[block] and not call.fec_k) or not alg.ready(s, block):
        return TAKE_SKIPPED
    if call.fec_k:
        verdict = fec_fetch(alg, chan, call, s, block, &inc, False, False)
    else:
        verdict = chan.poll(s, block, &inc)
    if verdict == POLL_READY:       # (other verdicts: the cursor's turn deals with them)
        s.done[block] = 1
        if settle(alg, chan, call, s, block, verdict, &inc, lossy, err):
            return TAKE_FAILED
    return verdict


cdef bint look_ahead(Algorithm alg, Channel chan, CallInfo* call, Stream* s, bint lossy,
                     ErrorInfo* err, int* failed) noexcept nogil:
    """The cursor block is not there: take blocks behind it that are, so that
    one lost block does not hold up the rest.  When the next block is not
    there either, nothing has overtaken the cursor: stop.  Else examine up to
    LOOK_AHEAD_SPAN blocks from where the last pass stopped, wrapping around
    once.  True if any was taken."""
    cdef int block, verdict, first = s.cursor + 1, looked = 0
    cdef bint took = False, wrapped = False
    if not chan.random_access(s):
        if chan.seeks(s):
            return seek_ahead(alg, chan, call, s, lossy, err, failed)
        return False
    if first >= s.nblocks:
        return False
    verdict = try_take(alg, chan, call, s, first, lossy, err)
    if verdict == POLL_WAIT:
        return False
    block = max(s.scan, first + 1)
    while verdict != TAKE_FAILED:
        took = took or verdict == POLL_READY
        if looked == LOOK_AHEAD_SPAN:
            break
        if block >= s.nblocks:
            if wrapped or first + 1 >= s.nblocks:
                break
            wrapped = True
            block = first + 1
        looked += 1
        verdict = try_take(alg, chan, call, s, block, lossy, err)
        block += 1
    if verdict == TAKE_FAILED:
        failed[0] = 1
        return True
    s.scan = block
    return took


cdef bint seek_ahead(Algorithm alg, Channel chan, CallInfo* call, Stream* s, bint lossy,
                     ErrorInfo* err, int* failed) noexcept nogil:
    """A stream read one block at a time (the one-sided network path) whose
    cursor block was dropped by injected loss: that block is never polled
    and waits for the end mark or the deadline, so read the blocks behind it
    meanwhile, each time the first one that is neither resolved nor dropped
    (the channel's single state machine works on that block only).  True if
    any was taken."""
    cdef int block = s.cursor, verdict
    cdef int end = call.records       # (with redundancy, the parity records follow)
    cdef bint took = False
    if not s.drop[block]:
        return False
    while True:
        while block < end and (s.done[block] or s.drop[block]):
            block += 1
        if block >= end or (block < s.nblocks and not alg.ready(s, block)):
            return took
        verdict = try_take(alg, chan, call, s, block, lossy, err)
        if verdict == TAKE_FAILED:
            failed[0] = 1
            return True
        if verdict != POLL_READY:
            return took
        took = True




# How often a waiting call looks for failures told over MPI (seconds).
cdef double NOTE_CHECK_INTERVAL = 1e-3


cdef inline bint stream_ended(const CallInfo* call, Channel chan, Stream* s,
                              double now) noexcept nogil:
    """Has the producer of `s` sent all it will send, call.early_close ago?"""
    if s.drop_end or call.early_close < 0:
        return False
    # Asked every time: on the one-sided network path a block whose get is
    # in flight is not given up, whenever the mark was seen.
    if not chan.closed(s):
        return False
    if s.end_at < 0:
        s.end_at = now
    return now >= s.end_at + call.early_close


cdef bint interrupted(Algorithm alg, Channel chan, CallInfo* call, ErrorInfo* err) noexcept nogil:
    """Did a signal handler raise (KeyboardInterrupt)?  Then fail the call and
    tell the peers; the exception stays set for the core to raise."""
    cdef int raised
    with gil:
        raised = PyErr_CheckSignals()
    if raised == 0:
        return False
    err.kind = ERR_INTERRUPTED
    err.rank = alg.rank
    snprintf(err.msg, MPL_MSG_LEN, b"rank %d was interrupted by a signal in call %llu",
             alg.rank, <unsigned long long>call.seq)
    chan.fail(call, err)
    return True


cdef int run_streams(Algorithm alg, Channel chan, CallInfo* call, bint lossy,
                     ErrorInfo* err) noexcept nogil:
    """Resolve every block of every stream.  0 on success; 1 with `err` set
    (and announced to peers) when the call fails."""
    cdef int i, block, verdict, unresolved, failed = 0
    cdef Stream* s
    cdef Incoming inc
    cdef bint progressed, ended
    cdef bint exact = call.timeout < 0
    cdef double now, patience = patience_end(call)
    cdef double next_signal_check = mpl_now() + SIGNAL_CHECK_INTERVAL
    cdef double next_note_check = mpl_now() + NOTE_CHECK_INTERVAL
    cdef int idle = 0
    call.anchor = -1.0
    call.seen = -1.0
    alg.start()
    while True:
        progressed = alg.produce()
        unresolved = 0
        now = mpl_now()
        # (a peer seen after patience no longer moves the anchor, but how
        # late it came is what the learned deadline needs to know)
        if call.seen < 0 and not exact:
            if chan.entered() == alg.size:
                call.seen = now
                if call.anchor < 0:
                    call.anchor = now
            elif call.anchor < 0 and now >= patience:
                call.anchor = patience
        for i in range(alg.nstreams):
            s = &alg.streams[i]
            while s.cursor < s.nblocks:
                block = s.cursor
                if s.done[block]:
                    s.cursor += 1
                    continue
                if not alg.ready(s, block):
                    break
                if call.fec_k:
                    verdict = fec_fetch(alg, chan, call, s, block, &inc, True, exact)
                elif s.drop[block]:
                    # Injected loss: the record never arrives.  Without a
                    # deadline there is nothing to wait for.
                    verdict = POLL_GONE if exact else POLL_WAIT
                else:
                    verdict = chan.poll(s, block, &inc)
                if verdict == POLL_WAIT:
                    if exact:
                        ended = False
                    else:
                        ended = stream_ended(call, chan, s, now)
                    if not ended and (exact or now < stage_deadline(call, s.stage)):
                        if look_ahead(alg, chan, call, s, lossy, err, &failed):
                            if failed:
                                return 1
                            progressed = True
                        break
                    if ended and chan.told_failure(call, s, err, NOTE_LOOK):
                        chan.fail(call, err)        # (the producer left because it failed)
                        return 1
                    if not s.drop[block]:
                        chan.abandon(s)     # (a dropped block has no get in flight;
                                            #  one for a block behind it stays)
                    if s.drop[block]:
                        alg.lost_injected += 1
                    elif ended:
                        alg.lost_gone += 1
                    else:
                        alg.lost_late += 1
                    if not ended:
                        alg.deadline_hit = True
                    alg.lose(s, block)
                elif settle(alg, chan, call, s, block, verdict, &inc, lossy, err):
                    return 1
                s.cursor += 1
                progressed = True
            if s.cursor < s.nblocks:
                unresolved += 1
        if unresolved == 0:
            while alg.produce():    # what peers still need from me
                pass
            return 0
        if progressed:
            idle = 0
        else:
            chan.progress()
            idle += 1
            if idle > call.spin:
                mpl_yield()
            if now >= next_signal_check:
                next_signal_check = now + SIGNAL_CHECK_INTERVAL
                if interrupted(alg, chan, call, err):
                    return 1
            if now >= next_note_check:
                # (outcome.pxi: one outcome per call on every rank)
                next_note_check = now + NOTE_CHECK_INTERVAL
                if chan.failed_elsewhere(call, err):
                    chan.fail(call, err)
                    return 1
