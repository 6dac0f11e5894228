/* Pacing: a token bucket per endpoint, so that datagrams leave at the rate
 * of the port they cross and in bursts a shallow switch queue can hold.
 * Without it a rank hands the kernel everything at once: the node's queue
 * takes it, the port drains it at its rate, and where several ranks send to
 * one node at once (incast, every all-to-all phase) the switch port toward
 * that node overflows and drops what the channel then counts as lost.
 *
 * Tokens are bytes on the wire: a datagram costs its length plus the IPv4,
 * UDP and Ethernet headers (what a rate-limiting queue counts).  rate 0:
 * unpaced.  A datagram to a peer on this node (`local`) never crosses the
 * port: it costs nothing. */
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
    const unsigned char *local;  /* per peer: 1 if on this node (NULL: none is) */
    size_t npeers;
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

/* Peers on this node (`local[peer]` 1), for `npeers` peers; the caller
 * keeps `local` alive while the endpoint is. */
static inline void mpl_pace_set_local(mpl_pace_t *p, const unsigned char *local, size_t npeers)
{
    p->local = local;
    p->npeers = local ? npeers : 0;
}

/* Tokens a datagram of `len` bytes to `peer` takes. */
static inline double mpl_pace_cost(const mpl_pace_t *p, int peer, size_t len)
{
    if (p->local && peer >= 0 && (size_t)peer < p->npeers && p->local[peer])
        return 0;
    return (double)(len + MPL_PACE_HEADERS);
}

/* May a datagram of `len` bytes to `peer` leave on the tokens in hand?
 * Takes them if so.  (A datagram larger than the whole bucket leaves when
 * it is full.) */
static inline int mpl_pace_spend(mpl_pace_t *p, int peer, size_t len)
{
    double cost = mpl_pace_cost(p, peer, len);
    if (cost == 0)
        return 1;
    if (p->tokens < cost && p->tokens < p->burst)
        return 0;
    p->tokens -= cost;
    return 1;
}

/* The same, with the tokens earned until now: one datagram at a time. */
static inline int mpl_pace_take(mpl_pace_t *p, int peer, size_t len)
{
    if (p->rate <= 0)
        return 1;
    mpl_pace_refill(p);
    return mpl_pace_spend(p, peer, len);
}

#endif /* MPILOSSY_PACE_H */
