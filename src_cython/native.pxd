# Declarations of mpilossy_native.h (see there for what each piece is for).
from libc.stdint cimport uint16_t, uint32_t, uint64_t, int32_t

cdef extern from "mpilossy_native.h" nogil:
    double mpl_now()
    void mpl_sleep(double seconds)
    void mpl_yield()
    void mpl_unimplemented(const char* what)

    uint64_t mpl_load_acquire(const uint64_t *p)
    uint64_t mpl_load_relaxed(const uint64_t *p)
    void mpl_store_release(uint64_t *p, uint64_t v)
    void mpl_store_relaxed(uint64_t *p, uint64_t v)
    void mpl_fence_acquire()
    void mpl_fence_release()

    uint64_t mpl_mix64(uint64_t x)
    uint64_t mpl_hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
    double mpl_unit(uint64_t h)

    float mpl_h2f(uint16_t h)
    uint16_t mpl_f2h(float f)

    enum: MPL_CACHELINE
    enum: MPL_MSG_LEN
    enum: MPL_STATUS_BYTES
    enum: MPL_RECORD_BYTES

    ctypedef struct mpl_status_t:
        uint64_t seq
        uint64_t sig
        uint64_t count
        uint32_t dtype, op, algo, block
        uint64_t grow
        uint64_t err_seq
        int32_t err_kind, err_rank
        char err_msg[MPL_MSG_LEN]
        uint64_t prev_seq, prev_sig, prev_count
        uint32_t prev_dtype, prev_op, prev_algo, prev_pad
        uint64_t prev_check

    ctypedef struct mpl_record_t:
        uint64_t seq
        uint64_t check
        uint32_t count
        uint32_t nbytes

    uint64_t mpl_record_check(uint64_t seq, uint64_t sig, uint64_t slot, uint64_t block)

    enum: MPL_PKT_MAGIC
    enum: MPL_PKT_VERSION
    enum: MPL_PKT_DATA
    enum: MPL_PKT_HELLO
    enum: MPL_PKT_ERROR
    enum: MPL_PKT_NACK
    enum: MPL_PKT_END

    ctypedef struct mpl_packet_t:
        uint32_t magic
        uint16_t version, kind
        uint64_t token
        uint64_t seq
        uint32_t src
        uint32_t slot
        uint32_t block
        uint32_t count
        uint32_t nbytes
        uint32_t sig
        unsigned char mac[16]

    enum: MPL_PKT_HEADER_BYTES
    enum: MPL_PKT_MAC_OFFSET

    ctypedef struct mpl_hello_t:
        uint64_t sig, count
        uint32_t dtype, op, algo, block

    ctypedef struct mpl_error_t:
        int32_t kind, rank
        char msg[MPL_MSG_LEN]



cdef extern from "channels/mpilossy_mac.h" nogil:
    enum: MPL_HAVE_MAC
    enum: MPL_MAC_KEY_BYTES
    enum: MPL_MAC_TAG_BYTES
    ctypedef struct mpl_mac_t:
        pass
    int mpl_mac_open(mpl_mac_t *m, const unsigned char *key, char *err, size_t errlen)
    void mpl_mac_close(mpl_mac_t *m)
    int mpl_mac_tag(mpl_mac_t *m, const void *head, size_t nhead, const void *body,
                    size_t nbody, unsigned char *tag)
    int mpl_mac_equal(const unsigned char *a, const unsigned char *b)


