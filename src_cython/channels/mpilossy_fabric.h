/* libfabric datagram endpoints (FI_EP_DGRAM) behind a handful of functions.
 *
 * The library is not linked: it is opened at run time with dlopen, reusing
 * the copy that the MPI library already loaded when there is one (two
 * libfabric copies in one process share the soname and fight).  Most libfabric
 * calls are inline functions that go through the objects' operation tables;
 * only fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric and fi_strerror are
 * real symbols, looked up with dlsym.  Built without the headers
 * (MPILOSSY_HAVE_LIBFABRIC undefined), every entry point fails with a message
 * that says what is missing. */
#ifndef MPILOSSY_FABRIC_H
#define MPILOSSY_FABRIC_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <errno.h>

#include "mpilossy_udp.h"         /* mpl_fab_event_t; the udp provider's socket */

typedef struct mpl_fab mpl_fab_t;

#ifdef MPILOSSY_HAVE_LIBFABRIC

#include <dlfcn.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>

#define MPL_FI_VERSION FI_VERSION(1, 5)

static struct {
    int loaded;
    int (*getinfo)(uint32_t, const char *, const char *, uint64_t,
                   const struct fi_info *, struct fi_info **);
    void (*freeinfo)(struct fi_info *);
    struct fi_info *(*dupinfo)(const struct fi_info *);
    int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*strerror)(int);
} mpl_fi;

/* Operations carry a struct fi_context as their first member when the
 * provider asks for FI_CONTEXT; the caller's context follows it. */
typedef struct {
    struct fi_context fi;
    void *user;
    int is_recv;
} mpl_fab_ctx_t;

struct mpl_fab {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    fi_addr_t *peers;
    int npeers;
    size_t prefix;        /* bytes the provider reserves before each message */
    size_t max_msg;
    int need_mr;          /* FI_MR_LOCAL: buffers must be registered */
    mpl_fab_ctx_t *ctx;   /* one per posted operation slot */
    size_t nctx;
};

static int mpl_fab_err(char *err, size_t errlen, const char *what, int rc)
{
    snprintf(err, errlen, "%s: %s", what,
             mpl_fi.strerror ? mpl_fi.strerror(rc < 0 ? -rc : rc) : "unknown error");
    return -1;
}

static int mpl_fab_load(char *err, size_t errlen)
{
    if (mpl_fi.loaded)
        return 0;
    void *lib = dlopen("libfabric.so.1", RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL);
    if (!lib)
        lib = dlopen("libfabric.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        snprintf(err, errlen, "cannot load libfabric.so.1 (%s); the mpich wheel ships one, "
                 "or install libfabric1", dlerror());
        return -1;
    }
    *(void **)&mpl_fi.getinfo = dlsym(lib, "fi_getinfo");
    *(void **)&mpl_fi.freeinfo = dlsym(lib, "fi_freeinfo");
    *(void **)&mpl_fi.dupinfo = dlsym(lib, "fi_dupinfo");
    *(void **)&mpl_fi.fabric = dlsym(lib, "fi_fabric");
    *(void **)&mpl_fi.strerror = dlsym(lib, "fi_strerror");
    if (!mpl_fi.getinfo || !mpl_fi.freeinfo || !mpl_fi.dupinfo || !mpl_fi.fabric || !mpl_fi.strerror) {
        snprintf(err, errlen, "libfabric.so.1 lacks fi_getinfo/fi_fabric");
        return -1;
    }
    mpl_fi.loaded = 1;
    return 0;
}

static const char *mpl_fab_provider(const mpl_fab_t *f) { return f->info->fabric_attr->prov_name; }
static const char *mpl_fab_domain_name(const mpl_fab_t *f) { return f->info->domain_attr->name; }
static size_t mpl_fab_prefix(const mpl_fab_t *f) { return f->prefix; }
static size_t mpl_fab_max_msg(const mpl_fab_t *f) { return f->max_msg; }

/* What mpilossy asks of a provider: datagrams, messages, and it copes with
 * FI_CONTEXT, FI_MSG_PREFIX and local memory registration. */
