# Tree all-reduce for small messages: reduce up a k-nomial tree, then
# broadcast down the same tree.  Radix 2 is the binomial tree; radix >= size
# is a star (one level: latency of two hops).
#
# The root rotates with every call (same argument as the ring's rotation).
# Ranks are renumbered v = (rank - root) % size; the children of v are
# v + d * radix**l for every level l below v's lowest non-zero base-radix
# digit and d = 1 .. radix-1.  Every node adds what its children sent to its
# own data (slot 0) and publishes the partial sum, with its contributor count,
# for its parent; the root scales it and publishes the result (slot 1), which
# every node forwards to its children.  A node that misses the result falls
# back on its own subtree's partial sum and tells its children at once
# (a record with count 0) instead of letting them wait.
#
# Stages: a child at level l is waited for until (l + 1) / (2 H) of the
# timeout (H = number of levels), the result at depth d until (H + d) / (2 H).
# Partial sums are kept and sent in acc_dtype (float32 for float16: they
# must not overflow where the result would not); the result in the data's.

cdef enum:
    TREE_PARTIAL = 0
    TREE_RESULT = 1

cdef enum:
    RADIX_MAX = 64        # the widest tree (a star up to 65 ranks); part of the call signature


cdef class Tree(Algorithm):
    cdef int radix
    cdef int root, vrank, parent
    cdef int nchildren
    cdef int* children
    cdef int levels
    cdef int* pending             # per block: children not resolved yet
    cdef uint32_t* count          # per block: contributors in my partial sum
    cdef Py_ssize_t block_cap
    cdef double* stage_end

    def __cinit__(self, int rank, int size):
        self.children = <int*>calloc(size, sizeof(int))
        self.stage_end = <double*>calloc(2 * 64, sizeof(double))
        if self.children == NULL or self.stage_end == NULL:
            raise MemoryError()
        self.radix = 2

    def __dealloc__(self):
        free(self.children)
        free(self.pending)
        free(self.count)
        free(self.stage_end)

    cdef int set_radix(self, int radix) except -1:
        if not 2 <= radix <= RADIX_MAX:
            raise ValueError(f"tree radix must be in 2..{RADIX_MAX}, got {radix}")
        self.radix = radix
        return 0

    cdef int layout(self, CallInfo* call) except -1:
        cdef Py_ssize_t width = 1
        cdef int s
        self.levels = 0
        while width < self.size:
            width *= self.radix
            self.levels += 1
        cdef Py_ssize_t wide = ITEMSIZE[acc_dtype(call.dtype)]
        # (records hold partial sums: as many values as fit the block's bytes)
        call.block_elems = max(1, min(call.block_elems * call.itemsize // wide, call.count))
        call.nblocks = <int>max(1, (call.count + call.block_elems - 1) // call.block_elems)
        call.block_bytes = call.block_elems * wide
        call.nslots = 2
        call.nstages = max(1, 2 * self.levels)
        for s in range(call.nstages):
            self.stage_end[s] = (s + 1.0) / call.nstages
        call.stage_end = self.stage_end
        return 0

    cdef int plan(self) except -1:
        cdef int n = self.size, k = self.radix, level, d, depth
        cdef Py_ssize_t width, u
        cdef int nb = self.call.nblocks
        if nb > self.block_cap:
            free(self.pending)
            free(self.count)
            self.pending = <int*>malloc(nb * sizeof(int))
            self.count = <uint32_t*>malloc(nb * sizeof(uint32_t))
            if self.pending == NULL or self.count == NULL:
                raise MemoryError()
            self.block_cap = nb
        self.root = <int>(mpl_mix64(self.call.seq ^ 0x54524545ull) % <uint64_t>n) \
            if self.call.rotate else 0
        self.vrank = (self.rank - self.root + n) % n
        # Children, from the lowest level up, and my depth.
        self.nchildren = 0
        level = 0
        width = 1
        while width < n:
            if self.vrank % (width * k) != 0:
                break           # my lowest non-zero digit is at this level
            for d in range(1, k):
                u = self.vrank + d * width
                if u >= n:
                    break
                self.children[self.nchildren] = <int>((u + self.root) % n)
                self.add_stream(self.children[self.nchildren], TREE_PARTIAL, level, level, True)
                self.nchildren += 1
            level += 1
            width *= k
        depth = 0
        u = self.vrank
        while u > 0:
            if u % k != 0:
                depth += 1
            u //= k
        if self.vrank != 0:
            # Parent: clear my lowest non-zero digit.
            self.parent = <int>((self.vrank - (self.vrank // width % k) * width + self.root) % n)
            self.add_stream(self.parent, TREE_RESULT, self.levels + depth - 1, -1, True)
        else:
            self.parent = -1
        return 0

    cdef inline Py_ssize_t block_first(self, int block) noexcept nogil:
        return <Py_ssize_t>block * self.call.block_elems

    cdef inline Py_ssize_t block_len(self, int block) noexcept nogil:
        return min(self.call.block_elems, self.call.count - self.block_first(block))

    # -- reactions --------------------------------------------------------------
    cdef void start(self) noexcept nogil:
        cdef int b
        cdef Py_ssize_t isz = self.call.itemsize
        for b in range(self.call.nblocks):
            k_widen(self.call.dtype, 1.0, self.chan.claim(TREE_PARTIAL, b),
                    self.send + self.block_first(b) * isz, self.block_len(b))
            self.count[b] = 1
            self.pending[b] = self.nchildren
            if self.nchildren == 0:
                self.reduced(b)

    cdef bint ready(self, Stream* s, int block) noexcept nogil:
        # The result may overwrite my data only once my partial sum is done.
        return s.slot == TREE_PARTIAL or self.pending[block] == 0

    cdef bint take(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef Py_ssize_t n = self.block_len(block)
        cdef int adt = acc_dtype(c.dtype)
        if inc.count == 0 or inc.nbytes != n * ITEMSIZE[adt if s.slot == TREE_PARTIAL
                                                         else c.dtype]:
            return False
        if s.slot == TREE_PARTIAL:
            k_acc(adt, self.chan.mine(TREE_PARTIAL, block), inc.data, n)
        else:
            memcpy(self.recv + self.block_first(block) * c.itemsize, inc.data, inc.nbytes)
            if self.nchildren:
                memcpy(self.chan.claim(TREE_RESULT, block), inc.data, inc.nbytes)
        return True

    cdef void commit(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        if s.slot == TREE_PARTIAL:
            self.count[block] += inc.count
            self.child_done(block)
        else:
            self.publish_result(block, inc.count)
            self.add_result(inc.count, self.block_len(block))

    cdef void lose(self, Stream* s, int block) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef Py_ssize_t n
        if s.slot == TREE_PARTIAL:
            self.child_done(block)
            return
        # No result: use my subtree's partial sum (zero-fill: nothing), and
        # let my children know.
        n = self.block_len(block)
        self.fallback_elems += n
        if c.scaling == SCALE_ZERO_FILL:
            memset(self.recv + self.block_first(block) * c.itemsize, 0, n * c.itemsize)
            self.add_result(0, n, False)
        else:
            k_narrow(c.dtype, call_scale(c, self.count[block], self.size),
                     self.recv + self.block_first(block) * c.itemsize,
                     self.chan.mine(TREE_PARTIAL, block), n)
            self.add_result(self.count[block], n, False)
        if self.nchildren:
            self.chan.claim(TREE_RESULT, block)
            self.publish_result(block, 0)

    cdef inline void child_done(self, int block) noexcept nogil:
        self.pending[block] -= 1
        if self.pending[block] == 0:
            self.reduced(block)

    cdef void reduced(self, int block) noexcept nogil:
        """My partial sum of `block` is complete."""
        cdef CallInfo* c = self.call
        cdef Py_ssize_t n = self.block_len(block)
        cdef char* result
        if self.vrank != 0:
            self.emit(TREE_PARTIAL, block, self.count[block],
                              <uint32_t>(n * ITEMSIZE[acc_dtype(c.dtype)]), &self.parent, 1)
            return
        result = self.chan.claim(TREE_RESULT, block)
        k_narrow(c.dtype, call_scale(c, self.count[block], self.size), result,
                 self.chan.mine(TREE_PARTIAL, block), n)
        memcpy(self.recv + self.block_first(block) * c.itemsize, result, n * c.itemsize)
        self.publish_result(block, self.count[block])
        self.add_result(self.count[block], n)

    cdef inline void publish_result(self, int block, uint32_t count) noexcept nogil:
        cdef uint32_t nbytes = <uint32_t>(self.block_len(block) * self.call.itemsize) if count else 0
        if self.nchildren:
            self.emit(TREE_RESULT, block, count, nbytes, self.children, self.nchildren)
