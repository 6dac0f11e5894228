"""What one call delivered, as this rank saw it: the CollectiveStats record
and its making from the compiled core's CallResult."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

from .._core import ALLGATHER, ALLREDUCE, DIRECT, REDUCE_SCATTER, RING, TREE, CallResult
from .contributors import Contributors

__all__ = ["CollectiveStats", "AllreduceStats", "stats_of", "ALGORITHM_NAMES",
           "COLLECTIVE_NAMES"]

ALGORITHM_NAMES = {RING: "ring", TREE: "tree", DIRECT: "direct"}
COLLECTIVE_NAMES = {ALLREDUCE: "allreduce", REDUCE_SCATTER: "reduce_scatter",
                    ALLGATHER: "allgather"}


class CollectiveStats(NamedTuple):
    """What one call delivered, as this rank saw it.  (A named tuple: one is
    built per call, and a frozen dataclass costs microseconds to build.)"""

    delivered: float
    """Fraction of all contributions (ranks x elements) in this rank's result, 0..1."""
    elapsed: float
    """Seconds spent in the call on this rank."""
    deadline_hit: bool
    """True if this rank gave up waiting for something."""
    fallback: float
    """Fraction of elements for which the reduced value did not arrive and this
    rank used its own partial sum instead (its deviation from the other ranks)."""
    min_contributors: int
    """Fewest contributions in any block of this rank's result."""
    algorithm: str
    nbytes: int
    seq: int
    """Call number on this communicator (1 for the first call)."""
    lost_blocks: tuple = (0, 0, 0, 0)
    """Blocks this rank did not receive, by cause: (injected, late, gone,
    torn).  'late' missed its deadline; 'gone': its producer had finished
    sending (moved past the call, or marked the stream complete: early
    close) and it never came; 'torn' changed while being read."""
    collective: str = "allreduce"
    timeout: Optional[float] = None
    """The deadline this call had, None without one.  With timeout="auto":
    the learned one (the cap for a call that waited for a peer far behind);
    a hierarchical call's is what went before its stages and the sum of
    theirs, each as far as its share of the cap let it run."""
    agreed: float = 1.0
    """Fraction of all contributions in the blocks whose reduced value
    arrived (fallbacks left out): what the reduction itself kept."""
    contributors: Optional[Contributors] = None
    """algorithm="direct" and the all-gather: which ranks' data is in each
    block of the result (all-gather: the owner's for a block that arrived,
    none for one that kept its previous contents)."""
    rebuilt: int = 0
    """redundancy=(k, m): blocks that were lost on the way and rebuilt from
    their group's parity (they count as arrived everywhere else)."""
    redundancy: Optional[Tuple[int, int]] = None
    """The code this call used (with redundancy="auto": the one picked)."""
    excluded: Tuple[int, ...] = ()
    """elastic=True: the ranks (of the communicator the Communicator was
    built on) that the agreement after this call excluded."""
    alone: bool = False
    """elastic=True: this rank answered the call alone, with its own data,
    to line up with survivors that reached the last agreement after more
    calls than it had made (docs/elastic.md)."""
    weights: Optional[float] = None
    """A weighted average on the direct algorithm: the sum of the weights
    of the ranks whose data reached every block of the chunk this rank
    reduced (the hierarchy weighs a node's partial by it)."""

    def contributed(self, rank: Optional[int] = None) -> float:
        """Fraction of this rank's result that holds `rank`'s data (default:
        this rank's own).  Only algorithm="direct" and the all-gather record
        who contributed."""
        if self.contributors is None:
            raise ValueError(f"the {self.algorithm} {self.collective} does not record who "
                             f"contributed; use algorithm='direct'")
        return self.contributors.fraction(rank)


AllreduceStats = CollectiveStats


def stats_of(result: CallResult, spec: Any, rank: int, size: int,
             spent: float = 0.0) -> CollectiveStats:
    """The statistics of a call that succeeded (`spec`: its CallSpec;
    `spent`: seconds of the call before the core's part, its agreements'
    waits, which come out of its deadline and count in its time)."""
    contributors = None
    if spec.algorithm == DIRECT:
        contributors = Contributors(
            result.contributors, size=size, rank=rank, count=spec.elements,
            chunks=(rank,) if spec.collective == REDUCE_SCATTER else tuple(range(size)))
    return CollectiveStats(
        delivered=result.delivered, elapsed=result.elapsed + spent, deadline_hit=result.deadline_hit,
        fallback=result.fallback, min_contributors=result.min_contributors,
        algorithm=ALGORITHM_NAMES[spec.algorithm], nbytes=spec.nbytes, seq=result.seq,
        lost_blocks=result.lost_blocks, collective=COLLECTIVE_NAMES[spec.collective],
        timeout=None if spec.timeout < 0 else spec.timeout, agreed=result.agreed,
        contributors=contributors, rebuilt=result.rebuilt, redundancy=spec.redundancy,
        weights=result.weight_sum if result.weight_sum >= 0 else None)
