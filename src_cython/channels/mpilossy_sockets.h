/* mpilossy's own datagram transport: one UDP socket, batched system calls.
 *
 * The operations of mpilossy_fabric.h (post receives, send, reap
 * completions), for plain Ethernet/IP, where libfabric's udp provider makes
 * one system call per datagram.  Sends are queued and leave together: one
 * sendmmsg per flush, a run of equal-sized datagrams to one peer as one
 * message with UDP segmentation offload (UDP_SEGMENT, Linux >= 4.18; the
 * kernel or the NIC cuts it into datagrams after the stack was crossed
 * once).  Receives are taken by recvmmsg straight into the posted buffers;
 * where the kernel has UDP receive offload (UDP_GRO, Linux >= 5.0) they
 * land instead in a few 64 KiB buffers, each holding up to 64 datagrams of
 * one sender that the kernel merged (or a segmented message that was never
 * cut, on loopback), and are split into the posted buffers: one copy per
 * datagram, in place of the kernel's receive path per datagram.
 * A send completes when the kernel has taken its bytes, a receive when a
 * datagram is in its buffer; a datagram that did not fit completes with
 * length 0 (counted as truncated by the channel). */
#ifndef MPILOSSY_SOCKETS_H
#define MPILOSSY_SOCKETS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>

#include "mpilossy_pace.h"
#include "mpilossy_udp.h"         /* mpl_fab_event_t */

typedef struct mpl_sock mpl_sock_t;

/* How many figures mpl_sock_costs reports. */
#define MPL_DG_COSTS 8

#ifdef __linux__
/* sendmmsg/recvmmsg need _GNU_SOURCE, which Python.h (pyconfig.h) defines first. */
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define MPL_SOCK_BATCH 64          /* messages per sendmmsg/recvmmsg */
#define MPL_SOCK_MAX_SEGS 64       /* datagrams per segmented message (kernel limit) */
#define MPL_SOCK_MAX_GSO 65000     /* bytes per segmented message (< 64 KiB IP) */
#define MPL_SOCK_HOLD 8            /* polls that may pass before queued sends leave */
#define MPL_SOCK_LANDINGS 8        /* merged messages one recvmmsg takes (UDP_GRO) */
#define MPL_SOCK_LANDING 65536     /* bytes of one: the largest UDP payload fits */

typedef struct {
    void *buf;
    size_t len;
    void *user;
} mpl_sock_post_t;

typedef struct {
    int peer;
    const void *buf;
    size_t len;
    void *user;
} mpl_sock_send_t;

/* What one sendmmsg hands over (on the heap: 70 KB, too much for a stack
 * frame that may sit under a deep call). */
typedef struct {
    struct mmsghdr msgs[MPL_SOCK_BATCH];
    struct iovec iov[MPL_SOCK_BATCH * MPL_SOCK_MAX_SEGS];
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } ctl[MPL_SOCK_BATCH];
    size_t first[MPL_SOCK_BATCH + 1];
} mpl_sock_batch_t;

/* Where merged messages land (UDP_GRO), and how far they are split. */
typedef struct {
    char data[MPL_SOCK_LANDINGS][MPL_SOCK_LANDING];
    size_t len[MPL_SOCK_LANDINGS];     /* bytes of message i */
    size_t seg[MPL_SOCK_LANDINGS];     /* its datagrams' size (the last may be shorter) */
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl[MPL_SOCK_LANDINGS];
    int count;                         /* messages landed */
    int next;                          /* the one being split */
    size_t off;                        /* its bytes already handed out */
} mpl_sock_landing_t;

struct mpl_sock {
    int fd;
    struct sockaddr_in self;
    struct sockaddr_in *peers;
    int npeers;
    mpl_sock_post_t *rq;           /* posted receive buffers, a FIFO ring */
    size_t rq_cap, rq_head, rq_count;
    mpl_sock_send_t *sq;           /* queued sends, in order */
    size_t sq_cap, sq_count;
    mpl_sock_batch_t *batch;       /* the messages of a flush */
    mpl_pace_t pace;               /* how fast datagrams may leave (mpilossy_pace.h) */
    void **done;                   /* completed sends not yet reaped, a FIFO ring */
    size_t done_cap, done_head, done_count;
    int gso;                       /* UDP_SEGMENT accepted so far */
    int gro;                       /* UDP_GRO on: receives land in `landing` */
    mpl_sock_landing_t *landing;
    int held;                      /* polls since queued sends last left */
    size_t max_msg;                /* largest datagram that needs no IP fragments */
    char domain[IF_NAMESIZE];
    /* what it cost: system calls and datagrams */
    uint64_t send_calls, recv_calls, sent, received, send_errors;
    uint64_t largest_batch;        /* most datagrams one sendmmsg handed over */
    uint64_t recv_messages;        /* what recvmmsg returned (merged: several datagrams each) */
};

