# The kernels and codes as Python functions, outside the GIL: for
# `python -m mpilossy.bench kernels` and the tests that check them against
# NumPy references.  The library itself calls the C functions directly.

# -- kernels, for python -m mpilossy.bench.kernels ---------------------------

cdef int kernel_buffers(object dst, object a, object b, Py_buffer* vd, Py_buffer* va,
                        Py_buffer* vb, int* dtype) except -1:
    import numpy as np
    codes = {"float16": DT_F16, "float32": DT_F32, "float64": DT_F64, "int32": DT_I32,
             "int64": DT_I64, "bfloat16": DT_BF16}      # (bfloat16: ml_dtypes')
    dtype[0] = codes[np.asarray(dst).dtype.name]
    PyObject_GetBuffer(dst, vd, PyBUF_SIMPLE | PyBUF_WRITABLE)
    PyObject_GetBuffer(a, va, PyBUF_SIMPLE)
    PyObject_GetBuffer(b if b is not None else a, vb, PyBUF_SIMPLE)
    if va.len != vd.len or vb.len != vd.len:
        PyBuffer_Release(vd)
        PyBuffer_Release(va)
        PyBuffer_Release(vb)
        raise ValueError("kernel buffers must have the same size")
    return 0


def kernel(str name, dst, a, b=None, double scale=1.0):
    """Run one reduction kernel on NumPy arrays of one dtype, outside the GIL:
    'add' dst = a + b, 'acc' dst += a, 'scale' dst = a * scale,
    'add_scale' dst = (a + b) * scale."""
    cdef Py_buffer vd, va, vb
    cdef int dtype
    kernel_buffers(dst, a, b, &vd, &va, &vb, &dtype)
    cdef Py_ssize_t n = vd.len // ITEMSIZE[dtype]
    cdef int which = {"add": 0, "acc": 1, "scale": 2, "add_scale": 3}[name]
    try:
        with nogil:
            if which == 0:
                k_add(dtype, vd.buf, va.buf, vb.buf, n)
            elif which == 1:
                k_acc(dtype, vd.buf, va.buf, n)
            elif which == 2:
                k_scale(dtype, scale, vd.buf, va.buf, n)
            else:
                k_add_scale(dtype, scale, vd.buf, va.buf, vb.buf, n)
    finally:
        PyBuffer_Release(&vd)
        PyBuffer_Release(&va)
        PyBuffer_Release(&vb)


