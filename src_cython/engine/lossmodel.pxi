# Injected loss, decided at the receiver before a call starts, from counters
# only (seed, call, link, block): the same seed gives the same losses however
# the ranks are scheduled.  The Python classes in mpilossy.loss describe the
# models; this is their compiled form.

cdef struct LossParams:
    bint bernoulli
    double p
    uint64_t bernoulli_seed
    bint gilbert
    double p_good_to_bad, p_bad_to_good, loss_good, loss_bad
    uint64_t gilbert_seed
    bint straggler
    int straggler_rank
    double straggler_delay, straggler_prob
    uint64_t straggler_seed


cdef inline int wire_record(const CallInfo* c, int at) noexcept nogil:
    """The record sent `at`-th on a stream: data blocks in order, with
    redundancy the m parity records of each group right after its data (the
    last group may hold fewer than k data blocks)."""
    cdef int k = c.fec_k, m = c.fec_m, n, group, full, data
    if not k:
        return at
    n = k + m
    full = (c.ngroups - 1) * n
    if at < full:
        group = at // n
        at = at % n
        return group * k + at if at < k else c.nblocks + group * m + (at - k)
    group = c.ngroups - 1
    at -= full
    data = c.nblocks - group * k
    return group * k + at if at < data else c.nblocks + group * m + (at - data)


cdef class LossState:
    cdef LossParams params
    cdef unsigned char* bad        # Gilbert-Elliott state of each incoming link
    cdef int size

    def __cinit__(self, int size):
        self.size = size
        self.bad = <unsigned char*>calloc(size, 1)
        if self.bad == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.bad)

    def configure(self, dict spec):
        """spec: {'bernoulli': (p, seed), 'gilbert': (pgb, pbg, lgood, lbad, seed),
        'straggler': (rank, delay, prob, seed)}; missing keys are off."""
        memset(&self.params, 0, sizeof(LossParams))
        memset(self.bad, 0, self.size)
        if 'bernoulli' in spec:
            self.params.bernoulli = True
            self.params.p, self.params.bernoulli_seed = spec['bernoulli']
        if 'gilbert' in spec:
            self.params.gilbert = True
            (self.params.p_good_to_bad, self.params.p_bad_to_good, self.params.loss_good,
             self.params.loss_bad, self.params.gilbert_seed) = spec['gilbert']
        if 'straggler' in spec:
            self.params.straggler = True
            (self.params.straggler_rank, self.params.straggler_delay,
             self.params.straggler_prob, self.params.straggler_seed) = spec['straggler']

    cdef inline bint drops(self) noexcept nogil:
        return self.params.bernoulli or self.params.gilbert

    cdef void fill(self, Algorithm alg, uint64_t seq) noexcept nogil:
        """Mark the blocks that this call loses, stream by stream, record by
        record in the order they are sent (the order a Gilbert-Elliott link
        walks: with redundancy, each group's parity after its data), and
        each stream's end mark: it is lost when both of the two datagrams
        that carry it on the datagram channel would be."""
        cdef int i, b, at
        cdef Stream* s
        cdef CallInfo* c = alg.call
        cdef uint64_t link, index = 0
        cdef bint bad
        cdef double loss
        for i in range(alg.nstreams):
            s = &alg.streams[i]
            link = (<uint64_t>s.peer << 32) | <uint64_t>alg.rank
            for at in range(c.records):
                b = wire_record(c, at)
                index += 1
                if self.params.bernoulli and mpl_unit(mpl_hash4(
                        self.params.bernoulli_seed, seq, link, index)) < self.params.p:
                    s.drop[b] = 1
                if self.params.gilbert:
                    bad = self.bad[s.peer]
                    if mpl_unit(mpl_hash4(self.params.gilbert_seed, seq, link, 2 * index)) < (
                            self.params.p_bad_to_good if bad else self.params.p_good_to_bad):
                        bad = not bad
                    self.bad[s.peer] = bad
                    loss = self.params.loss_bad if bad else self.params.loss_good
                    if mpl_unit(mpl_hash4(self.params.gilbert_seed, seq, link, 2 * index + 1)) < loss:
                        s.drop[b] = 1
            s.drop_end = self.lost_twice(seq, link, i)

    cdef bint lost_twice(self, uint64_t seq, uint64_t link, int stream) noexcept nogil:
        """Are both copies of a stream's end mark lost (under the loss the
        link is in now)?"""
        cdef uint64_t tag = (<uint64_t>1 << 62) | (<uint64_t>stream << 1)
        cdef double p = 0.0
        if self.params.bernoulli:
            p = self.params.p
            if (mpl_unit(mpl_hash4(self.params.bernoulli_seed, seq, link, tag)) < p
                    and mpl_unit(mpl_hash4(self.params.bernoulli_seed, seq, link, tag | 1)) < p):
                return True
        if self.params.gilbert:
            p = self.params.loss_bad if self.bad[(link >> 32) % <uint64_t>self.size] \
                else self.params.loss_good
            if (mpl_unit(mpl_hash4(self.params.gilbert_seed, seq, link, tag)) < p
                    and mpl_unit(mpl_hash4(self.params.gilbert_seed, seq, link, tag | 1)) < p):
                return True
        return False

    cdef double delay(self, uint64_t seq, int rank) noexcept nogil:
        """Seconds this rank sleeps before the call (straggler model)."""
        if (self.params.straggler and rank == self.params.straggler_rank
                and mpl_unit(mpl_hash4(self.params.straggler_seed, seq, 0x5354524147ull, 0))
                < self.params.straggler_prob):
            return self.params.straggler_delay
        return 0.0
