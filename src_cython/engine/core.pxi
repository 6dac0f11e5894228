# The compiled state of one lossy communicator and the entry points that the
# Python layer calls: one call = layout, begin, plan, run, end.

def library_version() -> str:
    """MPI_Get_library_version of the libmpi this extension is linked to."""
    cdef char text[8192]
    cdef int length = 0
    chk(MPI_Get_library_version(text, &length))
    return text[:length].decode(errors="replace")


# What one call returns to the Python layer (mpilossy.communicator).
CallResult = namedtuple("CallResult", [
    "err_kind", "err_rank", "err_msg",        # ERR_NONE (0) when the call succeeded
    "delivered", "elapsed", "deadline_hit", "fallback", "min_contributors", "seq",
    "lost_blocks",                            # (injected, late, gone, torn)
    "timing",                                 # (start, anchor, end, seen), monotonic clock
    "agreed",
    "contributors",                           # direct / all-gather: the core's bitmaps
    "rebuilt",                                # blocks rebuilt from parity (redundancy)
    "read_blocks",                            # data blocks this rank's streams covered
    "weight_sum",                             # weighted direct: Direct.own_weight(); else -1
], defaults=(0, -1.0))



cdef class CallSpec:
    """One call, resolved (mpilossy/call/spec.py builds it from the user's
    arguments and the communicator's config): everything the core needs
    besides the buffers, and what the statistics and the trace report."""
    cdef readonly int collective, algorithm, dtype, op
    cdef readonly double timeout     # the call's deadline in seconds; < 0: none
    cdef readonly double budget      # what the core gets: the deadline less the auto wait
    cdef readonly double weight      # this rank's weight; 0: none
    cdef readonly int qbits          # bits per quantised value; 0: not quantised
    cdef readonly Py_ssize_t qgroup  # values per quantisation scale
    cdef readonly object residual    # where quantisation errors go (error feedback), or None
    cdef readonly Py_ssize_t nbytes  # of this rank's sendbuf
    cdef readonly Py_ssize_t elements    # of the whole vector
    cdef readonly tuple kind         # (collective, algorithm, size bucket): the auto deadline's key
    cdef readonly int fec_k, fec_m   # redundancy: m parity records per group of k; 0: none
    cdef readonly int part           # PART_*: a whole call, or a segment of a pipelined one
    cdef readonly unsigned int tag   # what the ranks must share beyond the wire: in the signature

    def __init__(self, *, int collective, int algorithm, int dtype, int op, double timeout,
                 double budget, double weight, int qbits, Py_ssize_t qgroup, residual,
                 Py_ssize_t nbytes, Py_ssize_t elements, tuple kind, int fec_k=0, int fec_m=0,
                 int part=PART_WHOLE, unsigned int tag=0):
        if not PART_WHOLE <= part <= PART_LAST:
            raise ValueError(f"part must be PART_WHOLE, PART_SEGMENT or PART_LAST, got {part}")
        self.collective = collective
        self.algorithm = algorithm
        self.dtype = dtype
        self.op = op
        self.timeout = timeout
        self.budget = budget
        self.weight = weight
        self.qbits = qbits
        self.qgroup = qgroup
        self.residual = residual
        self.nbytes = nbytes
        self.elements = elements
        self.kind = kind
        self.fec_k = fec_k
        self.fec_m = fec_m
        self.part = part
        self.tag = tag

    @property
    def redundancy(self):
        """(k, m), or None without redundancy."""
        return (self.fec_k, self.fec_m) if self.fec_k else None

    def __repr__(self):
        return (f"CallSpec(collective={self.collective}, algorithm={self.algorithm}, "
                f"dtype={self.dtype}, op={self.op}, timeout={self.timeout}, "
                f"budget={self.budget}, weight={self.weight}, qbits={self.qbits}, "
                f"qgroup={self.qgroup}, nbytes={self.nbytes}, elements={self.elements}, "
                f"kind={self.kind}, redundancy={self.redundancy}, tag={self.tag})")