static int mpl_sock_fail(char *err, size_t errlen, const char *what)
{
    snprintf(err, errlen, "%s: %s", what, strerror(errno));
    return -1;
}

/* The IPv4 address of interface `name`; with no name, of the first interface
 * that is up and not loopback (loopback if there is no other). */
static int mpl_sock_interface(const char *name, struct in_addr *addr, char *chosen,
                              char *err, size_t errlen)
{
    struct ifaddrs *all, *i, *pick = NULL, *lo = NULL;
    if (getifaddrs(&all))
        return mpl_sock_fail(err, errlen, "getifaddrs");
    for (i = all; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP))
            continue;
        if (name && *name) {
            if (!strcmp(i->ifa_name, name)) { pick = i; break; }
        } else if (i->ifa_flags & IFF_LOOPBACK) {
            if (!lo) lo = i;
        } else if (!pick) {
            pick = i;
        }
    }
    if (!pick)
        pick = (name && *name) ? NULL : lo;
    if (!pick) {
        snprintf(err, errlen, "no IPv4 interface %s%s that is up", name && *name ? "named " : "",
                 name && *name ? name : "");
        freeifaddrs(all);
        return -1;
    }
    *addr = ((struct sockaddr_in *)pick->ifa_addr)->sin_addr;
    snprintf(chosen, IF_NAMESIZE, "%s", pick->ifa_name);
    freeifaddrs(all);
    return 0;
}

/* Segmentation and receive offload on (1) or off (0): UDP_SEGMENT where
 * the kernel accepts it (tried again on the next send), UDP_GRO where the
 * kernel has it and its landing buffers could be allocated (datagrams that
 * landed before it was turned off are still handed out).  Returns 1 when
 * receive offload is on afterwards. */
static int mpl_sock_set_offload(mpl_sock_t *s, int on)
{
    int flag = on ? 1 : 0;
    s->gso = flag;
    if (on && !s->landing)
        s->landing = calloc(1, sizeof(*s->landing));
    s->gro = 0;
    if (s->landing && !setsockopt(s->fd, IPPROTO_UDP, UDP_GRO, &flag, sizeof(flag)))
        s->gro = flag;
    if (!s->gro && s->landing && s->landing->next >= s->landing->count) {
        free(s->landing);
        s->landing = NULL;
    }
    return s->gro;
}

/* Open a socket on interface `domain` (NULL: see mpl_sock_interface), for
 * up to `nops` operations in flight. */
static int mpl_sock_open(mpl_sock_t **out, const char *domain, size_t nops,
                         char *err, size_t errlen)
{
    mpl_sock_t *s;
    struct ifreq ifr;
    socklen_t len = sizeof(struct sockaddr_in);
    *out = NULL;
    s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    s->fd = -1;
    s->rq_cap = s->sq_cap = s->done_cap = nops;
    s->rq = calloc(nops, sizeof(*s->rq));
    s->sq = calloc(nops, sizeof(*s->sq));
    s->done = calloc(nops, sizeof(*s->done));
    s->batch = calloc(1, sizeof(*s->batch));
    s->gso = 1;
    if (!s->rq || !s->sq || !s->done || !s->batch) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    s->self.sin_family = AF_INET;
    if (mpl_sock_interface(domain, &s->self.sin_addr, s->domain, err, errlen))
        goto fail;
    s->fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->fd < 0) {
        mpl_sock_fail(err, errlen, "socket");
        goto fail;
    }
    if (bind(s->fd, (struct sockaddr *)&s->self, sizeof(s->self))
            || getsockname(s->fd, (struct sockaddr *)&s->self, &len)) {
        mpl_sock_fail(err, errlen, "bind");
        goto fail;
    }
    /* One datagram, one packet: a lost IP fragment would lose the whole
     * datagram, so the largest is the interface's MTU less the IPv4 and
     * UDP headers. */
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, IF_NAMESIZE, "%s", s->domain);
    s->max_msg = 65507;
    if (ioctl(s->fd, SIOCGIFMTU, &ifr) == 0 && ifr.ifr_mtu > 28 && ifr.ifr_mtu - 28 < 65507)
        s->max_msg = (size_t)ifr.ifr_mtu - 28;
    mpl_sock_set_offload(s, 1);
    *out = s;
    return 0;
