# Reduction kernels: add, accumulate and unbiased scaling, outside the GIL.
#
# The kernels know nothing of ops: `finalize` multiplies by the factor that
# the call derives from the contributor count (scale_factor in channel.pxi).
# Integers are summed in unsigned arithmetic (wrap-around, like MPI) and,
# only when the factor is not 1 (data was lost), rescaled in double and
# rounded to nearest; a rescaled value beyond the type's range saturates to
# its minimum or maximum (never wraps).  Since the rescaling goes through
# double, an int64 rescaled past 2**53 in magnitude is rounded to 53 bits.

cdef enum:
    DT_F16 = 0
    DT_F32 = 1
    DT_F64 = 2
    DT_I32 = 3
    DT_I64 = 4
    DT_BF16 = 5         # (after the others: the codes travel in status blocks)
    NUM_DTYPES = 6

cdef enum:
    OP_SUM = 0
    OP_AVG = 1

# How a partial sum of `count` contributions becomes the result.  UNBIASED
# divides by what arrived; ZERO_FILL counts what is missing as zeros (the
# biased baseline, kept for ablations).
cdef enum:
    SCALE_UNBIASED = 0
    SCALE_ZERO_FILL = 1

cdef enum:
    SUM_TILE_BYTES = 16384     # k_sum's tile: a few of them fit in L1/L2

cdef Py_ssize_t ITEMSIZE[6]
ITEMSIZE[:] = [2, 4, 8, 4, 8, 2]

ctypedef fused wide_t:
    float
    double
    uint32_t
    uint64_t


