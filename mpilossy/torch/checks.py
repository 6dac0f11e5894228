"""Collective checks: the same exception on every rank when any rank's
tensors or settings are unusable, and a MismatchError naming the first
difference when ranks hold different parameters."""

from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Sequence, Tuple

from mpi4py import MPI

from ..errors import MembershipChanged, MismatchError
from ..reliable import again
from .tensors import NamedTensors, host_problem


def signature(named: NamedTensors) -> List[Tuple[Any, ...]]:
    return [(name, tuple(t.shape), str(t.dtype), t.device.type) for name, t in named]


_ERROR_TYPES = {"TypeError": TypeError, "ValueError": ValueError, "BufferError": BufferError,
                "MismatchError": MismatchError}


def check_everywhere(comm: MPI.Intracomm, local_error: Optional[Exception],
                     entries: Sequence[Any] = (), what: str = "parameters") -> None:
    """Collective: raise the same exception on every rank if any rank has a
    local error, or if `entries` differ between ranks (MismatchError naming
    the first difference).  One small allgather; one more on mismatch.
    Elastic: a rank lost during it, the allgather is made again over the
    survivors (at construction, and where a growth checks a newcomer)."""
    digest = hashlib.sha256(repr(list(entries)).encode()).hexdigest()
    error = None if local_error is None else (type(local_error).__name__, str(local_error))
    outcomes = again(lambda: comm.allgather((error, digest)), MembershipChanged)
    failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if failed:
        rank, (kind, message) = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise _ERROR_TYPES.get(kind, ValueError)(f"rank {rank}{others}: {message}")
    if len({d for _, d in outcomes}) > 1:
        every = again(lambda: comm.allgather(list(entries)), MembershipChanged)
        raise MismatchError(f"{what} differ across ranks: {_first_difference(every)}")


def _first_difference(every: List[List[Any]]) -> str:
    ref = every[0]
    for rank, entries in enumerate(every[1:], 1):
        if entries == ref:
            continue
        for i, (a, b) in enumerate(zip(ref, entries)):
            if a != b:
                return f"entry {i} is {a} on rank 0 but {b} on rank {rank}"
        return f"rank 0 has {len(ref)} entries, rank {rank} has {len(entries)}"
    return "(no difference found)"


def check_tensors(comm: MPI.Intracomm, named: NamedTensors, *, reducible: bool,
                  extra: Any = None, what: str = "parameters",
                  problem: Optional[Exception] = None, cuda: bool = False,
                  copied: bool = False) -> None:
    """Collective: no `problem` (a local error) on any rank, every tensor
    usable on this rank, and the same names, shapes, dtypes and devices
    (plus `extra`: settings that must agree) on every rank."""
    for name, t in named:
        if problem is not None:
            break
        problem = host_problem(f"{what[:-1]} {name!r}", t, reducible, cuda, copied)
    devices = sorted({str(t.device) for _, t in named})
    if problem is not None and len(devices) > 1:
        problem = type(problem)(f"{problem} (the {what} are on several devices: "
                                f"{', '.join(devices)})")
    check_everywhere(comm, problem, signature(named) + [("extra", repr(extra))], what)
