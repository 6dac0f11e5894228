# How a contribution travels on the direct algorithm (CallInfo.payload):
# as it is, quantised to 8 or 4 bits per value in groups with one scale
# each (mpilossy_quant.h, stochastic rounding), and with this rank's weight
# after it in a weighted average.  The reducer sums decoded values; the
# reduced block is encoded once.

cdef inline Py_ssize_t pay_qbytes(const CallInfo* c, Py_ssize_t n) noexcept nogil:
    return <Py_ssize_t>mpl_q_bytes(n, c.payload.qgroup, c.payload.qbits)


cdef inline Py_ssize_t pay_bytes(const CallInfo* c, Py_ssize_t n) noexcept nogil:
    """Bytes of `n` values as they travel (quantised or not)."""
    return pay_qbytes(c, n) if c.payload.qbits else n * c.itemsize


cdef inline Py_ssize_t pay_contribution_bytes(const CallInfo* c, Py_ssize_t n) noexcept nogil:
    """Record size of a contribution of `n` elements (with its weight)."""
    if c.payload.weight > 0:
        return round_up(pay_bytes(c, n), 8) + 8
    return pay_bytes(c, n)


cdef inline uint32_t pay_seed(const CallInfo* c, int rank, int chunk, int block,
                              int stage) noexcept nogil:
    """Random bits of a quantised record of `rank`: new for every call and
    record."""
    return <uint32_t>mpl_hash4(c.seq, <uint64_t>rank,
                               <uint64_t>chunk * <uint64_t>c.nblocks + block, <uint64_t>stage)


cdef inline void pay_encode(const CallInfo* c, char* record, const char* values, double s,
                            Py_ssize_t n, uint32_t seed, bint summed=False) noexcept nogil:
    """record = values * s, as it travels; `summed`: values are a running
    sum (acc_dtype), else data."""
    if record == values and s == 1.0 and not c.payload.qbits:
        return
    if c.payload.qbits:
        mpl_quantize(<unsigned char*>record, <const float*>values, <float>s, n,
                     c.payload.qgroup, c.payload.qbits, seed)
    elif summed:
        k_narrow(c.dtype, s, record, values, n)
    elif s != 1.0:
        k_scale(c.dtype, s, record, values, n)
    else:
        memcpy(record, values, n * c.itemsize)


cdef inline void pay_decode(const CallInfo* c, char* values, const char* record, double s,
                            Py_ssize_t n) noexcept nogil:
    """values = record * s."""
    if c.payload.qbits:
        mpl_dequantize(<float*>values, NULL, <const unsigned char*>record, <float>s, n,
                       c.payload.qgroup, c.payload.qbits)
    elif s != 1.0:
        k_scale(c.dtype, s, values, record, n)
    else:
        memcpy(values, record, n * c.itemsize)


cdef inline void pay_keep_error(const CallInfo* c, double own_mant, float* err,
                                const float* values, const char* record,
                                Py_ssize_t n) noexcept nogil:
    """err = values - what `record` (a quantised contribution of a rank whose
    weight's mantissa is `own_mant`) carries of them: the part error
    feedback sends again."""
    cdef double s = own_mant if c.payload.weight > 0 else 1.0
    cdef Py_ssize_t i
    pay_decode(c, <char*>err, record, 1.0 / s, n)
    for i in range(n):
        err[i] = values[i] - err[i]


cdef inline double pay_weight(const CallInfo* c, const char* data, Py_ssize_t n) noexcept nogil:
    """The weight a contribution of `n` elements carries (1 unweighted); 0
    if it is not a positive finite number (the record is refused)."""
    cdef double w
    if c.payload.weight <= 0:
        return 1.0
    memcpy(&w, data + round_up(pay_bytes(c, n), 8), 8)
    return w if isfinite(w) and w > 0 else 0.0
