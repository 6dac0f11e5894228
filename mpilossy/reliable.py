"""Reliable collectives of a Communicator, exact over every rank still in:
barrier() and bcast(), and BoundedComm, the subset of an mpi4py
communicator that mpilossy.torch's own reliable calls use.  Each is one or
more *attempts*: a nonblocking MPI collective started on a state's `exact`
communicator, with its buffers.  The Communicator waits for an attempt
(survivors.Elastic.wait on an elastic communicator: bounded by its
membership); when ranks were excluded meanwhile it abandons the attempt
whole, goes on over the survivors and raises Switched.  barrier() and
bcast() then start again from their first attempt (the ranks that saw an
attempt complete and those that did not all start from there); BoundedComm
raises MembershipChanged to its caller, which made several calls whose
ranks and roots have changed (docs/elastic.md).  An attempt never writes
into the caller's buffer: a late peer may still complete an abandoned one,
so it works on buffers of its own, copied out once it completed."""

from __future__ import annotations

import functools
import operator
import pickle
import zlib
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type, TypeVar

import numpy as np
from mpi4py import MPI

from .errors import MembershipChanged, MismatchError, MPILossyError
from .state import State

__all__ = ["Attempt", "Run", "Switched", "again", "bcast", "BoundedComm"]

T = TypeVar("T")
# A collective started on a state: (request, what it reads, what it writes).
Attempt = Callable[[State], Tuple[MPI.Request, Any, np.ndarray]]
# Waits for one attempt (closing: the barrier that closes a collective): what
# it wrote; raises Switched if ranks were excluded meanwhile.
Run = Callable[..., np.ndarray]


class Switched(Exception):
    """Ranks were excluded while an attempt was in flight: the Communicator
    goes on over the survivors; the attempt was abandoned."""


def again(operation: Callable[[], T], on: Type[BaseException] = Switched) -> T:
    """`operation()`, made again from its start as long as it raises `on`:
    Switched within this module; MembershipChanged for a caller of
    BoundedComm, whose operation made several calls whose ranks and roots
    have changed (its retry over the survivors)."""
    while True:
        try:
            return operation()
        except on:
            continue


