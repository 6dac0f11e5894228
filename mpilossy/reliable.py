"""Reliable collectives of a Communicator: barrier() and bcast(), exact over
every rank still in.  Each is one or more *attempts*: a nonblocking MPI
collective started on a state's `exact` communicator, with its buffers.
The Communicator waits for an attempt (survivors.Elastic.wait on an elastic
communicator: bounded by its membership) and, when ranks were excluded
meanwhile, abandons it whole and makes the next one over the survivors
(docs/elastic.md).  An attempt never writes into the user's buffer: a
late peer may still complete an abandoned one, so it works on buffers of
its own and the result is copied out once an attempt completed."""

from __future__ import annotations

import zlib
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .errors import MismatchError, MPILossyError
from .state import State

__all__ = ["Attempt", "Run", "bcast"]

# A collective started on a state: (request, what it reads, what it writes).
Attempt = Callable[[State], Tuple[MPI.Request, Any, np.ndarray]]
# Waits for one attempt, made again over the survivors as needed: what it wrote.
Run = Callable[[Attempt], np.ndarray]


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
    as they are at each attempt).  One reduction
    first: every rank's problem, byte count, dtype and root agreed, so
    that a mismatch raises on every rank instead of garbage.  If the root
    is excluded before its values arrived, MPILossyError on every survivor."""
    problem = bcast_problem(buf, root, rank, len(members()))
    owner = -1
    if problem is None:
        owner = members()[root]       # (its rank for good: the numbering changes on exclusion)
        dtype = zlib.crc32(buf.dtype.str.encode())
        mine = np.array([0, buf.nbytes, -buf.nbytes, dtype, -dtype, owner, -owner], np.int64)
    else:
        mine = np.array([rank + 1, 0, 0, 0, 0, 0, 0], np.int64)

    def check(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
        agreed = np.empty_like(mine)
        return state.exact.Iallreduce(mine, agreed, op=MPI.MAX), mine, agreed

    agreed = run(check)
    if problem is not None:
        raise problem
    if agreed[0]:
        raise MPILossyError(f"rank {agreed[0] - 1} cannot take part in this bcast "
                            f"(its own error says why)")
    if agreed[1] != -agreed[2] or agreed[3] != -agreed[4]:
        raise MismatchError("bcast: the ranks passed arrays of different byte counts or dtypes")
    if agreed[5] != -agreed[6]:
        raise MismatchError("bcast: the ranks passed different roots")
    data = buf.reshape(-1).view(np.uint8)

    def send(state: State) -> Tuple[MPI.Request, Any, np.ndarray]:
        members_now = list(members())
        if owner not in members_now:
            raise MPILossyError(f"the root of this bcast (rank {owner} of the communicator "
                                f"this one was built on) was excluded before its values "
                                f"arrived")
        at = members_now.index(owner)
        into = data if state.rank == at else np.empty_like(data)
        return state.exact.Ibcast(into, root=at), None, into

    got = run(send)
    if got is not data:
        data[...] = got

