# Direct (one-hop, "transpose") all-reduce and reduce-scatter: every chunk of
# the vector is reduced by one rank, its *reducer*, which takes that chunk
# straight from every peer; then every rank takes the reduced chunks straight
# from their reducers.  A lost block costs exactly one contribution (on a
# ring it costs the whole partial sum behind it), so a reduced block holds
# 1 + (N-1)(1-p) of N contributions on average at any rank count N.
#
# Slots: my slot c holds my contribution to chunk c, read by the reducer of
# c.  The slot of the chunk I reduce is my accumulator, then the reduced
# chunk, followed (at the next 8-byte boundary) by a bitmap of the ranks whose
# data is in it: ceil(N/64) words, so a reader learns who contributed, not only
# how many.
#
# The reducer of chunk c is (c + rotation) % N, with the rotation drawn from
# a hash of the call number (as the ring's chain start): the reducer's own
# data never travels, so it is always in; rotating spreads that advantage
# over all ranks equally (docs/unbiasedness.md).  In a reduce-scatter the
# reducer of chunk c then sends it to rank c, one more hop.
#
# An arrival is never added into the running sum before the channel confirms
# that its producer did not rewrite it meanwhile: it is added into the other
# of two buffers (the record and a private scratch block), which becomes the
# running sum on confirmation.  The running sum starts as my own send data,
# read in place.  When a contribution arrives, the others for the same block
# that can be read already (shared memory, the datagram inbox) are added in
# the same pass (k_sum: each input read once), and the last pass also
# scales, into the record.  So the reduction reads every contribution once
# and writes the record once, like the ring; what the ring does not pay is
# the copy of every rank's contributions into its window for the reducers.
#
# A rank that misses a reduced block uses its own contribution to it
# (count 1).  Stages: the reduction ends at half the budget, the gather at
# the full budget.
#
# Weighted average (call.payload.weight > 0): algorithms/weights.pxi keeps
# the sums of weights; a contribution travels as m * x with w after its data.
#
# float16: the running sums are kept in float32 (acc_dtype, kernels.pxi) in
# the two scratch buffers, and the reduced block is rounded to float16
# once: a sum of values near 65504 must not overflow where their average
# would not.
#
# Low-bit payloads (call.payload.qbits, float32; codecs/payload.pxi encodes
# and decodes them): contributions and reduced blocks travel quantised
# (mpilossy_quant.h: a scale per group, stochastic rounding); a block's record is smaller, so a block holds more values for
# the same bytes on the wire.  The reducer sums dequantised arrivals in
# float32, in two private buffers (the record is too small to hold the
# sum), and quantises the reduced block once; it keeps the decoded record
# itself, so that every rank holds the same values.  A lost block still
# costs exactly its own values.

cdef enum:
    FUSE_SCAN = 16       # streams looked at for contributions to add in one pass

cdef enum:
    SUM_IN_SEND = 0      # nothing added yet: my own data, in the send buffer
    SUM_IN_RECORD = 1
    SUM_IN_SCRATCH = 2


cdef inline int popcount64(uint64_t x) noexcept nogil:
    cdef int k = 0
    while x:
        x &= x - 1
        k += 1
    return k