cdef extern from "channels/mpilossy_transport.h" nogil:
    ctypedef struct mpl_dg_t:
        pass
    ctypedef struct mpl_fab_event_t:
        void *context
        size_t len
        int is_recv
    enum: MPL_FAB_EAGAIN
    enum: MPL_HAVE_LIBFABRIC
    int mpl_fab_list(char *out, size_t outlen, char *err, size_t errlen)
    int mpl_dg_is_native(const char *provider)
    int mpl_dg_open(mpl_dg_t **out, const char *provider, const char *domain,
                    size_t nops, size_t cq_size, char *err, size_t errlen)
    int mpl_dg_register(mpl_dg_t *d, void *buf, size_t len, void **mr, void **desc,
                        char *err, size_t errlen)
    void mpl_dg_deregister(void *mr)
    int mpl_dg_getname(mpl_dg_t *d, void *addr, size_t *len, char *err, size_t errlen)
    int mpl_dg_insert(mpl_dg_t *d, const void *addrs, int n, char *err, size_t errlen)
    int mpl_dg_recv(mpl_dg_t *d, void *buf, size_t len, void *desc, size_t slot, void *user)
    int mpl_dg_send(mpl_dg_t *d, int peer, const void *buf, size_t len, void *desc,
                    size_t slot, void *user)
    int mpl_dg_poll(mpl_dg_t *d, mpl_fab_event_t *events, int maxn)
    void mpl_dg_flush(mpl_dg_t *d)
    void mpl_dg_set_rate(mpl_dg_t *d, double rate, double burst)
    void mpl_dg_set_local(mpl_dg_t *d, const unsigned char *local, size_t npeers)
    int mpl_dg_set_offload(mpl_dg_t *d, int on)
    size_t mpl_dg_queued(const mpl_dg_t *d)
    void mpl_dg_discard_queued(mpl_dg_t *d)
    const char *mpl_dg_strerror(const mpl_dg_t *d, int rc)
    const char *mpl_dg_provider(const mpl_dg_t *d)
    const char *mpl_dg_domain_name(const mpl_dg_t *d)
    size_t mpl_dg_prefix(const mpl_dg_t *d)
    size_t mpl_dg_max_msg(const mpl_dg_t *d)
    void mpl_dg_costs(const mpl_dg_t *d, uint64_t out[8])
    void mpl_dg_close(mpl_dg_t *d)
    int mpl_udp_tune(const void *addr, size_t addrlen, int nbytes)
    long mpl_udp_drops(const void *addr, size_t addrlen)


cdef extern from "codecs/mpilossy_simd.h" nogil:
    size_t mpl_f16_mixed(int op, void *dst, const void *a, const void *b, float s, size_t n)
    size_t mpl_f16_fast(int op, uint16_t *dst, const uint16_t *a, const uint16_t *b,
                        float s, size_t n)
    int mpl_stream_f32(int op, float *dst, const float *a, const float *b, float s, size_t n)
    int mpl_stream_f64(int op, double *dst, const double *a, const double *b, double s, size_t n)


cdef extern from "codecs/mpilossy_bf16.h" nogil:
    void mpl_bf16_data(int op, uint16_t *dst, const uint16_t *a, const uint16_t *b, float s,
                       size_t n)
    void mpl_bf16_mixed(int op, void *dst, const void *a, const void *b, float s, size_t n)


cdef extern from "codecs/mpilossy_quant.h" nogil:
    size_t mpl_q_bytes(size_t n, size_t group, int bits)
    void mpl_quantize(unsigned char *dst, const float *src, float s, size_t n, size_t group,
                      int bits, uint32_t seed)
    void mpl_quantize_portable(unsigned char *dst, const float *src, float s, size_t n,
                               size_t group, int bits, uint32_t seed)
    void mpl_dequantize(float *dst, const float *acc, const unsigned char *src, float s,
                        size_t n, size_t group, int bits)


cdef extern from "codecs/mpilossy_fec.h" nogil:
    enum: MPL_HAVE_ISAL
    enum: MPL_FEC_MAX_K
    enum: MPL_FEC_MAX_M
    ctypedef struct mpl_fec_t:
        int k
        int m
    const char* mpl_fec_check(int k, int m)
    int mpl_fec_init(mpl_fec_t *c, int k, int m)
    void mpl_fec_encode(const mpl_fec_t *c, unsigned char *const *data,
                        unsigned char **parity, size_t len, int kk)
    int mpl_fec_decode(const mpl_fec_t *c, unsigned char **blocks,
                       const unsigned char *present, size_t len, int kk)
