# Sums of weights for weighted averages (call.payload.weight > 0).
#
# A contribution travels as m * x, where w = m * 2^e with m in [0.5, 1)
# (frexp), with w itself (a double) after its data, where the bitmap goes
# in a reduced record.  The reducer keeps, per block, the largest exponent
# E that arrived and sum(m 2^(e - E) x) and sum(m 2^(e - E)): scaling by
# powers of two is exact, every factor is at most 1, so no weight, however
# large or small, can overflow the data's dtype or the sum of weights, nor
# round a contribution away that is not negligible beside the others.
# Every block is sum(w x) / sum(w) over its own contributors.  The
# reducer's own m x is made in the scratch at the start.
#
# The data side (scaling each source by its factor) is the reducer's; this
# file keeps only the weights.

cdef struct WeightedSums:
    double* wsum            # per block: weights summed, each times 2^-wexp
    int* wexp               # per block: the largest weight exponent in the sum
    Py_ssize_t cap          # blocks wsum and wexp hold
    double* factors         # per source of the arrival being taken: its power of two
    double own_mant         # this rank's weight = own_mant * 2^own_exp
    int own_exp
    double taken_wsum       # wsum with the arrival being taken (ws_weigh, before ws_commit)
    int taken_exp           # and its exponent


cdef int ws_init(WeightedSums* w, int nsources) except -1:
    memset(w, 0, sizeof(WeightedSums))
    w.factors = <double*>calloc(nsources, sizeof(double))
    if not w.factors:
        raise MemoryError()
    return 0


cdef void ws_free(WeightedSums* w) noexcept nogil:
    free(w.factors)
    free(w.wsum)
    free(w.wexp)
    w.factors = w.wsum = NULL
    w.wexp = NULL
    w.cap = 0


cdef int ws_reserve(WeightedSums* w, Py_ssize_t nblocks) except -1:
    if nblocks <= w.cap:
        return 0
    free(w.wsum)
    free(w.wexp)
    w.wsum = <double*>malloc(nblocks * sizeof(double))
    w.wexp = <int*>malloc(nblocks * sizeof(int))
    if not (w.wsum and w.wexp):
        w.cap = 0
        raise MemoryError()
    w.cap = nblocks
    return 0


cdef void ws_start(WeightedSums* w, double weight, int nblocks) noexcept nogil:
    """Every block's sum holds this rank's weight alone (1 when unweighted)."""
    cdef int b
    w.own_mant, w.own_exp = 1.0, 0
    if weight > 0:
        w.own_mant = frexp(weight, &w.own_exp)
    for b in range(nblocks):
        w.wsum[b] = w.own_mant
        w.wexp[b] = w.own_exp


cdef void ws_weigh(WeightedSums* w, int block, int nsrc, const double* mants,
                   const int* exps) noexcept nogil:
    """Sources 1..nsrc-1 (mantissas and exponents of their weights) join the
    running sum, source 0: each source's factor relative to the largest
    exponent so far, and the sum of weights that goes with them (taken_wsum,
    taken_exp; ws_commit keeps it)."""
    cdef int k, top = w.wexp[block]
    for k in range(1, nsrc):
        top = max(top, exps[k])
    w.factors[0] = ldexp(1.0, w.wexp[block] - top)
    w.taken_wsum = w.wsum[block] * w.factors[0]
    for k in range(1, nsrc):
        w.factors[k] = ldexp(1.0, exps[k] - top)
        w.taken_wsum += mants[k] * w.factors[k]
    w.taken_exp = top


cdef inline void ws_commit(WeightedSums* w, int block) noexcept nogil:
    w.wsum[block] = w.taken_wsum
    w.wexp[block] = w.taken_exp
