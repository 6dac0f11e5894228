/* Low-bit payloads: float32 values quantised in groups of `group` elements,
 * one float32 scale per group (max |x| / maxcode) and signed codes of 8 or 4
 * bits, rounded stochastically so that the decoded value is x in
 * expectation.  Layout of an encoded block of n values: the ceil(n / group)
 * scales, then the codes (int8: one byte each; int4: two per byte, low
 * nibble first, stored as code + 8).  The random bits come from a hash of
 * (seed, index): the same call, rank and block always encode alike, and no
 * state is shared between threads.
 *
 * A group holding a non-finite value gets a NaN scale: all its values decode
 * as NaN (a NaN or Inf gradient stays visible instead of being rounded away).
 * A group whose largest magnitude is so small that maxcode / amax would
 * overflow is coded from its values times 2^64 (a power of two: exact), so
 * that no code comes from an infinite factor.
 */
#ifndef MPILOSSY_QUANT_H
#define MPILOSSY_QUANT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline int mpl_q_maxcode(int bits) { return bits == 8 ? 127 : 7; }

/* Bytes of an encoded block of n values. */
static inline size_t mpl_q_bytes(size_t n, size_t group, int bits)
{
    size_t groups = (n + group - 1) / group;
    return 4 * groups + (bits == 8 ? n : (n + 1) / 2);
}

/* 32-bit integer hash (a xorshift-multiply finaliser): vectorises. */
static inline uint32_t mpl_q_hash(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* floor(v + u), u uniform in [0, 1) from the hash, clamped to +-maxcode.
 * A value within rounding of +-maxcode (the group's largest) is exactly
 * +-maxcode: constant groups encode exactly. */
static inline int mpl_q_round(float v, uint32_t seed, uint32_t i, float maxcode)
{
    float u = (float)(int32_t)(mpl_q_hash(seed ^ (i * 0x9e3779b9U)) >> 8) * (1.0f / 16777216.0f);
    /* floor without libm (which does not vectorise on plain SSE2): v + u +
     * 128 > 0, where truncation is floor */
    int q = (int)(v + u + 128.0f) - 128;
    int top = (int)maxcode;
    q = v >= maxcode * (1.0f - 1e-6f) ? top : q;
    q = v <= -maxcode * (1.0f - 1e-6f) ? -top : q;
    q = q > top ? top : q;
    q = q < -top ? -top : q;
    return q;
}

/* The largest |src[i] * s| over [lo, hi), folded into *amax; *finite
 * cleared by a non-finite value. */
static inline void mpl_q_scan(const float *src, float s, size_t lo, size_t hi, float *amax,
                              int *finite)
{
    size_t i;
    for (i = lo; i < hi; i++) {
        float a = fabsf(src[i] * s);
        *amax = a > *amax ? a : *amax;
        *finite &= isfinite(a) != 0;
    }
}

#define MPL_Q_TINY 1e-30f                       /* maxcode / amax is finite above */
#define MPL_Q_LIFT 18446744073709551616.0f      /* 2^64 */

/* A group's scale (NaN for a non-finite group); a value times *pre times
 * *inv is its code (before rounding): *pre is 1, or 2^64 for a group below
 * MPL_Q_TINY, whose inverse scale would overflow otherwise. */
static inline float mpl_q_scale(float amax, int finite, float maxcode, float *inv, float *pre)
{
    *pre = (finite && amax > 0.0f && amax < MPL_Q_TINY) ? MPL_Q_LIFT : 1.0f;
    *inv = (finite && amax > 0.0f) ? maxcode / (amax * *pre) : 0.0f;
    return finite ? amax / maxcode : NAN;
}

/* The codes of values [lo, hi) of a group, one at a time (lo even for int4:
 * a group, and the vector part before a tail, start on a byte). */
static inline void mpl_q_codes(unsigned char *codes, const float *src, float s, float pre,
                               float inv, size_t lo, size_t hi, int bits, uint32_t seed,
                               float maxcode)
{
    size_t i;
    if (bits == 8) {
        for (i = lo; i < hi; i++)
            codes[i] = (unsigned char)(int8_t)mpl_q_round(src[i] * s * pre * inv, seed,
                                                          (uint32_t)i, maxcode);
        return;
    }
    for (i = lo; i < hi; i += 2) {
        int a = mpl_q_round(src[i] * s * pre * inv, seed, (uint32_t)i, maxcode);
        int b = i + 1 < hi ? mpl_q_round(src[i + 1] * s * pre * inv, seed, (uint32_t)i + 1,
                                         maxcode)
                           : 0;
        codes[i / 2] = (unsigned char)((a + 8) | (b + 8) << 4);
    }
}

/* dst[i] = (acc[i], or 0 without acc) + code * scale over [lo, hi) of an
 * int4 block, one value at a time. */
static inline void mpl_q_decode4(float *dst, const float *acc, const unsigned char *codes,
                                 float scale, size_t lo, size_t hi)
{
    size_t i;
    for (i = lo; i < hi; i++) {
        int code = (int)((codes[i / 2] >> (4 * (i & 1))) & 15) - 8;
        dst[i] = (acc ? acc[i] : 0.0f) + (float)code * scale;
    }
}

/* dst = encode(src * s), one value at a time (the reference: the AVX2
 * variant below gives the same bytes). */
static void mpl_quantize_portable(unsigned char *dst, const float *src, float s, size_t n,
                                  size_t group, int bits, uint32_t seed)
{
    size_t groups = (n + group - 1) / group, g;
    float maxcode = (float)mpl_q_maxcode(bits);
    float *scales = (float *)dst;                 /* dst is 8-byte aligned */
    unsigned char *codes = dst + 4 * groups;
    for (g = 0; g < groups; g++) {
        size_t lo = g * group, hi = lo + group < n ? lo + group : n;
        float amax = 0.0f, inv, pre, scale;
        int finite = 1;
        mpl_q_scan(src, s, lo, hi, &amax, &finite);
        scale = mpl_q_scale(amax, finite, maxcode, &inv, &pre);
        memcpy(scales + g, &scale, 4);
        mpl_q_codes(codes, src, s, pre, inv, lo, hi, bits, seed, maxcode);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MPL_AVX2 __attribute__((target("avx2")))

static int mpl_q_avx2(void)
{
    static int avx2 = -1;       /* (a race between threads writes the same value) */
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") != 0;
    }
    return avx2;
}

/* Eight codes of mpl_q_round at once, bit for bit the same: the hash in
 * 32-bit lanes, floor by truncation of v + u + 128, the same selects. */
MPL_AVX2 static inline __m256i mpl_q_round8(__m256 v, uint32_t seed, uint32_t i, float maxcode)
{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32((int)i), lane);
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x9e3779b9U));
    x = _mm256_xor_si256(x, _mm256_set1_epi32((int)seed));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x7feb352dU));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bU));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 8)),
                             _mm256_set1_ps(1.0f / 16777216.0f));
    __m256 t = _mm256_add_ps(_mm256_add_ps(v, u), _mm256_set1_ps(128.0f));
    __m256i q = _mm256_sub_epi32(_mm256_cvttps_epi32(t), _mm256_set1_epi32(128));
    __m256i top = _mm256_set1_epi32((int)maxcode), bottom = _mm256_set1_epi32(-(int)maxcode);
    __m256 edge = _mm256_set1_ps(maxcode * (1.0f - 1e-6f));
    __m256 medge = _mm256_set1_ps(-maxcode * (1.0f - 1e-6f));
    q = _mm256_blendv_epi8(q, top, _mm256_castps_si256(_mm256_cmp_ps(v, edge, _CMP_GE_OQ)));
    q = _mm256_blendv_epi8(q, bottom, _mm256_castps_si256(_mm256_cmp_ps(v, medge, _CMP_LE_OQ)));
    q = _mm256_min_epi32(q, top);
    return _mm256_max_epi32(q, bottom);
}

