"""The hierarchical all-reduce: an exact reduce-scatter within each node,
the lossy all-reduce of each slice across nodes among the ranks of the same
local index, the owners' records of who contributed and an exact all-gather
within each node (docs/hierarchy.md).  The sub-communicators are
hierarchy/levels.py, the stages' deadline and failures hierarchy/stages.py.

Slices: with S the fewest ranks of any node, the vector is cut into S
slices and local rank j < S of every node owns slice j; on nodes that hold
more ranks the others only take part within the node.  Where every node
holds S ranks the slices are the node communicator's own chunks and the
user's buffers are used in place; otherwise each rank lays its vector out
as S slices of M = ceil(count / S) elements followed by zeros for the local
ranks that own none (one copy in, one copy out).

Scaling: a node's slice holds all its ranks (the reduce-scatter within the
node is itself unbiased if a rank there missed its deadline), so across
nodes a slice that arrives counts its node's ranks: with equal nodes the
flat scaling over nodes is that; with unequal nodes the slices travel as
weighted averages, weighing each node by its number of ranks.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import numpy as np

from .._core import ALLGATHER, REDUCE_SCATTER
from ..call.buffers import chunk_bounds
from ..call.stats import CollectiveStats
from .levels import Hierarchy
from .record import assemble, capacity, owner_record
from .stages import INTRA_SHARE, Deadline, Stages

__all__ = ["allreduce"]


def allreduce(h: Hierarchy, send: np.ndarray, recv: np.ndarray, op: str, timeout: Any,
              compression: Any, redundancy: Any, weight: Optional[float] = None,
              residual: Optional[np.ndarray] = None) -> CollectiveStats:
    """One hierarchical all-reduce of the host arrays `send` into `recv`
    (checked by the caller and check(); the same array in place).
    timeout: the call's deadline in seconds, None, or "auto" (each
    stage's learned one).  weight: this rank's (op="avg"), or None.
    residual: float32 as long as `send` (zeroed by the caller), for
    error feedback of stage 2's compression.  A stage that fails on this
    rank is refused in the stages after it, and the call raises on
    every rank."""
    began = time.perf_counter()
    layout, lead, j = h.layout, h.leaders, h.layout.local_rank
    h.calls += 1
    count = send.size
    deadline = Deadline(timeout)
    weighted = weight is not None or not layout.uniform
    w = send.dtype.type(1.0 if weight is None else weight)
    if not weighted:
        # the node communicator's own chunks are the slices; this rank's
        # is kept in scratch until the last stage, so that a call failing
        # before leaves recv as it was (in place: the user's data)
        slices = [chunk_bounds(count, lead, s) for s in range(lead)]
        wide_send, wide_recv, region = send, recv, 0
        mine = h.buffer("mine", send.dtype, slices[j][1] - slices[j][0])
        slice_len = mine.size
    else:
        # each local rank's region: its slice, zeros to the width, then 1/w;
        # stage 1 is a weighted average (weight w), so every block is the
        # weighted mean of the node's ranks that reached it, and the last
        # element c / sum(w) over the c ranks that reached it: the node's
        # weight is estimated as L / that, exact when all arrived (ranks
        # past S hold zeros)
        width = -(-count // lead)
        region = width + 1
        slices = _slices(h, count, width)
        wide_send = h.buffer("send", send.dtype, layout.local_size * region)
        wide_recv = h.buffer("recv", send.dtype, layout.local_size * region)
        wide_send[lead * region:] = 0
        for s, (lo, hi) in enumerate(slices):
            at = s * region
            wide_send[at:at + hi - lo] = send[lo:hi]
            wide_send[at + hi - lo:at + width] = 0
            wide_send[at + width] = 1 / w
        mine = wide_recv[j * region:(j + 1) * region]
        slice_len = slices[j][1] - slices[j][0] if j < lead else 0
    first = slices[j][0] if j < lead else count
    inter: Any = h.inter            # (None: stages.inter does not call)
    per_owner = _record_words(h, -(-count // lead), send.dtype.itemsize)
    records = h.buffer("records", np.int64, layout.local_size * per_owner).view(np.uint64)
    own_record = records[j * per_owner:(j + 1) * per_owner]
    stages = Stages(h, None, deadline)

    # 1. within the node: this rank's slice, reduced over the node
    s1 = stages.intra(lambda d: h.intra.reduce_scatter(
        wide_send, mine, op="avg" if weighted else op, timeout=d.stage(INTRA_SHARE),
        weight=float(w) if weighted else None), REDUCE_SCATTER)
    # 2. across nodes, among the owners of the same slice (every owner
    # calls, also with an empty slice: a size that differs across nodes
    # is then a mismatch every owner sees, not a call some never make)
    node_weight = 0.0
    if weighted and s1 is not None and inter is not None:
        node_weight = layout.local_size / float(mine[region - 1])
    feedback = residual[first:first + slice_len] if residual is not None else None
    s2 = stages.inter(lambda d: inter.allreduce(
        mine[:slice_len], op="avg" if weighted else op, timeout=d.network(),
        weight=node_weight if weighted else None, compression=compression,
        redundancy=redundancy, residual=feedback, algorithm="direct"))
    if feedback is not None and s2 is not None:
        # what quantisation took from the node's slice, in this rank's
        # units: adding it to this rank's next input restores it
        feedback *= np.float32(node_weight / float(w) if weighted
                               else layout.local_size if op == "avg" else 1)
    # 3. within the node: the owners' records of who contributed
    if s2 is not None:
        owner_record(layout, slice_len, s1.contributors, s2.contributors, own_record)
    else:
        own_record[:] = 0
    s3 = stages.intra(lambda d: h.intra.allgather(
        own_record.view(np.int64), records.view(np.int64), timeout=d.record()), ALLGATHER)
    # 4. within the node: every slice to every rank of the node
    if not weighted and stages.failure is None:
        recv[first:first + slice_len] = mine
        mine = recv[first:first + slice_len]
    s4 = stages.intra(lambda d: h.intra.allgather(
        mine, wide_recv, timeout=d.rest()), ALLGATHER)
    if stages.failure is not None:
        stages.failure.throw(h.calls)
    assert s1 is not None and s3 is not None and s4 is not None
    missed: Optional[np.ndarray] = None
    fallback = 0
    if not s4.contributors.members().any(axis=1).all():     # (per element only then)
        arrived = s4.contributors.received()
        if weighted:
            arrived = np.concatenate([arrived[s * region:s * region + hi - lo]
                                      for s, (lo, hi) in enumerate(slices)])
        missed = ~arrived
        fallback = int(missed.sum())
    own = send[missed] if fallback else None    # (before recv, which may be send, changes)
    if weighted:
        for s, (lo, hi) in enumerate(slices):
            recv[lo:hi] = wide_recv[s * region:s * region + hi - lo]
        if op == "sum":
            recv *= recv.dtype.type(h.total)
    if own is not None:
        recv[missed] = _stand_in(h, own, op)

    came = s3.contributors.received().reshape(layout.local_size, per_owner).all(axis=1)
    record, delivered, agreed = assemble(
        layout, slices, records.reshape(layout.local_size, per_owner), came,
        missed if fallback else None, own=h.intra.scaling != "zero-fill")
    held = record.members().sum(axis=1)
    stats = [s for s in (s1, s2, s3, s4) if s is not None]
    return CollectiveStats(
        delivered=delivered, elapsed=time.perf_counter() - began,
        deadline_hit=any(s.deadline_hit for s in stats),
        fallback=fallback / max(count, 1),
        min_contributors=int(held.min()) if held.size else h.total,
        algorithm="hierarchical", nbytes=send.nbytes, seq=h.calls,
        lost_blocks=tuple(sum(s.lost_blocks[k] for s in stats) for k in range(4)),
        collective="allreduce", timeout=deadline.seconds, agreed=agreed,
        contributors=record, rebuilt=s2.rebuilt if s2 else 0,
        redundancy=s2.redundancy if s2 else None)


def _record_words(h: Hierarchy, longest: int, itemsize: int) -> int:
    """Words of one owner's record (stage 3) for slices of at most
    `longest` elements: the same on every rank of the node."""
    return capacity(longest, h.layout.nodes, h.total, itemsize, h.block_bytes,
                    h.max_block)


def _stand_in(h: Hierarchy, own: np.ndarray, op: str) -> np.ndarray:
    """Where a slice did not come back within the node, this rank's own
    contribution stands in for it (count 1), as in the flat algorithms."""
    if h.intra.scaling == "zero-fill":
        return np.zeros_like(own)
    return own * own.dtype.type(h.total) if op == "sum" else own


def _slices(h: Hierarchy, count: int, width: int) -> List[Tuple[int, int]]:
    """(first, end) in the user's vector of every slice (unequal nodes)."""
    return [(min(count, s * width), min(count, (s + 1) * width))
            for s in range(h.leaders)]