def quant_kernel(str name, dst, src, int bits, Py_ssize_t group, unsigned int seed=1,
                 float scale=1.0):
    """The low-bit payload kernels on NumPy arrays, outside the GIL:
    'quantize' float32 src -> dst bytes (mpl_q_bytes long), 'dequantize'
    bytes src -> float32 dst, 'dequantize_add' dst += decoded src;
    'quantize_portable': 'quantize' without the AVX2 variant (the same
    bytes, one value at a time)."""
    cdef Py_buffer vd, vs
    if bits not in (4, 8) or group < 2 or group % 2:
        raise ValueError("bits must be 4 or 8 and group even")
    PyObject_GetBuffer(dst, &vd, PyBUF_SIMPLE | PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(src, &vs, PyBUF_SIMPLE)
    except BaseException:
        PyBuffer_Release(&vd)
        raise
    cdef int which = {"quantize": 0, "dequantize": 1, "dequantize_add": 2,
                      "quantize_portable": 3}[name]
    cdef bint encoding = which == 0 or which == 3
    cdef Py_ssize_t n = (vs.len if encoding else vd.len) // 4
    cdef Py_ssize_t coded = <Py_ssize_t>mpl_q_bytes(n, group, bits)
    try:
        if (vd.len if encoding else vs.len) < coded:
            raise ValueError(f"the encoded buffer needs {coded} bytes")
        with nogil:
            if which == 0:
                mpl_quantize(<unsigned char*>vd.buf, <const float*>vs.buf, scale, n, group,
                             bits, seed)
            elif which == 3:
                mpl_quantize_portable(<unsigned char*>vd.buf, <const float*>vs.buf, scale, n,
                                      group, bits, seed)
            else:
                mpl_dequantize(<float*>vd.buf, <const float*>vd.buf if which == 2 else NULL,
                               <const unsigned char*>vs.buf, scale, n, group, bits)
    finally:
        PyBuffer_Release(&vd)
        PyBuffer_Release(&vs)


def quant_bytes(Py_ssize_t n, Py_ssize_t group, int bits) -> int:
    """Bytes of n float32 values encoded with `bits` per value."""
    return <Py_ssize_t>mpl_q_bytes(n, group, bits)


def buffer_address(obj) -> int:
    """Address of the first byte of a contiguous buffer (cheaper than
    numpy's __array_interface__, which builds a dict)."""
    cdef Py_buffer view
    PyObject_GetBuffer(obj, &view, PyBUF_ANY_CONTIGUOUS)
    cdef size_t address = <size_t>view.buf
    PyBuffer_Release(&view)
    return address


# -- erasure codes (mpilossy_fec.h) ---------------------------------------------
def fec_check(int k, int m):
    """None when (k, m) is a code this build has, else the reason."""
    cdef const char* why = mpl_fec_check(k, m)
    return None if why == NULL else why.decode()


cdef Py_ssize_t fec_rows(object buf, Py_buffer* view, int rows, bint writable) except -1:
    """Bytes per row of `buf` cut into `rows` equal rows."""
    PyObject_GetBuffer(buf, view, PyBUF_SIMPLE | (PyBUF_WRITABLE if writable else 0))
    if view.len % rows:
        PyBuffer_Release(view)
        raise ValueError(f"a buffer of {view.len} bytes is not {rows} equal blocks")
    return view.len // rows


def fec_kernel(str name, blocks, int k, int m, present=None, int filled=0) -> int:
    """The erasure-code kernels on a buffer of k + m equal blocks (data rows,
    then parity rows), outside the GIL.  'encode': write the parity rows
    from the data rows; returns m.  'decode': rebuild the data rows that
    `present` (k + m bytes, 0: lost) marks lost, from those present;
    returns how many were rebuilt.  `filled` (1..k, 0: k): the group's data
    rows, the others zero and never read (a stream's last group).  Raises
    ValueError for a code this build does not have and for a group with
    fewer than `filled` rows present."""
    cdef mpl_fec_t code
    cdef Py_buffer vb, vp
    cdef unsigned char* rows[MPL_FEC_MAX_K + MPL_FEC_MAX_M]
    cdef Py_ssize_t length
    cdef int i, got = 0
    cdef int which = {"encode": 0, "decode": 1}[name]
    if mpl_fec_init(&code, k, m):
        raise ValueError(f"redundancy=({k}, {m}): {fec_check(k, m)}")
    if not 0 <= filled <= k:
        raise ValueError(f"filled must be in 0..{k}, not {filled}")
    filled = filled or k
    length = fec_rows(blocks, &vb, k + m, True)
    try:
        for i in range(k + m):
            rows[i] = <unsigned char*>vb.buf + i * length
        if which == 0:
            with nogil:
                mpl_fec_encode(&code, rows, rows + k, <size_t>length, filled)
            return m
        if present is None:
            raise ValueError("decode needs `present`")
        PyObject_GetBuffer(present, &vp, PyBUF_SIMPLE)
        try:
            if vp.len != k + m:
                raise ValueError(f"present must have k + m = {k + m} bytes")
            with nogil:
                got = mpl_fec_decode(&code, rows, <const unsigned char*>vp.buf, <size_t>length,
                                     filled)
        finally:
            PyBuffer_Release(&vp)
        if got < 0:
            raise ValueError(f"fewer than {filled} of the group's {filled + m} blocks are present")
        return got
    finally:
        PyBuffer_Release(&vb)
