# The one-sided channel's window: every rank publishes its records in its
# own MPI window and peers read them (pull: rma.pxi).  Nobody ever writes
# into another rank's records, so a straggler several calls behind cannot
# corrupt a later call: at worst it reads a record that was already
# rewritten, which the record's sequence number and check word reveal
# (seqlock).
#
# Window: [status][done word per rank][end word per slot][records, two
# regions by call parity].  A slot's end word takes the call number once the
# slot's last record is published (early close, schedule.pxi).  Peers whose
# window memory MPI can share (MPI_Win_shared_query: same node) are mapped
# into this process (peer_base).

cdef enum:
    RECORD_HEADER = MPL_RECORD_BYTES    # sizeof(mpl_record_t) (asserted in mpilossy_native.h)


cdef inline Py_ssize_t round_up(Py_ssize_t x, Py_ssize_t to) noexcept nogil:
    return ((x + to - 1) // to) * to


cdef inline uint64_t previous_check(uint64_t seq, uint64_t sig, uint64_t count, uint32_t dtype,
                                    uint32_t op, uint32_t algo) noexcept nogil:
    """The check word of a status block's previous call (mpl_status_t.prev_check)."""
    return mpl_hash4(seq, sig, count, <uint64_t>dtype | <uint64_t>op << 16 | <uint64_t>algo << 32)


cdef class RmaWindow(Channel):
    """This rank's window: its layout, allocation and growth, and what this
    rank publishes in it (status, records, end words, errors)."""
    cdef MPI_Comm comm
    cdef MPI_Win win
    cdef bint has_win
    cdef char* base
    cdef Py_ssize_t capacity
    cdef char** peer_base          # a peer's window in my address space, or NULL
    cdef bint all_shared
    cdef bint use_shared
    cdef Py_ssize_t rec_offset     # where records start in every window
    cdef Py_ssize_t region         # bytes of records per call parity
    cdef Py_ssize_t stride         # bytes from one record to the next
    cdef CallInfo* call
    cdef int nslots_max            # end words per window
    cdef Py_ssize_t ends_offset
    cdef int* published_blocks     # per slot, in this call
    cdef unsigned char* published_to   # peers that read my records of this call
    # Reusing a region (rma.pxi: wait_for_readers): did the call that last
    # wrote it have no deadline, and the latest call every peer is known to
    # have entered.
    cdef bint region_exact[2]
    cdef uint64_t all_entered

    def __cinit__(self):
        self.has_win = False
        self.peer_base = NULL

    cdef int setup(self, MPI_Comm comm, Py_ssize_t capacity, bint use_shared) except -1:
        cdef int rank, size
        MPI_Comm_rank(comm, &rank)
        MPI_Comm_size(comm, &size)
        self.comm = comm
        self.rank = rank
        self.size = size
        self.use_shared = use_shared
        self.nslots_max = max(size, 2)
        self.ends_offset = MPL_STATUS_BYTES + 8 * size
        self.rec_offset = round_up(self.ends_offset + 8 * self.nslots_max, MPL_CACHELINE)
        self.published_blocks = <int*>calloc(self.nslots_max, sizeof(int))
        self.peer_base = <char**>calloc(size, sizeof(char*))
        self.published_to = <unsigned char*>calloc(size, 1)
        if not (self.peer_base and self.published_to and self.published_blocks):
            raise MemoryError()
        self.allocate_readers()
        self.outcomes = Outcomes()
        self.outcomes.setup(comm)
        self.allocate(max(capacity, 4096))
        return 0

    cdef int allocate_readers(self) except -1:
        """The reading side's own state (rma.pxi), before the first window."""
        return 0

    cdef int allocate(self, Py_ssize_t region) except -1:
        """Collective: a zeroed window on every rank, with two regions of
        `region` bytes of records.  Calls alternate between the regions, so
        that a rank that starts call s+1 never rewrites a record of call s
        that a slower peer may still read (even when the layout changes)."""
        cdef Py_ssize_t capacity = self.rec_offset + 2 * round_up(region, MPL_CACHELINE)
        cdef MPI_Info info
        cdef MPI_Aint size
        cdef int disp_unit, p
        cdef void* ptr
        chk(MPI_Info_create(&info))
        MPI_Info_set(info, b"same_size", b"true")
        MPI_Info_set(info, b"same_disp_unit", b"true")
        MPI_Info_set(info, b"accumulate_ordering", b"none")
        ierr = MPI_Win_allocate(capacity, 1, info, self.comm, &self.base, &self.win)
        MPI_Info_free(&info)
        chk(ierr)
        self.has_win = True
        self.capacity = capacity
        self.region = round_up(region, MPL_CACHELINE)
        chk(MPI_Win_set_errhandler(self.win, MPI_ERRORS_RETURN))
        memset(self.base, 0, capacity)
        chk(MPI_Win_lock_all(MPI_MODE_NOCHECK, self.win))
        self.all_shared = True
        for p in range(self.size):
            self.peer_base[p] = NULL
            if p == self.rank:
                self.peer_base[p] = self.base
                continue
            # MPI-4 allows the query on MPI_Win_allocate windows; some MPIs
            # (Open MPI 5.0) answer with an error instead of size 0: either
            # way the peer is read through MPI_Rget.
            if self.use_shared and MPI_Win_shared_query(self.win, p, &size, &disp_unit,
                                                        &ptr) == MPI_SUCCESS:
                if size >= capacity:
                    self.peer_base[p] = <char*>ptr
            if self.peer_base[p] == NULL:
                self.all_shared = False
        # Nobody reads a peer's status before the peer has zeroed it.
        chk(MPI_Barrier(self.comm))
        return 0

    cdef void quiesce(self):
        """Complete every operation still in flight on the window (the
        reading side's gets and done signals) before it is freed."""
        pass

    cdef void release_window(self):
        self.quiesce()
        if self.has_win:
            MPI_Win_unlock_all(self.win)
            MPI_Win_free(&self.win)
            self.has_win = False

    cdef void close(self):
        if self.outcomes is not None:
            self.outcomes.close()
        self.release_window()

    def __dealloc__(self):
        free(self.peer_base)
        free(self.published_blocks)
        free(self.published_to)

    # -- addresses ---------------------------------------------------------
    cdef inline Py_ssize_t record_offset(self, int slot, int block) noexcept nogil:
        return (self.rec_offset + (<Py_ssize_t>(self.call.seq & 1)) * self.region
                + (<Py_ssize_t>slot * self.call.records + block) * self.stride)

    cdef inline mpl_status_t* my_status(self) noexcept nogil:
        return <mpl_status_t*>self.base

    cdef inline uint64_t* done_words(self) noexcept nogil:
        return <uint64_t*>(self.base + MPL_STATUS_BYTES)

    cdef inline uint64_t* end_word(self, char* window, int slot) noexcept nogil:
        return <uint64_t*>(window + self.ends_offset + 8 * slot)

    # -- per call ------------------------------------------------------------
    cdef int begin(self, CallInfo* call) except -1:
        """Lay out this call's records (growing the window if they do not
        fit) and announce the call in the status block."""
        self.call = call
        self.stride = RECORD_HEADER + round_up(call.record_bytes, MPL_CACHELINE)
        memset(self.published_to, 0, self.size)
        if call.nslots > self.nslots_max:
            raise ValueError(f"{call.nslots} slots per call; windows hold {self.nslots_max}")
        memset(self.published_blocks, 0, self.nslots_max * sizeof(int))
        cdef Py_ssize_t need = <Py_ssize_t>call.nslots * call.records * self.stride
        if need > self.region:
            if self.grow(call, need):
                return 1
        self.announce(call, 0)
        return 0

    cdef void rewrite_status(self, CallInfo* call) noexcept nogil:
        """Take the status block from readers (seq 0) to announce `call`; the
        call it announced becomes the previous one, whose records are still
        in place for a peer that arrives there late."""
        cdef mpl_status_t* st = self.my_status()
        cdef uint64_t old = mpl_load_relaxed(&st.seq)
        mpl_store_relaxed(&st.seq, 0)
        mpl_fence_release()
        if old != call.seq and old != 0:
            st.prev_seq = old
            st.prev_sig = st.sig
            st.prev_count = st.count
            st.prev_dtype = st.dtype
            st.prev_op = st.op
            st.prev_algo = st.algo
            st.prev_check = previous_check(st.prev_seq, st.prev_sig, st.prev_count,
                                           st.prev_dtype, st.prev_op, st.prev_algo)

    cdef void announce(self, CallInfo* call, uint64_t grow) noexcept nogil:
        cdef mpl_status_t* st = self.my_status()
        self.rewrite_status(call)
        st.sig = call.sig
        st.count = call.count
        st.dtype = call.dtype
        st.op = announced_op(call)
        st.algo = announced_layout(call)
        st.block = <uint32_t>call.block_bytes
        st.grow = grow
        mpl_store_release(&st.seq, call.seq)

    cdef char* claim(self, int slot, int block) noexcept nogil:
        cdef char* rec = self.base + self.record_offset(slot, block)
        mpl_store_relaxed(&(<mpl_record_t*>rec).seq, 0)
        mpl_fence_release()
        return rec + RECORD_HEADER

    cdef char* mine(self, int slot, int block) noexcept nogil:
        return self.base + self.record_offset(slot, block) + RECORD_HEADER

    cdef void publish(self, int slot, int block, uint32_t count, uint32_t nbytes,
                      const int* dests, int ndests) noexcept nogil:
        cdef mpl_record_t* hdr = <mpl_record_t*>(self.base + self.record_offset(slot, block))
        cdef int i
        hdr.count = count
        hdr.nbytes = nbytes
        hdr.check = mpl_record_check(self.call.seq, self.call.sig, slot, block)
        mpl_store_release(&hdr.seq, self.call.seq)
        for i in range(ndests):
            self.published_to[dests[i]] = 1
        self.published_blocks[slot] += 1
        if self.published_blocks[slot] == self.call.records:
            mpl_store_release(self.end_word(self.base, slot), self.call.seq)

    cdef void fail(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        # The error goes out before the status that announces the call, so a
        # peer that sees this rank in the call also sees why it failed.
        cdef mpl_status_t* st = self.my_status()
        st.err_kind = err.kind
        st.err_rank = err.rank
        memcpy(st.err_msg, err.msg, MPL_MSG_LEN)
        mpl_store_release(&st.err_seq, call.seq)
        if mpl_load_relaxed(&st.seq) != call.seq:
            self.rewrite_status(call)
            st.sig = 0                  # no layout: never read as a mismatch
            st.grow = 0
            mpl_store_release(&st.seq, call.seq)
        if not self.all_shared:
            MPI_Win_sync(self.win)
        # Peers that already returned from this call learn it at their next
        # (outcome.pxi); the status block holds only the latest error.
        if self.outcomes is not None:
            self.outcomes.tell(call.seq, err)

    cdef void describe_mismatch(self, int peer, const mpl_status_t* st) noexcept nogil:
        describe_mismatch(&self.error, self.call, self.rank, peer, st.algo, st.count,
                          st.dtype, st.op)

    # -- growth --------------------------------------------------------------
    cdef int grow(self, CallInfo* call, Py_ssize_t need) except -1:
        """Every rank needs a larger window for this call.  Growing is
        collective, so first make sure that all peers agree (they announce the
        same need for the same call); a peer that disagrees fails the call on
        every rank instead of leaving us blocked in MPI_Win_allocate."""
        cdef int p, ready
        cdef mpl_status_t st
        cdef mpl_status_t* pst
        self.announce(call, <uint64_t>need)
        while True:
            ready = 0
            for p in range(self.size):
                if p == self.rank:
                    ready += 1
                    continue
                if self.peer_base[p] != NULL:
                    pst = <mpl_status_t*>self.peer_base[p]
                    memcpy(&st, pst, sizeof(mpl_status_t))
                    mpl_fence_acquire()
                    if mpl_load_relaxed(&pst.seq) != st.seq:
                        continue
                else:
                    chk(MPI_Get(&st, sizeof(mpl_status_t), MPI_BYTE, p, 0,
                                sizeof(mpl_status_t), MPI_BYTE, self.win))
                    chk(MPI_Win_flush(p, self.win))
                if st.err_seq == call.seq:
                    self.error.kind = st.err_kind
                    self.error.rank = st.err_rank
                    memcpy(self.error.msg, st.err_msg, MPL_MSG_LEN)
                    self.error.msg[MPL_MSG_LEN - 1] = 0
                    return 1
                if st.seq == call.seq:
                    if st.sig != call.sig or st.grow != <uint64_t>need:
                        self.describe_mismatch(p, &st)
                        self.fail(call, &self.error)
                        return 1
                    ready += 1
                elif st.seq > call.seq:
                    self.error.kind = ERR_PROTOCOL
                    self.error.rank = self.rank
                    snprintf(self.error.msg, MPL_MSG_LEN,
                             b"rank %d went past call %llu while rank %d waited to grow its window",
                             p, <unsigned long long>call.seq, self.rank)
                    self.fail(call, &self.error)
                    return 1
            if ready == self.size:
                break
            with nogil:
                self.progress()
                mpl_yield()
        self.release_window()
        self.allocate(max(need, self.region + self.region // 2))
        return 0
