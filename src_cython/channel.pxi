# The narrow interface between the algorithms and a channel.
#
# An algorithm publishes *records*: the payload of one block of one slot
# (a partial sum, a final result) together with its contributor count.  It
# consumes records of its peers through *streams*: a stream is the sequence
# of blocks of one slot of one peer, resolved in block order.  A channel
# moves records; it never decides what they mean.

cdef enum:
    POLL_WAIT = 0    # not there yet
    POLL_READY = 1   # `Incoming` describes the payload
    POLL_GONE = 2    # the producer moved past this call: the record will never come
    POLL_FAIL = 3    # the producer reported an error or disagrees on the call

# Error kinds carried between ranks; the Python layer maps them to exceptions.
cdef enum:
    ERR_NONE = 0
    ERR_TYPE = 1
    ERR_VALUE = 2
    ERR_BUFFER = 3
    ERR_MISMATCH = 4
    ERR_PROTOCOL = 5
    ERR_MPI = 6

cdef enum:
    ALGO_RING = 0
    ALGO_TREE = 1

cdef struct ErrorInfo:
    int kind
    int rank          # rank that detected the error first
    char msg[MPL_MSG_LEN]

cdef struct CallInfo:
    uint64_t seq
    uint64_t sig          # hash of everything the record layout depends on
    int dtype
    int op
    int algo
    int scaling           # SCALE_UNBIASED or SCALE_ZERO_FILL
    bint rotate           # move chain starts / tree roots with every call
    Py_ssize_t count      # elements
    Py_ssize_t itemsize
    int nslots            # records a rank publishes per block index
    int nblocks           # blocks per slot
    Py_ssize_t block_elems
    Py_ssize_t block_bytes
    double start
    double timeout        # < 0: no deadline
    double anchor         # when every peer was seen in this call (or patience
                          # ran out); < 0 until then
    double budget         # seconds the stages need after the anchor; <= 0: unknown
    int nstages
    double* stage_end     # fraction of the budget at which each stage gives up

cdef struct Incoming:
    const char* data
    uint32_t count
    uint32_t nbytes

cdef struct GetBuffers:
    # Targets of in-flight MPI_Rget; owned by a stream, or by the zombie list
    # when a call ends before the get completes.
    mpl_record_t hdr
    mpl_record_t hdr2
    mpl_status_t status
    char* payload
    Py_ssize_t capacity

cdef struct Stream:
    # Filled by the algorithm.
    int peer              # producer rank
    int slot              # producer's slot
    int nblocks
    int stage             # deadline stage
    int tag               # the algorithm's own index
    bint stable           # payload must be copied out and validated before use
    # Engine.
    int cursor            # next block to resolve
    unsigned char* drop   # injected loss, one flag per block
    # Channel.
    int cstate
    MPI_Request req
    GetBuffers* gb


# Deadlines.  `start + timeout` is the hard cap of a call.  Inside it, stage
# deadlines are counted from the *anchor*: the moment this rank has seen every
# peer enter the call.  A peer that enters late (it finished the previous
# call later, or computed longer) therefore shifts the stages instead of
# losing its data in the early ones.  How long to wait for late peers: until
# `start + timeout - budget`, where the budget is what the stages need (a few
# times the duration of recent lossless calls of this kind, learned by the
# core; half the timeout before anything is learned).  After the anchor the
# stages are spread over the budget, so a call that loses data ends about one
# budget after the anchor rather than at the cap, and the skew it leaves for
# the next call stays within that call's patience.
cdef double COLD_PATIENCE = 0.5     # fraction of the timeout, before learning


cdef inline double stage_deadline(const CallInfo* call, int stage) noexcept nogil:
    cdef double end = call.start + call.timeout
    cdef double budget
    if call.anchor < 0:
        return end
    budget = end - call.anchor
    if 0 < call.budget < budget:
        budget = call.budget
    return call.anchor + budget * call.stage_end[stage]


cdef inline double patience_end(const CallInfo* call) noexcept nogil:
    """When to stop waiting for peers that have not entered the call."""
    if call.budget > 0:
        return max(call.start, call.start + call.timeout - call.budget)
    return call.start + COLD_PATIENCE * call.timeout


cdef inline double call_scale(const CallInfo* call, uint32_t count, int nranks) noexcept nogil:
    return scale_factor(call.scaling, call.op, count, nranks)


cdef class Channel:
    """What an algorithm needs from a channel (all methods but setup nogil)."""
    cdef int rank, size
    cdef ErrorInfo error          # set when a poll returns POLL_FAIL

    cdef int begin(self, CallInfo* call) except -1:
        """Prepare a call: announce it to peers, make room for its records."""
        raise NotImplementedError

    cdef int prepare(self, Stream* s) except -1:
        """Get a stream ready for the current call (buffers, state)."""
        return 0

    cdef char* claim(self, int slot, int block) noexcept nogil:
        """Payload memory of my record (slot, block), withdrawn from readers."""
        return NULL

    cdef char* mine(self, int slot, int block) noexcept nogil:
        """Payload memory of my record (slot, block), as last written."""
        return NULL

    cdef void publish(self, int slot, int block, uint32_t count, uint32_t nbytes,
                      const int* dests, int ndests) noexcept nogil:
        """Make my record (slot, block) available to `dests`."""
        pass

    cdef int poll(self, Stream* s, Incoming* inc) noexcept nogil:
        """Look for block `s.cursor` of stream `s`; never blocks."""
        return POLL_WAIT

    cdef void abandon(self, Stream* s) noexcept nogil:
        """Stop waiting for the block in flight on `s`."""
        pass

    cdef bint confirm(self, Stream* s) noexcept nogil:
        """After using a READY payload in place: was it stable meanwhile?"""
        return True

    cdef void progress(self) noexcept nogil:
        """Drive the transport while nothing else happens."""
        pass

    cdef int entered(self) noexcept nogil:
        """How many ranks (me included) are known to have entered this call."""
        return self.size

    cdef void end(self, CallInfo* call, bint failed) noexcept nogil:
        """Finish a call (give peers what they still read from us)."""
        pass

    cdef void fail(self, CallInfo* call, ErrorInfo* err) noexcept nogil:
        """Tell peers that this call failed, and why."""
        pass

    cdef void close(self):
        pass
