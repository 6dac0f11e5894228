/* bfloat16 kernels.
 *
 * A bfloat16 is the upper half of a float32: widening is a 16-bit shift
 * (exact), narrowing rounds to nearest even (as PyTorch, ml_dtypes and the
 * CPUs' own conversion instructions do) and keeps a NaN a NaN.  Sums are
 * kept in float32, as NCCL and Gloo keep them for bfloat16: with 8 bits of
 * mantissa, a sum rounded at every step would lose most of its small terms.
 *
 * The loops are plain C over 32-bit integers with the op chosen outside the
 * loop, so that the compiler vectorises each of them (-O3) on every target;
 * on x86-64 a second copy is compiled for AVX2 (twice the lanes of the
 * baseline's SSE2) and chosen at run time, as float16's F16C kernels are.
 * Each function does all `n` elements. */
#ifndef MPILOSSY_BF16_H
#define MPILOSSY_BF16_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline float mpl_b2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__GNUC__)
#define MPL_BF16_INLINE static inline __attribute__((always_inline))
#else
#define MPL_BF16_INLINE static inline
#endif

MPL_BF16_INLINE uint16_t mpl_f2b(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;             /* a NaN must not round to inf */
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

/* Data in, data out: op 0 dst = a + b, 1 dst = a * s, 2 dst = (a + b) * s
 * (each rounded once, from float32). */
MPL_BF16_INLINE void mpl_bf16_data_body(int op, uint16_t *dst, const uint16_t *a,
                                        const uint16_t *b, float s, size_t n)
{
    size_t i;
    if (op == 0)
        for (i = 0; i < n; i++)
            dst[i] = mpl_f2b(mpl_b2f(a[i]) + mpl_b2f(b[i]));
    else if (op == 1)
        for (i = 0; i < n; i++)
            dst[i] = mpl_f2b(mpl_b2f(a[i]) * s);
    else
        for (i = 0; i < n; i++)
            dst[i] = mpl_f2b((mpl_b2f(a[i]) + mpl_b2f(b[i])) * s);
}

/* bfloat16 data with float32 accumulators, the ops of mpl_f16_mixed
 * (mpilossy_simd.h): 0 acc = b(a) * s (widen), 1 b = acc(a) * s (narrow),
 * 2 acc = b(a) + acc(b), 3 b = (b(a) + acc(b)) * s, 4 acc += b(a) * s. */
MPL_BF16_INLINE void mpl_bf16_mixed_body(int op, void *dst, const void *a, const void *b,
                                         float s, size_t n)
{
    const uint16_t *ha = (const uint16_t *)a;
    const float *fa = (const float *)a, *fb = (const float *)b;
    float *fd = (float *)dst;
    uint16_t *hd = (uint16_t *)dst;
    size_t i;
    switch (op) {
    case 0:
        for (i = 0; i < n; i++)
            fd[i] = mpl_b2f(ha[i]) * s;
        break;
    case 1:
        for (i = 0; i < n; i++)
            hd[i] = mpl_f2b(fa[i] * s);
        break;
    case 2:
        for (i = 0; i < n; i++)
            fd[i] = mpl_b2f(ha[i]) + fb[i];
        break;
    case 3:
        for (i = 0; i < n; i++)
            hd[i] = mpl_f2b((mpl_b2f(ha[i]) + fb[i]) * s);
        break;
    default:
        for (i = 0; i < n; i++)
            fd[i] = fd[i] + mpl_b2f(ha[i]) * s;
        break;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
static int mpl_avx2_checked = 0, mpl_avx2 = 0;
static inline int mpl_has_avx2(void)
{
    if (!mpl_avx2_checked) {
        __builtin_cpu_init();
        mpl_avx2 = __builtin_cpu_supports("avx2");
        mpl_avx2_checked = 1;
    }
    return mpl_avx2;
}

__attribute__((target("avx2"))) static void mpl_bf16_data_avx2(
    int op, uint16_t *dst, const uint16_t *a, const uint16_t *b, float s, size_t n)
{ mpl_bf16_data_body(op, dst, a, b, s, n); }
__attribute__((target("avx2"))) static void mpl_bf16_mixed_avx2(
    int op, void *dst, const void *a, const void *b, float s, size_t n)
{ mpl_bf16_mixed_body(op, dst, a, b, s, n); }
#define MPL_BF16_AVX2(fn, args) if (mpl_has_avx2()) { fn args; return; }
#else
#define MPL_BF16_AVX2(fn, args)
#endif

static inline void mpl_bf16_data(int op, uint16_t *dst, const uint16_t *a, const uint16_t *b,
                                 float s, size_t n)
{
    MPL_BF16_AVX2(mpl_bf16_data_avx2, (op, dst, a, b, s, n))
    mpl_bf16_data_body(op, dst, a, b, s, n);
}

static inline void mpl_bf16_mixed(int op, void *dst, const void *a, const void *b, float s,
                                  size_t n)
{
    MPL_BF16_AVX2(mpl_bf16_mixed_avx2, (op, dst, a, b, s, n))
    mpl_bf16_mixed_body(op, dst, a, b, s, n);
}

#endif /* MPILOSSY_BF16_H */
