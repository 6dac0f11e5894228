"""The stages of one two-level call: the deadline split over them, the
first failure as every rank raises it, and the refusal of every stage after
it (docs/hierarchy.md, "Errors")."""

from __future__ import annotations

import re
import time
from typing import Any, Callable, List, NoReturn, Optional

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from ..errors import MismatchError, MPILossyError
from .levels import Hierarchy

__all__ = ["INTRA_SHARE", "NETWORK_FLOOR", "Failure", "Stages", "Deadline", "refuse"]

# With a deadline T, the stage within the node before the network gets
# INTRA_SHARE * T, the network what is left less INTRA_SHARE * T (at least
# NETWORK_FLOOR * T), the stages after it the rest: shared memory takes
# microseconds to milliseconds, so the shares matter only when a rank of
# the node is stopped or slow.
INTRA_SHARE = 0.15
NETWORK_FLOOR = 0.25


class Failure:
    """The first failure of a hierarchical call, as every rank raises it:
    the exception type and "rank R: what", R a rank of the parent
    communicator."""

    # what a stage passes on as itself; anything else travels as MPILossyError
    _PASSED = (MismatchError, TypeError, ValueError, BufferError, MPILossyError)

    def __init__(self, cls: type, text: str, original: Optional[BaseException]) -> None:
        self.cls, self.text, self.original = cls, text, original

    @classmethod
    def own(cls, exc: BaseException, rank: int) -> "Failure":
        """This rank's own error."""
        kind = next((c for c in cls._PASSED if isinstance(exc, c)), MPILossyError)
        what = (str(exc) if isinstance(exc, cls._PASSED)
                else f"could not take part: {type(exc).__name__}: {exc}")
        return cls(kind, f"rank {rank}: {what}", exc)

    @classmethod
    def of_stage(cls, exc: BaseException, where: str, ranks: List[int],
                 rank: int) -> "Failure":
        """An error a stage raised: passed on by a peer (its text names the
        rank it began at), found by the stage itself (its text numbers the
        stage's ranks: `ranks` are theirs in the parent), or this rank's own."""
        detail = getattr(exc, "detail", None)
        if not isinstance(exc, Exception) or detail is None:
            return cls.own(exc, rank)
        kind = next((c for c in cls._PASSED if isinstance(exc, c)), MPILossyError)
        if not PASSED_ON.match(detail):
            detail = (f"rank {ranks[getattr(exc, 'origin')]}: in the stage {where}, "
                      f"whose ranks 0-{len(ranks) - 1} are ranks {ranks}: {detail}")
        return cls(kind, detail, None)

    def proxy(self) -> BaseException:
        """What a stage after this failure is refused with."""
        return self.cls(self.text)

    def throw(self, seq: int, collective: str = "allreduce") -> NoReturn:
        if self.original is not None and not isinstance(self.original, Exception):
            raise self.original                       # Ctrl-C and the like, as they came
        raise self.cls(f"{collective} call {seq}: {self.text}") from None


PASSED_ON = re.compile(r"rank \d+: ")


class Stages:
    """Runs one call's stages on this rank; after the first failure, each
    later stage is refused instead (Communicator._refuse_next), so that the
    ranks of that stage fail too and every sub-communicator counts the
    same calls on every rank."""

    def __init__(self, hierarchy: Hierarchy, failure: Optional[Failure],
                 deadline: "Deadline") -> None:
        self.h, self.failure, self.deadline = hierarchy, failure, deadline

    def intra(self, run: Callable[["Deadline"], Any], collective: int) -> Any:
        layout = self.h.layout
        return self._stage(self.h.intra, collective, run, f"within node {layout.node}",
                           layout.ranks_of(layout.node))

    def inter(self, run: Callable[["Deadline"], Any], collective: int = ALLREDUCE) -> Any:
        if self.h.inter is None:
            return None
        layout, j = self.h.layout, self.h.layout.local_rank
        return self._stage(self.h.inter, collective, run, f"across nodes of local rank {j}",
                           [layout.ranks_of(n)[j] for n in range(layout.nodes)])

    def _stage(self, lc: Any, collective: int, run: Callable[["Deadline"], Any],
               where: str, ranks: List[int]) -> Any:
        if self.failure is not None:
            lc._refuse_next(collective, self.failure.proxy(), self.deadline.total)
            return None
        try:
            return run(self.deadline)
        except BaseException as exc:
            self.failure = Failure.of_stage(exc, where, ranks, self.h.layout.rank)
            return None


class Deadline:
    """Splits one call's deadline over its stages (see INTRA_SHARE);
    None and "auto" go to every stage as they are."""

    def __init__(self, total: Any) -> None:
        self.total = total
        self.seconds: Optional[float] = total if isinstance(total, float) else None
        self.began = time.perf_counter()

    def _left(self) -> float:
        assert self.seconds is not None
        return self.seconds - (time.perf_counter() - self.began)

    def stage(self, share: float) -> Any:
        return self.total if self.seconds is None else share * self.seconds

    def network(self) -> Any:
        if self.seconds is None:
            return self.total
        return max(self._left() - INTRA_SHARE * self.seconds, NETWORK_FLOOR * self.seconds)

    def record(self) -> Any:
        """Stage 3's: half of what is left (the data's stage gets the rest)."""
        if self.seconds is None:
            return self.total
        return max(0.5 * self._left(), 0.25 * INTRA_SHARE * self.seconds)

    def rest(self) -> Any:
        if self.seconds is None:
            return self.total
        return max(self._left(), 0.5 * INTRA_SHARE * self.seconds)


def refuse(h: Hierarchy, exc: BaseException, timeout: Any, collective: int = ALLREDUCE) -> NoReturn:
    """This rank's input was refused (`exc`): take part in every stage of
    the call (a `collective`) only to fail it, so that every rank raises
    (the same exception type, naming this rank) instead of waiting for
    it.  Raises."""
    h.calls += 1
    failure = Failure.own(exc, h.layout.rank)
    stages = Stages(h, failure, Deadline(timeout))
    stages.intra(lambda d: None, REDUCE_SCATTER)
    if collective == REDUCE_SCATTER:
        stages.inter(lambda d: None, REDUCE_SCATTER)
        failure.throw(h.calls, "reduce_scatter")
    stages.inter(lambda d: None)
    stages.intra(lambda d: None, ALLGATHER)
    stages.intra(lambda d: None, ALLGATHER)
    failure.throw(h.calls)
