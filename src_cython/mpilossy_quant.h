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

/* dst = encode(src * s).  `first`: index of src[0] in the stream the seed
 * numbers (so that a block's groups draw independent bits). */
static void mpl_quantize(unsigned char *dst, const float *src, float s, size_t n, size_t group,
                         int bits, uint32_t seed)
{
    size_t groups = (n + group - 1) / group, g, i;
    float maxcode = (float)mpl_q_maxcode(bits);
    float *scales = (float *)dst;                 /* dst is 8-byte aligned */
    unsigned char *codes = dst + 4 * groups;
    for (g = 0; g < groups; g++) {
        size_t lo = g * group, hi = lo + group < n ? lo + group : n;
        float amax = 0.0f, inv, scale;
        int finite = 1;
        for (i = lo; i < hi; i++) {
            float a = fabsf(src[i] * s);
            amax = a > amax ? a : amax;
            finite &= isfinite(a) != 0;
        }
        scale = finite ? amax / maxcode : NAN;
        inv = (finite && amax > 0.0f) ? maxcode / amax : 0.0f;
        memcpy(scales + g, &scale, 4);
        if (bits == 8) {
            for (i = lo; i < hi; i++)
                codes[i] = (unsigned char)(int8_t)mpl_q_round(src[i] * s * inv, seed, (uint32_t)i,
                                                              maxcode);
        } else {
            /* group is even: a group starts on a byte */
            for (i = lo; i < hi; i += 2) {
                int a = mpl_q_round(src[i] * s * inv, seed, (uint32_t)i, maxcode);
                int b = i + 1 < hi ? mpl_q_round(src[i + 1] * s * inv, seed, (uint32_t)i + 1,
                                                 maxcode) : 0;
                codes[i / 2] = (unsigned char)((a + 8) | (b + 8) << 4);
            }
        }
    }
}

/* dst = (acc, or 0 if NULL) + decode(src) * s.  dst may be acc. */
static void mpl_dequantize(float *dst, const float *acc, const unsigned char *src, float s,
                           size_t n, size_t group, int bits)
{
    size_t groups = (n + group - 1) / group, g, i;
    const unsigned char *codes = src + 4 * groups;
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
            for (i = lo; i < hi; i++) {
                int code = (int)((codes[i / 2] >> (4 * (i & 1))) & 15) - 8;
                dst[i] = (acc ? acc[i] : 0.0f) + (float)code * scale;
            }
        }
    }
}

#endif
