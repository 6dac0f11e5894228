# Redundancy: erasure-coded streams (docs/redundancy.md).
#
# With redundancy=(k, m) the nblocks data records of a slot form groups of k
# (the last group padded with empty blocks, which are zero: they are neither
# stored nor coded, mpilossy_fec.h), and once the last block of a group is
# published, m parity records of it follow to the same readers:
# records nblocks + g*m + j of the slot.  A row of the code is a record's
# payload padded to block_bytes plus an 8-byte trailer with its contributor
# count and length, so that a rebuilt block has both (record_bytes is
# block_bytes + 8; the channel carries parity like data, sealed on the
# datagram channel).
#
# A reader keeps a copy of every row that arrives (a data record read in
# place, only once a rebuild needs it: ROW_IN_PLACE, engine/channel.pxi).
# A data block missing at a stream's cursor is rebuilt as soon as any k rows
# of its group are in hand, and is then taken like a block that arrived.
# Nothing else changes: a block not rebuilt by its stage deadline is lost,
# as it was.

cdef inline Py_ssize_t fec_row(const CallInfo* c, int block) noexcept nogil:
    """Row of a slot's record `block` (data or parity) among its groups' rows."""
    if block < c.nblocks:
        return <Py_ssize_t>(block // c.fec_k) * (c.fec_k + c.fec_m) + block % c.fec_k
    block -= c.nblocks
    return <Py_ssize_t>(block // c.fec_m) * (c.fec_k + c.fec_m) + c.fec_k + block % c.fec_m


cdef inline int fec_record(const CallInfo* c, int group, int i) noexcept nogil:
    """The record in row i of `group`: a data block, a parity record, or -1
    (padding of the last group)."""
    cdef int b
    if i < c.fec_k:
        b = group * c.fec_k + i
        return b if b < c.nblocks else -1
    return c.nblocks + group * c.fec_m + (i - c.fec_k)


cdef inline char* fec_row_memory(const CallInfo* c, Stream* s, Py_ssize_t row) noexcept nogil:
    return s.rows + row * c.record_bytes


cdef inline void fec_pad(const CallInfo* c, char* row, const char* data, uint32_t count,
                         uint32_t nbytes) noexcept nogil:
    """A data block as a row of the code: payload, zeros, trailer."""
    cdef uint32_t trailer[2]
    trailer[0] = count
    trailer[1] = nbytes
    memcpy(row, data, nbytes)
    memset(row + nbytes, 0, c.block_bytes - nbytes)
    memcpy(row + c.block_bytes, trailer, 8)


cdef inline void fec_keep(const CallInfo* c, Stream* s, int block, const Incoming* inc) noexcept nogil:
    """Copy a data block that arrived into its row (the caller marks the row
    in hand once the channel confirmed what was read)."""
    if inc.nbytes <= <uint32_t>c.block_bytes:
        fec_pad(c, fec_row_memory(c, s, fec_row(c, block)), inc.data, inc.count, inc.nbytes)


cdef inline int fec_filled(const CallInfo* c, int group) noexcept nogil:
    """Data blocks in `group` (k but in the last group)."""
    return min(c.fec_k, c.nblocks - group * c.fec_k)


cdef inline void fec_incoming(const CallInfo* c, Stream* s, int block, Incoming* inc) noexcept nogil:
    """A rebuilt block, as the algorithm takes it."""
    cdef const char* row = fec_row_memory(c, s, fec_row(c, block))
    cdef uint32_t trailer[2]
    memcpy(trailer, row + c.block_bytes, 8)
    inc.data = row
    inc.count = trailer[0]
    inc.nbytes = trailer[1]


cdef inline void fec_taken(const CallInfo* c, Stream* s, int block, bint in_place) noexcept nogil:
    """Data block `block` of `s` was taken: its row is in hand, kept or
    (`in_place`) to be read again when a rebuild needs it."""
    cdef Py_ssize_t row = fec_row(c, block)
    if not s.have[row]:
        s.have[row] = ROW_IN_PLACE if in_place else ROW_KEPT


cdef bint fec_read_row(Channel chan, CallInfo* c, Stream* s, int b, Py_ssize_t row) noexcept nogil:
    """Read record `b` of `s` into its row, where the channel reads records
    in any order; True if it is there, well formed and confirmed."""
    cdef Incoming inc
    if chan.poll(s, b, &inc) != POLL_READY:
        return False
    if b < c.nblocks:
        if inc.nbytes > <uint32_t>c.block_bytes:
            return False
        fec_keep(c, s, b, &inc)
    else:
        if inc.nbytes != <uint32_t>c.record_bytes or inc.count != 0:
            return False
        memcpy(fec_row_memory(c, s, row), inc.data, c.record_bytes)
    return chan.confirm(s, b)


cdef bint fec_rebuild(Algorithm alg, Channel chan, CallInfo* c, Stream* s, int group,
                      int polled) noexcept nogil:
    """Rebuild the missing data blocks of `group` of `s` if any k of its rows
    are in hand (looking for rows that arrived meanwhile, where the channel
    reads records in any order; record `polled` was just polled in vain and
    is not polled again).  True if it rebuilt any."""
    cdef int k = c.fec_k, n = c.fec_k + c.fec_m, i, b, got = 0, lost = 0
    cdef Py_ssize_t base = <Py_ssize_t>group * n
    cdef bint look = chan.random_access(s)
    cdef unsigned char* rows[MPL_FEC_MAX_K + MPL_FEC_MAX_M]
    cdef uint32_t trailer[2]
    for i in range(n):
        if s.have[base + i]:
            got += 1
            continue
        b = fec_record(c, group, i)     # (padding rows are always in hand)
        lost += i < k
        if not look or s.drop[b] or s.done[b] or b == polled:
            continue        # (a data block resolved without its row was lost or torn)
        if fec_read_row(chan, c, s, b, base + i):
            s.have[base + i] = ROW_KEPT
            got += 1
            lost -= i < k
    if got < k or lost == 0:
        return False
    for i in range(k):      # the rows taken in place are needed now
        if s.have[base + i] == ROW_IN_PLACE:
            s.have[base + i] = ROW_KEPT
            if not fec_read_row(chan, c, s, fec_record(c, group, i), base + i):
                s.have[base + i] = 0        # (rewritten since: a producer calls ahead)
                got -= 1
    if got < k:
        return False
    for i in range(n):
        rows[i] = <unsigned char*>fec_row_memory(c, s, base + i)
    if mpl_fec_decode(&alg.code, rows, s.have + base, <size_t>c.record_bytes,
                      fec_filled(c, group)) <= 0:
        return False
    for i in range(k):
        if s.have[base + i]:
            continue
        s.have[base + i] = ROW_KEPT
        b = fec_record(c, group, i)
        if s.done[b]:
            continue
        memcpy(trailer, rows[i] + c.block_bytes, 8)
        if trailer[0] <= <uint32_t>alg.size and trailer[1] <= <uint32_t>c.block_bytes:
            s.rebuilt[b] = 1
    return True


cdef bint fec_hopeless(CallInfo* c, Stream* s, int group) noexcept nogil:
    """Without a deadline every record that injected loss spares arrives: can
    `group` of `s` still be rebuilt?  (No: its dropped blocks are lost now.)"""
    cdef int n = c.fec_k + c.fec_m, i, b, usable = 0
    cdef Py_ssize_t base = <Py_ssize_t>group * n
    for i in range(n):
        b = fec_record(c, group, i)
        if s.have[base + i] or not (s.drop[b] or s.done[b]):
            usable += 1
    return usable < c.fec_k


cdef int fec_fetch(Algorithm alg, Channel chan, CallInfo* c, Stream* s, int block,
                   Incoming* inc, bint rebuild, bint exact) noexcept nogil:
    """Poll data `block` of `s` with redundancy on: a block rebuilt earlier,
    the record if it arrived, else (`rebuild`) the block rebuilt from its
    group now if it can be.  A block dropped by injected loss is never
    polled; without a deadline (`exact`) it is gone once its group cannot
    be rebuilt."""
    cdef int verdict = POLL_WAIT
    if s.rebuilt[block]:
        fec_incoming(c, s, block, inc)
        return POLL_READY
    if not s.drop[block]:
        verdict = chan.poll(s, block, inc)
        if verdict == POLL_READY or verdict == POLL_FAIL:
            return verdict
    if rebuild and fec_rebuild(alg, chan, c, s, block // c.fec_k, block) and s.rebuilt[block]:
        fec_incoming(c, s, block, inc)
        return POLL_READY
    if s.drop[block] and exact and fec_hopeless(c, s, block // c.fec_k):
        return POLL_GONE
    return verdict


cdef int fec_take_parity(Channel chan, CallInfo* c, Stream* s, int block) noexcept nogil:
    """Read parity record `block` of `s` into its row (a stream read in
    order: the one-sided network path).  The channel's verdict, or
    TAKE_SKIPPED when there is nothing to read."""
    cdef Incoming inc
    cdef Py_ssize_t row = fec_row(c, block)
    cdef int verdict
    if s.done[block] or s.drop[block]:
        return TAKE_SKIPPED
    verdict = chan.poll(s, block, &inc)
    if verdict != POLL_READY:
        return verdict
    s.done[block] = 1
    if inc.nbytes == <uint32_t>c.record_bytes and inc.count == 0:
        memcpy(fec_row_memory(c, s, row), inc.data, c.record_bytes)
        if chan.confirm(s, block):
            s.have[row] = ROW_KEPT
    return POLL_READY


cdef int fec_bind(Algorithm alg) except -1:
    """Prepare the code, the producer's tables and every stream's rows for
    the call."""
    cdef CallInfo* c = alg.call
    cdef int k = c.fec_k, n = c.fec_k + c.fec_m, i, pad
    cdef Py_ssize_t rows = <Py_ssize_t>c.ngroups * n, r
    cdef Stream* s
    if alg.code.k != k or alg.code.m != c.fec_m:
        if mpl_fec_init(&alg.code, k, c.fec_m):
            alg.code.k = 0
            raise ValueError(f"redundancy=({k}, {c.fec_m}): "
                             f"{mpl_fec_check(k, c.fec_m).decode()}")
    grow_buffer(<void**>&alg.group_published, &alg.fec_caps[0],
                <Py_ssize_t>c.nslots * c.ngroups, sizeof(int), keep=False)
    memset(alg.group_published, 0, <Py_ssize_t>c.nslots * c.ngroups * sizeof(int))
    grow_buffer(<void**>&alg.published_as, &alg.fec_caps[1],
                <Py_ssize_t>c.nslots * c.nblocks * 2, sizeof(uint32_t), keep=False)
    grow_buffer(<void**>&alg.encoding, &alg.fec_caps[2], k * c.record_bytes, 1, keep=False)
    pad = c.ngroups * k - c.nblocks         # padding rows, in the last group
    for i in range(alg.nstreams):
        s = &alg.streams[i]
        grow_buffer(<void**>&s.rows, &s.rows_cap, rows * c.record_bytes, 1, keep=False)
        grow_buffer(<void**>&s.have, &s.have_cap, rows, 1, keep=False)
        grow_buffer(<void**>&s.rebuilt, &s.rebuilt_cap, c.nblocks, 1, keep=False)
        memset(s.have, 0, rows)
        memset(s.rebuilt, 0, c.nblocks)
        for r in range(rows - n + k - pad, rows - n + k):
            s.have[r] = ROW_KEPT    # (zero padding: in hand, never read)
    return 0


cdef void fec_published(Algorithm alg, int slot, int block, uint32_t count, uint32_t nbytes,
                        const int* dests, int ndests) noexcept nogil:
    """Data block (slot, block) went out: once its group is complete, encode
    the group and publish its parity to the same readers.  A row is coded in
    two parts, its payload (block_bytes) and its trailer (8 bytes), so that
    a full block is coded where it was published, not copied first; only a
    short block is padded into a row of its own."""
    cdef CallInfo* c = alg.call
    cdef int k = c.fec_k, m = c.fec_m, group = block // k, i, b
    cdef int filled = fec_filled(c, group)
    cdef int* done = &alg.group_published[slot * c.ngroups + group]
    cdef uint32_t* was = &alg.published_as[(<Py_ssize_t>slot * c.nblocks + block) * 2]
    cdef uint32_t trailers[2 * MPL_FEC_MAX_K]
    cdef unsigned char* data[MPL_FEC_MAX_K]
    cdef unsigned char* parity[MPL_FEC_MAX_M]
    was[0] = count
    was[1] = nbytes
    done[0] += 1
    if done[0] != filled:
        return
    for i in range(filled):
        b = group * k + i
        was = &alg.published_as[(<Py_ssize_t>slot * c.nblocks + b) * 2]
        trailers[2 * i] = was[0]
        trailers[2 * i + 1] = was[1]
        if was[1] == <uint32_t>c.block_bytes:
            data[i] = <unsigned char*>alg.chan.mine(slot, b)
        else:
            data[i] = <unsigned char*>alg.encoding + <Py_ssize_t>i * c.record_bytes
            fec_pad(c, <char*>data[i], alg.chan.mine(slot, b), was[0], was[1])
    for i in range(m):
        parity[i] = <unsigned char*>alg.chan.claim(slot, c.nblocks + group * m + i)
    mpl_fec_encode(&alg.code, data, parity, <size_t>c.block_bytes, filled)
    for i in range(filled):
        data[i] = <unsigned char*>&trailers[2 * i]
    for i in range(m):
        parity[i] += c.block_bytes
    mpl_fec_encode(&alg.code, data, parity, 8, filled)
    for i in range(m):
        alg.chan.publish(slot, c.nblocks + group * m + i, 0, <uint32_t>c.record_bytes,
                     dests, ndests)