/* mpl_quantize for whole groups of a multiple of 8 values (the caller's
 * groups); returns 0 when it cannot (then the portable code runs). */
MPL_AVX2 static int mpl_quantize_avx2(unsigned char *dst, const float *src, float s, size_t n,
                                      size_t group, int bits, uint32_t seed)
{
    size_t groups = (n + group - 1) / group, g, i;
    float maxcode = (float)mpl_q_maxcode(bits);
    float *scales = (float *)dst;
    unsigned char *codes = dst + 4 * groups;
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.402823466e38f);
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    if (group % 8)
        return 0;
    for (g = 0; g < groups; g++) {
        size_t lo = g * group, hi = lo + group < n ? lo + group : n, full = lo + (hi - lo) / 8 * 8;
        __m256 vs = _mm256_set1_ps(s), vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        float amax, inv, pre, scale, lanes[8];
        int finite = 1;
        for (i = lo; i < full; i += 8) {
            __m256 a = _mm256_andnot_ps(sign, _mm256_mul_ps(_mm256_loadu_ps(src + i), vs));
            vmax = _mm256_max_ps(vmax, a);      /* (a NaN lane: caught by `bad`) */
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
        }
        _mm256_storeu_ps(lanes, vmax);
        amax = 0.0f;
        for (i = 0; i < 8; i++)
            amax = lanes[i] > amax ? lanes[i] : amax;
        finite = _mm256_movemask_ps(bad) == 0;
        mpl_q_scan(src, s, full, hi, &amax, &finite);
        scale = mpl_q_scale(amax, finite, maxcode, &inv, &pre);
        memcpy(scales + g, &scale, 4);
        __m256 k = _mm256_set1_ps(inv), vpre = _mm256_set1_ps(pre);
        int lift = pre != 1.0f;                 /* (rare: groups below MPL_Q_TINY) */
        if (bits == 8) {
            for (i = lo; i < full; i += 8) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + i), vs);
                v = _mm256_mul_ps(lift ? _mm256_mul_ps(v, vpre) : v, k);
                __m256i q = _mm256_shuffle_epi8(mpl_q_round8(v, seed, (uint32_t)i, maxcode), pick);
                uint32_t w0 = (uint32_t)_mm256_extract_epi32(q, 0), w1 = (uint32_t)_mm256_extract_epi32(q, 4);
                memcpy(codes + i, &w0, 4);
                memcpy(codes + i + 4, &w1, 4);
            }
        } else {
            for (i = lo; i < full; i += 8) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + i), vs);
                v = _mm256_mul_ps(lift ? _mm256_mul_ps(v, vpre) : v, k);
                int32_t q[8];
                _mm256_storeu_si256((__m256i *)q, _mm256_add_epi32(
                    mpl_q_round8(v, seed, (uint32_t)i, maxcode), _mm256_set1_epi32(8)));
                for (int j = 0; j < 8; j += 2)
                    codes[(i + j) / 2] = (unsigned char)(q[j] | q[j + 1] << 4);
            }
        }
        mpl_q_codes(codes, src, s, pre, inv, full, hi, bits, seed, maxcode);   /* the tail */
    }
    return 1;
}
#endif