cdef class Core:
    """Channel, algorithms and call counter of one mpilossy.Communicator."""
    cdef MPI.Comm comm           # the communicator's private duplicate
    cdef int rank, size
    cdef Channel chan
    cdef Ring ring
    cdef Tree tree
    cdef Direct direct
    cdef Gather gather
    cdef LossState loss
    cdef uint64_t seq
    cdef CallInfo call
    cdef ErrorInfo err
    cdef Py_ssize_t block_bytes
    cdef bint closed
    cdef int scaling
    cdef bint rotate
    cdef int spin                # the engine's settings (CallInfo.spin, early_close)
    cdef double early_close

    def __cinit__(self, MPI.Comm comm not None, config, str channel):
        """The core of a communicator on `comm` (its private duplicate):
        `config` is its mpilossy.call.config.Config (validated and agreed),
        `channel` "rma" or "ud" ("auto" resolved)."""
        self.comm = comm
        self.scaling = SCALE_ZERO_FILL if config.scaling == "zero-fill" else SCALE_UNBIASED
        self.rotate = config.rotate
        self.spin = config.spin
        self.early_close = config.early_close
        chk(MPI_Comm_rank(comm.ob_mpi, &self.rank))
        chk(MPI_Comm_size(comm.ob_mpi, &self.size))
        self.block_bytes = config.block_bytes
        self.ring = Ring(self.rank, self.size)
        self.tree = Tree(self.rank, self.size)
        self.tree.set_radix(config.tree_radix)
        self.direct = Direct(self.rank, self.size)
        self.gather = Gather(self.rank, self.size)
        self.loss = LossState(self.size)
        cdef DgramChannel ud
        cdef RmaChannel rma
        if channel == "ud":
            ud = DgramChannel()
            ud.setup(comm.ob_mpi, config.ud_provider, config.ud_domain, config.ud_mtu,
                     config.ud_recv_buffers, config.ud_socket_bytes)
            self.chan = ud
        else:
            rma = RmaChannel()
            rma.setup(comm.ob_mpi, config.capacity, config.rma_shm)
            self.chan = rma
        self.chan.notes_to_absent = not config.elastic

    @property
    def seq(self) -> int:
        """Number of calls made so far."""
        return self.seq

    @property
    def capacity(self) -> int:
        """Bytes of this rank's window (0 for the datagram channel)."""
        return self.chan.info().get("window_bytes", 0)

    @property
    def shared_peers(self) -> int:
        """Peers read through shared memory (the others through MPI_Rget)."""
        return self.chan.info().get("shared_memory_peers", 0)

    @property
    def max_block(self) -> int:
        """Largest record payload the channel moves as one unit (bytes)."""
        return self.chan.max_block_bytes()

    def channel_info(self) -> dict:
        """What the channel is and what it has seen (datagram counters), and
        the calls made so far."""
        return {**self.chan.info(), "seq": self.seq}

    def datagram_key(self) -> bytes:
        """The datagram channel's MAC key (tests make authentic replays with
        it; it is never sent on the network)."""
        return self.chan.mac_key()

    def set_send_rate(self, double rate, double burst, bytes local=None):
        """channel='ud': pace this rank's datagrams at `rate` bytes per
        second on the wire (0: unpaced), at most `burst` bytes at once;
        `local` (a byte per rank, nonzero on this node): datagrams that
        never cross the port, which cost nothing."""
        self.chan.set_rate(rate, burst, local)

    def set_offload(self, bint on) -> bool:
        """channel='ud', native transport: segmentation and receive offload
        on or off (on by default where the kernel has them); whether
        receive offload is on."""
        return self.chan.set_offload(on)

    def configure_loss(self, dict spec):
        self.loss.configure(spec)

    def close(self):
        if not self.closed:
            self.closed = True
            self.chan.close()

    def collective(self, sendbuf, recvbuf, CallSpec spec not None):
        """Run one call (spec.collective: COLL_*) on buffers the Python layer
        has validated, as `spec` says (mpilossy/call/spec.py resolves it).
        Returns its CallResult."""
        cdef Py_buffer sb, rb, eb
        cdef float* err = NULL
        if spec.fec_k and mpl_fec_check(spec.fec_k, spec.fec_m) != NULL:
            raise ValueError(f"redundancy=({spec.fec_k}, {spec.fec_m}): "
                             f"{mpl_fec_check(spec.fec_k, spec.fec_m).decode()}")
        PyObject_GetBuffer(sendbuf, &sb, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(recvbuf, &rb, PyBUF_SIMPLE | PyBUF_WRITABLE)
        except BaseException:
            PyBuffer_Release(&sb)
            raise
        if spec.residual is not None:
            try:
                PyObject_GetBuffer(spec.residual, &eb, PyBUF_SIMPLE | PyBUF_WRITABLE)
            except BaseException:
                PyBuffer_Release(&rb)
                PyBuffer_Release(&sb)
                raise
            err = <float*>eb.buf
        try:
            if err != NULL and (spec.dtype != DT_F32 or eb.len != sb.len):
                raise ValueError("residual: float32, as long as the send buffer")
            return self.run(<char*>sb.buf, <char*>rb.buf,
                            rb.len if spec.collective == COLL_ALLGATHER else sb.len, spec, err)
        finally:
            if err != NULL:
                PyBuffer_Release(&eb)
            PyBuffer_Release(&rb)
            PyBuffer_Release(&sb)

    cdef object run(self, char* send, char* recv, Py_ssize_t nbytes, CallSpec spec,
                    float* residual):
        """`nbytes`: the whole vector (the send buffer of an all-reduce or a
        reduce-scatter, the receive buffer of an all-gather)."""
        cdef CallInfo* call = &self.call
        cdef Algorithm alg
        cdef int coll = spec.collective, algo = spec.algorithm, dtype = spec.dtype
        if coll == COLL_ALLGATHER:
            alg = self.gather
            algo = ALGO_DIRECT
        elif algo == ALGO_DIRECT:
            alg = self.direct
        elif coll == COLL_REDUCE_SCATTER or algo == ALGO_RING:
            alg = self.ring
            algo = ALGO_RING
        else:
            alg = self.tree
        cdef double t0 = mpl_now(), pause
        cdef int failed = 0, i, began
        cdef bint lossy = self.loss.drops()
        self.seq += 1
        memset(call, 0, sizeof(CallInfo))
        call.seq = self.seq
        call.dtype = dtype
        call.op = spec.op
        call.algo = algo
        call.coll = coll
        call.itemsize = ITEMSIZE[dtype]
        call.count = nbytes // call.itemsize
        call.timeout = spec.budget
        call.injected = lossy
        call.spin = self.spin
        call.early_close = self.early_close
        call.scaling = self.scaling
        call.rotate = self.rotate
        call.payload.weight = spec.weight
        call.payload.qbits = spec.qbits
        call.payload.qgroup = spec.qgroup
        call.payload.residual = residual if spec.qbits else NULL
        call.fec_k = spec.fec_k
        call.fec_m = spec.fec_m if spec.fec_k else 0
        call.part = spec.part
        pause = self.loss.delay(call.seq, self.rank)
        with nogil:
            mpl_sleep(pause)
        call.start = mpl_now()
        if self.size == 1:
            k_scale(dtype, 1.0, recv, send, call.count)    # every collective is a copy
            return self.result(call, None, False, t0, mpl_now())
        # (a parity record is a block and its 8-byte trailer: blocks shrink to fit)
        call.max_block = self.chan.max_block_bytes() - (8 if call.fec_k else 0)
        call.block_elems = max(1, min(self.block_bytes, call.max_block) // call.itemsize)
        alg.layout(call)
        call.records = call.nblocks
        call.record_bytes = call.block_bytes
        if call.fec_k:
            call.ngroups = (call.nblocks + call.fec_k - 1) // call.fec_k
            call.records += call.ngroups * call.fec_m
            call.record_bytes += 8
        cdef Payload* pay = &call.payload
        call.sig = mpl_hash4(<uint64_t>call.count,
                             <uint64_t>dtype | <uint64_t>call.op << 8 | <uint64_t>algo << 16
                             | <uint64_t>self.tree.radix << 24 | <uint64_t>coll << 40
                             | <uint64_t>(pay.weight > 0) << 48 | <uint64_t>pay.qbits << 52
                             | <uint64_t>(call.timeout < 0) << 60 | <uint64_t>call.part << 61,
                             <uint64_t>call.block_elems ^ (<uint64_t>pay.qgroup << 40)
                             ^ (<uint64_t>call.fec_k << 24) ^ (<uint64_t>call.fec_m << 32),
                             <uint64_t>call.nblocks ^ (<uint64_t>self.size << 32)
                             ^ (<uint64_t>spec.tag << 56)) | 1
        self.chan.remember(call.seq, call.sig)
        if self.chan.late_error(call, &self.err):
            # A call this rank returned from failed elsewhere: this one fails
            # on every rank, saying so (outcome.pxi).
            with nogil:
                self.chan.fail(call, &self.err)
                self.chan.settle(call, True)
                self.chan.end(call, True)
            return self.result(call, None, True, t0, mpl_now())
        try:
            began = self.chan.begin(call)
            if not began:
                alg.bind(self.chan, call, send, recv)
                if lossy:
                    self.loss.fill(alg, call.seq)
        except BaseException:
            # (No memory, or sends that never completed.)  Tell the peers
            # and finish the call before the error leaves: the channel is
            # left able to take the next call, or to refuse it cleanly.
            self.err.kind = ERR_PROTOCOL
            self.err.rank = self.rank
            snprintf(self.err.msg, MPL_MSG_LEN, b"rank %d could not start call %llu",
                     self.rank, <unsigned long long>call.seq)
            with nogil:
                self.chan.fail(call, &self.err)
                self.chan.settle(call, True)
                self.chan.end(call, True)
            raise
        cdef Py_ssize_t read_blocks = 0
        if began:
            memcpy(&self.err, &self.chan.error, sizeof(ErrorInfo))
            failed = 1
        else:
            with nogil:
                failed = run_streams(alg, self.chan, call, lossy, &self.err)
                for i in range(alg.nstreams):
                    self.chan.abandon(&alg.streams[i])
                    read_blocks += alg.streams[i].nblocks
        with nogil:
            self.chan.settle(call, failed)
            self.chan.end(call, failed)
        cdef double finished = mpl_now()
        if PyErr_Occurred():
            # A signal handler's exception (KeyboardInterrupt): raised in a
            # call that waits without deadline, or while its rank waited for
            # its peers to finish (the channel's end).
            raise_pending()
        return self.result(call, alg, failed, t0, finished, read_blocks)

    cdef object result(self, CallInfo* call, Algorithm alg, bint failed, double t0,
                       double finished, Py_ssize_t read_blocks=0):
        """The CallResult of `call` (the one place one is made): the failure
        in self.err, a one-rank copy (`alg` None), or the algorithm's account."""
        if failed:
            return CallResult(
                err_kind=self.err.kind, err_rank=self.err.rank,
                err_msg=self.err.msg.decode(errors="replace"), delivered=0.0,
                elapsed=finished - t0, deadline_hit=False, fallback=0.0, min_contributors=0,
                seq=call.seq, lost_blocks=(0, 0, 0, 0), timing=(call.start, -1.0, finished, -1.0),
                agreed=0.0, contributors=None, rebuilt=0, read_blocks=0)
        if alg is None:
            return CallResult(
                err_kind=ERR_NONE, err_rank=-1, err_msg="", delivered=1.0,
                elapsed=finished - t0, deadline_hit=False, fallback=0.0, min_contributors=1,
                seq=call.seq, lost_blocks=(0, 0, 0, 0),
                timing=(call.start, call.start, finished, call.start),
                agreed=1.0, contributors=None, rebuilt=0, read_blocks=0)
        return CallResult(
            err_kind=ERR_NONE, err_rank=-1, err_msg="", delivered=alg.delivered(),
            elapsed=finished - t0, deadline_hit=alg.deadline_hit,
            fallback=alg.fallback_elems / <double>alg.result_elems if alg.result_elems else 0.0,
            min_contributors=alg.min_count, seq=call.seq,
            lost_blocks=(alg.lost_injected, alg.lost_late, alg.lost_gone, alg.lost_torn),
            timing=(call.start, call.anchor, finished, call.seen), agreed=alg.agreed(),
            contributors=(<Chunked>alg).contributors()
            if alg is self.direct or alg is self.gather else None,
            rebuilt=alg.rebuilt_blocks, read_blocks=read_blocks,
            weight_sum=(<Direct>alg).own_weight() if alg is self.direct else -1.0)

    def fail(self, int kind, str message, double timeout):
        """This rank cannot take part in the next call (bad input): count the
        call, tell the peers why, and return its CallResult (the error to
        raise)."""
        cdef CallInfo* call = &self.call
        self.seq += 1
        memset(call, 0, sizeof(CallInfo))
        call.seq = self.seq
        call.timeout = timeout
        call.start = mpl_now()
        self.chan.remember(call.seq, 0)
        self.err.kind = kind
        self.err.rank = self.rank
        encoded = message.encode()[:MPL_MSG_LEN - 1]
        memset(self.err.msg, 0, MPL_MSG_LEN)
        memcpy(self.err.msg, <char*>encoded, len(encoded))
        if self.size > 1:
            with nogil:
                self.chan.fail(call, &self.err)
                self.chan.settle(call, True)
                self.chan.end(call, True)
        return self.result(call, None, True, call.start, call.start)


cdef int raise_pending() except -1:
    """Propagate the exception that is already set (by a signal handler)."""
    return -1
