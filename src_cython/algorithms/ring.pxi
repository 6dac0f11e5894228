# Ring all-reduce and reduce-scatter: reduce-scatter along the ring, then
# each rank reads the reduced chunks it wants (all of them for an
# all-reduce, its own for a reduce-scatter), block by block so that the
# steps pipeline.
#
# The vector is cut into `size` chunks (chunk_bounds).  Chunk c is reduced
# by rank (c + rotation) % size, its *reducer*, along the chain reducer+1 ->
# reducer+2 -> ... -> reducer: the rank at position j of a chain adds its own
# data to the partial sum of position j-1 (read from its left neighbour) and
# publishes it as its record of slot j; the reducer (position size-1) scales
# the sum and publishes the reduced chunk in slot size-1.  A partial sum
# carries its contributor count; when a block does not arrive in time the
# chain restarts from the rank that waited for it.  The rotation changes with
# every call, so that every rank is equally likely to sit at every position
# (docs/unbiasedness.md proves that this makes the result unbiased).  In a
# reduce-scatter the reducer of chunk c is usually not rank c, which then
# reads it in one more hop: reducing at the owner would always count the
# owner's own data, the bias that rotation removes.
#
# Partial sums travel in acc_dtype (float32 for float16: they must not
# overflow where the result would not); the reduced chunk in the data's.
#
# A rank that misses a reduced block falls back on its own partial sum of it.
# Stages: reduce-scatter position j ends at j / (2 (size-1)) of the budget,
# the gather at the full budget.

