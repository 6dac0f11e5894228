# Recovery without deadline (timeout=None): a reader asks again (NACK) for
# the records of a stream it still needs and has not got, every
# NACK_INTERVAL; a producer answers each NACK once.  With a deadline nothing
# is ever asked again (dgram.pxi).
#
# What is needed: data blocks not in hand, except those injected loss
# dropped (never read), and with redundancy the parity records of a group
# that waits for such a dropped block: it can only be rebuilt, and its
# group's parity is as exposed to real loss as data (before the parity was
# asked for, such a call never ended under real drops).
#
# A NACK carries a number that grows with each one a rank sends in a call,
# so that a replayed NACK (captured and sent again, or duplicated) makes no
# resends.

cdef double NACK_INTERVAL = 0.05   # seconds between repeated requests of a stream


cdef class Requests:
    """The NACK numbers of one datagram channel: this rank's in the current
    call, and per peer and call parity the last one it answered."""
    cdef int size
    cdef uint64_t* answered_call      # peer * 2 + parity
    cdef uint32_t* answered_number
    cdef uint32_t sent

    def __cinit__(self, int size):
        self.size = size
        self.answered_call = <uint64_t*>calloc(2 * size, sizeof(uint64_t))
        self.answered_number = <uint32_t*>calloc(2 * size, sizeof(uint32_t))
        if self.answered_call == NULL or self.answered_number == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.answered_call)
        free(self.answered_number)

    cdef inline void new_call(self) noexcept nogil:
        self.sent = 0

    cdef inline uint32_t next_number(self) noexcept nogil:
        self.sent += 1
        return self.sent

    cdef inline bint replayed(self, int src, uint64_t seq, uint32_t number) noexcept nogil:
        """Was NACK `number` of peer `src` for call `seq` answered already?"""
        cdef int at = src * 2 + <int>(seq & 1)
        return self.answered_call[at] == seq and number <= self.answered_number[at]

    cdef inline void answered(self, int src, uint64_t seq, uint32_t number) noexcept nogil:
        cdef int at = src * 2 + <int>(seq & 1)
        self.answered_call[at] = seq
        self.answered_number[at] = number


cdef int records_to_ask_for(const CallInfo* c, Stream* s, const unsigned char* arrived,
                            uint32_t* missing, int cap) noexcept nogil:
    """The records of `s` (`arrived`: its row of the inbox's flags) this rank
    still needs, in order, at most `cap`: data blocks not in hand, and the
    parity of groups that wait for a dropped block.  Returns how many."""
    cdef int n = 0, group, first, last
    if not c.fec_k:
        return want_data(s, arrived, s.cursor, s.nblocks, missing, 0, cap)
    for group in range(s.cursor // c.fec_k, c.ngroups):
        first = max(s.cursor, group * c.fec_k)
        last = min(c.nblocks, (group + 1) * c.fec_k)
        n = want_data(s, arrived, first, last, missing, n, cap)
        if group_waits_for_parity(s, first, last):
            n = want_parity(c, s, arrived, group, missing, n, cap)
        if n == cap:
            break
    return n


cdef inline int want_data(Stream* s, const unsigned char* arrived, int first, int last,
                          uint32_t* missing, int n, int cap) noexcept nogil:
    """Add data blocks first..last-1 of `s` not in hand (a block injected
    loss dropped is never read: not asked for)."""
    cdef int b
    for b in range(first, last):
        if n == cap:
            break
        if not arrived[b] and not s.done[b] and not s.drop[b]:
            missing[n] = b
            n += 1
    return n


cdef inline bint group_waits_for_parity(Stream* s, int first, int last) noexcept nogil:
    """Does a block of data blocks first..last-1 of one group wait to be
    rebuilt (dropped by injected loss, unresolved, not rebuilt yet)?"""
    cdef int b
    for b in range(first, last):
        if s.drop[b] and not s.done[b] and not s.rebuilt[b]:
            return True
    return False


cdef inline int want_parity(const CallInfo* c, Stream* s, const unsigned char* arrived,
                            int group, uint32_t* missing, int n, int cap) noexcept nogil:
    """Add the parity records of `group` of `s` not in hand."""
    cdef int j, r
    for j in range(c.fec_m):
        if n == cap:
            break
        r = c.nblocks + group * c.fec_m + j
        # (its row: group * (k + m) + k + j, coding.pxi's fec_row)
        if (not arrived[r] and not s.drop[r]
                and not s.have[<Py_ssize_t>group * (c.fec_k + c.fec_m) + c.fec_k + j]):
            missing[n] = r
            n += 1
    return n