/* dst = encode(src * s): AVX2 where the CPU has it (about 5x), the same
 * bytes either way. */
static void mpl_quantize(unsigned char *dst, const float *src, float s, size_t n, size_t group,
                         int bits, uint32_t seed)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (mpl_q_avx2() && mpl_quantize_avx2(dst, src, s, n, group, bits, seed))
        return;
#endif
    mpl_quantize_portable(dst, src, s, n, group, bits, seed);
}

/* dst = (acc, or 0 if NULL) + decode(src) * s.  dst may be acc. */
#if defined(__x86_64__) && defined(__GNUC__)
/* The int4 decoder, eight nibbles per step (the int8 one vectorises as it
 * is): the same values as the loop in mpl_dequantize, multiply then add. */
MPL_AVX2 static void mpl_dequantize4_avx2(float *dst, const float *acc, const unsigned char *src,
                                          float s, size_t n, size_t group)
{
    size_t groups = (n + group - 1) / group, g, i;
    const unsigned char *codes = src + 4 * groups;
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for (g = 0; g < groups; g++) {
        size_t lo = g * group, hi = lo + group < n ? lo + group : n, full = lo + (hi - lo) / 8 * 8;
        float scale;
        memcpy(&scale, src + 4 * g, 4);
        scale *= s;
        __m256 k = _mm256_set1_ps(scale);
        for (i = lo; i < full; i += 8) {
            uint32_t word;
            memcpy(&word, codes + i / 2, 4);
            __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts),
                                         _mm256_set1_epi32(15));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8))), k);
            __m256 a = acc ? _mm256_loadu_ps(acc + i) : _mm256_setzero_ps();
            _mm256_storeu_ps(dst + i, _mm256_add_ps(a, v));
        }
        mpl_q_decode4(dst, acc, codes, scale, full, hi);     /* the tail */
    }
}
#endif

static void mpl_dequantize(float *dst, const float *acc, const unsigned char *src, float s,
                           size_t n, size_t group, int bits)
{
    size_t groups = (n + group - 1) / group, g, i;
    const unsigned char *codes = src + 4 * groups;
#if defined(__x86_64__) && defined(__GNUC__)
    if (bits == 4 && group % 8 == 0 && mpl_q_avx2()) {
        mpl_dequantize4_avx2(dst, acc, src, s, n, group);
        return;
    }
#endif
    for (g = 0; g < groups; g++) {
        size_t lo = g * group, hi = lo + group < n ? lo + group : n;
        float scale;
        memcpy(&scale, src + 4 * g, 4);
        scale *= s;
        if (bits == 8) {
            if (acc)
                for (i = lo; i < hi; i++)
                    dst[i] = acc[i] + (float)(int8_t)codes[i] * scale;
            else
                for (i = lo; i < hi; i++)
                    dst[i] = (float)(int8_t)codes[i] * scale;
        } else {
            mpl_q_decode4(dst, acc, codes, scale, lo, hi);
        }
    }
}

#endif