cdef class Ring(Chunked):
    cdef uint32_t* rs_count        # my record's count, per (position, block)
    cdef Py_ssize_t rs_cap
    cdef int* others               # every rank but me: readers of my final chunk
    cdef int left, right, rotation
    cdef double* stage_end

    def __cinit__(self, int rank, int size):
        self.others = <int*>calloc(size, sizeof(int))
        self.stage_end = <double*>calloc(size + 1, sizeof(double))
        if not (self.others and self.stage_end):
            raise MemoryError()
        self.left = (rank - 1 + size) % size
        self.right = (rank + 1) % size
        cdef int p, k = 0
        for p in range(size):
            if p != rank:
                self.others[k] = p
                k += 1

    def __dealloc__(self):
        free(self.rs_count)
        free(self.others)
        free(self.stage_end)

    cdef int layout(self, CallInfo* call) except -1:
        cdef int n = self.size, k
        cdef Py_ssize_t wide = ITEMSIZE[acc_dtype(call.dtype)]
        # (records hold partial sums: as many values as fit the block's bytes)
        call.block_elems = max(1, call.block_elems * call.itemsize // wide)
        self.cut(call)
        call.block_bytes = call.block_elems * wide
        call.nslots = n
        call.nstages = n
        for k in range(n - 1):
            self.stage_end[k] = (k + 1) / (2.0 * (n - 1))
        self.stage_end[n - 1] = 1.0
        call.stage_end = self.stage_end
        return 0

    cdef int plan(self) except -1:
        cdef int n = self.size, j, k, reducer
        cdef Py_ssize_t need = <Py_ssize_t>n * self.call.nblocks
        if need > self.rs_cap:
            free(self.rs_count)
            self.rs_count = <uint32_t*>malloc(need * sizeof(uint32_t))
            if self.rs_count == NULL:
                raise MemoryError()
            self.rs_cap = need
        self.rotation = <int>(mpl_mix64(self.call.seq ^ 0x52494E47ull) % <uint64_t>n) \
            if self.call.rotate else 0
        # Reduce-scatter: position j (1..n-1) reads the left neighbour's slot j-1.
        for j in range(1, n):
            self.add_stream(self.left, j - 1, j - 1, j, False)
        if self.call.coll == COLL_REDUCE_SCATTER:
            self.result_elems = self.chunk_len[self.rank]
            reducer = self.reducer_of(self.rank)
            if reducer != self.rank:
                self.add_stream(reducer, n - 1, n - 1, reducer, False)
            return 0
        # All-reduce: every other reducer's chunk, nearest first.
        for k in range(1, n):
            self.add_stream((self.rank - k + n) % n, n - 1, n - 1, (self.rank - k + n) % n, False)
        return 0

    # -- geometry --------------------------------------------------------------
    cdef inline int reducer_of(self, int chunk) noexcept nogil:
        return (chunk + self.rotation) % self.size

    cdef inline int chunk_at(self, int position) noexcept nogil:
        """Chunk whose chain has this rank at `position`."""
        cdef int n = self.size
        cdef int reducer = (self.rank - position - 1 + 2 * n) % n
        return (reducer - self.rotation + n) % n

    cdef inline int chunk_of_reducer(self, int reducer) noexcept nogil:
        return (reducer - self.rotation + self.size) % self.size

    cdef inline int position_of(self, int chunk) noexcept nogil:
        """My position in the chain of `chunk`."""
        return (self.rank - self.reducer_of(chunk) - 1 + self.size) % self.size

    cdef inline bint wanted(self, int chunk) noexcept nogil:
        """Is `chunk` part of my result?"""
        return self.call.coll == COLL_ALLREDUCE or chunk == self.rank

    cdef inline char* out(self, int chunk, int block) noexcept nogil:
        """Where `block` of `chunk` goes in my result (a wanted chunk)."""
        cdef Py_ssize_t first = self.block_first(chunk, block)
        if self.call.coll == COLL_REDUCE_SCATTER:
            first -= self.chunk_lo[chunk]
        return self.recv + first * self.call.itemsize

    cdef inline bint is_gather(self, Stream* s) noexcept nogil:
        return s.stage == self.size - 1

    # -- reactions --------------------------------------------------------------
    cdef void start(self) noexcept nogil:
        cdef int chunk = self.chunk_at(0), b
        cdef Py_ssize_t isz = self.call.itemsize, n
        cdef char* dst
        for b in range(self.call.nblocks):
            n = self.block_len(chunk, b)
            dst = self.chan.claim(0, b)
            k_widen(self.call.dtype, 1.0, dst, self.send + self.block_first(chunk, b) * isz, n)
            self.rs_count[b] = 1
            self.emit(0, b, 1, <uint32_t>(n * ITEMSIZE[acc_dtype(self.call.dtype)]),
                              &self.right, 1)

    cdef bint ready(self, Stream* s, int block) noexcept nogil:
        if not self.is_gather(s):
            return True
        # My own part of this chunk must be reduced before the gather may
        # overwrite it (in place) or fall back on it (lost).
        cdef int position = (self.rank - s.tag - 1 + self.size) % self.size
        return position == 0 or self.resolved(position - 1, block)

    cdef bint take(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int chunk, position
        cdef Py_ssize_t n, first
        cdef char* dst
        if inc.count == 0:
            return False
        if self.is_gather(s):
            chunk = self.chunk_of_reducer(s.tag)
            n = self.block_len(chunk, block)
            if inc.nbytes != n * c.itemsize:
                return False
            memcpy(self.out(chunk, block), inc.data, inc.nbytes)
            return True
        position = s.tag
        chunk = self.chunk_at(position)
        n = self.block_len(chunk, block)
        if (inc.nbytes != n * ITEMSIZE[acc_dtype(c.dtype)]
                or inc.count >= <uint32_t>self.size):
            return False
        first = self.block_first(chunk, block)
        dst = self.chan.claim(position, block)
        if position < self.size - 1:
            k_add_widened(c.dtype, dst, self.send + first * c.itemsize, inc.data, n)
        else:
            k_add_narrowed(c.dtype, call_scale(c, inc.count + 1, self.size), dst,
                           self.send + first * c.itemsize, inc.data, n)
        return True

    cdef void commit(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef int chunk
        if self.is_gather(s):
            chunk = self.chunk_of_reducer(s.tag)
            self.add_result(inc.count, self.block_len(chunk, block))
        else:
            self.publish_partial(s.tag, block, inc.count + 1)

    cdef void lose(self, Stream* s, int block) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int chunk, position
        cdef Py_ssize_t n, first
        cdef char* dst
        if self.is_gather(s):
            # Fall back on my own partial sum of this chunk: the contributions
            # of my chain up to and including me (zero-fill: nothing).
            chunk = self.chunk_of_reducer(s.tag)
            position = (self.rank - s.tag - 1 + self.size) % self.size
            n = self.block_len(chunk, block)
            dst = self.out(chunk, block)
            self.fallback_elems += n
            if c.scaling == SCALE_ZERO_FILL:
                memset(dst, 0, n * c.itemsize)
                self.add_result(0, n, False)
                return
            k_narrow(c.dtype,
                     call_scale(c, self.rs_count[position * c.nblocks + block], self.size),
                     dst, self.chan.mine(position, block), n)
            self.add_result(self.rs_count[position * c.nblocks + block], n, False)
            return
        # The chain broke before me: it restarts with my own data.
        position = s.tag
        chunk = self.chunk_at(position)
        n = self.block_len(chunk, block)
        first = self.block_first(chunk, block)
        dst = self.chan.claim(position, block)
        if position < self.size - 1:
            k_widen(c.dtype, 1.0, dst, self.send + first * c.itemsize, n)
        else:
            k_scale(c.dtype, call_scale(c, 1, self.size), dst, self.send + first * c.itemsize, n)
        self.publish_partial(position, block, 1)

    cdef void publish_partial(self, int position, int block, uint32_t count) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int chunk = self.chunk_at(position)
        cdef Py_ssize_t n = self.block_len(chunk, block)
        self.rs_count[position * c.nblocks + block] = count
        if position < self.size - 1:
            self.emit(position, block, count,
                              <uint32_t>(n * ITEMSIZE[acc_dtype(c.dtype)]), &self.right, 1)
            return
        # Reducer: the chunk goes to whoever wants it, me included.
        if c.coll == COLL_ALLREDUCE:
            self.emit(position, block, count, <uint32_t>(n * c.itemsize),
                              self.others, self.size - 1)
        elif chunk != self.rank:
            self.emit(position, block, count, <uint32_t>(n * c.itemsize), &chunk, 1)
        if self.wanted(chunk):
            memcpy(self.out(chunk, block), self.chan.mine(position, block), n * c.itemsize)
            self.add_result(count, n)
