# The one-sided channel: reading peers' windows (rma_window.pxi holds what
# this rank publishes).  Peers whose window memory MPI can share (same
# node) are read with plain loads, without copies and without MPI progress.
# Other peers are read with MPI_Rget, polled with MPI_Test, which also
# drives MPI progress for the peers that read us.

cdef enum:
    GET_IDLE = 0
    GET_HDR = 1
    GET_PAYLOAD = 2
    GET_CONFIRM = 3
    GET_STATUS = 4
    GET_HDR_LAST = 5

# How long end() waits for consumers to say they are done, at most (seconds):
# a call's own deadline when it is sooner, else this cap, whatever the call's
# timeout says (none, inf, nan, or merely huge).  Leaving earlier is safe:
# a consumer that still reads us gets MPI progress from our next MPI call, and
# what it reads stays in place until our call after next (two regions).
cdef double MAX_LINGER = 10.0
# A failed call without a deadline waits that long for its peers to learn why.
cdef double MAX_LINGER_EXACT = 5.0


cdef class RmaChannel(RmaWindow):
    """The channel interface (channel.pxi) over MPI windows: polling peers'
    records, by loads on the node and MPI_Rget beyond it."""
    cdef unsigned char* consumed_from
    cdef MPI_Request probe_req        # progress(): a get of a peer's status word
    cdef uint64_t probe_word
    cdef unsigned char* seen          # peers known to be in this call
    cdef int nseen
    cdef int seen_next                # network path: next peer whose status to get
    cdef MPI_Request seen_req
    cdef GetBuffers* seen_gb
    cdef uint64_t* ends_seen          # network path: peer * nslots_max + slot
    cdef double* ends_when            # when ends_seen reached its value
    cdef MPI_Request ends_req         # network path: one get of a peer's end words
    cdef int ends_peer
    cdef GetBuffers* ends_gb
    cdef uint64_t* done_out        # origin buffers of the done signals
    cdef MPI_Request* done_req
    cdef MPI_Request* zreq         # gets that outlived their call
    cdef GetBuffers** zbuf
    cdef int nzombies, zcap

    cdef int allocate_readers(self) except -1:
        cdef int p
        cdef int size = self.size
        self.ends_seen = <uint64_t*>calloc(<Py_ssize_t>size * self.nslots_max, sizeof(uint64_t))
        self.ends_when = <double*>calloc(<Py_ssize_t>size * self.nslots_max, sizeof(double))
        self.ends_req = MPI_REQUEST_NULL
        self.consumed_from = <unsigned char*>calloc(size, 1)
        self.seen = <unsigned char*>calloc(size, 1)
        self.seen_req = MPI_REQUEST_NULL
        self.probe_req = MPI_REQUEST_NULL
        self.done_out = <uint64_t*>calloc(size, sizeof(uint64_t))
        self.done_req = <MPI_Request*>malloc(size * sizeof(MPI_Request))
        if not (self.consumed_from and self.seen and self.done_out and self.done_req
                and self.ends_seen and self.ends_when):
            raise MemoryError()
        for p in range(size):
            self.done_req[p] = MPI_REQUEST_NULL
        return 0

    cdef void quiesce(self):
        cdef int i
        for i in range(self.nzombies):
            MPI_Wait(&self.zreq[i], MPI_STATUS_IGNORE)
            free_getbuffers(self.zbuf[i])
        self.nzombies = 0
        if self.probe_req != MPI_REQUEST_NULL:
            MPI_Wait(&self.probe_req, MPI_STATUS_IGNORE)
        if self.done_req != NULL:
            for i in range(self.size):
                if self.done_req[i] != MPI_REQUEST_NULL:
                    MPI_Wait(&self.done_req[i], MPI_STATUS_IGNORE)

    def __dealloc__(self):
        free(self.consumed_from)
        free(self.seen)
        free_getbuffers(self.seen_gb)
        free_getbuffers(self.ends_gb)
        free(self.ends_seen)
        free(self.ends_when)
        free(self.done_out)
        free(self.done_req)
        free(self.zreq)
        free(self.zbuf)

    # -- per call ------------------------------------------------------------
    cdef int begin(self, CallInfo* call) except -1:
        self.reap_zombies()
        memset(self.consumed_from, 0, self.size)
        memset(self.seen, 0, self.size)
        self.seen[self.rank] = 1
        self.nseen = 1
        self.seen_next = 0
        if self.seen_gb == NULL and not self.all_shared:
            self.seen_gb = new_getbuffers(0)
        if self.ends_gb == NULL and not self.all_shared:
            self.ends_gb = new_getbuffers(8 * self.nslots_max)
        if (call.seq > 2 and self.region_exact[call.seq & 1]
                and self.all_entered < call.seq - 1):
            self.wait_for_readers(call)
        self.region_exact[call.seq & 1] = call.timeout < 0
        return RmaWindow.begin(self, call)

    cdef int wait_for_readers(self, CallInfo* call) except -1:
        """The region this call writes last held call seq-2, which had no
        deadline: a peer may still be reading it (its call seq-2 ends only
        once it has everything).  A rank reuses a region only once every
        peer has entered call seq-1, and so has left seq-2.  A complete call
        seq-1 without deadline or injected loss proves it (its result needs
        every rank's data of it), so does a call that saw every peer enter
        (end); after a failed call, or with injected loss, this waits: as
        long as it takes without a deadline (a signal ends it), until the
        deadline with one (a reader still in seq-2 then fails its call, and
        outcome.pxi tells everyone)."""
        cdef uint64_t need = call.seq - 1
        cdef int p = 0, flag
        cdef double now, next_signal_check = mpl_now() + SIGNAL_CHECK_INTERVAL
        try:
            while p < self.size:
                if p == self.rank or self.peer_reached(p, need):
                    p += 1
                    continue
                now = mpl_now()
                if call.timeout >= 0 and now >= call.start + call.timeout:
                    break
                if now >= next_signal_check:
                    next_signal_check = now + SIGNAL_CHECK_INTERVAL
                    PyErr_CheckSignals()
                with nogil:
                    self.progress()
                    mpl_yield()
        finally:
            if self.seen_req != MPI_REQUEST_NULL:
                self.bury(self.seen_req, self.seen_gb)
                self.seen_req = MPI_REQUEST_NULL
                self.seen_gb = new_getbuffers(0)
        if p == self.size:
            self.all_entered = need
        return 0

    cdef bint peer_reached(self, int p, uint64_t seq) noexcept nogil:
        """Is peer p known to be in call `seq` or later (never blocks)?"""
        cdef int flag
        if self.peer_base[p] != NULL:
            return mpl_load_acquire(&(<mpl_status_t*>self.peer_base[p]).seq) >= seq
        if self.seen_req == MPI_REQUEST_NULL:
            self.rget(&self.seen_gb.status, sizeof(mpl_status_t), p, 0, &self.seen_req)
            return False
        MPI_Test(&self.seen_req, &flag, MPI_STATUS_IGNORE)
        if not flag:
            return False
        return self.seen_gb.status.seq >= seq

    cdef bint closed(self, Stream* s) noexcept nogil:
        """The producer's end word for the slot has reached this call.  Its
        records were visible before the word, so a block still missing is one
        that injected loss dropped, or one whose get is still in flight
        (then: not closed yet).  Network path: the block at the cursor is
        missing only if a header get issued *after* the word was seen came
        back without it (a get issued before may have missed a record that
        was published just before the word)."""
        cdef int flag, k
        cdef uint64_t cur = self.call.seq
        cdef uint64_t* seen
        cdef uint64_t* fresh
        cdef double* when
        cdef double now
        if self.peer_base[s.peer] != NULL:
            return mpl_load_acquire(self.end_word(self.peer_base[s.peer], s.slot)) >= cur
        if s.cstate != GET_IDLE:
            return False
        seen = self.ends_seen + <Py_ssize_t>s.peer * self.nslots_max
        when = self.ends_when + <Py_ssize_t>s.peer * self.nslots_max
        if seen[s.slot] >= cur:
            return s.drop[s.cursor] or s.miss_at > when[s.slot]
        # Network path: one get of one peer's end words at a time.
        if self.ends_req != MPI_REQUEST_NULL:
            MPI_Test(&self.ends_req, &flag, MPI_STATUS_IGNORE)
            if not flag:
                return False
            now = mpl_now()
            fresh = <uint64_t*>self.ends_gb.payload
            for k in range(self.nslots_max):
                if fresh[k] >= cur and self.ends_seen[self.ends_peer * self.nslots_max + k] < cur:
                    self.ends_when[self.ends_peer * self.nslots_max + k] = now
            memcpy(self.ends_seen + <Py_ssize_t>self.ends_peer * self.nslots_max,
                   self.ends_gb.payload, 8 * self.nslots_max)
            if seen[s.slot] >= cur:
                return s.drop[s.cursor] or s.miss_at > when[s.slot]
        self.ends_peer = s.peer
        self.rget(self.ends_gb.payload, 8 * self.nslots_max, s.peer, self.ends_offset,
                  &self.ends_req)
        return False

    # -- reading peers -------------------------------------------------------
    cdef inline bint record_valid(self, const mpl_record_t* hdr, uint64_t seq, int slot, int block) noexcept nogil:
        """Is `hdr` (a private copy: a peer may rewrite the original at any
        time, even with another call's layout) the header of record (slot,
        block) of this call, with a payload that fits this call's blocks?"""
        return (seq == self.call.seq
                and hdr.check == mpl_record_check(seq, self.call.sig, slot, block)
                and hdr.count <= <uint32_t>self.size
                and hdr.nbytes <= <uint32_t>self.call.record_bytes)

    cdef inline bint read_header(self, const char* rec, mpl_record_t* hdr, int slot,
                                 int block) noexcept nogil:
        """Copy the header of a record in shared memory once, then validate
        the copy: everything after uses the copy, never the live header."""
        cdef uint64_t seq = mpl_load_acquire(&(<const mpl_record_t*>rec).seq)
        memcpy(hdr, rec, RECORD_HEADER)
        hdr.seq = seq
        return self.record_valid(hdr, seq, slot, block)

    cdef int poll(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        self.consumed_from[s.peer] = 1
        if self.peer_base[s.peer] != NULL:
            return self.poll_shared(s, block, inc)
        return self.poll_get(s, block, inc)

    cdef bint seeks(self, Stream* s) noexcept nogil:
        return self.peer_base[s.peer] == NULL

    cdef bint random_access(self, Stream* s) noexcept nogil:
        return self.peer_base[s.peer] != NULL

    cdef int poll_shared(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef Py_ssize_t off = self.record_offset(s.slot, block)
        cdef char* rec = self.peer_base[s.peer] + off
        cdef mpl_record_t* live = <mpl_record_t*>rec
        cdef mpl_record_t hdr
        cdef int verdict
        if not self.read_header(rec, &hdr, s.slot, block):
            verdict = self.judge(s.peer, <mpl_status_t*>self.peer_base[s.peer])
            if verdict != POLL_READY:
                return verdict
            # The producer moved on: its record is now final, look once more.
            if not self.read_header(rec, &hdr, s.slot, block):
                return POLL_GONE
        if off + RECORD_HEADER + <Py_ssize_t>hdr.nbytes > self.capacity:
            return POLL_GONE        # cannot happen with a valid layout; never read past the window
        inc.count = hdr.count
        inc.nbytes = hdr.nbytes
        if s.stable:
            if <Py_ssize_t>hdr.nbytes > s.gb.capacity:
                return POLL_GONE
            memcpy(s.gb.payload, rec + RECORD_HEADER, hdr.nbytes)
            mpl_fence_acquire()
            if mpl_load_relaxed(&live.seq) != hdr.seq or live.check != hdr.check:
                return POLL_GONE
            inc.data = s.gb.payload
        else:
            inc.data = rec + RECORD_HEADER
        return POLL_READY

    cdef bint confirm(self, Stream* s, int block) noexcept nogil:
        """The record is still this call's: its sequence number and its check
        word (a producer two calls ahead with another layout may have written
        payload over the header, which can match the sequence by chance)."""
        if s.stable or self.peer_base[s.peer] == NULL:
            return True     # already validated when it was copied
        cdef mpl_record_t* hdr = <mpl_record_t*>(
            self.peer_base[s.peer] + self.record_offset(s.slot, block))
        mpl_fence_acquire()
        return (mpl_load_relaxed(&hdr.seq) == self.call.seq
                and hdr.check == mpl_record_check(self.call.seq, self.call.sig, s.slot, block))

    cdef int judge(self, int peer, const mpl_status_t* st) noexcept nogil:
        """Why is the record not there?  WAIT, FAIL, or READY meaning 'the
        producer is past this call: read the record one last time, and if it
        is still not valid it never will be'.  (A header that fails its check
        may be payload of an older call with another layout: its seq means
        nothing, so only the producer's status is believed.)"""
        cdef uint64_t cur = self.call.seq
        cdef uint64_t seq = mpl_load_acquire(&st.seq)    # before err_seq: see fail()
        if mpl_load_acquire(&st.err_seq) == cur:
            self.error.kind = st.err_kind
            self.error.rank = st.err_rank
            memcpy(self.error.msg, st.err_msg, MPL_MSG_LEN)
            self.error.msg[MPL_MSG_LEN - 1] = 0
            return POLL_FAIL
        if seq == cur and st.sig != 0:
            if st.sig != self.call.sig or st.grow != 0:
                self.describe_mismatch(peer, st)
                mpl_fence_acquire()
                if mpl_load_relaxed(&st.seq) == cur:
                    return POLL_FAIL
            return POLL_WAIT
        if seq > cur:
            if seq == cur + 1 and self.disagreed_before(peer, st, seq):
                return POLL_FAIL
            return POLL_READY
        if 0 < seq < cur and self.late_and_otherwise(peer, st, seq):
            return POLL_FAIL
        return POLL_WAIT

    cdef bint late_and_otherwise(self, int peer, const mpl_status_t* st,
                                 uint64_t seq) noexcept nogil:
        """The producer is behind, in call `seq` that this rank left: did it
        make it otherwise?  (It cannot tell: every peer had left that call
        by the time it came, so only they can.)"""
        cdef uint64_t sig = st.sig, count = st.count
        cdef uint32_t dtype = st.dtype, op = st.op, algo = st.algo
        mpl_fence_acquire()
        if mpl_load_relaxed(&st.seq) != seq:
            return False                # rewritten meanwhile: look again later
        return self.made_otherwise(peer, seq, sig, algo, count, dtype, op)

    cdef bint disagreed_before(self, int peer, const mpl_status_t* st, uint64_t seq) noexcept nogil:
        """The producer is one call ahead, and this rank arrives late in the
        call before: did the producer make that call with another signature?
        (Its records of it are still in place, but this rank cannot read them:
        without this the late rank would take them for gone, and nobody would
        learn that the ranks disagree.)"""
        cdef uint64_t pseq = st.prev_seq, psig = st.prev_sig, pcount = st.prev_count
        cdef uint32_t pdtype = st.prev_dtype, pop = st.prev_op, palgo = st.prev_algo
        cdef uint64_t pcheck = st.prev_check
        mpl_fence_acquire()
        if mpl_load_relaxed(&st.seq) != seq:
            return False                # rewritten meanwhile: look again later
        if pseq != self.call.seq or psig == 0 or psig == self.call.sig:
            return False
        if pcheck != previous_check(pseq, psig, pcount, pdtype, pop, palgo):
            return False                # a torn copy (network path)
        describe_mismatch(&self.error, self.call, self.rank, peer, palgo, pcount, pdtype, pop)
        return True

    cdef int poll_get(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        """Network path: a small state machine of MPI_Rget for one block at a
        time (the cursor's, or the first one behind injected-lost blocks:
        seek_ahead), never blocking."""
        cdef int flag, verdict, ierr
        if s.gb == NULL:            # its buffers went to the zombie list
            s.gb = alloc_getbuffers(self.call.record_bytes)
            if s.gb == NULL:
                self.error.kind = ERR_MPI
                self.error.rank = self.rank
                snprintf(self.error.msg, MPL_MSG_LEN, b"out of memory on rank %d", self.rank)
                return POLL_FAIL
        cdef GetBuffers* gb = s.gb
        if s.cstate != GET_IDLE and s.gblock != block:
            return POLL_WAIT            # busy with another block of the stream
        cdef Py_ssize_t off = self.record_offset(s.slot, block)
        s.gblock = block
        while True:
            if s.cstate != GET_IDLE:
                ierr = MPI_Test(&s.req, &flag, MPI_STATUS_IGNORE)
                if ierr != MPI_SUCCESS:
                    return self.mpi_failure(b"MPI_Test", ierr)
                if not flag:
                    return POLL_WAIT
            if s.cstate == GET_IDLE:
                s.hdr_at = mpl_now()
                if self.rget(&gb.hdr, RECORD_HEADER, s.peer, off, &s.req):
                    return POLL_FAIL
                s.cstate = GET_HDR
            elif s.cstate == GET_HDR or s.cstate == GET_HDR_LAST:
                if (self.record_valid(&gb.hdr, gb.hdr.seq, s.slot, block)
                        and <Py_ssize_t>gb.hdr.nbytes <= gb.capacity):
                    if self.rget(gb.payload, gb.hdr.nbytes, s.peer, off + RECORD_HEADER, &s.req):
                        return POLL_FAIL
                    s.cstate = GET_PAYLOAD
                elif s.cstate == GET_HDR_LAST:
                    s.cstate = GET_IDLE
                    return POLL_GONE
                else:
                    if self.rget(&gb.status, sizeof(mpl_status_t), s.peer, 0, &s.req):
                        return POLL_FAIL
                    s.cstate = GET_STATUS
            elif s.cstate == GET_PAYLOAD:
                if self.rget(&gb.hdr2, RECORD_HEADER, s.peer, off, &s.req):
                    return POLL_FAIL
                s.cstate = GET_CONFIRM
            elif s.cstate == GET_CONFIRM:
                s.cstate = GET_IDLE
                if gb.hdr2.seq != gb.hdr.seq or gb.hdr2.check != gb.hdr.check:
                    return POLL_GONE
                inc.data = gb.payload
                inc.count = gb.hdr.count
                inc.nbytes = gb.hdr.nbytes
                return POLL_READY
            elif s.cstate == GET_STATUS:
                verdict = self.judge(s.peer, &gb.status)
                if verdict == POLL_READY:
                    if self.rget(&gb.hdr, RECORD_HEADER, s.peer, off, &s.req):
                        return POLL_FAIL
                    s.cstate = GET_HDR_LAST
                else:
                    s.cstate = GET_IDLE
                    if verdict == POLL_WAIT:
                        s.miss_at = s.hdr_at
                    return verdict

    cdef int rget(self, void* dst, Py_ssize_t nbytes, int peer, Py_ssize_t offset,
                  MPI_Request* req) noexcept nogil:
        cdef int ierr = MPI_Rget(dst, <int>nbytes, MPI_BYTE, peer, offset, <int>nbytes,
                                 MPI_BYTE, self.win, req)
        if ierr != MPI_SUCCESS:
            self.mpi_failure(b"MPI_Rget", ierr)
            return 1
        return 0

    cdef int mpi_failure(self, const char* what, int ierr) noexcept nogil:
        cdef char text[MPI_MAX_ERROR_STRING]
        cdef int length = 0
        text[0] = 0
        MPI_Error_string(ierr, text, &length)
        self.error.kind = ERR_MPI
        self.error.rank = self.rank
        snprintf(self.error.msg, MPL_MSG_LEN, b"%s failed on rank %d: %s", what, self.rank, text)
        return POLL_FAIL

    cdef int prepare(self, Stream* s) except -1:
        s.cstate = GET_IDLE
        s.req = MPI_REQUEST_NULL
        s.gblock = 0
        s.hdr_at = s.miss_at = -1.0
        # The producer lingers until we say we are done with it: owed even if
        # no block of it is ever polled (all of them lost to injected loss).
        if self.peer_base[s.peer] == NULL:
            self.consumed_from[s.peer] = 1
        if s.stable or self.peer_base[s.peer] == NULL:
            if s.gb == NULL or s.gb.capacity < self.call.record_bytes:
                free_getbuffers(s.gb)
                s.gb = new_getbuffers(self.call.record_bytes)
        return 0

    cdef void abandon(self, Stream* s) noexcept nogil:
        """A call ends with a get in flight: its buffers wait in the zombie list."""
        if s.cstate == GET_IDLE:
            return
        self.bury(s.req, s.gb)
        s.gb = NULL
        s.req = MPI_REQUEST_NULL
        s.cstate = GET_IDLE

    cdef void bury(self, MPI_Request req, GetBuffers* gb) noexcept nogil:
        """Keep an unfinished get and its target buffers until it completes."""
        cdef int cap = 2 * self.zcap + 8
        cdef MPI_Request* reqs
        cdef GetBuffers** bufs
        if self.nzombies == self.zcap:
            reqs = <MPI_Request*>realloc(self.zreq, cap * sizeof(MPI_Request))
            if reqs != NULL:
                self.zreq = reqs
            bufs = <GetBuffers**>realloc(self.zbuf, cap * sizeof(GetBuffers*))
            if bufs != NULL:
                self.zbuf = bufs
            if reqs == NULL or bufs == NULL:
                # No memory to keep it: MPI frees the request when the get
                # completes, and its buffers are left to it (never freed).
                MPI_Request_free(&req)
                return
            self.zcap = cap
        self.zreq[self.nzombies] = req
        self.zbuf[self.nzombies] = gb
        self.nzombies += 1

    cdef void reap_zombies(self) noexcept nogil:
        cdef int i = 0, flag
        while i < self.nzombies:
            MPI_Test(&self.zreq[i], &flag, MPI_STATUS_IGNORE)
            if flag:
                free_getbuffers(self.zbuf[i])
                self.nzombies -= 1
                self.zreq[i] = self.zreq[self.nzombies]
                self.zbuf[i] = self.zbuf[self.nzombies]
            else:
                i += 1

    cdef int entered(self) noexcept nogil:
        cdef int p, flag
        cdef uint64_t cur = self.call.seq
        if self.nseen == self.size:
            return self.nseen
        for p in range(self.size):
            if not self.seen[p] and self.peer_base[p] != NULL:
                if mpl_load_acquire(&(<mpl_status_t*>self.peer_base[p]).seq) >= cur:
                    self.seen[p] = 1
                    self.nseen += 1
        if self.all_shared:
            return self.nseen
        # Network path: one status get in flight, visiting unseen peers in turn.
        if self.seen_req != MPI_REQUEST_NULL:
            MPI_Test(&self.seen_req, &flag, MPI_STATUS_IGNORE)
            if not flag:
                return self.nseen
            if not self.seen[self.seen_next] and self.seen_gb.status.seq >= cur:
                self.seen[self.seen_next] = 1
                self.nseen += 1
            self.seen_next = (self.seen_next + 1) % self.size
        for p in range(self.size):
            if not self.seen[self.seen_next]:
                self.rget(&self.seen_gb.status, sizeof(mpl_status_t), self.seen_next, 0, &self.seen_req)
                break
            self.seen_next = (self.seen_next + 1) % self.size
        return self.nseen

    def info(self) -> dict:
        cdef int p, shared = 0
        for p in range(self.size):
            if p != self.rank and self.peer_base[p] != NULL:
                shared += 1
        return {"channel": "rma", "window_bytes": self.capacity,
                "shared_memory_peers": shared, "gets_outliving_their_call": self.nzombies,
                "done_notes": self.n_done_notes, "note_waits_out": self.n_note_waits_out}

    cdef void progress(self) noexcept nogil:
        # MPI_Iprobe moves messages; the window's own traffic (peers' gets of
        # our records and status, their done signals, which MPICH's netmod
        # serves only while this rank calls into the window) moves when a
        # request of the window is tested.  A rank with none of its own in
        # flight (one lingering after a call it failed) keeps a small get of
        # a peer's status word going for that: without it nobody could read
        # its status, and every peer waited out its deadline.
        cdef int flag, k, p
        if self.outcomes is not None:
            self.outcomes.reap()        # (see Outcomes.reap: notes MPI postponed)
        if self.all_shared:
            return
        MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, self.comm, &flag, MPI_STATUS_IGNORE)
        if self.probe_req != MPI_REQUEST_NULL:
            MPI_Test(&self.probe_req, &flag, MPI_STATUS_IGNORE)
            return
        for k in range(1, self.size):        # a peer beyond this node (a get of
            p = (self.rank + k) % self.size   # our own is served without the netmod)
            if self.peer_base[p] == NULL:
                MPI_Rget(&self.probe_word, 8, MPI_BYTE, p, 0, 8, MPI_BYTE, self.win,
                         &self.probe_req)
                return

    # -- end of a call -------------------------------------------------------
    cdef void end(self, CallInfo* call, bint failed) noexcept nogil:
        """Peers reached through MPI_Rget need us to drive progress until they
        have read what we published: tell our producers that we are done,
        then linger until our consumers say the same, or linger_limit."""
        cdef int p, flag
        cdef double limit
        cdef bint waiting
        if not failed and (self.nseen == self.size or (call.timeout < 0 and not call.injected)):
            self.all_entered = call.seq     # (wait_for_readers)
        if call.timeout >= 0 and not failed:
            self.tell_readers_done(call)
        if self.all_shared:
            return
        limit = linger_limit(call, failed, mpl_now())
        if self.seen_req != MPI_REQUEST_NULL:
            self.bury(self.seen_req, self.seen_gb)
            self.seen_req = MPI_REQUEST_NULL
            self.seen_gb = NULL         # begin() allocates a fresh one
        if self.ends_req != MPI_REQUEST_NULL:
            self.bury(self.ends_req, self.ends_gb)
            self.ends_req = MPI_REQUEST_NULL
            self.ends_gb = NULL
        for p in range(self.size):
            if p != self.rank and self.peer_base[p] == NULL and (failed or self.consumed_from[p]):
                self.send_done(p, call, limit)
        cdef uint64_t* done = self.done_words()
        while True:
            waiting = False
            MPI_Win_sync(self.win)
            for p in range(self.size):
                if (p != self.rank and self.peer_base[p] == NULL
                        and (failed or self.published_to[p])
                        and mpl_load_acquire(&done[p]) < call.seq):
                    waiting = True
                    break
            if not waiting or mpl_now() >= limit:
                return
            self.progress()
            mpl_yield()

    cdef void tell_readers_done(self, CallInfo* call) noexcept nogil:
        """With a deadline: this rank leaves the call.  A reader behind it
        (not in the call yet: a straggler) will find its records rewritten
        two calls on and look for a failure note (Channel.told_failure), up
        to NOTE_WAIT_LOSSY a call: it paid that in every call it was behind,
        and fell further behind.  A done note to each reader not in the call
        ends that wait (not on an elastic communicator: notes_to_absent).
        Readers in the call get none: a note nobody reads before the
        communicator is freed can reach the next one MPI gives its context."""
        cdef int p
        if self.outcomes is None or not self.notes_to_absent:
            return
        self.outcomes.reap()
        for p in range(self.size):
            if p == self.rank or not self.published_to[p] or self.seen[p]:
                continue
            if (self.peer_base[p] != NULL and
                    mpl_load_acquire(&(<mpl_status_t*>self.peer_base[p]).seq) >= call.seq):
                continue                # in the call (or past it) after all
            if not self.tell_done(call.seq, p):
                return                  # no memory: readers wait as before

    cdef void send_done(self, int peer, CallInfo* call, double limit) noexcept nogil:
        cdef int flag = 1
        cdef double until
        if self.done_req[peer] != MPI_REQUEST_NULL:
            # The previous signal (an earlier call's) must be out before this
            # one is written, and it does not tell the peer that this call is
            # done: a peer lingering for it would wait out its limit (seen
            # with calls failing back to back).  So wait a little for it.
            MPI_Test(&self.done_req[peer], &flag, MPI_STATUS_IGNORE)
            until = limit if call.timeout < 0 else min(limit, mpl_now() + DONE_WAIT)
            while not flag and mpl_now() < until:
                mpl_yield()
                MPI_Test(&self.done_req[peer], &flag, MPI_STATUS_IGNORE)
        if not flag:
            return      # still in flight: the peer stops lingering at its own limit
        self.done_out[peer] = call.seq
        MPI_Rput(&self.done_out[peer], 8, MPI_BYTE, peer,
                 MPL_STATUS_BYTES + 8 * self.rank, 8, MPI_BYTE, self.win, &self.done_req[peer])
        MPI_Test(&self.done_req[peer], &flag, MPI_STATUS_IGNORE)


# How long a call with a deadline waits for its previous done signal to a
# peer to leave before it sends this call's (seconds).
cdef double DONE_WAIT = 0.002


cdef inline double linger_limit(const CallInfo* call, bint failed, double now) noexcept nogil:
    """When end() stops waiting for consumers: the call's deadline if it has
    one and it is sooner than MAX_LINGER seconds from `now`, else that cap
    (MAX_LINGER_EXACT for a failed call without a deadline).  A timeout that
    is not a finite number >= 0 counts as no deadline."""
    cdef double cap = now + (MAX_LINGER_EXACT if failed and call.timeout < 0 else MAX_LINGER)
    cdef double deadline = call.start + call.timeout
    if call.timeout >= 0 and deadline < cap:      # false for nan and inf
        return deadline
    return cap


cdef GetBuffers* alloc_getbuffers(Py_ssize_t capacity) noexcept nogil:
    cdef GetBuffers* gb = <GetBuffers*>calloc(1, sizeof(GetBuffers))
    if gb == NULL:
        return NULL
    gb.payload = <char*>malloc(max(capacity, 64))
    if gb.payload == NULL:
        free(gb)
        return NULL
    gb.capacity = capacity
    return gb


cdef GetBuffers* new_getbuffers(Py_ssize_t capacity) except NULL:
    cdef GetBuffers* gb = alloc_getbuffers(capacity)
    if gb == NULL:
        raise MemoryError()
    return gb


cdef void free_getbuffers(GetBuffers* gb) noexcept nogil:
    if gb != NULL:
        free(gb.payload)
        free(gb)
