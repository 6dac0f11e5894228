# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""Test scaffolding for mpilossy's compiled core (like NumPy's
_multiarray_tests): it compiles the same channel, engine and direct sources
as mpilossy._core and drives them without MPI or a network.

  RecordJudge    hand-written one-sided records fed to the RMA read path
  DatagramJudge  datagrams fed to the datagram channel's decoder and placement
  encode_datagram  a datagram exactly as the channel builds it
  BareChannel    a channel that overrides nothing (each required method aborts)
  DirectRank     rank 0 of a direct all-reduce run by the engine on peers'
                 records held in memory (MemoryChannel), one of which can
                 be rewritten right after its confirmation

Nothing here is used by the library itself.
"""

include "prelude.pxi"
include "codecs/kernels.pxi"
include "engine/channel.pxi"
include "engine/outcome.pxi"
include "channels/rma_window.pxi"
include "channels/rma.pxi"
include "channels/dgram_wire.pxi"
include "channels/dgram_endpoint.pxi"
include "channels/dgram_recovery.pxi"
include "channels/dgram.pxi"
include "algorithms/schedule.pxi"
include "codecs/coding.pxi"
include "codecs/payload.pxi"
include "algorithms/weights.pxi"
include "algorithms/direct.pxi"


cdef void test_call(CallInfo* call, uint64_t seq, uint64_t sig, int nslots, int nblocks,
                    Py_ssize_t block_bytes) noexcept:
    """A call as both judges fake it: this layout, a one-second deadline
    starting now."""
    memset(call, 0, sizeof(CallInfo))
    call.seq = seq
    call.sig = sig
    call.nslots = nslots
    call.nblocks = call.records = nblocks
    call.block_bytes = call.record_bytes = block_bytes
    call.timeout = 1.0
    call.start = mpl_now()


# -- the channel interface -----------------------------------------------------

cdef class BareChannel(Channel):
    """A channel that overrides nothing, for tests: each of the methods a
    channel must provide aborts the process (mpl_unimplemented)."""

    def call(self, str name):
        cdef Stream s
        cdef Incoming inc
        memset(&s, 0, sizeof(Stream))
        if name == "claim":
            self.claim(0, 0)
        elif name == "mine":
            self.mine(0, 0)
        elif name == "publish":
            self.publish(0, 0, 0, 0, NULL, 0)
        elif name == "poll":
            self.poll(&s, 0, &inc)
        elif name == "confirm":
            self.confirm(&s, 0)
        else:
            raise ValueError(f"not a method a channel must provide: {name!r}")


# -- the engine and direct, on records held in memory ---------------------------

cdef class MemoryChannel(Channel):
    """This rank's side of a call whose peers published every record before
    it began, into plain memory: records are read in place and in any order
    (as through shared memory), and every producer has closed its slots, so
    a record that is not there is lost at once (early close).  confirm() of
    one chosen record rewrites its payload just after its check passed, as
    a producer two calls ahead can; the record is then another call's (not
    there, and no later confirm passes).  My own records live here too and
    go nowhere."""
    cdef CallInfo* call
    cdef char* mem                  # rank x slot x record, record_bytes each
    cdef uint32_t* meta             # per record: count, nbytes
    cdef unsigned char* present
    cdef Py_ssize_t tear_at         # the record confirm() rewrites; -1: none
    cdef char* tear_with
    cdef int tears                  # how many it rewrote

    cdef int setup(self, int size, CallInfo* call) except -1:
        cdef Py_ssize_t n = <Py_ssize_t>size * call.nslots * call.records
        self.rank = 0
        self.size = size
        self.call = call
        self.mem = <char*>calloc(n, call.record_bytes)
        self.meta = <uint32_t*>calloc(2 * n, sizeof(uint32_t))
        self.present = <unsigned char*>calloc(n, 1)
        self.tear_with = <char*>calloc(1, call.record_bytes)
        if not (self.mem and self.meta and self.present and self.tear_with):
            raise MemoryError()
        self.tear_at = -1
        return 0

    def __dealloc__(self):
        free(self.mem)
        free(self.meta)
        free(self.present)
        free(self.tear_with)

    cdef inline Py_ssize_t at(self, int rank, int slot, int record) noexcept nogil:
        return (<Py_ssize_t>rank * self.call.nslots + slot) * self.call.records + record

    cdef char* claim(self, int slot, int block) noexcept nogil:
        return self.mem + self.at(self.rank, slot, block) * self.call.record_bytes

    cdef char* mine(self, int slot, int block) noexcept nogil:
        return self.mem + self.at(self.rank, slot, block) * self.call.record_bytes

    cdef void publish(self, int slot, int block, uint32_t count, uint32_t nbytes,
                      const int* dests, int ndests) noexcept nogil:
        pass

    cdef int poll(self, Stream* s, int block, Incoming* inc) noexcept nogil:
        cdef Py_ssize_t i = self.at(s.peer, s.slot, block)
        if not self.present[i]:
            return POLL_WAIT
        inc.data = self.mem + i * self.call.record_bytes
        inc.count = self.meta[2 * i]
        inc.nbytes = self.meta[2 * i + 1]
        return POLL_READY

    cdef bint random_access(self, Stream* s) noexcept nogil:
        return True

    cdef bint confirm(self, Stream* s, int block) noexcept nogil:
        cdef Py_ssize_t i = self.at(s.peer, s.slot, block)
        if i == self.tear_at:
            # The check has passed; now the producer rewrites the record.
            memcpy(self.mem + i * self.call.record_bytes, self.tear_with, self.meta[2 * i + 1])
            self.present[i] = 0
            self.tear_at = -1
            self.tears += 1
            return True
        return self.present[i]

    cdef bint closed(self, Stream* s) noexcept nogil:
        return True


cdef class DirectRank:
    """Rank 0 of a direct sum all-reduce of `count` elements of `dtype`
    (rotation off: it reduces chunk 0, in slot 0 of every peer), run by the
    engine (run_streams) on a MemoryChannel: put() the peers' records,
    optionally tear() one at its confirmation, then run() the call once with
    chosen records dropped by injected loss.  The call is filled as Core.run
    fills it before bind (core.pxi)."""
    cdef MemoryChannel chan
    cdef Direct alg
    cdef CallInfo call
    cdef bint ran

    def __cinit__(self, int size, int dtype, Py_ssize_t count, Py_ssize_t block_bytes,
                  int fec_k=0, int fec_m=0, double timeout=10.0):
        cdef CallInfo* c = &self.call
        if size < 2 or not 0 <= dtype < 5:
            raise ValueError("size >= 2 and a DTYPE_*")
        if fec_k and mpl_fec_check(fec_k, fec_m) != NULL:
            raise ValueError(f"redundancy=({fec_k}, {fec_m}): "
                             f"{mpl_fec_check(fec_k, fec_m).decode()}")
        self.alg = Direct(0, size)
        memset(c, 0, sizeof(CallInfo))
        c.seq = 1
        c.dtype = dtype
        c.op = OP_SUM
        c.algo = ALGO_DIRECT
        c.coll = COLL_ALLREDUCE
        c.scaling = SCALE_UNBIASED
        c.itemsize = ITEMSIZE[dtype]
        c.count = count
        c.timeout = timeout
        c.injected = True
        c.early_close = 0.0             # a missing record is lost once it is looked at
        c.fec_k = fec_k
        c.fec_m = fec_m if fec_k else 0
        c.max_block = (1 << 30) - (8 if fec_k else 0)
        c.block_elems = max(1, block_bytes // c.itemsize)
        self.alg.layout(c)
        c.records = c.nblocks
        c.record_bytes = c.block_bytes
        if fec_k:
            c.ngroups = (c.nblocks + fec_k - 1) // fec_k
            c.records += c.ngroups * c.fec_m
            c.record_bytes += 8
        c.sig = 0x5EED
        self.chan = MemoryChannel()
        self.chan.setup(size, c)

    @property
    def layout(self) -> dict:
        """nblocks (data records per slot), block_elems, block_bytes,
        records (with parity), record_bytes, ngroups of the call."""
        return {"nblocks": self.call.nblocks, "block_elems": self.call.block_elems,
                "block_bytes": self.call.block_bytes, "records": self.call.records,
                "record_bytes": self.call.record_bytes, "ngroups": self.call.ngroups}

    cdef Py_ssize_t record(self, int peer, int slot, int record) except -1:
        if not (0 < peer < self.chan.size and 0 <= slot < self.call.nslots
                and 0 <= record < self.call.records):
            raise IndexError(f"no record ({peer}, {slot}, {record})")
        return self.chan.at(peer, slot, record)

    def put(self, int peer, int slot, int record, uint32_t count, bytes payload):
        """Peer `peer` published `payload` as its record (slot, record)."""
        cdef Py_ssize_t i = self.record(peer, slot, record)
        if len(payload) > self.call.record_bytes:
            raise ValueError(f"payload: at most {self.call.record_bytes} bytes")
        memcpy(self.chan.mem + i * self.call.record_bytes, <const char*>payload, len(payload))
        self.chan.meta[2 * i] = count
        self.chan.meta[2 * i + 1] = <uint32_t>len(payload)
        self.chan.present[i] = 1

    def tear(self, int peer, int slot, int record, bytes payload):
        """When the record (put before) is confirmed, rewrite its payload
        with `payload` right after the check (the confirmation passes)."""
        cdef Py_ssize_t i = self.record(peer, slot, record)
        if not self.chan.present[i] or len(payload) != self.chan.meta[2 * i + 1]:
            raise ValueError("tear a record put before, with a payload of its length")
        memcpy(self.chan.tear_with, <const char*>payload, len(payload))
        self.chan.tear_at = i

    def run(self, bytes send, list drops=None) -> dict:
        """Run the call on this rank's `send` (the whole vector) with the
        records `drops` [(peer, slot, record), ...] lost to injected loss.
        Returns recv (the result), failed, error, rebuilt (blocks),
        lost (injected, late, gone, torn), tears (records rewritten)."""
        cdef CallInfo* c = &self.call
        cdef ErrorInfo err
        cdef Stream* s
        cdef int failed, i
        cdef bytearray out = bytearray(len(send))
        if self.ran:
            raise RuntimeError("a DirectRank runs one call")
        if len(send) != c.count * c.itemsize:
            raise ValueError(f"send: {c.count * c.itemsize} bytes")
        self.ran = True
        memset(&err, 0, sizeof(ErrorInfo))
        c.start = mpl_now()
        self.alg.bind(self.chan, c, <char*><const char*>send, <char*>out)
        for peer, slot, record in drops or ():
            self.record(peer, slot, record)
            hits = 0
            for i in range(self.alg.nstreams):
                s = &self.alg.streams[i]
                if s.peer == peer and s.slot == slot:
                    s.drop[<int>record] = 1
                    hits += 1
            if not hits:
                raise ValueError(f"rank 0 reads no slot {slot} of rank {peer}")
        with nogil:
            failed = run_streams(self.alg, self.chan, c, True, &err)
        return {"recv": bytes(out), "failed": bool(failed),
                "error": err.msg.decode(errors="replace") if failed else "",
                "rebuilt": self.alg.rebuilt_blocks,
                "lost": (self.alg.lost_injected, self.alg.lost_late, self.alg.lost_gone,
                         self.alg.lost_torn),
                "tears": self.chan.tears}


# -- one-sided records ---------------------------------------------------------

cdef enum:
    RECORD_JUDGE_GUARD = 256


cdef class RecordJudge:
    """Feeds hand-written records of one peer (rank 1) to the shared-memory
    read path (poll_shared, confirm), without MPI, for tests.  The peer's
    window is plain memory.  A stable stream's copy lands between guard
    zones that must never change.  flip() rewrites a record's header from a
    second thread while hammer() polls it, as a producer two calls ahead
    with another layout can."""
    cdef RmaChannel chan
    cdef CallInfo call
    cdef Stream st
    cdef GetBuffers gb
    cdef char* window
    cdef char* area
    cdef Py_ssize_t block_bytes
    cdef uint64_t stop

    def __cinit__(self, int size=4, int nslots=2, int nblocks=2, Py_ssize_t block_bytes=256,
                  uint64_t seq=5, uint64_t sig=0x5EED):
        cdef RmaChannel c = RmaChannel()
        self.chan = c
        c.rank = 0
        c.size = size
        c.nslots_max = max(size, 2)
        c.peer_base = <char**>calloc(size, sizeof(char*))
        c.consumed_from = <unsigned char*>calloc(size, 1)
        c.ends_offset = MPL_STATUS_BYTES + 8 * size
        c.rec_offset = round_up(c.ends_offset + 8 * c.nslots_max, MPL_CACHELINE)
        test_call(&self.call, seq, sig, nslots, nblocks, block_bytes)
        c.call = &self.call
        c.stride = RECORD_HEADER + round_up(block_bytes, MPL_CACHELINE)
        c.region = <Py_ssize_t>nslots * nblocks * c.stride
        c.capacity = c.rec_offset + 2 * c.region
        self.block_bytes = block_bytes
        self.window = <char*>calloc(c.capacity, 1)
        self.area = <char*>malloc(block_bytes + 2 * RECORD_JUDGE_GUARD)
        if not (c.peer_base and c.consumed_from and self.window and self.area):
            raise MemoryError()
        memset(self.area, 0xAB, block_bytes + 2 * RECORD_JUDGE_GUARD)
        c.peer_base[1] = self.window
        c.peer_base[0] = self.window        # not read: only rank 1 is polled
        memset(&self.gb, 0, sizeof(GetBuffers))
        self.gb.payload = self.area + RECORD_JUDGE_GUARD
        self.gb.capacity = block_bytes
        memset(&self.st, 0, sizeof(Stream))
        self.st.peer = 1
        self.st.nblocks = nblocks
        self.st.gb = &self.gb
        self.set_status(seq)

    def __dealloc__(self):
        free(self.window)
        free(self.area)

    cdef mpl_record_t* record(self, int slot, int block):
        if not (0 <= slot < self.call.nslots and 0 <= block < self.call.nblocks):
            raise IndexError(f"no record ({slot}, {block})")
        return <mpl_record_t*>(self.window + self.chan.record_offset(slot, block))

    def set_status(self, uint64_t seq, sig=None, uint32_t dtype=0, uint32_t op=0,
                   uint32_t algo=0, uint64_t count=0):
        """The call the peer announces being in (> this call: it moved on),
        and the layout it announces for it (default: this call's)."""
        cdef mpl_status_t* st = <mpl_status_t*>self.window
        mpl_store_relaxed(&st.seq, 0)
        st.sig = self.call.sig if sig is None else <uint64_t>sig
        st.dtype = dtype
        st.op = op
        st.algo = algo
        st.count = count
        mpl_store_release(&st.seq, seq)

    def error(self):
        """(kind, message) of the last POLL_FAIL."""
        return self.chan.error.kind, self.chan.error.msg.decode(errors="replace")

    def write(self, int slot, int block, uint32_t count, uint32_t nbytes, seq=None, check=None,
              int fill=0x5A):
        """Publish a record as the peer would (payload: `fill` bytes); `seq`
        and `check` default to this call's."""
        cdef mpl_record_t* hdr = self.record(slot, block)
        cdef uint64_t s = self.call.seq if seq is None else seq
        mpl_store_relaxed(&hdr.seq, 0)
        memset(<char*>hdr + RECORD_HEADER, fill, self.block_bytes)
        hdr.count = count
        hdr.nbytes = nbytes
        hdr.check = (mpl_record_check(s, self.call.sig, slot, block) if check is None
                     else <uint64_t>check)
        mpl_store_release(&hdr.seq, s)

    def set_check(self, int slot, int block, uint64_t check):
        """Overwrite only the check word (payload of another layout landing
        on the header, sequence number intact)."""
        self.record(slot, block).check = check

    def poll(self, int slot, int block, bint stable):
        """(verdict, count, nbytes, payload bytes that fit in a block)."""
        cdef Incoming inc
        self.record(slot, block)
        memset(&inc, 0, sizeof(Incoming))
        self.st.slot = slot
        self.st.stable = stable
        verdict = self.chan.poll(&self.st, block, &inc)
        if verdict != POLL_READY:
            return (verdict, 0, 0, b"")
        return (verdict, inc.count, inc.nbytes,
                inc.data[:min(<Py_ssize_t>inc.nbytes, self.block_bytes)])

    def confirm(self, int slot, int block):
        self.st.slot = slot
        self.st.stable = False
        return self.chan.confirm(&self.st, block)

    def guards_intact(self) -> bool:
        cdef Py_ssize_t i, n = self.block_bytes + 2 * RECORD_JUDGE_GUARD
        for i in range(n):
            if (i < RECORD_JUDGE_GUARD or i >= n - RECORD_JUDGE_GUARD) and \
                    <unsigned char>self.area[i] != 0xAB:
                return False
        return True

    def arm(self):
        """Before starting flip() in another thread."""
        mpl_store_relaxed(&self.stop, 0)

    def halt(self):
        """Stop flip() (hammer() does it when it ends)."""
        mpl_store_relaxed(&self.stop, 1)

    def flip(self, int slot, int block, uint32_t good_count, uint32_t good_nbytes,
             uint32_t bad_count, uint32_t bad_nbytes):
        """Until hammer() ends: rewrite the record's (count, nbytes) between
        a valid pair and an invalid one, sequence and check word intact."""
        cdef uint64_t* word = <uint64_t*>&self.record(slot, block).count
        cdef uint64_t good = good_count | (<uint64_t>good_nbytes << 32)
        cdef uint64_t bad = bad_count | (<uint64_t>bad_nbytes << 32)
        with nogil:
            while not mpl_load_relaxed(&self.stop):
                mpl_store_relaxed(word, bad)
                mpl_store_relaxed(word, good)

    def hammer(self, double seconds, int slot, int block, bint stable):
        """Poll the record for `seconds`, then stop flip().  Returns (polls,
        ready, bad): bad = READY answers whose count or nbytes break the
        rule (count <= size, nbytes <= block_bytes)."""
        cdef Incoming inc
        cdef long polls = 0, ready = 0, bad = 0
        cdef double end = mpl_now() + seconds
        self.record(slot, block)
        self.st.slot = slot
        self.st.stable = stable
        with nogil:
            while polls & 1023 or mpl_now() < end:
                polls += 1
                if self.chan.poll(&self.st, block, &inc) == POLL_READY:
                    ready += 1
                    if inc.count > <uint32_t>self.chan.size or inc.nbytes > <uint32_t>self.block_bytes:
                        bad += 1
            mpl_store_relaxed(&self.stop, 1)
        return polls, ready, bad


# -- datagrams -----------------------------------------------------------------

def encode_datagram(bytes key, int kind, uint64_t token, uint64_t seq, uint32_t src,
                    uint32_t slot, uint32_t block, uint32_t count, uint32_t sig,
                    bytes payload) -> bytes:
    """A datagram exactly as the channel builds it (header, MAC with `key`,
    payload)."""
    cdef mpl_packet_t hdr
    cdef mpl_mac_t mac
    cdef char err[256]
    if len(key) != MPL_MAC_KEY_BYTES:
        raise ValueError(f"key: {MPL_MAC_KEY_BYTES} bytes")
    if mpl_mac_open(&mac, <const unsigned char*><const char*>key, err, 256):
        raise MPILossyChannelError(err.decode(errors="replace"))
    memset(&hdr, 0, sizeof(mpl_packet_t))
    hdr.magic = MPL_PKT_MAGIC
    hdr.version = MPL_PKT_VERSION
    hdr.kind = kind
    hdr.token = token
    hdr.seq = seq
    hdr.src = src
    hdr.slot = slot
    hdr.block = block
    hdr.count = count
    hdr.nbytes = len(payload)
    hdr.sig = sig
    mpl_mac_tag(&mac, &hdr, MPL_PKT_MAC_OFFSET, <const char*>payload, len(payload), hdr.mac)
    mpl_mac_close(&mac)
    return (<char*>&hdr)[:sizeof(mpl_packet_t)] + payload


cdef enum:
    JUDGE_GUARD = 4096


@cython.no_gc_clear     # __dealloc__ must still see `chan`: it lent it the inbox
cdef class DatagramJudge:
    """Feeds datagrams to the channel's own validation and placement code,
    without a network, for tests and fuzzing.  The inbox sits between guard
    zones that must never change."""
    cdef DgramChannel chan
    cdef char* area
    cdef Py_ssize_t inbox_bytes
    cdef list stream_ids
    cdef list chan_peer

    def __cinit__(self, bytes key, uint64_t token, int size, int rank, uint64_t seq, int nslots,
                  int nblocks, Py_ssize_t block_bytes, uint64_t sig, list streams):
        cdef DgramChannel c = DgramChannel()
        cdef Stream st
        cdef int i
        self.chan = c
        c.rank = rank
        c.size = size
        c.token = token
        if len(key) != MPL_MAC_KEY_BYTES:
            raise ValueError(f"key: {MPL_MAC_KEY_BYTES} bytes")
        c.open_mac(<const unsigned char*><const char*>key)
        c.prefix = 0
        c.payload_max = block_bytes
        c.pkt = round_up(HEADER_BYTES + block_bytes, MPL_CACHELINE)
        c.peer_seq = <uint64_t*>calloc(size, sizeof(uint64_t))
        c.stash = <char*>aligned(STASH_PACKETS * c.pkt)
        c.replaying = <char*>aligned(STASH_PACKETS * c.pkt)
        c.stash_cap = STASH_PACKETS
        c.requests = Requests(size)
        c.free_slots = <int*>calloc(SEND_SLOTS, sizeof(int))
        c.slot_owner = <int*>calloc(SEND_SLOTS, sizeof(int))
        test_call(&c.cur, seq, sig, nslots, nblocks, block_bytes)
        c.stream_of = <int*>malloc(size * nslots * sizeof(int))
        c.stream_of_cap = size * nslots
        for i in range(size * nslots):
            c.stream_of[i] = -1
        c.nstreams = 0
        self.stream_ids = []
        self.chan_peer = [peer for peer, _ in streams]
        for peer, slot in streams:
            memset(&st, 0, sizeof(Stream))
            st.peer = peer
            st.slot = slot
            st.nblocks = nblocks
            c.prepare(&st)
            self.stream_ids.append(st.index)
        # Move the inbox between guard zones.
        self.inbox_bytes = <Py_ssize_t>len(streams) * nblocks * block_bytes
        self.area = <char*>malloc(self.inbox_bytes + 2 * JUDGE_GUARD)
        memset(self.area, 0xAB, self.inbox_bytes + 2 * JUDGE_GUARD)
        free(c.inbox)
        c.inbox = self.area + JUDGE_GUARD
        c.inbox_cap = self.inbox_bytes
        c.armed = True

    def __dealloc__(self):
        if self.chan is not None:
            self.chan.inbox = NULL       # ours, freed below
        free(self.area)

    def fail_call(self, uint64_t seq, int nslots, int nblocks, Py_ssize_t block_bytes,
                  uint64_t sig):
        """The channel fails call `seq` before it began (its begin() raised,
        for want of memory): what fail() installs is the call without its
        layout, whatever layout the call would have had."""
        cdef CallInfo call
        cdef ErrorInfo err
        test_call(&call, seq, sig, nslots, nblocks, block_bytes)
        memset(&err, 0, sizeof(ErrorInfo))
        err.kind = ERR_PROTOCOL
        self.chan.fail(&call, &err)

    def hold_outbox(self, uint64_t seq, int nslots, int nblocks):
        """This rank published every record of call `seq` (nslots x nblocks,
        empty payloads) and keeps them for NACKs, as after a call."""
        cdef DgramChannel c = self.chan
        cdef int parity = seq & 1
        cdef Py_ssize_t records = <Py_ssize_t>nslots * nblocks, r
        cdef mpl_packet_t* hdr
        free(c.outbox[parity])
        free(c.published[parity])
        c.outbox[parity] = <char*>aligned(records * c.pkt)
        c.published[parity] = <unsigned char*>malloc(records)
        if c.outbox[parity] == NULL or c.published[parity] == NULL:
            raise MemoryError()
        memset(c.published[parity], 1, records)
        for r in range(records):
            hdr = <mpl_packet_t*>(c.outbox[parity] + r * c.pkt)
            memset(hdr, 0, HEADER_BYTES)
        c.outbox_cap[parity] = c.published_cap_of[parity] = records
        c.out_seq[parity] = seq
        c.out_slot_records[parity] = nblocks
        c.out_records[parity] = <int>records

    def set_draining(self, int depth):
        """As if inside `depth` nested drain() calls (a send waiting for room)."""
        self.chan.draining = depth

    def feed(self, bytes datagram):
        """Judge one datagram as if it had just been received."""
        self.chan.accept(<const char*>datagram, len(datagram), True)

    def guards_intact(self) -> bool:
        cdef Py_ssize_t i, end = self.inbox_bytes + 2 * JUDGE_GUARD
        for i in range(JUDGE_GUARD):
            if <unsigned char>self.area[i] != 0xAB or <unsigned char>self.area[end - 1 - i] != 0xAB:
                return False
        return True

    def arrived(self, int stream_number, int block) -> tuple:
        """(arrived, count, payload) of a block of the n-th stream given."""
        cdef DgramChannel c = self.chan
        if not 0 <= block < c.cur.nblocks:
            raise IndexError(f"block {block} of {c.cur.nblocks}")
        cdef Py_ssize_t at = <Py_ssize_t>self.stream_ids[stream_number] * c.cur.nblocks + block
        if not c.arrived[at]:
            return (False, 0, b"")
        return (True, c.counts[at], (c.inbox + at * c.cur.block_bytes)[:c.sizes[at]])

    def counters(self) -> dict:
        return self.chan.counters()

    @property
    def stashed(self) -> int:
        return self.chan.nstash

    @property
    def error(self) -> str:
        return self.chan.error.msg.decode(errors="replace") if self.chan.error.kind else ""

    @property
    def error_kind(self) -> int:
        return self.chan.error.kind

    def peer_seen_in(self, int peer) -> int:
        """The latest call `peer` was seen in."""
        return self.chan.peer_seq[peer]

    def poll(self, int stream_number, int block, double now_offset=0.0) -> str:
        """Poll a block of the n-th stream given as the engine would:
        "ready", "wait", "gone" or "fail"."""
        cdef Stream st
        cdef Incoming inc
        if not 0 <= block < self.chan.cur.nblocks:
            raise IndexError(f"block {block} of {self.chan.cur.nblocks}")
        memset(&st, 0, sizeof(Stream))
        st.index = self.stream_ids[stream_number]
        st.peer = self.chan_peer[stream_number]
        st.nblocks = self.chan.cur.nblocks
        st.cursor = block + 1          # not the cursor: no draining (no network here)
        return ("wait", "ready", "gone", "fail")[self.chan.poll(&st, block, &inc)]


def grow_refused(Py_ssize_t items, Py_ssize_t need) -> tuple:
    """A buffer of `items` int64 grown to `need` items where that cannot be
    allocated: (raised MemoryError, capacity after, the old contents kept)."""
    cdef int64_t* buf = <int64_t*>malloc(items * 8)
    cdef Py_ssize_t cap = items, i
    cdef bint raised = False, kept = True
    if buf == NULL:
        raise MemoryError()
    for i in range(items):
        buf[i] = i
    try:
        grow_buffer(<void**>&buf, &cap, need, 8)
    except MemoryError:
        raised = True
    for i in range(min(cap, items)):
        kept = kept and buf[i] == i
    free(buf)
    return raised, cap, kept