fail:
    if (s->fd >= 0)
        close(s->fd);
    free(s->rq);
    free(s->sq);
    free(s->done);
    free(s->batch);
    free(s);
    return -1;
}

static void mpl_sock_close(mpl_sock_t *s)
{
    if (!s)
        return;
    if (s->fd >= 0)
        close(s->fd);
    free(s->landing);
    free(s->peers);
    free(s->rq);
    free(s->sq);
    free(s->done);
    free(s->batch);
    free(s);
}

static int mpl_sock_getname(mpl_sock_t *s, void *addr, size_t *len, char *err, size_t errlen)
{
    if (*len < sizeof(s->self)) {
        snprintf(err, errlen, "address buffer too small");
        return -1;
    }
    memcpy(addr, &s->self, sizeof(s->self));
    *len = sizeof(s->self);
    return 0;
}

static int mpl_sock_insert(mpl_sock_t *s, const void *addrs, int n, char *err, size_t errlen)
{
    s->peers = calloc((size_t)n, sizeof(struct sockaddr_in));
    if (!s->peers) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    memcpy(s->peers, addrs, (size_t)n * sizeof(struct sockaddr_in));
    s->npeers = n;
    return 0;
}

/* Post a receive buffer.  0, or -EAGAIN when every slot is taken. */
static int mpl_sock_recv(mpl_sock_t *s, void *buf, size_t len, void *user)
{
    if (s->rq_count == s->rq_cap)
        return -EAGAIN;
    mpl_sock_post_t *p = &s->rq[(s->rq_head + s->rq_count) % s->rq_cap];
    p->buf = buf;
    p->len = len;
    p->user = user;
    s->rq_count++;
    return 0;
}

/* Paced, from `from` on (where the tokens ran out): the datagrams to peers
 * on this node, which cost nothing, move ahead of the ones that wait for
 * tokens, keeping their order (datagrams promise none across peers).
 * Returns the end of the run of free ones. */
static size_t mpl_sock_free_first(mpl_sock_t *s, size_t from)
{
    size_t k, at = from;
    for (k = from; k < s->sq_count; k++) {
        if (mpl_pace_cost(&s->pace, s->sq[k].peer, s->sq[k].len) != 0)
            continue;
        if (k != at) {
            mpl_sock_send_t q = s->sq[k];
            memmove(&s->sq[at + 1], &s->sq[at], (k - at) * sizeof(*s->sq));
            s->sq[at] = q;
        }
        at++;
    }
    return at;
}

/* Hand the queued sends to the kernel: as many as it takes now.  Returns
 * how many datagrams left, or -1 (errno set) when none could.  (No
 * recursion: where segmentation offload is refused it tries again once,
 * without it, in a loop.) */
