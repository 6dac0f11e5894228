# The datagram channel's wire format: what one datagram is, and when one is
# believed.  A datagram is a 64-byte header (mpl_packet_t, mpilossy_native.h)
# and a payload: a record (DATA), a call's signature (HELLO), an error
# (ERROR), a list of missing blocks (NACK) or nothing (END).  Every datagram
# carries a MAC (SipHash-2-4, 128-bit tag, mpilossy_mac.h) over its header
# and payload, keyed with a secret that rank 0 draws from the OS at
# construction and broadcasts over MPI: a datagram nobody with the key made
# is dropped and counted as `forged`, before anything in it is believed.

cdef enum:
    HEADER_BYTES = 64              # sizeof(mpl_packet_t)
    MIN_PAYLOAD = 384              # >= sizeof(mpl_error_t), rounded to 64: errors must fit


cdef enum:
    PACKET_OK = 0
    PACKET_FOREIGN = 1
    PACKET_TRUNCATED = 2
    PACKET_MALFORMED = 3
    PACKET_FORGED = 4


cdef int check_packet(const char* data, Py_ssize_t length, uint64_t token, int size, int me,
                      Py_ssize_t payload_max, mpl_mac_t* mac, mpl_packet_t* hdr) noexcept nogil:
    """Is this an authentic, well-formed datagram of this communicator from a
    peer?  Copies the header out once (the buffer may be unaligned); every
    later decision uses the copy."""
    cdef unsigned char tag[MPL_MAC_TAG_BYTES]
    cdef uint32_t n
    if length < HEADER_BYTES:
        return PACKET_TRUNCATED
    memcpy(hdr, data, sizeof(mpl_packet_t))
    if hdr.magic != MPL_PKT_MAGIC or hdr.version != MPL_PKT_VERSION or hdr.token != token:
        return PACKET_FOREIGN
    if hdr.src >= <uint32_t>size or hdr.src == <uint32_t>me or hdr.kind < MPL_PKT_DATA \
            or hdr.kind > MPL_PKT_END:
        return PACKET_FOREIGN
    if <Py_ssize_t>hdr.nbytes != length - HEADER_BYTES:
        return PACKET_TRUNCATED
    n = hdr.nbytes
    if n > <uint64_t>payload_max \
            or (hdr.kind == MPL_PKT_HELLO and n != sizeof(mpl_hello_t)) \
            or (hdr.kind == MPL_PKT_ERROR and n != sizeof(mpl_error_t)) \
            or (hdr.kind == MPL_PKT_NACK and n % 4) \
            or (hdr.kind == MPL_PKT_END and n):
        return PACKET_MALFORMED
    if mpl_mac_tag(mac, data, MPL_PKT_MAC_OFFSET, data + HEADER_BYTES, n, tag) \
            or not mpl_mac_equal(tag, hdr.mac):
        return PACKET_FORGED
    return PACKET_OK


# -- for benchmarks ------------------------------------------------------------

def mac_seconds(Py_ssize_t payload, int count) -> float:
    """Seconds to seal and to check (two MACs) `count` datagrams of `payload`
    bytes, as a sender and a receiver do: the cost of authentication per
    datagram, for python -m mpilossy.bench.kernels."""
    cdef mpl_mac_t mac
    cdef char err[256]
    cdef unsigned char key[MPL_MAC_KEY_BYTES]
    cdef unsigned char tag[MPL_MAC_TAG_BYTES]
    cdef char* buf = <char*>calloc(HEADER_BYTES + max(payload, 1), 1)
    cdef int i
    cdef double t0, t1
    if buf == NULL:
        raise MemoryError()
    memset(key, 7, MPL_MAC_KEY_BYTES)
    if mpl_mac_open(&mac, key, err, 256):
        free(buf)
        raise MPILossyChannelError(err.decode(errors="replace"))
    with nogil:
        t0 = mpl_now()
        for i in range(count):
            (<mpl_packet_t*>buf).seq = i
            mpl_mac_tag(&mac, buf, MPL_PKT_MAC_OFFSET, buf + HEADER_BYTES, payload,
                        (<mpl_packet_t*>buf).mac)
            mpl_mac_tag(&mac, buf, MPL_PKT_MAC_OFFSET, buf + HEADER_BYTES, payload, tag)
            if not mpl_mac_equal(tag, (<mpl_packet_t*>buf).mac):
                break
        t1 = mpl_now()
    mpl_mac_close(&mac)
    free(buf)
    return t1 - t0
