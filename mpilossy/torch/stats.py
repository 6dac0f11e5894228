"""Per-step statistics: the lossy calls of one training step added up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .. import CollectiveStats

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """What one training step's communication delivered, as this rank saw it."""

    step: int
    """Steps so far, this one included (1 for the first)."""
    calls: int
    """Lossy collective calls (buckets, pieces, dtypes)."""
    nbytes: int
    """Bytes given to those calls."""
    delivered: float
    """Fraction of contributions that arrived, weighted by bytes (1.0 = nothing lost)."""
    fallback: float
    """Share of elements, weighted by bytes, for which this rank kept its own
    partial sum (allreduce) or its previous values (allgather): the source of drift."""
    deadline_hits: int
    """Calls in which this rank gave up waiting for something."""
    min_contributors: int
    """Fewest contributions in any block of any call (0 if no call)."""
    lost_blocks: Tuple[int, int, int, int]
    """Blocks not received, by cause (injected, late, gone, torn)."""
    comm_seconds: float
    """Seconds spent in the lossy calls."""
    sync_seconds: float = 0.0
    """Seconds spent in reliable traffic this step (drift broadcast, drift meter)."""
    drift: Optional[float] = None
    """Relative drift measured this step (before a broadcast of the same step), else None."""
    broadcast: bool = False
    """True if the parameters were re-synchronised this step."""
    reliable: bool = False
    """True if the gradients were finally reduced reliably (phase-aware
    tolerance: a tight phase, or more loss than the step could accept)."""
    excluded: Tuple[int, ...] = ()
    """Communicator(elastic=True): ranks excluded during this step."""
    joined: Tuple[int, ...] = ()
    """Communicator(elastic=True, spares=k): spares called in at the end of
    this step (DistributedOptimizer sent them the model and its state)."""
    alone: int = 0
    """Communicator(elastic=True): calls this rank answered alone to line up
    with survivors that reached the exclusion's agreement later
    (CollectiveStats.alone)."""

    @classmethod
    def of(cls, step: int, calls: Sequence[CollectiveStats], **extra: Any) -> "StepStats":
        nbytes = sum(c.nbytes for c in calls)

        def weighted(field: str, empty: float) -> float:
            if not nbytes:
                return empty if not calls else sum(getattr(c, field) for c in calls) / len(calls)
            return sum(getattr(c, field) * c.nbytes for c in calls) / nbytes

        lost = [sum(c.lost_blocks[i] for c in calls) for i in range(4)]
        return cls(step=step, calls=len(calls), nbytes=nbytes,
                   delivered=weighted("delivered", 1.0), fallback=weighted("fallback", 0.0),
                   deadline_hits=sum(bool(c.deadline_hit) for c in calls),
                   min_contributors=min((c.min_contributors for c in calls), default=0),
                   lost_blocks=tuple(lost), comm_seconds=sum(c.elapsed for c in calls),
                   excluded=tuple(r for c in calls for r in c.excluded),
                   alone=sum(c.alone for c in calls), **extra)


class Recorder:
    """Collects the calls of the step under way; `finish` closes the step."""

    def __init__(self) -> None:
        self.steps = 0
        self.last: Optional[StepStats] = None
        self._calls: List[CollectiveStats] = []
        self.reliable = False

    def pending_delivered(self) -> float:
        """Delivered fraction (by bytes) of the calls of the step under way."""
        nbytes = sum(c.nbytes for c in self._calls)
        if not nbytes:
            return 1.0
        return sum(c.delivered * c.nbytes for c in self._calls) / nbytes

    def add(self, stats: CollectiveStats) -> None:
        self._calls.append(stats)

    def finish(self, **extra: Any) -> StepStats:
        self.steps += 1
        self.last = StepStats.of(self.steps, self._calls, reliable=self.reliable, **extra)
        self._calls = []
        self.reliable = False
        return self.last
