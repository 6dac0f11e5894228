/* Erasure codes for lossy streams: m parity blocks per group of k data
 * blocks, so that a receiver that lost up to m of the k + m rebuilds them
 * without a round trip.
 *
 * m = 1 is XOR, here.  m >= 2 is a Reed-Solomon code over GF(2^8) with a
 * Cauchy generator (every k of the k + m rows are independent), through
 * Intel ISA-L's table-driven SIMD kernels where mpilossy was built with its
 * headers (MPILOSSY_HAVE_ISAL); without them only m = 1 is available.
 *
 * Blocks of a group are `len` bytes each (a shorter last block is padded
 * with zeros by the caller).  Data blocks are rows 0..k-1 of the code,
 * parity blocks rows k..k+m-1.  A group may hold only its first `kk` <= k
 * data blocks (the last group of a stream): the others are zero, so they
 * add nothing to a parity row and are neither stored nor read; the parity
 * is the same as that of the group padded with zero blocks. */
#ifndef MPILOSSY_FEC_H
#define MPILOSSY_FEC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef MPILOSSY_HAVE_ISAL
#include <isa-l/erasure_code.h>
#define MPL_HAVE_ISAL 1
#else
#define MPL_HAVE_ISAL 0
#endif

#define MPL_FEC_MAX_K 64       /* data blocks per group */
#define MPL_FEC_MAX_M 8        /* parity blocks per group (and m < k) */
#define MPL_FEC_STRIP 4096     /* bytes XORed per pass: the sources stay in L1 */

/* 0 when (k, m) is a code this build has, else a reason. */
static const char *mpl_fec_check(int k, int m)
{
    if (k < 2 || k > MPL_FEC_MAX_K)
        return "k must be in 2..64";
    if (m < 1 || m > MPL_FEC_MAX_M || m >= k)
        return "m must be in 1..8 and less than k";
    if (m >= 2 && !MPL_HAVE_ISAL)
        return "m >= 2 needs Intel ISA-L (mpilossy was built without its headers: "
               "install libisal-dev and rebuild)";
    return 0;
}

/* dst ^= src over n bytes (the compiler vectorises the word loop). */
static inline void mpl_xor_into(unsigned char *restrict dst, const unsigned char *restrict src,
                                size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t a[4], b[4];
        memcpy(a, dst + i, 32);
        memcpy(b, src + i, 32);
        a[0] ^= b[0]; a[1] ^= b[1]; a[2] ^= b[2]; a[3] ^= b[3];
        memcpy(dst + i, a, 32);
    }
    for (; i < n; i++)
        dst[i] ^= src[i];
}

/* out = XOR of the n blocks src[0..n-1], strip by strip.  Encodes the
 * parity of m = 1 (the k data blocks) and rebuilds its one lost block (the
 * k - 1 data blocks left and the parity). */
static void mpl_fec_xor(unsigned char *out, unsigned char *const *src, int n, size_t len)
{
    size_t at, strip;
    int i;
    for (at = 0; at < len; at += strip) {
        strip = len - at < MPL_FEC_STRIP ? len - at : MPL_FEC_STRIP;
        memcpy(out + at, src[0] + at, strip);
        for (i = 1; i < n; i++)
            mpl_xor_into(out + at, src[i] + at, strip);
    }
}

/* A code: the generator matrix and the tables that encode with it. */
typedef struct {
    int k, m;
#if MPL_HAVE_ISAL
    unsigned char matrix[(MPL_FEC_MAX_K + MPL_FEC_MAX_M) * MPL_FEC_MAX_K];
    unsigned char tables[32 * MPL_FEC_MAX_K * MPL_FEC_MAX_M];
#endif
} mpl_fec_t;

/* Set up code (k, m); 0, or -1 when mpl_fec_check refuses it. */
static int mpl_fec_init(mpl_fec_t *c, int k, int m)
{
    if (mpl_fec_check(k, m))
        return -1;
    c->k = k;
    c->m = m;
#if MPL_HAVE_ISAL
    if (m >= 2) {
        gf_gen_cauchy1_matrix(c->matrix, k + m, k);
        ec_init_tables(k, m, c->matrix + k * k, c->tables);
    }
#endif
    return 0;
}

#if MPL_HAVE_ISAL
/* Tables of the code's parity rows restricted to data columns 0..kk-1. */
static void mpl_fec_tables(const mpl_fec_t *c, int kk, unsigned char *tables)
{
    unsigned char sub[MPL_FEC_MAX_M * MPL_FEC_MAX_K];
    int p, j;
    for (p = 0; p < c->m; p++)
        for (j = 0; j < kk; j++)
            sub[p * kk + j] = c->matrix[(c->k + p) * c->k + j];
    ec_init_tables(kk, c->m, sub, tables);
}
#endif