static struct fi_info *mpl_fab_hints(const char *provider, const char *domain)
{
    struct fi_info *hints = mpl_fi.dupinfo(NULL);
    hints->ep_attr->type = FI_EP_DGRAM;
    hints->caps = FI_MSG;
    hints->mode = FI_CONTEXT | FI_MSG_PREFIX;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    if (provider && *provider)
        hints->fabric_attr->prov_name = strdup(provider);
    if (domain && *domain)
        hints->domain_attr->name = strdup(domain);
    return hints;
}

/* List the datagram providers (for channel="auto" and error messages):
 * writes "prov/domain" names separated by spaces. */
static int mpl_fab_list(char *out, size_t outlen, char *err, size_t errlen)
{
    struct fi_info *hints, *info = NULL, *cur;
    int rc;
    out[0] = 0;
    if (mpl_fab_load(err, errlen))
        return -1;
    hints = mpl_fab_hints(NULL, NULL);
    rc = mpl_fi.getinfo(MPL_FI_VERSION, NULL, NULL, 0, hints, &info);
    mpl_fi.freeinfo(hints);
    if (rc)
        return rc == -FI_ENODATA ? 0 : mpl_fab_err(err, errlen, "fi_getinfo", rc);
    for (cur = info; cur; cur = cur->next) {
        size_t used = strlen(out);
        snprintf(out + used, outlen - used, "%s%s/%s", used ? " " : "",
                 cur->fabric_attr->prov_name, cur->domain_attr->name);
    }
    mpl_fi.freeinfo(info);
    return 0;
}

/* Open an endpoint.  `provider`/`domain` may be NULL (first match; the
 * FI_PROVIDER variable is honoured by fi_getinfo itself).  `nctx` is how
 * many operations may be in flight at once. */
static int mpl_fab_open(mpl_fab_t **out, const char *provider, const char *domain,
                        size_t nctx, size_t cq_size, char *err, size_t errlen)
{
    struct fi_info *hints, *info = NULL;
    struct fi_av_attr av_attr;
    struct fi_cq_attr cq_attr;
    mpl_fab_t *f;
    int rc;
    *out = NULL;
    if (mpl_fab_load(err, errlen))
        return -1;
    hints = mpl_fab_hints(provider, domain);
    rc = mpl_fi.getinfo(MPL_FI_VERSION, NULL, NULL, 0, hints, &info);
    mpl_fi.freeinfo(hints);
    if (rc == -FI_ENODATA || (!rc && !info)) {
        snprintf(err, errlen, "no libfabric datagram provider%s%s%s%s",
                 provider && *provider ? " " : "", provider ? provider : "",
                 domain && *domain ? " on domain " : "", domain ? domain : "");
        return -1;
    }
    if (rc)
        return mpl_fab_err(err, errlen, "fi_getinfo", rc);
    f = calloc(1, sizeof(*f));
    f->info = info;
    f->prefix = (info->mode & FI_MSG_PREFIX) ? info->ep_attr->msg_prefix_size : 0;
    f->max_msg = info->ep_attr->max_msg_size;
    f->need_mr = (info->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
    f->nctx = nctx;
    f->ctx = calloc(nctx, sizeof(mpl_fab_ctx_t));
    if ((rc = mpl_fi.fabric(info->fabric_attr, &f->fabric, NULL)))
        goto fail_fabric;
    if ((rc = fi_domain(f->fabric, info, &f->domain, NULL)))
        goto fail_domain;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    if ((rc = fi_av_open(f->domain, &av_attr, &f->av, NULL)))
        goto fail_av;
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_MSG;
    cq_attr.size = cq_size;
    if ((rc = fi_cq_open(f->domain, &cq_attr, &f->cq, NULL)))
        goto fail_cq;
    if ((rc = fi_endpoint(f->domain, info, &f->ep, NULL)))
        goto fail_ep;
    if ((rc = fi_ep_bind(f->ep, &f->av->fid, 0)) ||
        (rc = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV)) ||
        (rc = fi_enable(f->ep)))
        goto fail_enable;
    *out = f;
    return 0;
fail_enable: mpl_fab_err(err, errlen, "fi_enable", rc); fi_close(&f->ep->fid); goto undo_cq;
fail_ep: mpl_fab_err(err, errlen, "fi_endpoint", rc);
undo_cq: fi_close(&f->cq->fid); goto undo_av;
fail_cq: mpl_fab_err(err, errlen, "fi_cq_open", rc);
undo_av: fi_close(&f->av->fid); goto undo_domain;
fail_av: mpl_fab_err(err, errlen, "fi_av_open", rc);
undo_domain: fi_close(&f->domain->fid); goto undo_fabric;
fail_domain: mpl_fab_err(err, errlen, "fi_domain", rc);
undo_fabric: fi_close(&f->fabric->fid); goto undo_info;
fail_fabric: mpl_fab_err(err, errlen, "fi_fabric", rc);
undo_info:
    mpl_fi.freeinfo(info);
    free(f->ctx);
    free(f);
    return -1;
}

