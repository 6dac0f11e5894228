/* What Cython cannot say by itself: memory ordering for records that peers
 * read straight out of shared memory, counter-based random numbers for loss
 * injection, half-precision conversion, and the layout of a window. */
#ifndef MPILOSSY_NATIVE_H
#define MPILOSSY_NATIVE_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#include <math.h>
#include <sched.h>

/* ---- clock ---------------------------------------------------------------*/
static inline double mpl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void mpl_sleep(double seconds)
{
    if (seconds <= 0) return;
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0) {}
}

static inline void mpl_yield(void) { sched_yield(); }

/* ---- interface methods a channel must override ---------------------------
 * The base Channel's claim/mine/publish/poll are nogil and cannot raise: a
 * subclass that forgets one stops the process here instead of losing data. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noreturn, cold))
static inline void mpl_unimplemented(const char *what)
{
    fprintf(stderr, "mpilossy: %s is not implemented by this channel "
            "(a Channel subclass must override it)\n", what);
    fflush(stderr);
    abort();
}

/* ---- seqlock ordering ------------------------------------------------------
 * A writer clears `seq`, fences, writes the payload, and stores `seq` with
 * release.  A reader loads `seq` with acquire, reads the payload, fences, and
 * loads `seq` again: equal and non-zero means the payload was not touched. */
static inline uint64_t mpl_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t mpl_load_relaxed(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void mpl_store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void mpl_store_relaxed(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline void mpl_fence_acquire(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
static inline void mpl_fence_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }

/* ---- counter-based hashing (splitmix64 finaliser) --------------------------*/
static inline uint64_t mpl_mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline uint64_t mpl_hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return mpl_mix64(mpl_mix64(mpl_mix64(mpl_mix64(a) ^ b) ^ c) ^ d);
}

/* Uniform double in [0, 1) from 53 random bits. */
static inline double mpl_unit(uint64_t h) { return (double)(h >> 11) * 0x1.0p-53; }

/* ---- half precision ------------------------------------------------------*/
#if defined(__FLT16_MAX__) && !defined(MPILOSSY_NO_FLOAT16)
static inline float mpl_h2f(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t mpl_f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }
#else
static inline float mpl_h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);           /* inf, nan */
    else if (exp) bits = sign | ((exp + 112u) << 23) | (man << 13);     /* normal */
    else if (man) {                                                      /* subnormal */
        float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    } else bits = sign;
    float f; memcpy(&f, &bits, 4); return f;
}
static inline uint16_t mpl_f2h(float f)
{
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);            /* overflow */
    if (ax < 0x38800000u) {                                              /* subnormal or zero */
        float v = fabsf(f) * 0x1.0p24f;                                  /* units of 2^-24 */
        return (uint16_t)(sign | (uint16_t)nearbyintf(v));
    }
    uint32_t r = ax + 0xC8000FFFu + ((ax >> 13) & 1u);                   /* rebias, round to even */
    return (uint16_t)(sign | (r >> 13));
}
#endif

/* ---- window layout -------------------------------------------------------
 * Every rank's window starts with its status block, followed by one `done`
 * word per peer and then the records.  Only the owner writes its status and
 * records; peers write only their own `done` word (network path). */
#define MPL_CACHELINE 64
#define MPL_MSG_LEN 320

typedef struct {
    uint64_t seq;        /* call the owner is in; 0 while being rewritten */
    uint64_t sig;        /* hash of the call's layout: peers must agree */
    uint64_t count;      /* elements */
    uint32_t dtype, op, algo, block;   /* for error messages */
    uint64_t grow;       /* >0: the owner waits to grow every window to this */
    uint64_t err_seq;    /* last call this owner knows to have failed */
    int32_t err_kind, err_rank;
    char err_msg[MPL_MSG_LEN];
    /* The owner's call before `seq`, whose records are still in place: a
     * rank that arrives there late compares its call with it.  Rewritten
     * only while seq is 0; prev_check (mpl_hash4 of the others) tells a
     * copy torn by a concurrent rewrite (network path). */
    uint64_t prev_seq, prev_sig, prev_count;
    uint32_t prev_dtype, prev_op, prev_algo, prev_pad;
    uint64_t prev_check;
} mpl_status_t;

typedef struct {
    uint64_t seq;        /* call that wrote the payload; 0 while being written */
    uint64_t check;      /* mpl_hash4 of (seq, sig, slot, block) */
    uint32_t count;      /* contributors summed in the payload; 0 = nothing */
    uint32_t nbytes;
    uint64_t pad[5];
} mpl_record_t;

/* A record's payload follows its header at this offset (rma.pxi: RECORD_HEADER). */
#define MPL_RECORD_BYTES 64
_Static_assert(sizeof(mpl_record_t) == MPL_RECORD_BYTES, "record header is 64 bytes");

#define MPL_STATUS_BYTES (((sizeof(mpl_status_t) + MPL_CACHELINE - 1) / MPL_CACHELINE) * MPL_CACHELINE)
/* The done words (uint64_t) follow the status in every window. */
_Static_assert(MPL_STATUS_BYTES % MPL_CACHELINE == 0 && MPL_STATUS_BYTES % 8 == 0,
               "the status block keeps the done words aligned");

static inline uint64_t mpl_record_check(uint64_t seq, uint64_t sig, uint64_t slot, uint64_t block)
{
    return mpl_hash4(seq, sig, slot, block) | 1u;
}

/* ---- datagrams ----------------------------------------------------------
 * Every datagram starts with this header.  A receiver accepts a packet only
 * if it is long enough, its magic, version and communicator token match, its
 * source is a peer, its length matches and suits its kind, and its MAC
 * (mpilossy_mac.h: keyed, over the header up to `mac` and the payload) is
 * right; then it is judged by its call number.  The token only tells
 * communicators apart cheaply; the MAC's key is what makes a datagram
 * authentic, and it never travels in one. */
#define MPL_PKT_MAGIC 0x4D504C44u      /* "MPLD" */
#define MPL_PKT_VERSION 2
/* END: the sender has sent every block of `slot` to this receiver (early close). */
enum { MPL_PKT_DATA = 1, MPL_PKT_HELLO = 2, MPL_PKT_ERROR = 3, MPL_PKT_NACK = 4, MPL_PKT_END = 5 };

typedef struct {
    uint32_t magic;
    uint16_t version, kind;
    uint64_t token;      /* this communicator's */
    uint64_t seq;        /* call number */
    uint32_t src;        /* sender's rank */
    uint32_t slot;
    uint32_t block;
    uint32_t count;      /* contributors summed in the payload */
    uint32_t nbytes;     /* payload bytes */
    uint32_t sig;        /* low bits of the call signature (DATA) */
    unsigned char mac[16];
} mpl_packet_t;

#define MPL_PKT_HEADER_BYTES 64
#define MPL_PKT_MAC_OFFSET 48            /* the MAC covers the header up to here */
_Static_assert(sizeof(mpl_packet_t) == MPL_PKT_HEADER_BYTES, "datagram header is 64 bytes");
_Static_assert(offsetof(mpl_packet_t, mac) == MPL_PKT_MAC_OFFSET, "MAC follows 48 header bytes");

/* What a HELLO carries: the call the sender entered, to detect ranks that
 * disagree; and what an ERROR carries. */
typedef struct {
    uint64_t sig, count;
    uint32_t dtype, op, algo, block;
} mpl_hello_t;

typedef struct {
    int32_t kind, rank;
    char msg[MPL_MSG_LEN];
} mpl_error_t;

#endif /* MPILOSSY_NATIVE_H */