static int mpl_sock_flush(mpl_sock_t *s)
{
    struct mmsghdr *msgs = s->batch->msgs;
    struct iovec *iov = s->batch->iov;
    size_t *first = s->batch->first, i, nv, left = 0, k, ready = s->sq_count;
    int m, sent, d;
    if (!s->sq_count)
        return 0;
    if (s->pace.rate > 0) {
        /* Paced: as many from the head of the queue as the tokens allow
         * (one clock read per flush, not per datagram). */
        mpl_pace_refill(&s->pace);
        for (ready = 0; ready < s->sq_count && mpl_pace_spend(&s->pace, s->sq[ready].peer, s->sq[ready].len); ready++)
            ;
        if (ready < s->sq_count)        /* (no datagram to this node waits for tokens) */
            ready = mpl_sock_free_first(s, ready);
        if (!ready) {
            errno = EAGAIN;
            return -1;
        }
    }
again:
    i = nv = 0;
    m = 0;
    /* Group: a run of datagrams to one peer, all of the run's first length
     * but the last (which may be shorter), is one segmented message. */
    while (i < ready && m < MPL_SOCK_BATCH) {
        const mpl_sock_send_t *q = &s->sq[i];
        size_t n = 1, bytes = q->len;
        if (s->gso)
            while (i + n < ready && n < MPL_SOCK_MAX_SEGS
                   && s->sq[i + n].peer == q->peer && s->sq[i + n].len <= q->len
                   && s->sq[i + n - 1].len == q->len && bytes + s->sq[i + n].len <= MPL_SOCK_MAX_GSO) {
                bytes += s->sq[i + n].len;
                n++;
            }
        memset(&msgs[m], 0, sizeof(msgs[m]));
        first[m] = i;
        for (k = 0; k < n; k++) {
            iov[nv + k].iov_base = (void *)s->sq[i + k].buf;
            iov[nv + k].iov_len = s->sq[i + k].len;
        }
        msgs[m].msg_hdr.msg_name = &s->peers[q->peer];
        msgs[m].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
        msgs[m].msg_hdr.msg_iov = &iov[nv];
        msgs[m].msg_hdr.msg_iovlen = n;
        if (n > 1) {
            struct cmsghdr *c;
            memset(s->batch->ctl[m].buf, 0, sizeof(s->batch->ctl[m].buf));
            msgs[m].msg_hdr.msg_control = s->batch->ctl[m].buf;
            msgs[m].msg_hdr.msg_controllen = sizeof(s->batch->ctl[m].buf);
            c = CMSG_FIRSTHDR(&msgs[m].msg_hdr);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            *(uint16_t *)(void *)CMSG_DATA(c) = (uint16_t)q->len;
        }
        nv += n;
        i += n;
        m++;
    }
    first[m] = i;
    sent = sendmmsg(s->fd, msgs, (unsigned)m, MSG_DONTWAIT);
    s->send_calls++;
    if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == EINTR) {
            if (s->pace.rate > 0)       /* nothing left: every token comes back */
                for (k = 0; k < ready; k++)
                    s->pace.tokens += mpl_pace_cost(&s->pace, s->sq[k].peer, s->sq[k].len);
            return -1;
        }
        if (s->gso && (errno == EIO || errno == EINVAL || errno == ENOPROTOOPT
                       || errno == EOPNOTSUPP) && first[1] - first[0] > 1) {
            s->gso = 0;            /* no segmentation offload here: one datagram per message */
            goto again;
        }
        /* Refused for good (an ICMP error reported late, a peer gone): the
         * first message is lost, as a datagram can be. */
        s->send_errors++;
        sent = 1;
    }
    for (d = 0; d < sent; d++)
        for (k = first[d]; k < first[d + 1]; k++) {
            s->done[(s->done_head + s->done_count) % s->done_cap] = s->sq[k].user;
            s->done_count++;
        }
    left = first[sent];
    if (s->pace.rate > 0)               /* the tokens of what did not leave come back */
        for (k = left; k < ready; k++)
            s->pace.tokens += mpl_pace_cost(&s->pace, s->sq[k].peer, s->sq[k].len);
    s->sent += left;
    if (left > s->largest_batch)
        s->largest_batch = left;
    memmove(s->sq, s->sq + left, (s->sq_count - left) * sizeof(*s->sq));
    s->sq_count -= left;
    return (int)left;
}

/* Flush until the queue is empty or the kernel takes nothing more. */
static void mpl_sock_flush_all(mpl_sock_t *s)
{
    s->held = 0;
    while (s->sq_count && mpl_sock_flush(s) > 0)
        ;
}

/* Queue a send of `len` bytes from `buf` to `peer`; it leaves at the next
 * flush (a full batch, or mpl_sock_poll).  0, or -EAGAIN when the queue is
 * full and the kernel takes nothing now. */
static int mpl_sock_send(mpl_sock_t *s, int peer, const void *buf, size_t len, void *user)
{
    if (s->sq_count == s->sq_cap && mpl_sock_flush(s) <= 0)
        return -EAGAIN;
    mpl_sock_send_t *q = &s->sq[s->sq_count++];
    q->peer = peer;
    q->buf = buf;
    q->len = len;
    q->user = user;
    if (s->sq_count >= MPL_SOCK_BATCH * 8)
        mpl_sock_flush(s);
    return 0;
}

/* Hand out landed datagrams into posted buffers, from events[total] on;
 * returns the new total.  A datagram larger than its buffer completes with
 * length 0, as a truncated receive does. */
static int mpl_sock_split(mpl_sock_t *s, mpl_fab_event_t *events, int total, int max)
{
    mpl_sock_landing_t *L = s->landing;
    while (L && L->next < L->count && total < max && s->rq_count) {
        int i = L->next;
        size_t n = L->len[i] - L->off;
        mpl_sock_post_t *p = &s->rq[s->rq_head];
        if (n > L->seg[i])
            n = L->seg[i];
        if (n && n <= p->len)
            memcpy(p->buf, L->data[i] + L->off, n);
        events[total].context = p->user;
        events[total].is_recv = 1;
        events[total].len = n <= p->len ? n : 0;
        s->rq_head = (s->rq_head + 1) % s->rq_cap;
        s->rq_count--;
        s->received++;
        total++;
        L->off += n;
        if (!n || L->off >= L->len[i]) {
            L->next++;
            L->off = 0;
        }
    }
    return total;
}

