/* Pacing: a token bucket per endpoint, so that datagrams leave at the rate
 * of the port they cross and in bursts a shallow switch queue can hold.
 * Without it a rank hands the kernel everything at once: the node's queue
 * takes it, the port drains it at its rate, and where several ranks send to
 * one node at once (incast, every all-to-all phase) the switch port toward
 * that node overflows and drops what the channel then counts as lost.
 *
 * Tokens are bytes on the wire: a datagram costs its length plus the IPv4,
 * UDP and Ethernet headers (what a rate-limiting queue counts).  rate 0:
 * unpaced. */
#ifndef MPILOSSY_PACE_H
#define MPILOSSY_PACE_H

#include <stddef.h>
#include <time.h>

#define MPL_PACE_HEADERS 42      /* IPv4 20 + UDP 8 + Ethernet 14 */

typedef struct {
    double rate;                 /* bytes per second; 0: unpaced */
    double burst;                /* most tokens ever held */
    double tokens;
    double last;                 /* when tokens were last added */
} mpl_pace_t;

static inline double mpl_pace_clock(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void mpl_pace_set(mpl_pace_t *p, double rate, double burst)
{
    p->rate = rate > 0 ? rate : 0;
    p->burst = burst;
    p->tokens = burst;
    p->last = mpl_pace_clock();
}

/* Add the tokens earned since the last call. */
static inline void mpl_pace_refill(mpl_pace_t *p)
{
    double now = mpl_pace_clock();
    p->tokens += (now - p->last) * p->rate;
    if (p->tokens > p->burst)
        p->tokens = p->burst;
    p->last = now;
}

static inline double mpl_pace_cost(size_t len) { return (double)(len + MPL_PACE_HEADERS); }

/* May a datagram of `len` bytes leave on the tokens in hand?  Takes them if
 * so.  (A datagram larger than the whole bucket leaves when it is full.) */
static inline int mpl_pace_spend(mpl_pace_t *p, size_t len)
{
    double cost = mpl_pace_cost(len);
    if (p->tokens < cost && p->tokens < p->burst)
        return 0;
    p->tokens -= cost;
    return 1;
}

/* The same, with the tokens earned until now: one datagram at a time. */
static inline int mpl_pace_take(mpl_pace_t *p, size_t len)
{
    if (p->rate <= 0)
        return 1;
    mpl_pace_refill(p);
    return mpl_pace_spend(p, len);
}

#endif /* MPILOSSY_PACE_H */
