# All-gather: every rank publishes its chunk and reads every other rank's
# chunk directly, nearest first.  Nothing is reduced, so there is nothing to
# scale: a block that does not arrive in time leaves the receiver's previous
# contents in place (the sharded training mode relies on this: a rank that
# misses a segment of the new parameters keeps its old values).  One stage,
# the whole budget.  The result's bitmaps say which blocks arrived: the
# owner's bit for a block that did, none for one that kept its contents.

cdef class Gather(Chunked):
    cdef int* others
    cdef double stage_end[1]

    def __cinit__(self, int rank, int size):
        self.others = <int*>calloc(size, sizeof(int))
        if self.others == NULL:
            raise MemoryError()
        cdef int k
        for k in range(1, size):
            self.others[k - 1] = (rank - k + size) % size
        self.stage_end[0] = 1.0

    def __dealloc__(self):
        free(self.others)

    cdef int layout(self, CallInfo* call) except -1:
        self.cut(call)
        call.nslots = 1
        call.nstages = 1
        call.stage_end = self.stage_end
        return 0

    cdef int plan(self) except -1:
        cdef int k
        self.reserve_members(<Py_ssize_t>self.size * self.call.nblocks)
        for k in range(self.size - 1):
            # Stable: validated before it is copied in, so that a block that
            # changes while being read never overwrites the previous contents.
            self.add_stream(self.others[k], 0, 0, self.others[k], True)
        return 0

    cdef void start(self) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int b, me = self.rank
        cdef Py_ssize_t n
        cdef char* mine = self.recv + self.chunk_lo[me] * c.itemsize
        if self.send != mine:        # not in place: my chunk goes into my result too
            memcpy(mine, self.send, self.chunk_len[me] * c.itemsize)
        for b in range(c.nblocks):
            n = self.block_len(me, b)
            memcpy(self.chan.claim(0, b), self.send + (self.block_first(me, b) - self.chunk_lo[me])
                   * c.itemsize, n * c.itemsize)
            self.emit(0, b, 1, <uint32_t>(n * c.itemsize), self.others, self.size - 1)
            self.arrived(me, b)
            self.add_result(self.size, n)

    cdef bint take(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef Py_ssize_t n = self.block_len(s.tag, block)
        if inc.count != 1 or inc.nbytes != n * self.call.itemsize:
            return False
        memcpy(self.recv + self.block_first(s.tag, block) * self.call.itemsize, inc.data, inc.nbytes)
        return True

    cdef void commit(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        self.arrived(s.tag, block)
        self.add_result(self.size, self.block_len(s.tag, block))

    cdef inline void arrived(self, int owner, int block) noexcept nogil:
        cdef uint64_t* bits = self.result_members + \
            (<Py_ssize_t>owner * self.call.nblocks + block) * self.words
        bits[owner >> 6] |= 1ull << (owner & 63)

    cdef void lose(self, Stream* s, int block) noexcept nogil:
        cdef Py_ssize_t n = self.block_len(s.tag, block)
        self.add_result(0, n, False)
        self.fallback_elems += n
