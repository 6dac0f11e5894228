"""Pipelined staging of a large GPU all-reduce: the call is cut into
segments, each its own core call, so that the copy of segment k+1 to the
host and of segment k-1 back to the device run while segment k travels.
A call then costs about one segment's copies plus the transport, not all
the copies plus the transport (docs/gpu.md, "Pipelined staging").

Every rank cuts a call the same way (`plan`, from the element count and
the agreed segment size), and each segment tells the core which part of
the call it is (PART_*), which belongs to the call's signature: ranks that
cut differently, or one that does not cut at all, fail on the first call
where they differ, on every rank, instead of waiting for each other.

The call keeps one deadline: each segment gets what is left of it when it
starts (the core's budget floor, a quarter of the deadline, applies to
each).  The first segment that fails ends the call.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .._core import PART_LAST, PART_SEGMENT, PART_WHOLE
from .contributors import Contributors
from .stats import CollectiveStats

__all__ = ["plan", "part_of", "merge_stats"]

Segment = Tuple[int, int]          # [first, stop) in elements
# Fewest segments worth cutting a call into: on an H200 with 2 and 4 ranks
# sharing it, a call of two segments was slower cut than whole, of eight and
# more faster (docs/gpu.md, "Pipelined staging").
MIN_SEGMENTS = 4


def plan(elements: int, itemsize: int, segment_bytes: int) -> Optional[List[Segment]]:
    """The segments of a call of `elements` values, or None where the call
    goes in one piece (segmenting off, or under MIN_SEGMENTS segments' worth).
    Equal segments (the first `elements % n` one element longer), so that
    a call's segments have the same deadline kind."""
    if segment_bytes <= 0:
        return None
    per = max(1, segment_bytes // itemsize)
    if elements < MIN_SEGMENTS * per:
        return None
    n = -(-elements // per)
    base, extra = divmod(elements, n)
    bounds, first = [], 0
    for k in range(n):
        stop = first + base + (1 if k < extra else 0)
        bounds.append((first, stop))
        first = stop
    return bounds


def part_of(k: int, count: int) -> int:
    """PART_* of segment k of `count` (PART_WHOLE: the call is not cut)."""
    if count <= 1:
        return PART_WHOLE
    return PART_LAST if k == count - 1 else PART_SEGMENT


def merge_stats(parts: Sequence[CollectiveStats], lengths: Sequence[int], elapsed: float,
                rank: int, size: int) -> CollectiveStats:
    """One call's statistics from its segments' (`lengths`: their element
    counts): fractions weighted by elements, counts added, the worst of
    the rest; `elapsed`: the whole call, copies included."""
    weights = np.asarray(lengths, np.float64) / max(1, sum(lengths))
    first = parts[0]
    contributors = None
    if first.contributors is not None:         # (algorithm="direct")
        records = [p.contributors for p in parts if p.contributors is not None]
        contributors = Contributors.concatenate(records, lengths, size=size, rank=rank)
    lost = tuple(int(sum(p.lost_blocks[i] for p in parts)) for i in range(4))
    return first._replace(
        delivered=float(np.dot(weights, [p.delivered for p in parts])),
        elapsed=elapsed,
        deadline_hit=any(p.deadline_hit for p in parts),
        fallback=float(np.dot(weights, [p.fallback for p in parts])),
        min_contributors=min(p.min_contributors for p in parts),
        nbytes=sum(p.nbytes for p in parts),
        seq=parts[-1].seq,
        lost_blocks=lost,
        agreed=float(np.dot(weights, [p.agreed for p in parts])),
        contributors=contributors,
        rebuilt=sum(p.rebuilt for p in parts))