/* Register a buffer that messages are sent from or received into, for
 * FI_MR_LOCAL providers (verbs); a no-op elsewhere.  `*mr` and `*desc` stay
 * NULL when nothing was registered. */
static int mpl_fab_register(mpl_fab_t *f, void *buf, size_t len, void **mr, void **desc,
                            char *err, size_t errlen)
{
    struct fid_mr *m;
    int rc;
    *mr = NULL;
    *desc = NULL;
    if (!f->need_mr)
        return 0;
    rc = fi_mr_reg(f->domain, buf, len, FI_SEND | FI_RECV, 0, 0, 0, &m, NULL);
    if (rc)
        return mpl_fab_err(err, errlen, "fi_mr_reg", rc);
    *mr = m;
    *desc = fi_mr_desc(m);
    return 0;
}

static void mpl_fab_deregister(void *mr)
{
    if (mr)
        fi_close(&((struct fid_mr *)mr)->fid);
}

static int mpl_fab_getname(mpl_fab_t *f, void *addr, size_t *len, char *err, size_t errlen)
{
    int rc = fi_getname(&f->ep->fid, addr, len);
    return rc ? mpl_fab_err(err, errlen, "fi_getname", rc) : 0;
}

static int mpl_fab_insert(mpl_fab_t *f, const void *addrs, int n, char *err, size_t errlen)
{
    f->peers = calloc((size_t)n, sizeof(fi_addr_t));
    f->npeers = n;
    int rc = fi_av_insert(f->av, addrs, (size_t)n, f->peers, 0, NULL);
    if (rc != n)
        return mpl_fab_err(err, errlen, "fi_av_insert", rc < 0 ? rc : -FI_EINVAL);
    return 0;
}

/* Post a receive into `buf` (`len` bytes, prefix included) using context
 * slot `slot`.  0, -FI_EAGAIN (queue full), or another negative error. */
static int mpl_fab_recv(mpl_fab_t *f, void *buf, size_t len, void *desc, size_t slot, void *user)
{
    mpl_fab_ctx_t *c = &f->ctx[slot];
    c->user = user;
    c->is_recv = 1;
    return (int)fi_recv(f->ep, buf, len, desc, FI_ADDR_UNSPEC, &c->fi);
}

static int mpl_fab_send(mpl_fab_t *f, int peer, const void *buf, size_t len, void *desc,
                        size_t slot, void *user)
{
    mpl_fab_ctx_t *c = &f->ctx[slot];
    c->user = user;
    c->is_recv = 0;
    return (int)fi_send(f->ep, buf, len, desc, f->peers[peer], &c->fi);
}

/* Reap up to `max` completions.  Returns how many, or a negative error. */
static int mpl_fab_poll(mpl_fab_t *f, mpl_fab_event_t *events, int max)
{
    struct fi_cq_msg_entry entries[64];
    struct fi_cq_err_entry e;
    int i, got, total = 0;
    while (total < max) {
        got = (int)fi_cq_read(f->cq, entries, (size_t)(max - total < 64 ? max - total : 64));
        if (got == -FI_EAGAIN)
            break;
        if (got == -FI_EAVAIL) {
            /* A failed operation (e.g. a truncated receive): report it with
             * length 0 so that its buffer is reposted and the packet ignored. */
            memset(&e, 0, sizeof(e));
            if (fi_cq_readerr(f->cq, &e, 0) < 1)
                break;
            mpl_fab_ctx_t *c = (mpl_fab_ctx_t *)e.op_context;
            events[total].context = c ? c->user : NULL;
            events[total].is_recv = c ? c->is_recv : 0;
            events[total].len = 0;
            total++;
            continue;
        }
        if (got < 0)
            return got;
        for (i = 0; i < got; i++) {
            mpl_fab_ctx_t *c = (mpl_fab_ctx_t *)entries[i].op_context;
            events[total].context = c->user;
            events[total].is_recv = c->is_recv;
            events[total].len = entries[i].len;
            total++;
        }
    }
    return total;
}