/* parity[0..m-1] from data[0..kk-1] (1 <= kk <= k), `len` bytes each. */
static void mpl_fec_encode(const mpl_fec_t *c, unsigned char *const *data,
                           unsigned char **parity, size_t len, int kk)
{
    if (c->m == 1) {
        mpl_fec_xor(parity[0], data, kk, len);
        return;
    }
#if MPL_HAVE_ISAL
    if (kk == c->k) {
        ec_encode_data((int)len, c->k, c->m, (unsigned char *)c->tables,
                       (unsigned char **)data, parity);
    } else {
        unsigned char tables[32 * MPL_FEC_MAX_K * MPL_FEC_MAX_M];
        mpl_fec_tables(c, kk, tables);
        ec_encode_data((int)len, kk, c->m, tables, (unsigned char **)data, parity);
    }
#endif
}

/* Rebuild the lost data blocks of a group of kk data blocks (1 <= kk <= k;
 * rows kk..k-1 are zero and never read).  blocks[0..k+m-1]: every row's
 * memory; present[i]: row i arrived.  The rows of lost data blocks are
 * written; nothing else is.  Returns how many data blocks were rebuilt (0
 * when none was lost), or -1 when fewer than kk rows arrived. */
static int mpl_fec_decode(const mpl_fec_t *c, unsigned char **blocks,
                          const unsigned char *present, size_t len, int kk)
{
    int k = c->k, m = c->m, n = k + m, lost[MPL_FEC_MAX_M], nlost = 0, have = 0, i;
    unsigned char *rows[MPL_FEC_MAX_K];
    for (i = 0; i < n; i++)
        have += present[i] != 0 && (i < kk || i >= k);
    for (i = 0; i < kk; i++)
        if (!present[i]) {
            if (nlost == m)
                return -1;
            lost[nlost++] = i;
        }
    if (!nlost)
        return 0;
    if (have < kk)
        return -1;
    if (m == 1) {
        /* the parity XOR the kk - 1 others: the one lost */
        int r = 0;
        for (i = 0; i < n; i++)
            if (present[i] && (i < kk || i >= k))
                rows[r++] = blocks[i];
        mpl_fec_xor(blocks[lost[0]], rows, kk, len);
        return 1;
    }
#if MPL_HAVE_ISAL
    {
        /* The sources: the k - nlost data rows that arrived (D), then the
         * first nlost parity rows that arrived (P).  Each parity row is
         * G[p, D] d_D + G[p, L] d_L, so with A = G[P, L] (nlost x nlost)
         *     d_L = A^-1 (rows(P) + G[P, D] d_D)        (GF(2^8): - is +).
         * Only A is inverted, not a k x k matrix: the fixed cost of a
         * decode is nlost^2 * k multiplications, not k^3. */
        unsigned char a[MPL_FEC_MAX_M * MPL_FEC_MAX_M], ainv[MPL_FEC_MAX_M * MPL_FEC_MAX_M];
        unsigned char want[MPL_FEC_MAX_M * MPL_FEC_MAX_K];
        unsigned char tables[32 * MPL_FEC_MAX_K * MPL_FEC_MAX_M];
        unsigned char *out[MPL_FEC_MAX_M];
        int parity[MPL_FEC_MAX_M], np = 0, r = 0, j, p, col;
        for (i = 0; i < kk; i++)
            if (present[i])
                rows[r++] = blocks[i];
        for (i = k; i < n && np < nlost; i++)
            if (present[i]) {
                parity[np++] = i;
                rows[r++] = blocks[i];
            }
        for (p = 0; p < nlost; p++)
            for (j = 0; j < nlost; j++)
                a[p * nlost + j] = c->matrix[parity[p] * k + lost[j]];
        if (gf_invert_matrix(a, ainv, nlost))
            return -1;              /* (cannot happen: a Cauchy code's k rows are independent) */
        for (j = 0; j < nlost; j++) {
            const unsigned char *arow = ainv + j * nlost;
            col = 0;
            for (i = 0; i < kk; i++) {
                unsigned char sum = 0;
                if (!present[i])
                    continue;
                for (p = 0; p < nlost; p++)
                    sum ^= gf_mul(arow[p], c->matrix[parity[p] * k + i]);
                want[j * kk + col++] = sum;
            }
            for (p = 0; p < nlost; p++)
                want[j * kk + col++] = arow[p];
            out[j] = blocks[lost[j]];
        }
        ec_init_tables(kk, nlost, want, tables);
        ec_encode_data((int)len, kk, nlost, tables, rows, out);
        return nlost;
    }
#else
    return -1;
#endif
}

#endif /* MPILOSSY_FEC_H */
