/* Datagram authentication: SipHash-2-4 with a 128-bit tag, from OpenSSL's
 * libcrypto (EVP_MAC "SIPHASH", OpenSSL >= 3.0), keyed with a secret that the
 * ranks of a communicator agree on over MPI and that never travels in a
 * datagram.  A datagram is accepted only if its tag, over the header up to
 * the tag and the payload, is right: without the key nobody can make one.
 *
 * Built without OpenSSL (MPILOSSY_HAVE_OPENSSL undefined), opening a MAC
 * fails with a message that says what is missing, and channel='ud' with it. */
#ifndef MPILOSSY_MAC_H
#define MPILOSSY_MAC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>

#define MPL_MAC_KEY_BYTES 16
#define MPL_MAC_TAG_BYTES 16

#ifdef MPILOSSY_HAVE_OPENSSL

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#define MPL_HAVE_MAC 1

typedef struct {
    EVP_MAC *mac;
    EVP_MAC_CTX *ctx;
    unsigned char key[MPL_MAC_KEY_BYTES];
} mpl_mac_t;

static inline void mpl_mac_close(mpl_mac_t *m)
{
    EVP_MAC_CTX_free(m->ctx);
    EVP_MAC_free(m->mac);
    m->ctx = NULL;
    m->mac = NULL;
    OPENSSL_cleanse(m->key, MPL_MAC_KEY_BYTES);
}

static inline int mpl_mac_open(mpl_mac_t *m, const unsigned char *key, char *err, size_t errlen)
{
    size_t tag = MPL_MAC_TAG_BYTES;
    OSSL_PARAM params[2];
    params[0] = OSSL_PARAM_construct_size_t("size", &tag);
    params[1] = OSSL_PARAM_construct_end();
    m->ctx = NULL;
    memcpy(m->key, key, MPL_MAC_KEY_BYTES);
    m->mac = EVP_MAC_fetch(NULL, "SIPHASH", NULL);
    if (m->mac) m->ctx = EVP_MAC_CTX_new(m->mac);
    if (!m->ctx || !EVP_MAC_init(m->ctx, key, MPL_MAC_KEY_BYTES, params)) {
        unsigned long code = ERR_get_error();
        const char *why = code ? ERR_reason_error_string(code) : NULL;
        snprintf(err, errlen, "OpenSSL's SipHash is unavailable: %s", why ? why : "no such MAC");
        ERR_clear_error();
        mpl_mac_close(m);
        return -1;
    }
    return 0;
}

/* Tag of (head[0:nhead], body[0:nbody]).  0 on success. */
static inline int mpl_mac_tag(mpl_mac_t *m, const void *head, size_t nhead, const void *body,
                              size_t nbody, unsigned char *tag)
{
    size_t len = 0;
    /* Fresh state from the key each time: re-initialising without the key
     * is a no-op on OpenSSL 3.0.0-3.0.2, which would chain the datagrams. */
    if (!EVP_MAC_init(m->ctx, m->key, MPL_MAC_KEY_BYTES, NULL)) return -1;
    if (!EVP_MAC_update(m->ctx, (const unsigned char *)head, nhead)) return -1;
    if (nbody && !EVP_MAC_update(m->ctx, (const unsigned char *)body, nbody)) return -1;
    if (!EVP_MAC_final(m->ctx, tag, &len, MPL_MAC_TAG_BYTES) || len != MPL_MAC_TAG_BYTES) return -1;
    return 0;
}

/* Constant time: how long a comparison takes says nothing about the tag. */
static inline int mpl_mac_equal(const unsigned char *a, const unsigned char *b)
{
    return CRYPTO_memcmp(a, b, MPL_MAC_TAG_BYTES) == 0;
}

#else  /* no OpenSSL */

#define MPL_HAVE_MAC 0

typedef struct { void *unused; } mpl_mac_t;

static inline void mpl_mac_close(mpl_mac_t *m) { (void)m; }

static inline int mpl_mac_open(mpl_mac_t *m, const unsigned char *key, char *err, size_t errlen)
{
    (void)m; (void)key;
    snprintf(err, errlen, "mpilossy was built without OpenSSL's libcrypto (>= 3.0), which "
             "authenticates datagrams: install libssl-dev (or openssl-devel) and rebuild");
    return -1;
}

static inline int mpl_mac_tag(mpl_mac_t *m, const void *head, size_t nhead, const void *body,
                              size_t nbody, unsigned char *tag)
{
    (void)m; (void)head; (void)nhead; (void)body; (void)nbody;
    memset(tag, 0, MPL_MAC_TAG_BYTES);
    return -1;
}

static inline int mpl_mac_equal(const unsigned char *a, const unsigned char *b)
{
    (void)a; (void)b;
    return 0;
}

#endif
#endif /* MPILOSSY_MAC_H */