cdef inline void _add(wide_t* dst, const wide_t* a, const wide_t* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = a[i] + b[i]


cdef inline void _acc(wide_t* dst, const wide_t* src, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = dst[i] + src[i]


cdef inline void _scale_float(wide_t* dst, const wide_t* src, wide_t s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = src[i] * s


cdef inline void _add_scale_float(wide_t* dst, const wide_t* a, const wide_t* b, wide_t s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = (a[i] + b[i]) * s


# float16: through F16C where the CPU has it (mpilossy_simd.h), element by
# element for what is left.
cdef void _add_f16(uint16_t* dst, const uint16_t* a, const uint16_t* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(<Py_ssize_t>mpl_f16_fast(0, dst, a, b, 1.0, n), n):
        dst[i] = mpl_f2h(mpl_h2f(a[i]) + mpl_h2f(b[i]))


cdef void _scale_f16(uint16_t* dst, const uint16_t* src, float s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(<Py_ssize_t>mpl_f16_fast(1, dst, src, src, s, n), n):
        dst[i] = mpl_f2h(mpl_h2f(src[i]) * s)


cdef void _add_scale_f16(uint16_t* dst, const uint16_t* a, const uint16_t* b, float s,
                         Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(<Py_ssize_t>mpl_f16_fast(2, dst, a, b, s, n), n):
        dst[i] = mpl_f2h((mpl_h2f(a[i]) + mpl_h2f(b[i])) * s)


# llround is undefined beyond the range of long long and a cast to int32
# wraps: clamp first.  (A nan cannot come out of a finite sum times a finite
# factor; it would give 0.)
cdef inline int32_t _saturate_i32(double v) noexcept nogil:
    if v >= 2147483647.0:
        return 2147483647
    if v <= -2147483648.0:
        return -2147483647 - 1
    if v != v:
        return 0
    return <int32_t>llround(v)


cdef inline int64_t _saturate_i64(double v) noexcept nogil:
    # 2**63 is the first double above INT64_MAX (which is not a double).
    if v >= 9223372036854775808.0:
        return 9223372036854775807
    if v <= -9223372036854775808.0:
        return -9223372036854775807 - 1
    if v != v:
        return 0
    return <int64_t>llround(v)


cdef void _rescale_i32(int32_t* dst, const int32_t* src, double s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = _saturate_i32(<double>src[i] * s)


cdef void _rescale_i64(int64_t* dst, const int64_t* src, double s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = _saturate_i64(<double>src[i] * s)


cdef inline double scale_factor(int scaling, int op, uint32_t count, int nranks) noexcept nogil:
    """Multiplier that turns a sum of `count` of `nranks` contributions into
    the result: avg = sum / count, sum = sum * nranks / count (unbiased)."""
    if scaling == SCALE_ZERO_FILL:
        return 1.0 / nranks if op == OP_AVG else 1.0
    if op == OP_AVG:
        return 1.0 / count
    return <double>nranks / count


cdef void k_add(int dt, void* dst, const void* a, const void* b, Py_ssize_t n) noexcept nogil:
    """dst = a + b"""
    if dt == DT_F32:
        if not mpl_stream_f32(0, <float*>dst, <const float*>a, <const float*>b, 1.0, n):
            _add(<float*>dst, <const float*>a, <const float*>b, n)
    elif dt == DT_F64:
        if not mpl_stream_f64(0, <double*>dst, <const double*>a, <const double*>b, 1.0, n):
            _add(<double*>dst, <const double*>a, <const double*>b, n)
    elif dt == DT_I32:
        _add(<uint32_t*>dst, <const uint32_t*>a, <const uint32_t*>b, n)
    elif dt == DT_I64:
        _add(<uint64_t*>dst, <const uint64_t*>a, <const uint64_t*>b, n)
    elif dt == DT_BF16:
        mpl_bf16_data(0, <uint16_t*>dst, <const uint16_t*>a, <const uint16_t*>b, 1.0, n)
    else:
        _add_f16(<uint16_t*>dst, <const uint16_t*>a, <const uint16_t*>b, n)


cdef void k_acc(int dt, void* dst, const void* src, Py_ssize_t n) noexcept nogil:
    """dst += src"""
    if dt == DT_F32:
        _acc(<float*>dst, <const float*>src, n)
    elif dt == DT_F64:
        _acc(<double*>dst, <const double*>src, n)
    elif dt == DT_I32:
        _acc(<uint32_t*>dst, <const uint32_t*>src, n)
    elif dt == DT_I64:
        _acc(<uint64_t*>dst, <const uint64_t*>src, n)
    elif dt == DT_BF16:
        mpl_bf16_data(0, <uint16_t*>dst, <const uint16_t*>dst, <const uint16_t*>src, 1.0, n)
    else:
        _add_f16(<uint16_t*>dst, <const uint16_t*>dst, <const uint16_t*>src, n)


cdef void k_scale(int dt, double s, void* dst, const void* src, Py_ssize_t n) noexcept nogil:
    """dst = src * s (dst may be src)."""
    if s == 1.0:
        if dst != src:
            memcpy(dst, src, n * ITEMSIZE[dt])
    elif dt == DT_F32:
        if not mpl_stream_f32(1, <float*>dst, <const float*>src, <const float*>src, <float>s, n):
            _scale_float(<float*>dst, <const float*>src, <float>s, n)
    elif dt == DT_F64:
        if not mpl_stream_f64(1, <double*>dst, <const double*>src, <const double*>src, s, n):
            _scale_float(<double*>dst, <const double*>src, s, n)
    elif dt == DT_I32:
        _rescale_i32(<int32_t*>dst, <const int32_t*>src, s, n)
    elif dt == DT_I64:
        _rescale_i64(<int64_t*>dst, <const int64_t*>src, s, n)
    elif dt == DT_BF16:
        mpl_bf16_data(1, <uint16_t*>dst, <const uint16_t*>src, <const uint16_t*>src, <float>s, n)
    else:
        _scale_f16(<uint16_t*>dst, <const uint16_t*>src, <float>s, n)


cdef void k_add_scale(int dt, double s, void* dst, const void* a, const void* b,
                      Py_ssize_t n) noexcept nogil:
    """dst = (a + b) * s, in one pass for floats."""
    if s != 1.0 and dt == DT_F32:
        if not mpl_stream_f32(2, <float*>dst, <const float*>a, <const float*>b, <float>s, n):
            _add_scale_float(<float*>dst, <const float*>a, <const float*>b, <float>s, n)
    elif s != 1.0 and dt == DT_F64:
        if not mpl_stream_f64(2, <double*>dst, <const double*>a, <const double*>b, s, n):
            _add_scale_float(<double*>dst, <const double*>a, <const double*>b, s, n)
    elif s != 1.0 and dt == DT_F16:
        _add_scale_f16(<uint16_t*>dst, <const uint16_t*>a, <const uint16_t*>b, <float>s, n)
    elif s != 1.0 and dt == DT_BF16:
        mpl_bf16_data(2, <uint16_t*>dst, <const uint16_t*>a, <const uint16_t*>b, <float>s, n)
    else:
        k_add(dt, dst, a, b, n)
        k_scale(dt, s, dst, dst, n)


# -- accumulators ---------------------------------------------------------------
# Partial sums are kept in the call's dtype, except the 16-bit floats',
# kept in float32: float16 tops out at 65504, and a sum of N values near it
# would overflow where their average would not; bfloat16's 8-bit mantissa
# would lose the small terms of a sum rounded at every step.  The mixed
# kernels below take the data in the call's dtype and the accumulators in
# acc_dtype; for the other dtypes they are the plain kernels.

cdef inline int acc_dtype(int dt) noexcept nogil:
    """The dtype partial sums of a call of dtype `dt` are kept in."""
    return DT_F32 if dt == DT_F16 or dt == DT_BF16 else dt


cdef void _f16_mixed(int op, void* dst, const void* a, const void* b, float s,
                     Py_ssize_t n) noexcept nogil:
    """mpl_f16_mixed's ops (mpilossy_simd.h), F16C first, then one by one."""
    cdef Py_ssize_t i
    cdef float* f
    cdef uint16_t* h
    for i in range(<Py_ssize_t>mpl_f16_mixed(op, dst, a, b, s, n), n):
        if op == 0:
            (<float*>dst)[i] = mpl_h2f((<const uint16_t*>a)[i]) * s
        elif op == 1:
            (<uint16_t*>dst)[i] = mpl_f2h((<const float*>a)[i] * s)
        elif op == 2:
            (<float*>dst)[i] = mpl_h2f((<const uint16_t*>a)[i]) + (<const float*>b)[i]
        elif op == 4:
            (<float*>dst)[i] = (<float*>dst)[i] + mpl_h2f((<const uint16_t*>a)[i]) * s
        else:
            (<uint16_t*>dst)[i] = mpl_f2h((mpl_h2f((<const uint16_t*>a)[i])
                                           + (<const float*>b)[i]) * s)


cdef void k_widen(int dt, double s, void* dst, const void* src, Py_ssize_t n) noexcept nogil:
    """dst (accumulators) = src (data) * s"""
    if dt == DT_F16:
        _f16_mixed(0, dst, src, NULL, <float>s, n)
    elif dt == DT_BF16:
        mpl_bf16_mixed(0, dst, src, NULL, <float>s, n)
    else:
        k_scale(dt, s, dst, src, n)


cdef void k_narrow(int dt, double s, void* dst, const void* src, Py_ssize_t n) noexcept nogil:
    """dst (data) = src (accumulators) * s"""
    if dt == DT_F16:
        _f16_mixed(1, dst, src, NULL, <float>s, n)
    elif dt == DT_BF16:
        mpl_bf16_mixed(1, dst, src, NULL, <float>s, n)
    else:
        k_scale(dt, s, dst, src, n)


cdef void k_add_widened(int dt, void* dst, const void* a, const void* b,
                        Py_ssize_t n) noexcept nogil:
    """dst (accumulators) = a (data) + b (accumulators)"""
    if dt == DT_F16:
        _f16_mixed(2, dst, a, b, 1.0, n)
    elif dt == DT_BF16:
        mpl_bf16_mixed(2, dst, a, b, 1.0, n)
    else:
        k_add(dt, dst, a, b, n)


cdef void k_add_narrowed(int dt, double s, void* dst, const void* a, const void* b,
                         Py_ssize_t n) noexcept nogil:
    """dst (data) = (a (data) + b (accumulators)) * s"""
    if dt == DT_F16:
        _f16_mixed(3, dst, a, b, <float>s, n)
    elif dt == DT_BF16:
        mpl_bf16_mixed(3, dst, a, b, <float>s, n)
    else:
        k_add_scale(dt, s, dst, a, b, n)


cdef void k_sum(int dt, double s, void* dst, const char** srcs, int nsrc,
                Py_ssize_t n) noexcept nogil:
    """dst = (srcs[0] + ... + srcs[nsrc-1]) * s, nsrc >= 2, tile by tile so
    that the partial sums stay in cache: each source is read once and dst
    written once.  dst must not be one of the sources."""
    cdef Py_ssize_t isz = ITEMSIZE[dt], tile = SUM_TILE_BYTES // ITEMSIZE[dt], off, m
    cdef int k
    cdef char* out = <char*>dst
    off = 0
    while off < n:
        m = min(tile, n - off)
        k_add(dt, out + off * isz, srcs[0] + off * isz, srcs[1] + off * isz, m)
        for k in range(2, nsrc):
            k_acc(dt, out + off * isz, srcs[k] + off * isz, m)
        k_scale(dt, s, out + off * isz, out + off * isz, m)
        off += m


cdef inline void _acc_scaled_float(wide_t* dst, const wide_t* src, wide_t f,
                                   Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        dst[i] = dst[i] + src[i] * f


cdef void k_acc_scaled(int dt, void* dst, const void* src, double f, Py_ssize_t n) noexcept nogil:
    """dst (accumulators) += src (data) * f: float dtypes (weights)."""
    if dt == DT_F16:
        _f16_mixed(4, dst, src, NULL, <float>f, n)
    elif dt == DT_BF16:
        mpl_bf16_mixed(4, dst, src, NULL, <float>f, n)
    elif f == 1.0:
        k_acc(dt, dst, src, n)
    elif dt == DT_F32:
        _acc_scaled_float(<float*>dst, <const float*>src, <float>f, n)
    else:
        _acc_scaled_float(<double*>dst, <const double*>src, f, n)


cdef void k_sum_into(int dt, double s, void* dst, const char** srcs, const double* factors,
                     int nsrc, Py_ssize_t n) noexcept nogil:
    """dst = (srcs[0] * factors[0] + ... + srcs[nsrc-1] * factors[nsrc-1]) * s,
    where dst and srcs[0] (a running sum) are accumulators (acc_dtype) and
    the other sources data of dtype `dt`; factors NULL: all 1.  Tile by
    tile, each source read once; dst is none of the sources."""
    cdef int adt = acc_dtype(dt), k
    cdef Py_ssize_t isz = ITEMSIZE[dt], asz = ITEMSIZE[adt]
    cdef Py_ssize_t tile = SUM_TILE_BYTES // asz, off = 0, m
    cdef char* out = <char*>dst
    if adt == dt and factors == NULL:
        k_sum(dt, s, dst, srcs, nsrc, n)
        return
    while off < n:
        m = min(tile, n - off)
        k_scale(adt, factors[0] if factors != NULL else 1.0, out + off * asz,
                srcs[0] + off * asz, m)
        for k in range(1, nsrc):
            k_acc_scaled(dt, out + off * asz, srcs[k] + off * isz,
                         factors[k] if factors != NULL else 1.0, m)
        k_scale(adt, s, out + off * asz, out + off * asz, m)
        off += m
