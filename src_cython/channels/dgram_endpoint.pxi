# The datagram channel's endpoint: a transport (mpilossy_transport.h:
# libfabric FI_EP_DGRAM, i.e. verbs UD on InfiniBand/RoCE, efa on AWS, udp
# elsewhere; or mpilossy's own batched UDP sockets) and the buffers around
# it.  Receive buffers stay posted all the time; every send takes a send
# slot until its completion is reaped (drain), which also hands each
# received datagram to the protocol (dgram.pxi: accept).  Setting up is
# collective: the MAC key, the datagram size and every rank's address are
# agreed over MPI, and a rank that fails makes every rank raise.

cdef enum:
    DEFAULT_RECV_BUFFERS = 512
    SEND_SLOTS = 1024
    CONTROL_BUFFERS = 256
    MAX_EVENTS = 256

# Without a deadline, how long a full send queue or the sends of an earlier
# call may hold a call up before the channel gives up on them (an error for
# the call; with a deadline, the call's own end is the bound).
cdef double STALL_LIMIT = 5.0


cdef class DgramEndpoint(Channel):
    """One transport endpoint (mpilossy_transport.h: libfabric or native
    sockets) and its buffers: receives kept posted, send slots, control
    buffers, the two outboxes; sending, and reaping completions."""
    cdef mpl_dg_t* fab
    cdef MPI_Comm comm
    cdef uint64_t token
    cdef mpl_mac_t mac                # keyed with the communicator's secret
    cdef bint mac_ready
    cdef unsigned char key[MPL_MAC_KEY_BYTES]
    cdef char errbuf[256]
    cdef bytes provider_name, domain_name
    cdef char local_addr[256]         # this endpoint's address (udp: a sockaddr)
    cdef size_t local_len
    cdef int socket_bytes             # udp: kernel receive buffer in effect
    cdef double pace_rate             # bytes per second on the wire; 0: unpaced
    cdef bytes pace_local             # per peer: 1 on this node (pacing charges it nothing)
    # sizes
    cdef Py_ssize_t prefix            # bytes the provider reserves before a message
    cdef Py_ssize_t payload_max       # payload bytes per datagram: the largest block
    cdef Py_ssize_t pkt               # bytes of one packet buffer
    # receive buffers, posted all the time
    cdef char* rbuf
    cdef int nrecv
    cdef void* rbuf_mr
    cdef void* rbuf_desc
    # outboxes, by call parity (their records are laid out by the protocol)
    cdef char* outbox[2]
    cdef Py_ssize_t outbox_cap[2]     # packets
    cdef void* out_mr[2]
    cdef void* out_desc[2]
    cdef int pending[2]               # sends in flight from each outbox
    # control datagrams (HELLO, ERROR, NACK, END)
    cdef char* cbuf
    cdef void* cbuf_mr
    cdef void* cbuf_desc
    cdef int* cbuf_busy
    cdef int cnext
    # send slots: which buffer each in-flight send uses (0/1 outbox, 2+k control)
    cdef int* slot_owner
    cdef int* free_slots
    cdef int nfree
    cdef int draining                 # drain() calls under way (it nests: drain ->
                                      # accept -> a send waiting for room -> drain)
    # counters, for the whole life of the endpoint
    cdef uint64_t n_sent, n_received, n_truncated, n_unsent

    def __cinit__(self):
        self.fab = NULL
        self.mac_ready = False

    cdef int open_mac(self, const unsigned char* key) except -1:
        memcpy(self.key, key, MPL_MAC_KEY_BYTES)
        if mpl_mac_open(&self.mac, self.key, self.errbuf, 256):
            raise MPILossyChannelError("channel='ud': " + self.errbuf.decode(errors="replace"))
        self.mac_ready = True
        return 0

    cdef int setup(self, MPI_Comm comm, str provider, str domain, Py_ssize_t payload,
                   int nrecv, int socket_bytes) except -1:
        cdef int rank, size, bad, i
        cdef size_t addrlen = 0
        cdef char* addrs
        cdef unsigned char secret[MPL_MAC_KEY_BYTES + 8]
        MPI_Comm_rank(comm, &rank)
        MPI_Comm_size(comm, &size)
        self.comm = comm
        self.rank = rank
        self.size = size
        if not MPL_HAVE_MAC:        # the same build on every rank: the same answer
            mpl_mac_open(&self.mac, secret, self.errbuf, 256)
            raise MPILossyChannelError("channel='ud' is unavailable: "
                                       + self.errbuf.decode(errors="replace"))
        # The MAC key and the token, from the OS's random source on rank 0,
        # over MPI: the key never appears in a datagram.
        if rank == 0:
            drawn = os.urandom(MPL_MAC_KEY_BYTES + 8)
            memcpy(secret, <const char*>drawn, MPL_MAC_KEY_BYTES + 8)
        chk(MPI_Bcast(secret, MPL_MAC_KEY_BYTES + 8, MPI_BYTE, 0, comm))
        memcpy(&self.token, secret + MPL_MAC_KEY_BYTES, 8)
        failure = None
        try:
            self.open_mac(secret)       # (OpenSSL's configuration may differ per node)
        except Exception as exc:
            failure = exc
        memset(secret, 0, MPL_MAC_KEY_BYTES + 8)
        agree_or_raise(comm, failure)
        # On one host the loopback interface will do (and must: only loopback
        # traffic is allowed in tests); across hosts the provider's first match.
        if not domain and provider in ("", "udp", "native") and one_host(comm, size):
            domain = "lo"
        self.provider_name = provider.encode()
        self.domain_name = domain.encode()
        self.nrecv = nrecv
        cdef const char* prov = NULL
        cdef const char* dom = NULL
        if provider:
            prov = self.provider_name
        if domain:
            dom = self.domain_name
        bad = mpl_dg_open(&self.fab, prov, dom, nrecv + SEND_SLOTS, 2 * (nrecv + SEND_SLOTS),
                           self.errbuf, 256)
        cdef int any_bad = 0
        chk(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MIN, comm))
        if any_bad:
            reason = self.errbuf.decode(errors="replace") if bad else "failed on another rank"
            raise MPILossyChannelError(f"channel='ud' is unavailable: {reason}")
        # Every rank uses the same datagram size: the smallest.
        self.prefix = mpl_dg_prefix(self.fab)
        cdef long mine = <long>min(<size_t>payload, mpl_dg_max_msg(self.fab) - self.prefix - HEADER_BYTES)
        cdef long agreed
        mine = (mine // 64) * 64
        chk(MPI_Allreduce(&mine, &agreed, 1, MPI_LONG, MPI_MIN, comm))
        if agreed < MIN_PAYLOAD:
            raise MPILossyChannelError(
                f"channel='ud': datagrams too small ({agreed} bytes of payload; at least "
                f"{MIN_PAYLOAD}, so that an error record fits: MPILOSSY_UD_MTU)")
        self.payload_max = agreed
        self.pkt = round_up(self.prefix + HEADER_BYTES + self.payload_max, MPL_CACHELINE)
        # Local steps that can fail are agreed on before the next collective:
        # a rank that raised alone would leave the others waiting in it.
        addrlen = 256
        cdef char local[256]
        failure = None
        try:
            self.allocate_fixed()
            if mpl_dg_getname(self.fab, local, &addrlen, self.errbuf, 256):
                raise MPILossyChannelError(self.errbuf.decode(errors="replace"))
        except Exception as exc:
            failure = exc
        agree_or_raise(comm, failure)
        memcpy(self.local_addr, local, addrlen)
        self.local_len = addrlen
        if mpl_dg_provider(self.fab) in (b"udp", b"native"):
            self.socket_bytes = mpl_udp_tune(local, addrlen, socket_bytes)
        # fi_av_insert wants the addresses packed, each of the provider's length.
        cdef int mylen = <int>addrlen, minlen = 0, maxlen_i = 0
        chk(MPI_Allreduce(&mylen, &minlen, 1, MPI_INT, MPI_MIN, comm))
        chk(MPI_Allreduce(&mylen, &maxlen_i, 1, MPI_INT, MPI_MAX, comm))
        if minlen != maxlen_i:
            raise MPILossyChannelError("channel='ud': ranks opened different kinds of endpoints "
                                       f"(address lengths {minlen}..{maxlen_i})")
        addrs = <char*>calloc(size, addrlen)
        chk(MPI_Allgather(local, mylen, MPI_BYTE, addrs, mylen, MPI_BYTE, comm))
        bad = mpl_dg_insert(self.fab, addrs, size, self.errbuf, 256)
        free(addrs)
        chk(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MIN, comm))
        if any_bad:
            raise MPILossyChannelError("channel='ud': cannot insert peer addresses: "
                                       + self.errbuf.decode(errors="replace"))
        failure = None
        try:
            self.post_receives()
        except Exception as exc:
            failure = exc
        # (An allreduce: it also keeps anyone from sending before every
        # receive is posted.)
        agree_or_raise(comm, failure)
        return 0

    cdef int allocate_fixed(self) except -1:
        cdef int i
        self.rbuf = <char*>aligned(self.nrecv * self.pkt)
        self.cbuf = <char*>aligned(CONTROL_BUFFERS * self.pkt)
        self.cbuf_busy = <int*>calloc(CONTROL_BUFFERS, sizeof(int))
        self.slot_owner = <int*>calloc(SEND_SLOTS, sizeof(int))
        self.free_slots = <int*>calloc(SEND_SLOTS, sizeof(int))
        if not (self.rbuf and self.cbuf and self.cbuf_busy and self.slot_owner
                and self.free_slots):
            raise MemoryError()
        for i in range(SEND_SLOTS):
            self.free_slots[i] = SEND_SLOTS - 1 - i
        self.nfree = SEND_SLOTS
        if (mpl_dg_register(self.fab, self.rbuf, self.nrecv * self.pkt, &self.rbuf_mr,
                             &self.rbuf_desc, self.errbuf, 256)
                or mpl_dg_register(self.fab, self.cbuf, CONTROL_BUFFERS * self.pkt, &self.cbuf_mr,
                                    &self.cbuf_desc, self.errbuf, 256)):
            raise MPILossyChannelError(self.errbuf.decode(errors="replace"))
        return 0

    cdef int post_receives(self) except -1:
        cdef int k, rc
        for k in range(self.nrecv):
            rc = mpl_dg_recv(self.fab, self.rbuf + k * self.pkt, self.pkt, self.rbuf_desc,
                              k, <void*><intptr_t>k)
            if rc:
                raise MPILossyChannelError(f"fi_recv: {mpl_dg_strerror(self.fab, rc).decode()}")
        return 0

    cdef void close(self):
        cdef double limit = mpl_now() + 1.0
        if self.fab == NULL:
            return
        while (self.pending[0] or self.pending[1] or self.nfree < SEND_SLOTS) and mpl_now() < limit:
            self.drain()
        mpl_dg_flush(self.fab)
        mpl_dg_deregister(self.out_mr[0])
        mpl_dg_deregister(self.out_mr[1])
        mpl_dg_deregister(self.rbuf_mr)
        mpl_dg_deregister(self.cbuf_mr)
        mpl_dg_close(self.fab)
        self.fab = NULL

    cdef void close_mac(self) noexcept nogil:
        if self.mac_ready:
            mpl_mac_close(&self.mac)
            self.mac_ready = False
        memset(self.key, 0, MPL_MAC_KEY_BYTES)

    def __dealloc__(self):
        self.close()
        self.close_mac()
        free(self.rbuf)
        free(self.cbuf)
        free(self.cbuf_busy)
        free(self.slot_owner)
        free(self.free_slots)
        free(self.outbox[0])
        free(self.outbox[1])

    def set_rate(self, double rate, double burst, bytes local=None):
        """Pace the datagrams this rank sends: `rate` bytes per second on
        the wire (0: unpaced), at most `burst` bytes at once.  local: one
        byte per peer, nonzero for a peer on this node, whose datagrams
        never cross the port and cost nothing."""
        if local is not None and len(local) != self.size:
            raise ValueError(f"local has {len(local)} bytes for {self.size} peers")
        self.pace_local = local
        if self.fab != NULL:
            mpl_dg_set_rate(self.fab, rate, burst)
            mpl_dg_set_local(self.fab, NULL if local is None else <const unsigned char*>local,
                             0 if local is None else len(local))
        self.pace_rate = rate

    cdef Py_ssize_t max_block_bytes(self) noexcept nogil:
        return self.payload_max

    def address(self) -> str:
        """This endpoint's address, "ip:port" for the udp provider (IPv4)."""
        cdef const unsigned char* a = <const unsigned char*>self.local_addr
        if self.local_len >= 8 and a[0] | (a[1] << 8) == 2:     # AF_INET, native order
            return f"{a[4]}.{a[5]}.{a[6]}.{a[7]}:{(a[2] << 8) | a[3]}"
        return self.local_addr[:self.local_len].hex()

    def set_offload(self, bint on) -> bool:
        """Segmentation and receive offload (native transport) on or off;
        whether receive offload is on."""
        return self.fab != NULL and mpl_dg_set_offload(self.fab, on) == 1

    def counters(self) -> dict:
        """What the endpoint sent and received (and the transport's costs)."""
        cdef long queue = -1
        if self.fab != NULL:
            queue = mpl_udp_drops(self.local_addr, self.local_len)
        return {"queue_drops": queue, "socket_bytes": self.socket_bytes,
                "pace_bytes_per_s": self.pace_rate,
                "pace_free_peers": 0 if self.pace_local is None else sum(
                    1 for b in self.pace_local if b),
                "sent": self.n_sent,
                "received": self.n_received, "truncated": self.n_truncated,
                "unsent": self.n_unsent, **self.transport_costs()}

    def transport_costs(self) -> dict:
        """The native transport's system calls and datagrams (empty for
        libfabric, which does not count them)."""
        cdef uint64_t c[8]
        if self.fab == NULL or not mpl_dg_is_native(mpl_dg_provider(self.fab)):
            return {}
        mpl_dg_costs(self.fab, c)
        return {"send_calls": c[0], "recv_calls": c[1], "transport_sent": c[2],
                "transport_received": c[3], "send_refused": c[4],
                "largest_send_batch": c[5], "received_messages": c[6],
                "receive_offload": bool(c[7])}

    # -- sending -----------------------------------------------------------------
    cdef int reserve_outbox(self, int parity, Py_ssize_t records, double limit) except -1:
        """Room for `records` packets in outbox `parity`, once the sends of
        the call that used it before (call seq-2) are done.  A failure
        leaves the outbox as it was (its memory and capacity agree)."""
        cdef char* grown
        cdef void* mr = NULL
        cdef void* desc = NULL
        while self.pending[parity]:
            self.drain()
            if mpl_now() > limit:
                raise MPILossyChannelError("channel='ud': sends of an earlier call never completed")
        if records > self.outbox_cap[parity]:
            grown = <char*>aligned(records * self.pkt)
            if grown == NULL:
                raise MemoryError()
            if mpl_dg_register(self.fab, grown, records * self.pkt, &mr, &desc, self.errbuf, 256):
                free(grown)
                raise MPILossyChannelError(self.errbuf.decode(errors="replace"))
            mpl_dg_deregister(self.out_mr[parity])
            free(self.outbox[parity])
            self.outbox[parity] = grown
            self.out_mr[parity] = mr
            self.out_desc[parity] = desc
            self.outbox_cap[parity] = records
        return 0

    cdef char* packet(self, int parity, Py_ssize_t record) noexcept nogil:
        return self.outbox[parity] + record * self.pkt

    cdef void fill_header(self, mpl_packet_t* hdr, int kind, uint64_t seq, uint32_t slot,
                          uint32_t block, uint32_t count, uint32_t nbytes) noexcept nogil:
        memset(hdr, 0, HEADER_BYTES)
        hdr.magic = MPL_PKT_MAGIC
        hdr.version = MPL_PKT_VERSION
        hdr.kind = kind
        hdr.token = self.token
        hdr.seq = seq
        hdr.src = self.rank
        hdr.slot = slot
        hdr.block = block
        hdr.count = count
        hdr.nbytes = nbytes

    cdef void seal(self, mpl_packet_t* hdr) noexcept nogil:
        """Write the MAC of a filled header and the payload that follows it."""
        mpl_mac_tag(&self.mac, hdr, MPL_PKT_MAC_OFFSET, (<const char*>hdr) + HEADER_BYTES,
                    hdr.nbytes, hdr.mac)

    cdef double stall_limit(self) noexcept nogil:
        """Until when a send may wait for room (the protocol bounds it by the
        call's deadline)."""
        return mpl_now() + STALL_LIMIT

    cdef void send(self, int peer, char* buf, Py_ssize_t length, int owner) noexcept nogil:
        """Post a send; `owner` is 0/1 (an outbox) or 2 + control buffer."""
        cdef int slot, rc
        cdef double limit = -1.0
        if self.fab == NULL:            # offline (DatagramJudge): nothing to send
            return
        while self.nfree == 0:
            self.drain()
            if limit < 0:
                limit = self.stall_limit()
            elif mpl_now() > limit:
                self.n_unsent += 1      # the queue never drained: count it lost
                return
        slot = self.free_slots[self.nfree - 1]
        while True:
            rc = mpl_dg_send(self.fab, peer, buf, length,
                              self.out_desc[owner] if owner < 2 else self.cbuf_desc,
                              self.nrecv + slot, <void*><intptr_t>slot)
            if rc != MPL_FAB_EAGAIN:
                break
            self.drain()
            if limit < 0:
                limit = self.stall_limit()
            elif mpl_now() > limit:
                self.n_unsent += 1      # the transport refuses: count it lost
                return
        if rc:
            self.n_unsent += 1
            return
        self.nfree -= 1
        self.slot_owner[slot] = owner
        if owner < 2:
            self.pending[owner] += 1
        else:
            self.cbuf_busy[owner - 2] += 1
        self.n_sent += 1

    cdef char* control_buffer(self, int* owner) noexcept nogil:
        cdef int k, tries
        for tries in range(2 * CONTROL_BUFFERS):
            k = self.cnext
            self.cnext = (self.cnext + 1) % CONTROL_BUFFERS
            if self.cbuf_busy[k] == 0:
                owner[0] = 2 + k
                return self.cbuf + k * self.pkt
            if tries == CONTROL_BUFFERS:
                self.drain()
        return NULL

    cdef void send_control(self, int kind, uint64_t seq, uint32_t slot, uint32_t block,
                           const void* payload, uint32_t nbytes, int peer) noexcept nogil:
        """A HELLO/ERROR/NACK to `peer`, or to every peer when peer < 0."""
        self.send_control_to(kind, seq, slot, block, payload, nbytes, &peer, 1 if peer >= 0 else -1)

    cdef void send_control_to(self, int kind, uint64_t seq, uint32_t slot, uint32_t block,
                              const void* payload, uint32_t nbytes, const int* peers,
                              int npeers) noexcept nogil:
        """A control datagram to `npeers` peers, or to every peer when npeers < 0."""
        cdef int owner, p
        if self.fab == NULL or nbytes > <uint32_t>self.payload_max:
            return      # offline (DatagramJudge), or too large (setup makes sure it is not)
        cdef char* buf = self.control_buffer(&owner)
        if buf == NULL:
            return
        cdef mpl_packet_t* hdr = <mpl_packet_t*>(buf + self.prefix)
        self.fill_header(hdr, kind, seq, slot, block, 0, nbytes)
        if nbytes:
            memcpy(buf + self.prefix + HEADER_BYTES, payload, nbytes)
        self.seal(hdr)
        if npeers >= 0:
            for p in range(npeers):
                self.send(peers[p], buf, self.prefix + HEADER_BYTES + nbytes, owner)
            return
        for p in range(self.size):
            if p != self.rank:
                self.send(p, buf, self.prefix + HEADER_BYTES + nbytes, owner)

    # -- receiving -------------------------------------------------------------
    cdef void drain(self) noexcept nogil:
        """Reap completions: recycle send slots, judge received datagrams."""
        cdef mpl_fab_event_t events[MAX_EVENTS]
        cdef int n, i, k, slot, owner
        if self.fab == NULL:            # offline (DatagramJudge): nothing to reap
            return
        self.draining += 1
        n = mpl_dg_poll(self.fab, events, MAX_EVENTS)
        for i in range(n):
            k = <int><intptr_t>events[i].context
            if events[i].is_recv:
                if events[i].len > <size_t>self.prefix:
                    self.accept(self.rbuf + k * self.pkt + self.prefix,
                                <Py_ssize_t>events[i].len - self.prefix, True)
                else:
                    self.n_truncated += 1
                mpl_dg_recv(self.fab, self.rbuf + k * self.pkt, self.pkt, self.rbuf_desc,
                             k, <void*><intptr_t>k)
            else:
                slot = k
                owner = self.slot_owner[slot]
                if owner < 2:
                    self.pending[owner] -= 1
                else:
                    self.cbuf_busy[owner - 2] -= 1
                self.free_slots[self.nfree] = slot
                self.nfree += 1
        self.draining -= 1

    cdef void accept(self, const char* data, Py_ssize_t length, bint may_stash) noexcept nogil:
        """Judge one received datagram (header + payload): the protocol's."""
        mpl_unimplemented(b"DgramEndpoint.accept")