def _ibarrier(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
    return state.exact.Ibarrier(), None, np.empty(0)


def closed(run: Run, attempt: Attempt) -> np.ndarray:
    """One collective and the barrier that closes it.  A collective can
    complete on some ranks and not on others (a bcast's receivers have their
    data while the root still sends to a rank that stopped); none leaves
    the barrier before every rank entered it, so the survivors of a loss
    during it all make the collective again, or, where one of them had left
    the barrier, none does (Elastic.wait)."""
    got = run(attempt)
    run(_ibarrier, closing=True)
    return got


def barrier(run: Run) -> None:
    again(lambda: run(_ibarrier, closing=True))


def bcast_problem(buf: Any, root: Any, rank: int, size: int) -> Optional[Exception]:
    """Why this rank cannot take part in bcast(buf, root) (None if it can)."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not (
            0 <= root < size):
        return ValueError(f"root must be a rank of the communicator (0..{size - 1}), "
                          f"got {root!r}")
    if not isinstance(buf, np.ndarray):
        return TypeError(f"bcast needs a NumPy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        return BufferError("bcast needs a C-contiguous array")
    if rank != root and not buf.flags.writeable:
        return BufferError("buf is read-only; the root's values are written into it")
    return None


def bcast(run: Run, buf: Any, root: Any, rank: int,
          members: Callable[[], Sequence[int]]) -> None:
    """`buf` on every rank becomes `root`'s (a rank of the communicator as
    it is now; members(): its ranks in the communicator it was built on,
    as they are at each attempt).  One reduction first: every rank's
    problem, byte count, dtype and root agreed, so that a mismatch raises
    on every rank instead of garbage.  If the root is excluded before its
    values arrived, MPILossyError on every survivor."""
    problem = bcast_problem(buf, root, rank, len(members()))
    owner = -1
    if problem is None:
        owner = members()[root]     # (its rank for good: the numbering changes on exclusion)
        dtype = zlib.crc32(buf.dtype.str.encode())
        mine = np.array([0, buf.nbytes, -buf.nbytes, dtype, -dtype, owner, -owner], np.int64)
    else:
        mine = np.array([rank + 1, 0, 0, 0, 0, 0, 0], np.int64)
    data = None if problem is not None else buf.reshape(-1).view(np.uint8)

    def check(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
        agreed = np.empty_like(mine)
        return state.exact.Iallreduce(mine, agreed, op=MPI.MAX), mine, agreed

    def send(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
        members_now = list(members())
        if owner not in members_now:
            raise MPILossyError(f"the root of this bcast (rank {owner} of the communicator "
                                f"this one was built on) was excluded before its values "
                                f"arrived")
        at = members_now.index(owner)
        assert data is not None
        into = data if state.rank == at else np.empty_like(data)
        return state.exact.Ibcast(into, root=at), None, into

    def whole() -> np.ndarray:
        agreed = run(check)
        if problem is not None:
            raise problem
        if agreed[0]:
            raise MPILossyError(f"rank {agreed[0] - 1} cannot take part in this bcast "
                                f"(its own error says why)")
        if agreed[1] != -agreed[2] or agreed[3] != -agreed[4]:
            raise MismatchError("bcast: the ranks passed arrays of different byte counts "
                                "or dtypes")
        if agreed[5] != -agreed[6]:
            raise MismatchError("bcast: the ranks passed different roots")
        return closed(run, send)

    got = again(whole)
    if data is not None and got is not data:
        data[...] = got


# mpi4py's reductions of Python objects
_PYTHON_OPS: List[Tuple[MPI.Op, Callable[[Any, Any], Any]]] = [
    (MPI.SUM, operator.add), (MPI.PROD, operator.mul), (MPI.MAX, max), (MPI.MIN, min),
    (MPI.LAND, lambda a, b: a and b), (MPI.LOR, lambda a, b: a or b)]


class BoundedComm:
    """What mpilossy.torch's reliable calls use on an elastic Communicator
    (torch/communicators.py's reliable_comm): Barrier, Bcast, bcast,
    Allreduce, allreduce, allgather and Allgatherv with mpi4py's signatures, and
    shift (an object to the next rank, around the ring), each bounded by the
    membership; if ranks are excluded while one is in
    flight, MembershipChanged (the caller makes its operation again, over
    the survivors).  Anything else is the Communicator's duplicate's own,
    unbounded.  `rank` and `size` are the survivors' once ranks are out."""

    def __init__(self, run: Run, comm: Callable[[], MPI.Intracomm]) -> None:
        self._run, self._comm = run, comm

    def _once(self, attempt: Optional[Attempt]) -> np.ndarray:
        """The collective `attempt` starts, closed by a barrier (None: the
        barrier alone)."""
        try:
            if attempt is None:
                return self._run(_ibarrier, closing=True)
            return closed(self._run, attempt)
        except Switched:
            raise MembershipChanged("ranks were excluded during a reliable collective; "
                                    "the communicator goes on over the survivors") from None

    @property
    def rank(self) -> int:
        return self._comm().Get_rank()

    @property
    def size(self) -> int:
        return self._comm().Get_size()

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm(), name)

    def Barrier(self) -> None:
        self._once(None)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        data = np.asarray(buf).reshape(-1).view(np.uint8)

        def attempt(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            into = data if state.rank == root else np.empty_like(data)
            return state.exact.Ibcast(into, root=root), None, into

        got = self._once(attempt)
        if got is not data:
            data[...] = got

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> None:
        recv = np.asarray(recvbuf)
        send = np.array(recv if sendbuf is MPI.IN_PLACE else sendbuf, copy=True)

        def attempt(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            into = np.empty_like(recv)
            return state.exact.Iallreduce(send, into, op=op), send, into

        recv[...] = self._once(attempt)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        """In place only (MPI.IN_PLACE, [data, (counts, displs), type])."""
        if sendbuf is not MPI.IN_PLACE:
            raise NotImplementedError("BoundedComm.Allgatherv: in place only")
        data, (counts, displs), kind = recvbuf
        data = np.asarray(data)

        def attempt(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            into = data.copy()
            return (state.exact.Iallgatherv(MPI.IN_PLACE, [into, (counts, displs), kind]),
                    None, into)

        data[...] = self._once(attempt)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        mine = pickle.dumps(obj) if self.rank == root else b""
        length = np.array([len(mine)], np.int64)
        self.Bcast(length, root)
        data = np.frombuffer(mine, np.uint8).copy() if mine else np.empty(length[0], np.uint8)
        self.Bcast(data, root)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def allreduce(self, obj: Any, op: MPI.Op = MPI.SUM) -> Any:
        """Python objects, as mpi4py's allreduce: every rank's, gathered
        (allgather) and reduced in rank order."""
        reduce = next((f for o, f in _PYTHON_OPS if o == op), None)
        if reduce is None:
            raise NotImplementedError(f"BoundedComm.allreduce: op {op} (SUM, PROD, MAX, "
                                      f"MIN, LAND, LOR only)")
        return functools.reduce(reduce, self.allgather(obj))

    def allgather(self, obj: Any) -> List[Any]:
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)

        def lengths_of(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            send = np.array([mine.size], np.int64)
            into = np.empty(state.size, np.int64)
            return state.exact.Iallgather(send, into), send, into

        lengths = self._once(lengths_of)
        displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

        def data_of(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            into = np.empty(int(lengths.sum()), np.uint8)
            return (state.exact.Iallgatherv(mine, [into, (lengths, displs), MPI.BYTE]),
                    mine, into)

        data = self._once(data_of)
        return [pickle.loads(data[d:d + n].tobytes()) for d, n in zip(displs, lengths)]

    def shift(self, obj: Any) -> Any:
        """Python objects around the ring: each rank sends `obj` to the next
        rank and returns the previous rank's (two nonblocking all-to-alls
        that move one message each: the length, then the data)."""
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)

        def ring(state: State) -> Tuple[int, int]:
            return (state.rank + 1) % state.size, (state.rank - 1) % state.size

        def lengths_of(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            send = np.zeros(state.size, np.int64)
            send[ring(state)[0]] = mine.size
            into = np.empty(state.size, np.int64)
            return state.exact.Ialltoall(send, into), send, into

        lengths = self._once(lengths_of)

        def data_of(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
            after, before = ring(state)
            sent, taken = np.zeros(state.size, np.int64), np.zeros(state.size, np.int64)
            sent[after], taken[before] = mine.size, lengths[before]
            at = np.zeros(state.size, np.int64)
            into = np.empty(int(lengths[before]), np.uint8)
            return (state.exact.Ialltoallv([mine, (sent, at), MPI.BYTE],
                                           [into, (taken, at), MPI.BYTE]), mine, into)

        return pickle.loads(self._once(data_of).tobytes())
