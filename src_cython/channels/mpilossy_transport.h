/* The datagram channel's transport, one set of calls for two back ends:
 * libfabric (verbs UD, EFA, its udp provider; mpilossy_fabric.h) or
 * mpilossy's own batched UDP sockets (provider "native";
 * mpilossy_sockets.h).  Errors are negative; MPL_FAB_EAGAIN means "no room
 * now, reap completions and try again" for both. */
#ifndef MPILOSSY_TRANSPORT_H
#define MPILOSSY_TRANSPORT_H

#include "mpilossy_fabric.h"
#include "mpilossy_sockets.h"

#define MPL_DG_NATIVE "native"

typedef struct {
    mpl_fab_t *fab;          /* exactly one of the two is set */
    mpl_sock_t *sock;
    mpl_pace_t pace;         /* libfabric's pacing (the native transport paces its flushes) */
} mpl_dg_t;

static int mpl_dg_is_native(const char *provider)
{
    return provider && !strcmp(provider, MPL_DG_NATIVE);
}

/* Open an endpoint of `provider` ("native", a libfabric provider, or NULL
 * for libfabric's first match) on `domain`, for `nops` operations in flight. */
static int mpl_dg_open(mpl_dg_t **out, const char *provider, const char *domain, size_t nops,
                       size_t cq_size, char *err, size_t errlen)
{
    mpl_dg_t *d = calloc(1, sizeof(*d));
    int rc;
    *out = NULL;
    if (!d) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    rc = mpl_dg_is_native(provider) ? mpl_sock_open(&d->sock, domain, nops, err, errlen)
                                    : mpl_fab_open(&d->fab, provider, domain, nops, cq_size, err, errlen);
    if (rc) {
        free(d);
        return -1;
    }
    *out = d;
    return 0;
}

static void mpl_dg_close(mpl_dg_t *d)
{
    if (!d)
        return;
    if (d->sock)
        mpl_sock_close(d->sock);
    else
        mpl_fab_close(d->fab);
    free(d);
}

static int mpl_dg_register(mpl_dg_t *d, void *buf, size_t len, void **mr, void **desc,
                           char *err, size_t errlen)
{
    if (d->sock) {
        *mr = *desc = NULL;          /* sockets copy: nothing to register */
        return 0;
    }
    return mpl_fab_register(d->fab, buf, len, mr, desc, err, errlen);
}

static void mpl_dg_deregister(void *mr) { mpl_fab_deregister(mr); }    /* (NULL: no-op) */

static int mpl_dg_getname(mpl_dg_t *d, void *addr, size_t *len, char *err, size_t errlen)
{
    return d->sock ? mpl_sock_getname(d->sock, addr, len, err, errlen)
                   : mpl_fab_getname(d->fab, addr, len, err, errlen);
}

static int mpl_dg_insert(mpl_dg_t *d, const void *addrs, int n, char *err, size_t errlen)
{
    return d->sock ? mpl_sock_insert(d->sock, addrs, n, err, errlen)
                   : mpl_fab_insert(d->fab, addrs, n, err, errlen);
}

static int mpl_dg_recv(mpl_dg_t *d, void *buf, size_t len, void *desc, size_t slot, void *user)
{
    if (d->sock)
        return mpl_sock_recv(d->sock, buf, len, user) ? MPL_FAB_EAGAIN : 0;
    return mpl_fab_recv(d->fab, buf, len, desc, slot, user);
}

static int mpl_dg_send(mpl_dg_t *d, int peer, const void *buf, size_t len, void *desc,
                       size_t slot, void *user)
{
    int rc;
    if (d->sock)
        return mpl_sock_send(d->sock, peer, buf, len, user) ? MPL_FAB_EAGAIN : 0;
    if (!mpl_pace_take(&d->pace, peer, len))
        return MPL_FAB_EAGAIN;
    rc = mpl_fab_send(d->fab, peer, buf, len, desc, slot, user);
    if (rc && d->pace.rate > 0)         /* not sent: its tokens come back */
        d->pace.tokens += mpl_pace_cost(&d->pace, peer, len);
    return rc;
}

static int mpl_dg_poll(mpl_dg_t *d, mpl_fab_event_t *events, int max)
{
    return d->sock ? mpl_sock_poll(d->sock, events, max) : mpl_fab_poll(d->fab, events, max);
}

/* Hand every queued send to the kernel now (the native transport queues
 * them; libfabric's sends leave when posted).  Call before the caller stops
 * polling: a datagram left queued would leave only at its next call. */
static void mpl_dg_flush(mpl_dg_t *d)
{
    if (d && d->sock)
        mpl_sock_flush_all(d->sock);
}

/* Pace the datagrams this endpoint sends: `rate` bytes per second on the
 * wire (0: unpaced), at most `burst` bytes at once. */
static void mpl_dg_set_rate(mpl_dg_t *d, double rate, double burst)
{
    mpl_pace_set(d->sock ? mpl_sock_pace(d->sock) : &d->pace, rate, burst);
}

/* Peers on this node (`local[peer]` 1): their datagrams never cross the
 * port, so pacing does not charge them.  The caller keeps `local` alive. */
static void mpl_dg_set_local(mpl_dg_t *d, const unsigned char *local, size_t npeers)
{
    mpl_pace_set_local(d->sock ? mpl_sock_pace(d->sock) : &d->pace, local, npeers);
}

/* Segmentation and receive offload of the native transport on or off
 * (libfabric: nothing to do).  Returns 1 when receive offload is on. */
static int mpl_dg_set_offload(mpl_dg_t *d, int on)
{
    return d && d->sock ? mpl_sock_set_offload(d->sock, on) : 0;
}

/* Datagrams queued that have not left yet (native transport; libfabric's
 * leave when posted). */
static size_t mpl_dg_queued(const mpl_dg_t *d)
{
    return d && d->sock ? mpl_sock_queued(d->sock) : 0;
}

/* Give up the sends still queued (see mpl_sock_discard). */
static void mpl_dg_discard_queued(mpl_dg_t *d)
{
    if (d && d->sock)
        mpl_sock_discard(d->sock);
}

static const char *mpl_dg_strerror(const mpl_dg_t *d, int rc)
{
    return d && d->sock ? strerror(rc < 0 ? -rc : rc) : mpl_fab_strerror(rc);
}

static const char *mpl_dg_provider(const mpl_dg_t *d)
{
    return d->sock ? MPL_DG_NATIVE : mpl_fab_provider(d->fab);
}

static const char *mpl_dg_domain_name(const mpl_dg_t *d)
{
    return d->sock ? mpl_sock_domain_name(d->sock) : mpl_fab_domain_name(d->fab);
}

static size_t mpl_dg_prefix(const mpl_dg_t *d) { return d->sock ? 0 : mpl_fab_prefix(d->fab); }

static size_t mpl_dg_max_msg(const mpl_dg_t *d)
{
    return d->sock ? mpl_sock_max_msg(d->sock) : mpl_fab_max_msg(d->fab);
}

/* System calls and datagrams of the native transport (zeros for libfabric,
 * which does not say): send calls, receive calls, sent, received, refused,
 * largest send batch, messages received, receive offload on. */
static void mpl_dg_costs(const mpl_dg_t *d, uint64_t out[MPL_DG_COSTS])
{
    if (d && d->sock)
        mpl_sock_costs(d->sock, out);
    else
        memset(out, 0, MPL_DG_COSTS * sizeof(uint64_t));
}

#endif /* MPILOSSY_TRANSPORT_H */