cdef void* aligned(Py_ssize_t nbytes) noexcept nogil:
    cdef void* p = NULL
    if posix_memalign(&p, 4096, <size_t>max(nbytes, 64)) != 0:
        return NULL
    return p


cdef int agree_or_raise(MPI_Comm comm, object failure) except -1:
    """Collective: raise `failure` on the rank that had it, and an error that
    names the ranks on every other rank; return 0 if nobody failed."""
    cdef int mine = 0 if failure is None else 1, anyone = 0
    chk(MPI_Allreduce(&mine, &anyone, 1, MPI_INT, MPI_MAX, comm))
    if not anyone:
        return 0
    if failure is not None:
        raise failure
    raise MPILossyChannelError("channel='ud' could not be set up on another rank")


cdef int grow_buffer(void** buf, Py_ssize_t* cap, Py_ssize_t need, size_t itemsize,
              bint keep=True) except -1:
    """Make *buf hold at least `need` items of `itemsize` bytes (*cap items
    now): the new buffer is allocated before the old one goes, and `keep`
    copies what it held.  A failure raises MemoryError and leaves *buf and
    *cap as they were, in agreement."""
    cdef void* grown
    if need <= cap[0] and buf[0] != NULL:
        return 0
    if need > PY_SSIZE_T_MAX // <Py_ssize_t>itemsize:
        raise MemoryError()
    grown = malloc(max(need, 1) * itemsize)
    if grown == NULL:
        raise MemoryError()
    if keep and buf[0] != NULL:
        memcpy(grown, buf[0], min(cap[0], need) * itemsize)
    free(buf[0])
    buf[0] = grown
    cap[0] = need
    return 0


cdef bint one_host(MPI_Comm comm, int size) except -1:
    """Do all ranks run on the same host (same processor name)?"""
    cdef char name[MPI_MAX_PROCESSOR_NAME]
    cdef int length = 0, p
    cdef bint same = True
    memset(name, 0, MPI_MAX_PROCESSOR_NAME)
    chk(MPI_Get_processor_name(name, &length))
    cdef char* names = <char*>calloc(size, MPI_MAX_PROCESSOR_NAME)
    if names == NULL:
        raise MemoryError()
    try:
        chk(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names,
                          MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm))
        for p in range(1, size):
            if strncmp(names, names + p * MPI_MAX_PROCESSOR_NAME, MPI_MAX_PROCESSOR_NAME):
                same = False
    finally:
        free(names)
    return same
