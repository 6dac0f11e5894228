"""Group averaging (Moshpit SGD's scheme): average in small groups that
change every round, so that no round needs every rank at once.

The ranks sit on a grid of d dimensions whose sides are at most
`group_size` (mixed radix: `grid_shape`).  Round t averages, lossily, along
dimension t mod d: each rank with the ranks that differ from it in that
coordinate alone, a group of one side's length.  Without loss, after d
rounds in a row (any d consecutive ones) every rank holds the exact global
average: averaging along every axis of a full grid is averaging over the
grid.  Under loss each round is the unbiased lossy average of the group (the
contributions that arrived, rescaled), so the d-round result is the global
average in expectation, and how far from it a run ends is measured by
`python -m mpilossy.bench group`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from mpi4py import MPI

from .call.stats import CollectiveStats
from .communicator import Communicator
from .errors import LaggingError, MismatchError, MPILossyError

# The exceptions a failed Communicator raises, by name, for the ranks that
# only hear of the failure (anything else becomes an MPILossyError).
_ERRORS = {cls.__name__: cls for cls in (TypeError, ValueError, BufferError, MemoryError,
                                         OSError, RuntimeError, MismatchError, MPILossyError,
                                         LaggingError)}

__all__ = ["GroupAverager", "grid_shape"]


def grid_shape(size: int, group_size: int) -> Tuple[int, ...]:
    """The grid's sides for `size` ranks, each at most `group_size` where the
    factors of `size` allow (a prime factor larger than `group_size` is a
    side of its own): the product is `size`, largest sides first."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    sides: List[int] = []
    left = size
    while left > 1:
        side = next((f for f in range(min(group_size, left), 1, -1) if left % f == 0), None)
        if side is None:                     # every factor <= group_size is gone
            side = next(f for f in range(group_size + 1, left + 1) if left % f == 0)
        sides.append(side)
        left //= side
    return tuple(sorted(sides, reverse=True))


def _coordinates(rank: int, shape: Tuple[int, ...]) -> List[int]:
    coords = []
    for side in shape:
        coords.append(rank % side)
        rank //= side
    return coords


class GroupAverager:
    """Lossy averaging in rotating groups (Moshpit SGD).

    ``GroupAverager(comm, group_size=2, **communicator_arguments)`` builds
    one mpilossy Communicator per grid dimension (collective: if any group's
    Communicator fails, every rank raises the same exception, naming the
    ranks and the first one's error).  Each
    ``average(buf)`` is one round: buf becomes the lossy average of buf over
    this round's group, in place, and the round's statistics are returned.
    ``rounds_to_mix`` rounds in a row give the exact global average without
    loss.
    """

    def __init__(self, comm: MPI.Intracomm, group_size: int = 2,
                 **communicator_arguments: Any) -> None:
        error: Optional[Exception] = None
        shape: Tuple[int, ...] = ()
        try:
            shape = grid_shape(comm.Get_size(), group_size)
        except (TypeError, ValueError) as exc:
            error = exc
        # Every rank learns of a bad argument on any rank.
        if any(comm.allgather(error is not None)):
            raise error or ValueError("GroupAverager arguments rejected on another rank")
        self.comm = comm
        self.shape = shape
        self.coordinates = _coordinates(comm.Get_rank(), shape)
        self._groups: List[Communicator] = []
        self._round = 0
        for dim in range(len(shape)):
            # Ranks that agree on every other coordinate form one group.
            others = [c for k, c in enumerate(self.coordinates) if k != dim]
            color = 0
            for k, c in enumerate(others):
                color = color * (max(shape) + 1) + c
            sub = comm.Split(color, self.coordinates[dim])
            failure: Optional[BaseException] = None
            try:
                self._groups.append(Communicator(sub, **communicator_arguments))
            except BaseException as exc:    # (Ctrl-C too: the peers must hear of it)
                failure = exc
            finally:
                sub.Free()          # (the Communicator keeps its own duplicate)
            self._agree_built(dim, failure)

    def _agree_built(self, dim: int, failure: Optional[BaseException]) -> None:
        """Collective over the whole communicator: raise on every rank if the
        Communicator of any rank's group along `dim` failed.  A Communicator
        agrees on its failure within its group only; without this the other
        groups would go on to the next dimension's Split (or their first
        round) and wait for ever for ranks that have left."""
        report = None if failure is None else (type(failure).__name__, str(failure))
        reports = self.comm.allgather(report)
        failed = [r for r, e in enumerate(reports) if e is not None]
        if not failed:
            return
        self.free()                 # (collective within each group built so far)
        if failure is not None and not isinstance(failure, Exception):
            raise failure           # KeyboardInterrupt and the like: as they are
        kind, message = reports[failed[0]]
        error = _ERRORS.get(kind, MPILossyError)(
            f"GroupAverager: the group along dimension {dim} of rank(s) {failed} could not "
            f"be built: rank {failed[0]}: {message}")
        if failure is not None:
            raise error from failure
        raise error

    @property
    def rounds_to_mix(self) -> int:
        """Rounds after which, without loss, every rank holds the global average."""
        return len(self.shape)

    @property
    def round(self) -> int:
        """Rounds done so far (the next one averages along round % rounds_to_mix)."""
        return self._round

    def group(self, dimension: int) -> Communicator:
        """The Communicator of this rank's group along `dimension`."""
        return self._groups[dimension]

    def average(self, buf: Any, **call_arguments: Any) -> Optional[CollectiveStats]:
        """One round: `buf` (writable, contiguous) becomes its lossy average
        over this round's group, in place; `call_arguments` are those of
        Communicator.allreduce (algorithm, timeout).  Returns the round's
        statistics (None on a single rank: no group).  Collective over the
        whole communicator: every rank is in one group of each round."""
        self._round += 1
        if not self._groups:
            return None
        lc = self._groups[(self._round - 1) % len(self._groups)]
        return lc.allreduce(buf, op="avg", **call_arguments)

    def free(self) -> None:
        for lc in self._groups:
            lc.free()
        self._groups = []

    def __enter__(self) -> "GroupAverager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()
