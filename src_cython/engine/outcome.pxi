# One outcome per call on every rank: errors (and completions: without
# deadline, and to a channel's readers with one: Channel.tell_done) told over MPI,
# which loses nothing, beside what each channel says in-band (the one-sided
# status block, ERROR and END datagrams).
#
# The rule: a call that fails on one rank fails on every rank.  A rank that
# fails a call tells every peer.  A peer still in the call fails it too (the
# channels' in-band paths usually get there first).  A peer that already had
# its outcome of the call (its result was complete, or its deadline ended
# first) learns at its next call, which then fails on every rank with the
# same error, naming the call that failed.  A rank that has failed a call
# since has raised already and is not told twice.

cdef enum:
    ERROR_TAG = 0x4D45             # MPI tag of the notes

# How long close() waits for its notes to leave (seconds).
cdef double NOTE_LINGER = 1.0


cdef struct ErrorNote:
    # A note told over MPI: the call it is about, and the error that failed
    # it there, or ERR_NONE where the sender has its result of the call.
    # Either way the sender is done with the call and reads no more of it.
    uint64_t token                  # the communicator's (Outcomes.setup)
    uint64_t seq
    ErrorInfo err


cdef class Outcomes:
    """What this rank told its peers over MPI, and what it heard from them."""
    cdef MPI_Comm comm
    cdef int rank, size
    cdef MPI_Request* reqs            # the notes this rank sent that are in flight
    cdef ErrorNote** bufs
    cdef int nnotes, cap
    cdef uint64_t* done_seq           # per peer: the latest call it said it is done with
    # Errors of calls this rank has not settled, one per call, as many as
    # come: a peer that fails calls back to back (a stage of the hierarchy
    # refusing, bad input in a loop) while this rank sleeps sends notes of
    # every one of them before this rank is in the first (a fixed number of
    # slots lost the rest, and this rank returned results of calls that had
    # failed elsewhere).
    cdef ErrorNote* later
    cdef int nlater, later_cap
    cdef ErrorNote late               # the earliest error of a call this rank returned from
    cdef uint64_t settled             # the latest call whose outcome this rank has
    cdef uint64_t last_failed         # the latest call that failed on this rank
    cdef uint64_t heard               # error notes heard, for the channel's counters
    cdef uint64_t token               # drawn at setup, carried by every note

    cdef int setup(self, MPI_Comm comm) except -1:
        """Collective over `comm`.  The token tells this communicator's notes
        from those of a freed one whose context MPI gave to a new one: a
        note still unread when its communicator was freed would otherwise
        fail the new one's call of the same number."""
        self.comm = comm
        chk(MPI_Comm_rank(comm, &self.rank))
        chk(MPI_Comm_size(comm, &self.size))
        if self.rank == 0:
            self.token = int.from_bytes(os.urandom(8), "little") | 1
        chk(MPI_Bcast(&self.token, 1, MPI_UINT64_T, 0, comm))
        self.done_seq = <uint64_t*>calloc(self.size, sizeof(uint64_t))
        if self.done_seq == NULL:
            raise MemoryError()
        return 0

    def __dealloc__(self):
        # Notes still in flight (close() was not called: the communicator may
        # be gone by now) are left to MPI.
        free(self.reqs)
        free(self.bufs)
        free(self.done_seq)
        free(self.later)

    cdef void tell(self, uint64_t seq, const ErrorInfo* err) noexcept nogil:
        """Send `err` (ERR_NONE: done with call `seq`) to every peer; the notes
        stay until MPI is done with them (reap)."""
        cdef int p
        self.reap()
        for p in range(self.size):
            if p != self.rank and not self.tell_one(seq, err, p):
                return                  # no memory: the in-band paths will have to do

    cdef bint tell_one(self, uint64_t seq, const ErrorInfo* err, int peer) noexcept nogil:
        """Send `err` about call `seq` to `peer`; False where memory ran out."""
        cdef ErrorNote* note
        if self.nnotes == self.cap and not self.more():
            return False
        note = <ErrorNote*>malloc(sizeof(ErrorNote))
        if note == NULL:
            return False
        note.token = self.token
        note.seq = seq
        note.err = err[0]
        if MPI_Isend(note, sizeof(ErrorNote), MPI_BYTE, peer, ERROR_TAG, self.comm,
                     &self.reqs[self.nnotes]) != MPI_SUCCESS:
            free(note)
            return True
        self.bufs[self.nnotes] = note
        self.nnotes += 1
        return True

    cdef bint said_done(self, int peer, uint64_t seq) noexcept nogil:
        """Has `peer` said (in a note heard by now) that it is done with call
        `seq`: it sent what it will send of it?"""
        return self.done_seq[peer] >= seq

    cdef bint more(self) noexcept nogil:
        cdef int cap = 2 * self.cap + self.size
        cdef MPI_Request* reqs = <MPI_Request*>realloc(self.reqs, cap * sizeof(MPI_Request))
        if reqs == NULL:
            return False
        self.reqs = reqs
        cdef ErrorNote** bufs = <ErrorNote**>realloc(self.bufs, cap * sizeof(ErrorNote*))
        if bufs == NULL:
            return False
        self.bufs = bufs
        self.cap = cap
        return True

    cdef void reap(self) noexcept nogil:
        """Free the notes MPI has sent.  Testing them also moves the ones
        MPI postponed (MPICH's shared-memory transport queues a send when
        its cells are busy, and only the sender's progress sends it later):
        a channel's waits call this, or a rank waiting on one shared-memory
        word made no MPI call, and a peer waiting for its note of a failed
        call gave up after NOTE_WAIT with the wrong error."""
        cdef int i = 0, flag
        while i < self.nnotes:
            MPI_Test(&self.reqs[i], &flag, MPI_STATUS_IGNORE)
            if flag:
                free(self.bufs[i])
                self.nnotes -= 1
                self.reqs[i] = self.reqs[self.nnotes]
                self.bufs[i] = self.bufs[self.nnotes]
            else:
                i += 1

    cdef void hear(self) noexcept nogil:
        """Take the notes peers sent: an error of a call this rank has settled
        is `late` (unless this rank failed a call since), one of a call it
        has not goes to `later` (the channel fails that call with it)."""
        cdef int flag = 1
        cdef MPI_Status status
        cdef ErrorNote note
        self.reap()
        while True:
            MPI_Iprobe(MPI_ANY_SOURCE, ERROR_TAG, self.comm, &flag, &status)
            if not flag:
                return
            if MPI_Recv(&note, sizeof(ErrorNote), MPI_BYTE, status.MPI_SOURCE, ERROR_TAG,
                        self.comm, MPI_STATUS_IGNORE) != MPI_SUCCESS:
                return
            if note.token != self.token:
                continue                # a freed communicator's
            if note.seq > self.done_seq[status.MPI_SOURCE]:
                self.done_seq[status.MPI_SOURCE] = note.seq
            if note.err.kind == ERR_NONE:
                continue                # done, not failed
            self.heard += 1
            note.err.msg[MPL_MSG_LEN - 1] = 0
            if not ERR_NONE < note.err.kind <= ERR_LAST:
                note.err.kind = ERR_PROTOCOL
            if note.seq <= self.settled:
                self.keep_late(&note)
            else:
                self.keep_later(&note)

    cdef void keep_late(self, const ErrorNote* note) noexcept nogil:
        if self.last_failed < note.seq and (self.late.seq == 0 or note.seq < self.late.seq):
            self.late = note[0]

    cdef void keep_later(self, const ErrorNote* note) noexcept nogil:
        """One error per call (the first heard)."""
        cdef int i, cap
        cdef ErrorNote* grown
        for i in range(self.nlater):
            if self.later[i].seq == note.seq:
                return
        if self.nlater == self.later_cap:
            cap = 2 * self.later_cap + 8
            grown = <ErrorNote*>realloc(self.later, cap * sizeof(ErrorNote))
            if grown == NULL:
                return                  # no memory: the in-band paths will have to do
            self.later, self.later_cap = grown, cap
        self.later[self.nlater] = note[0]
        self.nlater += 1

    cdef bint pending(self, uint64_t seq, ErrorInfo* err) noexcept nogil:
        """Did a peer say that call `seq` (not settled here yet) failed?"""
        cdef int i
        for i in range(self.nlater):
            if self.later[i].seq == seq:
                err[0] = self.later[i].err
                return True
        return False

    cdef void settle(self, uint64_t seq, bint failed) noexcept nogil:
        """This rank has its outcome of call `seq`.  An error of it heard
        while it ran and not acted on (a channel that reads only its
        in-band paths during a call) becomes late when the call succeeded."""
        cdef int i, kept = 0
        self.settled = seq
        if failed:
            self.last_failed = seq
        for i in range(self.nlater):
            if self.later[i].seq <= seq:
                self.keep_late(&self.later[i])
            else:
                self.later[kept] = self.later[i]
                kept += 1
        self.nlater = kept

    cdef bint take_late(self, const CallInfo* call, ErrorInfo* err) noexcept nogil:
        """Before `call` begins: did a call this rank returned from fail on
        another rank?  Then `err` is what fails `call` on every rank."""
        self.hear()
        return self.late_error(err)

    cdef bint failed_elsewhere(self, const CallInfo* call, ErrorInfo* err) noexcept nogil:
        """While in `call`: did a peer say that this call failed, or that a
        call this rank returned from did (then this one fails: it is the
        first this rank is in after it heard)?  Then `err` says why."""
        self.hear()
        if self.pending(call.seq, err):
            return True
        return self.late_error(err)

    cdef bint late_error(self, ErrorInfo* err) noexcept nogil:
        cdef ErrorNote note = self.late
        self.late.seq = 0
        if note.seq == 0 or self.last_failed >= note.seq:
            return False
        err.kind = note.err.kind
        err.rank = note.err.rank
        snprintf(err.msg, MPL_MSG_LEN,
                 b"call %llu failed after rank %d had returned from it: %s",
                 <unsigned long long>note.seq, self.rank, note.err.msg)
        return True

    cdef void close(self):
        """Let the notes in flight leave (a bounded wait), and take the ones
        nobody will read any more."""
        cdef double limit = mpl_now() + NOTE_LINGER
        cdef int i
        with nogil:
            while self.nnotes and mpl_now() < limit:
                self.reap()
                if self.nnotes:
                    mpl_yield()
            self.hear()
        for i in range(self.nnotes):        # never completed: MPI may still read them
            MPI_Request_free(&self.reqs[i])
        self.nnotes = 0