/* Receive up to `want` messages into the landing buffers (UDP_GRO): each
 * is one datagram or several of one size from one sender.  Returns how
 * many, or <= 0 when none were waiting. */
static int mpl_sock_land(mpl_sock_t *s, int want)
{
    mpl_sock_landing_t *L = s->landing;
    struct mmsghdr msgs[MPL_SOCK_LANDINGS];
    struct iovec iov[MPL_SOCK_LANDINGS];
    struct cmsghdr *c;
    int i, got;
    for (i = 0; i < want; i++) {
        iov[i].iov_base = L->data[i];
        iov[i].iov_len = MPL_SOCK_LANDING;
        memset(&msgs[i], 0, sizeof(msgs[i]));
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_control = L->ctl[i].buf;
        msgs[i].msg_hdr.msg_controllen = sizeof(L->ctl[i].buf);
    }
    got = recvmmsg(s->fd, msgs, (unsigned)want, MSG_DONTWAIT, NULL);
    s->recv_calls++;
    if (got <= 0)
        return got;
    for (i = 0; i < got; i++) {
        /* (cut: cannot happen below 64 KiB; handed out as one truncated datagram) */
        L->len[i] = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? 0 : msgs[i].msg_len;
        L->seg[i] = L->len[i];
        for (c = CMSG_FIRSTHDR(&msgs[i].msg_hdr); c; c = CMSG_NXTHDR(&msgs[i].msg_hdr, c))
            if (c->cmsg_level == IPPROTO_UDP && c->cmsg_type == UDP_GRO) {
                int seg;
                memcpy(&seg, CMSG_DATA(c), sizeof(seg));
                if (seg > 0 && (size_t)seg < L->len[i])
                    L->seg[i] = (size_t)seg;
            }
    }
    L->count = got;
    L->next = 0;
    L->off = 0;
    s->recv_messages += (uint64_t)got;
    return got;
}

/* Reap up to `max` completions: datagrams received, then sends the kernel
 * took.  The queued sends are flushed when nothing more arrived (the rank
 * waits), a batch is full, or they were held over MPL_SOCK_HOLD polls:
 * while datagrams pour in, sends gather into larger batches.  Returns how
 * many completions. */
