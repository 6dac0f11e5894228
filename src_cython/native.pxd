# Declarations of mpilossy_native.h (see there for what each piece is for).
from libc.stdint cimport uint16_t, uint32_t, uint64_t, int32_t

cdef extern from "mpilossy_native.h" nogil:
    double mpl_now()
    void mpl_sleep(double seconds)
    void mpl_yield()

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

    ctypedef struct mpl_status_t:
        uint64_t seq
        uint64_t sig
        uint64_t count
        uint32_t dtype, op, algo, block
        uint64_t grow
        uint64_t err_seq
        int32_t err_kind, err_rank
        char err_msg[MPL_MSG_LEN]

    ctypedef struct mpl_record_t:
        uint64_t seq
        uint64_t check
        uint32_t count
        uint32_t nbytes

    uint64_t mpl_record_check(uint64_t seq, uint64_t sig, uint64_t slot, uint64_t block)