cdef class Direct(Chunked):
    cdef int* others               # every rank but me, nearest below me first
    cdef int rotation
    cdef int reduced_chunk         # the chunk I reduce in this call
    cdef int next_row              # the next block index to send (produce)
    cdef Py_ssize_t data_bytes     # payload bytes of a full block, before the bitmap
    cdef Py_ssize_t acc_bytes      # bytes of a block's running sum (in the scratch)
    # per block of the chunk I reduce
    cdef uint32_t* count
    cdef WeightedSums weights        # weighted calls: the sums of weights per block
    cdef int* pending
    cdef unsigned char* where        # where the running sum is: SUM_IN_*
    cdef unsigned char* scaled       # the running sum is already the result
    # the arrival being taken (between take and commit)
    cdef const char** sources
    cdef int* taken                  # other streams whose block joins it
    cdef int ntaken, target
    cdef bint wide                   # running sums in the scratch only (float32 of
                                     # float16 or quantised data)
    cdef bint target_final
    cdef uint64_t* members           # bitmap of the running sum
    cdef char* scratch
    cdef Py_ssize_t block_cap, scratch_cap
    cdef double stage_end[2]

    def __cinit__(self, int rank, int size):
        self.others = <int*>calloc(size, sizeof(int))
        self.sources = <const char**>calloc(FUSE_SCAN + 2, sizeof(char*))
        self.taken = <int*>calloc(size, sizeof(int))
        if not (self.others and self.sources and self.taken):
            raise MemoryError()
        ws_init(&self.weights, FUSE_SCAN + 2)
        cdef int k
        for k in range(1, size):
            self.others[k - 1] = (rank - k + size) % size
        self.stage_end[0] = 0.5
        self.stage_end[1] = 1.0

    def __dealloc__(self):
        free(self.others)
        free(self.sources)
        free(self.taken)
        free(self.count)
        ws_free(&self.weights)
        free(self.pending)
        free(self.where)
        free(self.scaled)
        free(self.members)
        free(self.scratch)

    cdef int layout(self, CallInfo* call) except -1:
        cdef Py_ssize_t trailer = 8 * self.words
        cdef Py_ssize_t wire, n
        cdef Payload* pay = &call.payload
        if call.max_block < trailer + 8 + call.itemsize:
            raise ValueError(f"algorithm='direct' needs {trailer + 8 + call.itemsize} bytes per "
                             f"record at {self.size} ranks; the channel moves {call.max_block}")
        # The bitmap goes in the same record as the block it describes.
        if pay.qbits:
            # as many values as fit the bytes a plain block would take
            wire = min(call.block_elems * call.itemsize, call.max_block)
            n = max(1, (wire - trailer - 8) * pay.qgroup // (pay.qgroup * pay.qbits // 8 + 4))
            if n > pay.qgroup:
                n -= n % pay.qgroup            # whole groups
            while n > 1 and round_up(mpl_q_bytes(n, pay.qgroup, pay.qbits), 8) + trailer > wire:
                n -= 1
            call.block_elems = n
        elif round_up(call.block_elems * call.itemsize, 8) + trailer > call.max_block:
            call.block_elems = (call.max_block - trailer - 8) // call.itemsize
        self.cut(call)
        # (self.call is bound later: the layout reads `call`)
        self.data_bytes = round_up(<Py_ssize_t>mpl_q_bytes(call.block_elems, call.payload.qgroup,
                                                           call.payload.qbits) if call.payload.qbits
                                   else call.block_elems * call.itemsize, 8)
        self.acc_bytes = round_up(call.block_elems * ITEMSIZE[acc_dtype(call.dtype)], 8)
        call.block_bytes = self.data_bytes + trailer
        call.nslots = self.size
        call.nstages = 2
        call.stage_end = self.stage_end
        return 0

    cdef int plan(self) except -1:
        cdef CallInfo* c = self.call
        cdef int n = self.size, nb = c.nblocks, k, reducer
        if nb > self.block_cap:
            free(self.count)
            free(self.pending)
            free(self.where)
            free(self.scaled)
            free(self.members)
            self.count = <uint32_t*>malloc(nb * sizeof(uint32_t))
            self.pending = <int*>malloc(nb * sizeof(int))
            self.where = <unsigned char*>malloc(nb)
            self.scaled = <unsigned char*>malloc(nb)
            self.members = <uint64_t*>malloc(<Py_ssize_t>nb * self.words * 8)
            if not (self.count and self.pending and self.where and self.scaled and self.members):
                self.block_cap = 0
                raise MemoryError()
            self.block_cap = nb
        ws_reserve(&self.weights, nb)
        # one running sum per block; two when quantised or float16 (see location)
        self.wide = c.payload.qbits != 0 or acc_dtype(c.dtype) != c.dtype
        cdef Py_ssize_t need = <Py_ssize_t>nb * self.acc_bytes * (2 if self.wide else 1)
        if need > self.scratch_cap:
            free(self.scratch)
            self.scratch = <char*>malloc(need)
            self.scratch_cap = 0
            if self.scratch == NULL:
                raise MemoryError()
            self.scratch_cap = need
        # who is in each block of my result: entry chunk * nblocks + block
        # (all-reduce) or block (reduce-scatter)
        self.reserve_members(nb if c.coll == COLL_REDUCE_SCATTER else <Py_ssize_t>n * nb)
        self.rotation = <int>(mpl_mix64(c.seq ^ 0x444952454354ull) % <uint64_t>n) \
            if c.rotate else 0
        self.reduced_chunk = self.chunk_of(self.rank)
        # Reduction: every peer's contribution to my chunk.
        for k in range(n - 1):
            self.add_stream(self.others[k], self.reduced_chunk, 0, self.others[k], False)
        # Gather: the reduced chunks I want, from their reducers.
        if c.coll == COLL_REDUCE_SCATTER:
            self.result_elems = self.chunk_len[self.rank]
            reducer = self.reducer_of(self.rank)
            if reducer != self.rank:
                self.add_stream(reducer, self.rank, 1, reducer, False)
            return 0
        for k in range(n - 1):
            self.add_stream(self.others[k], self.chunk_of(self.others[k]), 1, self.others[k], False)
        return 0

    cdef double own_weight(self) noexcept nogil:
        """A weighted call: the sum of the weights of the ranks whose data
        reached every block of the chunk this rank reduced (the smallest
        block sum; exact in double); -1 unweighted or without blocks."""
        cdef CallInfo* c = self.call
        cdef int b
        cdef double w, least = -1.0
        if c.payload.weight <= 0:
            return -1.0
        for b in range(c.nblocks):
            if self.block_len(self.reduced_chunk, b) == 0:
                break
            w = ldexp(self.weights.wsum[b], self.weights.wexp[b])
            if least < 0 or w < least:
                least = w
        return least

    # -- geometry --------------------------------------------------------------
    cdef inline int reducer_of(self, int chunk) noexcept nogil:
        return (chunk + self.rotation) % self.size

    cdef inline int chunk_of(self, int reducer) noexcept nogil:
        return (reducer - self.rotation + self.size) % self.size

    cdef inline bint wanted(self, int chunk) noexcept nogil:
        return self.call.coll == COLL_ALLREDUCE or chunk == self.rank

    cdef inline char* out(self, int chunk, int block) noexcept nogil:
        cdef Py_ssize_t first = self.block_first(chunk, block)
        if self.call.coll == COLL_REDUCE_SCATTER:
            first -= self.chunk_lo[chunk]
        return self.recv + first * self.call.itemsize

    cdef inline uint64_t* result_entry(self, int chunk, int block) noexcept nogil:
        cdef Py_ssize_t i = block if self.call.coll == COLL_REDUCE_SCATTER \
            else <Py_ssize_t>chunk * self.call.nblocks + block
        return self.result_members + i * self.words

    cdef inline char* location(self, int block, int where) noexcept nogil:
        if where == SUM_IN_SEND:
            return self.send + self.block_first(self.reduced_chunk, block) * self.call.itemsize
        if where == SUM_IN_RECORD:
            if self.wide:           # the record holds codes or float16: a second buffer
                return self.scratch + <Py_ssize_t>(self.call.nblocks + block) * self.acc_bytes
            return self.chan.mine(self.reduced_chunk, block)
        return self.scratch + <Py_ssize_t>block * self.acc_bytes

    cdef inline int next_location(self, int block) noexcept nogil:
        """Where the next arrival goes.  Without loss N-1 arrivals alternate
        between the two buffers; the first goes where the last ends in the
        record."""
        if self.where[block] == SUM_IN_SEND:
            return SUM_IN_RECORD if self.size % 2 == 0 else SUM_IN_SCRATCH
        return SUM_IN_SCRATCH if self.where[block] == SUM_IN_RECORD else SUM_IN_RECORD

    cdef inline double final_scale(self, uint32_t count, double wsum) noexcept nogil:
        """What turns the sum of `count` contributions (weighing `wsum`, in
        the same powers of two as the sum) into the result."""
        if self.call.payload.weight > 0:
            return 1.0 / wsum
        return call_scale(self.call, count, self.size)

    # -- reactions --------------------------------------------------------------
    cdef void start(self) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int b, me = self.reduced_chunk
        cdef uint64_t* bits
        self.next_row = 0
        ws_start(&self.weights, c.payload.weight, c.nblocks)
        for b in range(c.nblocks):
            self.chan.claim(me, b)          # withdrawn until reduced
            self.count[b] = 1
            self.pending[b] = self.size - 1
            self.where[b] = SUM_IN_SEND
            self.scaled[b] = 0
            if c.payload.weight > 0 or (self.wide and not c.payload.qbits):
                k_widen(c.dtype, self.weights.own_mant, self.location(b, SUM_IN_SCRATCH),
                        self.location(b, SUM_IN_SEND), self.block_len(me, b))
                self.where[b] = SUM_IN_SCRATCH
            bits = self.members + <Py_ssize_t>b * self.words
            memset(bits, 0, 8 * self.words)
            bits[self.rank >> 6] |= 1ull << (self.rank & 63)
        self.produce()

    cdef bint produce(self) noexcept nogil:
        """Send block `next_row` of every chunk to its reducer: row by row,
        so that every reducer can start on block 0 while later rows are
        still being copied into the channel."""
        cdef CallInfo* c = self.call
        cdef int b = self.next_row, k, reducer, chunk
        cdef Py_ssize_t isz = c.itemsize, n
        cdef char* record
        cdef const char* mine
        if b >= c.nblocks:
            return False
        self.next_row += 1
        for k in range(1, self.size):
            reducer = (self.rank + k) % self.size
            chunk = self.chunk_of(reducer)
            n = self.block_len(chunk, b)
            record = self.chan.claim(chunk, b)
            mine = self.send + self.block_first(chunk, b) * isz
            pay_encode(self.call, record, mine, self.weights.own_mant, n, pay_seed(self.call, self.rank, chunk, b, 0))
            if c.payload.residual != NULL:
                pay_keep_error(self.call, self.weights.own_mant, c.payload.residual + self.block_first(chunk, b), <const float*>mine,
                                record, n)
            if c.payload.weight > 0:
                memcpy(record + round_up(pay_bytes(self.call, n), 8), &c.payload.weight, 8)
            self.emit(chunk, b, 1, <uint32_t>pay_contribution_bytes(self.call, n), &reducer, 1)
        return True

    cdef bint ready(self, Stream* s, int block) noexcept nogil:
        # A reduced block may overwrite my send data (in place), and its
        # fallback reads my contribution from the channel: both only once
        # that row of my contributions has been produced.
        return s.stage == 0 or block < self.next_row

    cdef bint take(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int chunk, k, total = 0
        cdef Py_ssize_t n
        cdef uint64_t* bits
        if s.stage == 0:
            return self.take_contribution(s, block, inc)
        chunk = self.chunk_of(s.tag)
        n = self.block_len(chunk, block)
        if (inc.count == 0 or inc.count > <uint32_t>self.size
                or inc.nbytes != round_up(pay_bytes(self.call, n), 8) + 8 * self.words):
            return False
        bits = self.result_entry(chunk, block)
        memcpy(bits, inc.data + round_up(pay_bytes(self.call, n), 8), 8 * self.words)
        for k in range(self.words):
            total += popcount64(bits[k])
        if self.size & 63 and bits[self.words - 1] >> (self.size & 63):
            return False        # a rank that does not exist
        if total != <int>inc.count:
            return False
        pay_decode(self.call, self.out(chunk, block), inc.data, 1.0, n)
        return True

    cdef bint take_contribution(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        """Add `inc`, and every other contribution to `block` that can be read
        now, to the running sum, into the other buffer."""
        cdef CallInfo* c = self.call
        cdef Py_ssize_t n = self.block_len(self.reduced_chunk, block)
        cdef int i, k, nsrc = 2
        cdef int mine = <int>(s - self.streams), ncontrib = self.size - 1
        cdef Stream* t
        cdef Incoming other
        cdef double w
        cdef double mants[FUSE_SCAN + 2]
        cdef int exps[FUSE_SCAN + 2]
        if inc.count != 1 or inc.nbytes != pay_contribution_bytes(self.call, n):
            return False
        w = pay_weight(self.call, inc.data, n)
        if w == 0:
            return False
        mants[1] = frexp(w, &exps[1])
        self.sources[0] = self.location(block, self.where[block])
        self.sources[1] = inc.data
        self.ntaken = 0
        # The streams after this one (stage-0 streams come first in the plan),
        # at most FUSE_SCAN of them: the cost per arrival stays bounded at
        # any rank count.
        for k in range(1, min(ncontrib, FUSE_SCAN + 1)):
            i = (mine + k) % ncontrib
            t = &self.streams[i]
            if self.resolved(i, block) or t.drop[block] or not self.chan.random_access(t):
                continue
            if self.chan.poll(t, block, &other) != POLL_READY:
                continue
            if other.count != 1 or other.nbytes != pay_contribution_bytes(self.call, n):
                continue        # the engine will find it wrong on its own turn
            w = pay_weight(self.call, other.data, n)
            if w == 0:
                continue
            mants[nsrc] = frexp(w, &exps[nsrc])
            self.sources[nsrc] = other.data
            nsrc += 1
            self.taken[self.ntaken] = i
            self.ntaken += 1
        self.target_final = self.pending[block] == nsrc - 1
        if self.target_final:
            self.target = SUM_IN_SCRATCH if self.where[block] == SUM_IN_RECORD else SUM_IN_RECORD
        else:
            self.target = self.next_location(block)
        if c.payload.weight > 0:
            ws_weigh(&self.weights, block, nsrc, mants, exps)
        self.add_up(self.location(block, self.target), nsrc, n,
                    self.final_scale(self.count[block] + nsrc - 1, self.weights.taken_wsum)
                    if self.target_final else 1.0)
        # (With redundancy these records stay where they are, ROW_IN_PLACE:
        # read in place, they are read again if a rebuild needs them.)
        for i in range(self.ntaken):            # read in place: still what it was?
            if not self.chan.confirm(&self.streams[self.taken[i]], block):
                return False
        return True

    cdef inline void add_up(self, char* dst, int nsrc, Py_ssize_t n, double s) noexcept nogil:
        """dst = (sources[0] + ... + sources[nsrc - 1]) * s: the running sum
        (acc_dtype) and arrivals (data, or quantised records when the call
        says so), each times its factor in a weighted call."""
        cdef CallInfo* c = self.call
        cdef const double* f = self.weights.factors if c.payload.weight > 0 else NULL
        cdef int k
        if not c.payload.qbits:
            k_sum_into(c.dtype, s, dst, self.sources, f, nsrc, n)
            return
        if f != NULL and f[0] != 1.0:
            k_scale(DT_F32, f[0], dst, self.sources[0], n)
            self.sources[0] = dst
        mpl_dequantize(<float*>dst, <const float*>self.sources[0],
                       <const unsigned char*>self.sources[1], f[1] if f != NULL else 1.0,
                       n, c.payload.qgroup, c.payload.qbits)
        for k in range(2, nsrc):
            mpl_dequantize(<float*>dst, <const float*>dst,
                           <const unsigned char*>self.sources[k], f[k] if f != NULL else 1.0,
                           n, c.payload.qgroup, c.payload.qbits)
        if s != 1.0:
            k_scale(DT_F32, s, dst, dst, n)

    cdef void commit(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef uint64_t* bits
        cdef Stream* t
        cdef int i
        if s.stage == 0:
            self.scaled[block] = self.target_final
            self.where[block] = self.target
            self.count[block] += 1 + self.ntaken
            if self.call.payload.weight > 0:
                ws_commit(&self.weights, block)
            bits = self.members + <Py_ssize_t>block * self.words
            bits[s.peer >> 6] |= 1ull << (s.peer & 63)
            for i in range(self.ntaken):
                t = &self.streams[self.taken[i]]
                t.done[block] = 1
                if self.call.fec_k:
                    fec_taken(self.call, t, block, True)
                bits[t.peer >> 6] |= 1ull << (t.peer & 63)
            self.pending[block] -= self.ntaken
            self.contribution_done(block)
        else:
            self.add_result(inc.count, self.block_len(self.chunk_of(s.tag), block))

    cdef void lose(self, Stream* s, int block) noexcept nogil:
        cdef CallInfo* c = self.call
        cdef int chunk
        cdef Py_ssize_t n
        cdef char* dst
        cdef uint64_t* bits
        if s.stage == 0:
            self.contribution_done(block)
            return
        # No reduced value: my own contribution stands in for it.
        chunk = self.chunk_of(s.tag)
        n = self.block_len(chunk, block)
        dst = self.out(chunk, block)
        bits = self.result_entry(chunk, block)
        memset(bits, 0, 8 * self.words)
        self.fallback_elems += n
        if c.scaling == SCALE_ZERO_FILL:
            memset(dst, 0, n * c.itemsize)
            self.add_result(0, n, False)
            return
        bits[self.rank >> 6] |= 1ull << (self.rank & 63)
        pay_decode(self.call, dst, self.chan.mine(chunk, block),
                    1.0 / self.weights.own_mant if c.payload.weight > 0 else call_scale(c, 1, self.size), n)
        self.add_result(1, n, False)

    cdef inline void contribution_done(self, int block) noexcept nogil:
        self.pending[block] -= 1
        if self.pending[block] == 0:
            self.reduced(block)

    cdef void reduced(self, int block) noexcept nogil:
        """Every contribution to `block` of my chunk arrived or was lost."""
        cdef CallInfo* c = self.call
        cdef int me = self.reduced_chunk
        cdef Py_ssize_t n = self.block_len(me, block)
        cdef char* record = self.chan.mine(me, block)
        cdef uint64_t* bits = self.members + <Py_ssize_t>block * self.words
        cdef Py_ssize_t at = round_up(pay_bytes(self.call, n), 8)
        cdef uint32_t nbytes = <uint32_t>(at + 8 * self.words)
        cdef double scale = 1.0 if self.scaled[block] \
            else self.final_scale(self.count[block], self.weights.wsum[block])
        if c.payload.qbits and c.coll == COLL_REDUCE_SCATTER and me == self.rank:
            # My own chunk of a reduce-scatter goes nowhere: not quantised again.
            k_narrow(c.dtype, scale, self.out(me, block),
                     self.location(block, self.where[block]), n)
            memcpy(self.result_entry(me, block), bits, 8 * self.words)
            self.add_result(self.count[block], n)
            return
        pay_encode(self.call, record, self.location(block, self.where[block]), scale, n,
                    pay_seed(self.call, self.rank, me, block, 1), self.where[block] != SUM_IN_SEND)
        memcpy(record + at, bits, 8 * self.words)
        if c.coll == COLL_ALLREDUCE:
            self.emit(me, block, self.count[block], nbytes, self.others, self.size - 1)
        elif me != self.rank:
            self.emit(me, block, self.count[block], nbytes, &me, 1)
        if self.wanted(me):
            pay_decode(self.call, self.out(me, block), record, 1.0, n)
            memcpy(self.result_entry(me, block), bits, 8 * self.words)
            self.add_result(self.count[block], n)