static int mpl_sock_poll(mpl_sock_t *s, mpl_fab_event_t *events, int max)
{
    struct mmsghdr msgs[MPL_SOCK_BATCH];
    struct iovec iov[MPL_SOCK_BATCH];
    int total = 0, n, got, i, arrived = 0, more = 1;
    while (total < max && s->rq_count) {
        if (s->landing && s->landing->next < s->landing->count) {
            total = mpl_sock_split(s, events, total, max);
            continue;
        }
        if (!more)
            break;
        n = max - total;
        if ((size_t)n > s->rq_count) n = (int)s->rq_count;
        if (s->gro) {
            /* (a message holds at least one datagram: no more than needed) */
            if (n > MPL_SOCK_LANDINGS) n = MPL_SOCK_LANDINGS;
            got = mpl_sock_land(s, n);
            if (got <= 0)
                break;
            arrived += got;
            more = got == n;
            continue;
        }
        if (n > MPL_SOCK_BATCH) n = MPL_SOCK_BATCH;
        for (i = 0; i < n; i++) {
            mpl_sock_post_t *p = &s->rq[(s->rq_head + (size_t)i) % s->rq_cap];
            iov[i].iov_base = p->buf;
            iov[i].iov_len = p->len;
            memset(&msgs[i], 0, sizeof(msgs[i]));
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        got = recvmmsg(s->fd, msgs, (unsigned)n, MSG_DONTWAIT, NULL);
        s->recv_calls++;
        if (got <= 0)
            break;
        for (i = 0; i < got; i++) {
            mpl_sock_post_t *p = &s->rq[s->rq_head];
            events[total].context = p->user;
            events[total].is_recv = 1;
            events[total].len = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? 0 : msgs[i].msg_len;
            s->rq_head = (s->rq_head + 1) % s->rq_cap;
            s->rq_count--;
            total++;
        }
        s->received += (uint64_t)got;
        s->recv_messages += (uint64_t)got;
        arrived += got;
        more = got == n;
    }
    /* (held: a steady stream of arrivals, a flood of garbage included,
     * must not keep this rank's own datagrams from leaving) */
    if (s->sq_count && (!arrived || s->sq_count >= MPL_SOCK_BATCH || ++s->held >= MPL_SOCK_HOLD))
        mpl_sock_flush_all(s);
    while (total < max && s->done_count) {
        events[total].context = s->done[s->done_head];
        events[total].is_recv = 0;
        events[total].len = 0;
        s->done_head = (s->done_head + 1) % s->done_cap;
        s->done_count--;
        total++;
    }
    return total;
}

static size_t mpl_sock_max_msg(const mpl_sock_t *s) { return s->max_msg; }
static size_t mpl_sock_queued(const mpl_sock_t *s) { return s->sq_count; }

/* Give up the queued sends (paced ones that missed their call's end): they
 * complete unsent, counted as refused. */
static void mpl_sock_discard(mpl_sock_t *s)
{
    size_t k;
    for (k = 0; k < s->sq_count; k++) {
        s->done[(s->done_head + s->done_count) % s->done_cap] = s->sq[k].user;
        s->done_count++;
    }
    s->send_errors += s->sq_count;
    s->sq_count = 0;
}
static mpl_pace_t *mpl_sock_pace(mpl_sock_t *s) { return &s->pace; }
static const char *mpl_sock_domain_name(const mpl_sock_t *s) { return s->domain; }

/* Send and receive system calls, datagrams sent and received, sends
 * refused, the largest batch one send call carried, messages received
 * (fewer than datagrams where the kernel merged them), and whether
 * receive offload is on. */
static void mpl_sock_costs(const mpl_sock_t *s, uint64_t out[MPL_DG_COSTS])
{
    out[0] = s->send_calls;
    out[1] = s->recv_calls;
    out[2] = s->sent;
    out[3] = s->received;
    out[4] = s->send_errors;
    out[5] = s->largest_batch;
    out[6] = s->recv_messages;
    out[7] = (uint64_t)s->gro;
}

#else  /* not Linux: no sendmmsg/recvmmsg */

struct mpl_sock { int unused; };
static int mpl_sock_open(mpl_sock_t **out, const char *d, size_t n, char *err, size_t errlen)
{ (void)d; (void)n; *out = NULL; snprintf(err, errlen, "the native datagram transport needs Linux"); return -1; }
static void mpl_sock_close(mpl_sock_t *s) { (void)s; }
static int mpl_sock_getname(mpl_sock_t *s, void *a, size_t *l, char *e, size_t el) { (void)s; (void)a; (void)l; (void)e; (void)el; return -1; }
static int mpl_sock_insert(mpl_sock_t *s, const void *a, int n, char *e, size_t el) { (void)s; (void)a; (void)n; (void)e; (void)el; return -1; }
static int mpl_sock_recv(mpl_sock_t *s, void *b, size_t l, void *u) { (void)s; (void)b; (void)l; (void)u; return -1; }
static int mpl_sock_send(mpl_sock_t *s, int p, const void *b, size_t l, void *u) { (void)s; (void)p; (void)b; (void)l; (void)u; return -1; }
static int mpl_sock_poll(mpl_sock_t *s, mpl_fab_event_t *e, int m) { (void)s; (void)e; (void)m; return -1; }
static size_t mpl_sock_max_msg(const mpl_sock_t *s) { (void)s; return 0; }
static size_t mpl_sock_queued(const mpl_sock_t *s) { (void)s; return 0; }
static void mpl_sock_discard(mpl_sock_t *s) { (void)s; }
static mpl_pace_t *mpl_sock_pace(mpl_sock_t *s) { static mpl_pace_t none; (void)s; return &none; }
static const char *mpl_sock_domain_name(const mpl_sock_t *s) { (void)s; return ""; }
static void mpl_sock_costs(const mpl_sock_t *s, uint64_t out[MPL_DG_COSTS]) { (void)s; memset(out, 0, MPL_DG_COSTS * sizeof(uint64_t)); }
static void mpl_sock_flush_all(mpl_sock_t *s) { (void)s; }
static int mpl_sock_set_offload(mpl_sock_t *s, int on) { (void)s; (void)on; return 0; }

#endif
#endif /* MPILOSSY_SOCKETS_H */
