"""The stages of one two-level call: the deadline split over them, the
first failure as every rank raises it, and the refusal of every stage after
it (docs/hierarchy.md, "Errors")."""

from __future__ import annotations

import re
import time
from typing import Any, Callable, List, NoReturn, Optional, Tuple

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from ..call.request import Request
from ..errors import MismatchError, MPILossyError
from .levels import Hierarchy, Level

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
    later stage is refused instead (Level.refuse_next), so that the
    ranks of that stage fail too and every sub-communicator counts the
    same calls on every rank."""

    def __init__(self, hierarchy: Hierarchy, failure: Optional[Failure],
                 deadline: "Deadline") -> None:
        self.h, self.failure, self.deadline = hierarchy, failure, deadline
        self.had = 0.0      # the stages' deadlines so far, each as far as its limit let it run

    def intra(self, request: Callable[["Deadline"], Request]) -> Any:
        """Stage within the node: `request(deadline)` is its call."""
        layout = self.h.layout
        return self._stage(self.h.intra, request, f"within node {layout.node}",
                           layout.ranks_of(layout.node))

    def inter(self, request: Callable[["Deadline"], Request]) -> Any:
        """Stage across nodes (owners of a slice only; None elsewhere)."""
        if self.h.inter is None:
            return None
        layout, j = self.h.layout, self.h.layout.local_rank
        return self._stage(self.h.inter, request, f"across nodes of local rank {j}",
                           [layout.ranks_of(n)[j] for n in range(layout.nodes)])

    def _stage(self, level: Level, request: Callable[["Deadline"], Request],
               where: str, ranks: List[int]) -> Any:
        if self.failure is not None:
            level.refuse_next(request(self.deadline), self.failure.proxy())
            return None
        try:
            call = request(self.deadline)
            stats = self.h.run(level, call)
        except BaseException as exc:
            self.failure = Failure.of_stage(exc, where, ranks, self.h.layout.rank)
            return None
        if stats.timeout is not None:
            # (a stage that waited for a peer far behind has its level's
            # cap, past its share: control/deadline.py, _catch_up)
            limit = call.limit
            if limit is None or level.auto.waited_behind:
                self.had += stats.timeout
            else:
                self.had += min(stats.timeout, limit)
        return stats

    def timeout(self) -> Optional[float]:
        """The deadline the call had, for its stats: the one given; with
        "auto", what went before the stages (Deadline's `spent`) and each
        stage's learned deadline as far as its share let it run (the cap
        for one that waited for a peer far behind); None without a
        deadline."""
        deadline = self.deadline
        if deadline.seconds is not None or deadline.bound is None:
            return deadline.seconds
        return deadline.spent + self.had


Bound = Tuple[Any, Optional[float]]      # (a stage's timeout=, its limit in seconds)


class Deadline:
    """Splits one call's deadline over its stages (see INTRA_SHARE): each
    stage's (timeout, limit).  A deadline of T seconds gives each stage
    its share of T.  "auto" gives each stage its own learned deadline,
    limited to the share it would get of the learned deadline's cap, so
    that the whole call, like a flat one, ends within about the cap.
    None goes to every stage as it is.  `spent`: seconds of the call
    gone before its stages (the parent's agreements), out of the deadline."""

    def __init__(self, total: Any, cap: float, spent: float = 0.0) -> None:
        self.total = total
        self.seconds: Optional[float] = total if isinstance(total, float) else None
        self.bound = self.seconds if self.seconds is not None else (
            cap if total == "auto" else None)
        self.spent = spent
        self.began = time.perf_counter() - spent

    def _left(self) -> float:
        assert self.bound is not None
        return self.bound - (time.perf_counter() - self.began)

    def _of(self, seconds: float) -> Bound:
        return (seconds, None) if self.seconds is not None else (self.total, seconds)

    def stage(self, share: float) -> Bound:
        if self.bound is None:
            return self.total, None
        return self._of(share * self.bound)

    def network(self) -> Bound:
        if self.bound is None:
            return self.total, None
        return self._of(max(self._left() - INTRA_SHARE * self.bound, NETWORK_FLOOR * self.bound))

    def record(self) -> Bound:
        """Stage 3's: half of what is left (the data's stage gets the rest)."""
        if self.bound is None:
            return self.total, None
        return self._of(max(0.5 * self._left(), 0.25 * INTRA_SHARE * self.bound))

    def rest(self) -> Bound:
        if self.bound is None:
            return self.total, None
        return self._of(max(self._left(), 0.5 * INTRA_SHARE * self.bound))


def refuse(h: Hierarchy, exc: BaseException, request: Request) -> NoReturn:
    """This rank's input was refused (`exc`): take part in every stage of
    the call (`request`, as the user made it) only to fail it, so that
    every rank raises (the same exception type, naming this rank) instead
    of waiting for it.  Raises."""
    h.calls += 1
    failure = Failure.own(exc, h.layout.rank)
    stages = Stages(h, failure, Deadline(request.timeout, h.cap))

    def stage(collective: int) -> Callable[[Deadline], Request]:
        return lambda d: Request(collective, None, timeout=d.total)

    if request.collective == ALLGATHER:         # (hierarchy/gather.py's stages)
        stages.inter(stage(ALLGATHER))
        stages.intra(stage(ALLGATHER))
        stages.intra(stage(ALLGATHER))
        failure.throw(h.calls, "allgather")
    stages.intra(stage(REDUCE_SCATTER))
    if request.collective == REDUCE_SCATTER:
        stages.inter(stage(REDUCE_SCATTER))
        failure.throw(h.calls, "reduce_scatter")
    stages.inter(stage(ALLREDUCE))
    stages.intra(stage(ALLGATHER))
    stages.intra(stage(ALLGATHER))
    failure.throw(h.calls)