static const char *mpl_fab_strerror(int rc) { return mpl_fi.strerror ? mpl_fi.strerror(rc < 0 ? -rc : rc) : "?"; }

static void mpl_fab_close(mpl_fab_t *f)
{
    if (!f)
        return;
    if (f->ep) fi_close(&f->ep->fid);
    if (f->cq) fi_close(&f->cq->fid);
    if (f->av) fi_close(&f->av->fid);
    if (f->domain) fi_close(&f->domain->fid);
    if (f->fabric) fi_close(&f->fabric->fid);
    if (f->info) mpl_fi.freeinfo(f->info);
    free(f->peers);
    free(f->ctx);
    free(f);
}

#define MPL_FAB_EAGAIN (-FI_EAGAIN)
#define MPL_HAVE_LIBFABRIC 1


#else  /* built without libfabric headers */

#define MPL_FAB_MISSING "mpilossy was built without libfabric headers (install libfabric-dev, or your site's libfabric, and rebuild)"
struct mpl_fab { int unused; };
static int mpl_fab_list(char *out, size_t outlen, char *err, size_t errlen)
{ (void)outlen; out[0] = 0; snprintf(err, errlen, MPL_FAB_MISSING); return -1; }
static int mpl_fab_open(mpl_fab_t **out, const char *p, const char *d, size_t n, size_t q, char *err, size_t errlen)
{ (void)p; (void)d; (void)n; (void)q; *out = NULL; snprintf(err, errlen, MPL_FAB_MISSING); return -1; }
static int mpl_fab_register(mpl_fab_t *f, void *b, size_t l, void **m, void **d, char *e, size_t el) { (void)f; (void)b; (void)l; (void)e; (void)el; *m = *d = NULL; return -1; }
static void mpl_fab_deregister(void *mr) { (void)mr; }
static int mpl_fab_getname(mpl_fab_t *f, void *a, size_t *l, char *e, size_t el) { (void)f; (void)a; (void)l; (void)e; (void)el; return -1; }
static int mpl_fab_insert(mpl_fab_t *f, const void *a, int n, char *e, size_t el) { (void)f; (void)a; (void)n; (void)e; (void)el; return -1; }
static int mpl_fab_recv(mpl_fab_t *f, void *b, size_t l, void *d, size_t s, void *u) { (void)f; (void)b; (void)l; (void)d; (void)s; (void)u; return -1; }
static int mpl_fab_send(mpl_fab_t *f, int p, const void *b, size_t l, void *d, size_t s, void *u) { (void)f; (void)p; (void)b; (void)l; (void)d; (void)s; (void)u; return -1; }
static int mpl_fab_poll(mpl_fab_t *f, mpl_fab_event_t *e, int m) { (void)f; (void)e; (void)m; return -1; }
static const char *mpl_fab_strerror(int rc) { (void)rc; return MPL_FAB_MISSING; }
static const char *mpl_fab_provider(const mpl_fab_t *f) { (void)f; return ""; }
static const char *mpl_fab_domain_name(const mpl_fab_t *f) { (void)f; return ""; }
static size_t mpl_fab_prefix(const mpl_fab_t *f) { (void)f; return 0; }
static size_t mpl_fab_max_msg(const mpl_fab_t *f) { (void)f; return 0; }
static void mpl_fab_close(mpl_fab_t *f) { (void)f; }
#define MPL_FAB_EAGAIN (-EAGAIN)
#define MPL_HAVE_LIBFABRIC 0

#endif
#endif /* MPILOSSY_FABRIC_H */
