/* Kernel variants that need instructions a portable build cannot assume:
 *
 * - float16 through F16C (8 conversions per instruction), chosen at run time;
 *   without it every element goes through a software conversion, 50x slower.
 * - streaming (non-temporal) stores for destinations larger than the caches,
 *   as memcpy does: a normal store first reads the destination line, which
 *   turns an add (2 reads, 1 write) into 4 memory streams instead of 3.
 *
 * Each function returns 1 when it did the work, 0 to let the portable
 * kernel do it. */
#ifndef MPILOSSY_SIMD_H
#define MPILOSSY_SIMD_H

#include <stddef.h>
#include <stdint.h>

#define MPL_STREAM_BYTES (1u << 20)

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

static int mpl_f16c_checked = 0, mpl_f16c = 0;
static inline int mpl_has_f16c(void)
{
    if (!mpl_f16c_checked) {
        __builtin_cpu_init();
        mpl_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
        mpl_f16c_checked = 1;
    }
    return mpl_f16c;
}

#define MPL_F16C __attribute__((target("f16c,avx")))
#define MPL_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define MPL_STORE8(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))

/* op: 0 dst = a + b, 1 dst = a * s, 2 dst = (a + b) * s; returns how many
 * leading elements were done (a multiple of 8), the rest is the caller's. */
MPL_F16C static size_t mpl_f16_vec(int op, uint16_t *dst, const uint16_t *a, const uint16_t *b,
                                   float s, size_t n)
{
    size_t i = 0;
    __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) {
        __m256 x = MPL_LOAD8(a + i);
        if (op == 0)
            x = _mm256_add_ps(x, MPL_LOAD8(b + i));
        else if (op == 1)
            x = _mm256_mul_ps(x, vs);
        else
            x = _mm256_mul_ps(_mm256_add_ps(x, MPL_LOAD8(b + i)), vs);
        MPL_STORE8(dst + i, x);
    }
    return i;
}

static inline size_t mpl_f16_fast(int op, uint16_t *dst, const uint16_t *a, const uint16_t *b,
                                  float s, size_t n)
{
    return mpl_has_f16c() ? mpl_f16_vec(op, dst, a, b, s, n) : 0;
}

/* float16 data with float32 accumulators (sums of float16 are kept in
 * float32: they must not overflow where the average would not).  op:
 * 0 acc = h(a) * s (widen), 1 h = acc(a) * s (narrow),
 * 2 acc = h(a) + acc(b), 3 h = (h(a) + acc(b)) * s, 4 acc += h(a) * s.  `dst`, `a`, `b` are
 * float32 or float16 as the op says.  Returns the leading elements done. */
MPL_F16C static size_t mpl_f16_mixed_vec(int op, void *dst, const void *a, const void *b,
                                         float s, size_t n)
{
    size_t i = 0;
    __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) {
        __m256 x;
        if (op == 1)
            x = _mm256_mul_ps(_mm256_loadu_ps((const float *)a + i), vs);
        else
            x = MPL_LOAD8((const uint16_t *)a + i);
        if (op == 0)
            x = _mm256_mul_ps(x, vs);
        else if (op == 2 || op == 3)
            x = _mm256_add_ps(x, _mm256_loadu_ps((const float *)b + i));
        else if (op == 4)
            x = _mm256_add_ps(_mm256_loadu_ps((const float *)dst + i), _mm256_mul_ps(x, vs));
        if (op == 3)
            x = _mm256_mul_ps(x, vs);
        if (op == 1 || op == 3)
            MPL_STORE8((uint16_t *)dst + i, x);
        else
            _mm256_storeu_ps((float *)dst + i, x);
    }
    return i;
}

static inline size_t mpl_f16_mixed(int op, void *dst, const void *a, const void *b, float s,
                                   size_t n)
{
    return mpl_has_f16c() ? mpl_f16_mixed_vec(op, dst, a, b, s, n) : 0;
}

/* Streaming float32/float64 kernels: op as above.  Returns 1 if done.  One
 * body for both types; V* are the SSE2 intrinsics of the type, W its width. */
#define MPL_STREAM_KERNEL(NAME, T, VT, W, VLOAD, VADD, VMUL, VSET1, VSTREAM)            \
static inline int NAME(int op, T *dst, const T *a, const T *b, T s, size_t n)          \
{                                                                                       \
    size_t i = 0;                                                                       \
    if (n * sizeof(T) < MPL_STREAM_BYTES)                                               \
        return 0;                                                                       \
    VT vs = VSET1(s);                                                                   \
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++)                                   \
        dst[i] = op == 0 ? a[i] + b[i] : op == 1 ? a[i] * s : (a[i] + b[i]) * s;        \
    for (; i + W <= n; i += W) {                                                        \
        VT x = VLOAD(a + i);                                                            \
        if (op == 0)                                                                    \
            x = VADD(x, VLOAD(b + i));                                                  \
        else if (op == 1)                                                               \
            x = VMUL(x, vs);                                                            \
        else                                                                            \
            x = VMUL(VADD(x, VLOAD(b + i)), vs);                                        \
        VSTREAM(dst + i, x);                                                            \
    }                                                                                   \
    for (; i < n; i++)                                                                  \
        dst[i] = op == 0 ? a[i] + b[i] : op == 1 ? a[i] * s : (a[i] + b[i]) * s;        \
    _mm_sfence();                                                                       \
    return 1;                                                                           \
}

MPL_STREAM_KERNEL(mpl_stream_f32, float, __m128, 4, _mm_loadu_ps, _mm_add_ps, _mm_mul_ps,
                  _mm_set1_ps, _mm_stream_ps)
MPL_STREAM_KERNEL(mpl_stream_f64, double, __m128d, 2, _mm_loadu_pd, _mm_add_pd, _mm_mul_pd,
                  _mm_set1_pd, _mm_stream_pd)

#else  /* other machines: the portable kernels do everything */

static inline size_t mpl_f16_fast(int op, uint16_t *dst, const uint16_t *a, const uint16_t *b,
                                  float s, size_t n)
{ (void)op; (void)dst; (void)a; (void)b; (void)s; (void)n; return 0; }
static inline size_t mpl_f16_mixed(int op, void *dst, const void *a, const void *b, float s,
                                   size_t n)
{ (void)op; (void)dst; (void)a; (void)b; (void)s; (void)n; return 0; }
static inline int mpl_stream_f32(int op, float *dst, const float *a, const float *b, float s, size_t n)
{ (void)op; (void)dst; (void)a; (void)b; (void)s; (void)n; return 0; }
static inline int mpl_stream_f64(int op, double *dst, const double *a, const double *b, double s, size_t n)
{ (void)op; (void)dst; (void)a; (void)b; (void)s; (void)n; return 0; }

#endif
#endif /* MPILOSSY_SIMD_H */
