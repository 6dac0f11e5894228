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

Scaling: where a node's slice reaches stage 2 whole (every rank of the
node in it) the flat scaling over nodes is right.  Otherwise (nodes of
different sizes, a rank that missed stage 1's deadline, weights) the slices
travel as weighted averages: stage 1 a (weighted) average within the node,
stage 2 a weighted average across nodes with each node's partial weighing
the weights (1 each unweighted) of the node's ranks that reached all of it,
which the owner reduced itself (CollectiveStats.weights); so every block is
the weighted mean over the ranks its record names.  Weights stay doubles
throughout (the core scales by powers of two): no weight is cast to the
data's dtype.  Integer data cannot travel as averages: there a node whose
rank missed stage 1 counts as whole (its partial sum scaled up within the
node), as docs/hierarchy.md says.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import numpy as np

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from ..call.buffers import chunk_bounds
from ..call.dtypes import is_float
from ..call.request import Request
from ..call.spec import TAG_RESIDUAL, TAG_WEIGHTED
from ..call.stats import CollectiveStats
from .levels import Hierarchy
from .record import assemble, capacity, owner_record
from .stages import INTRA_SHARE, Deadline, Stages

__all__ = ["allreduce", "weighs_nodes", "node_weight"]


def weighs_nodes(h: Hierarchy, request: Request, send: np.ndarray) -> bool:
    """Do the slices of this call travel as weighted averages?  The same on
    every rank of a call whose ranks agree (dtype, deadline, weight)."""
    if not is_float(send.dtype) or h.intra.scaling != "unbiased":
        return False
    return (request.weight is not None or not h.layout.uniform
            or request.timeout is not None)


def node_weight(stage_1: Optional[CollectiveStats], own: float) -> float:
    """What this node's partial weighs in stage 2: the weights of its ranks
    that reached all of this rank's slice (the owner's own, `own`, at
    least; an empty slice weighs that)."""
    if stage_1 is None or stage_1.weights is None or not stage_1.weights > 0:
        return own
    return stage_1.weights


def allreduce(h: Hierarchy, request: Request, send: np.ndarray,
              recv: np.ndarray, spent: float = 0.0) -> CollectiveStats:
    """One hierarchical all-reduce of the host arrays `send` into `recv`
    (`request` checked by the caller and check(); the same array in
    place): request.timeout the call's deadline in seconds, None, or
    "auto" (each stage's learned one, the call bounded by the cap);
    request.weight this rank's (op="avg"), or None; request.residual
    float32 as long as `send` (zeroed by the caller), for error feedback of
    stage 2's compression.  A stage that fails on this rank is refused in
    the stages after it, and the call raises on every rank."""
    began = time.perf_counter() - spent     # (spent: before the stages, Deadline)
    layout, lead, j = h.layout, h.leaders, h.layout.local_rank
    h.calls += 1
    count = send.size
    op, residual = request.op, request.residual
    deadline = Deadline(request.timeout, h.cap, spent)
    weighted = weighs_nodes(h, request, send)
    w = 1.0 if request.weight is None else float(request.weight)
    # (what every rank must share beyond what travels: a rank that passes a
    # weight or a residual where the others do not fails every stage)
    tag = ((TAG_WEIGHTED if request.weight is not None else 0)
           | (TAG_RESIDUAL if residual is not None else 0))
    if layout.uniform:
        # the node communicator's own chunks are the slices; this rank's
        # is kept in scratch until the last stage, so that a call failing
        # before leaves recv as it was (in place: the user's data)
        slices = [chunk_bounds(count, lead, s) for s in range(lead)]
        wide_send, wide_recv, width = send, recv, 0
        mine = h.buffer("mine", send.dtype, slices[j][1] - slices[j][0])
        slice_len = mine.size
    else:
        # each local rank's region: its slice, zeros to the width (ranks
        # past S own none: zeros)
        width = -(-count // lead)
        slices = _slices(h, count, width)
        wide_send = h.buffer("send", send.dtype, layout.local_size * width)
        wide_recv = h.buffer("recv", send.dtype, layout.local_size * width)
        wide_send[lead * width:] = 0
        for s, (lo, hi) in enumerate(slices):
            wide_send[s * width:s * width + hi - lo] = send[lo:hi]
            wide_send[s * width + hi - lo:(s + 1) * width] = 0
        mine = wide_recv[j * width:(j + 1) * width]
        slice_len = slices[j][1] - slices[j][0] if j < lead else 0
    first = slices[j][0] if j < lead else count
    per_owner = _record_words(h, -(-count // lead), send.dtype.itemsize)
    records = h.buffer("records", np.int64, layout.local_size * per_owner).view(np.uint64)
    own_record = records[j * per_owner:(j + 1) * per_owner]
    stages = Stages(h, None, deadline)

    def stage(collective: int, bound: Tuple[Any, Optional[float]], sendbuf: Any, recvbuf: Any,
              **more: Any) -> Request:
        return Request(collective, sendbuf, recvbuf, timeout=bound[0], limit=bound[1], **more)

    # 1. within the node: this rank's slice, reduced over the node
    s1 = stages.intra(lambda d: stage(
        REDUCE_SCATTER, d.stage(INTRA_SHARE), wide_send, mine,
        op="avg" if weighted else op, weight=w if weighted else None, tag=tag))
    # 2. across nodes, among the owners of the same slice (every owner
    # calls, also with an empty slice: a size that differs across nodes
    # is then a mismatch every owner sees, not a call some never make)
    weight = node_weight(s1, w) if weighted else None
    feedback = residual[first:first + slice_len] if residual is not None else None
    s2 = stages.inter(lambda d: stage(
        ALLREDUCE, d.network(), mine[:slice_len], None, op="avg" if weighted else op,
        weight=weight, compression=request.compression, redundancy=request.redundancy,
        residual=feedback, algorithm="direct", tag=tag))
    if feedback is not None and s2 is not None:
        # what quantisation took from the node's slice, in this rank's
        # units: adding it to this rank's next input restores it
        feedback *= np.float32(weight / w if weight is not None
                               else layout.local_size if op == "avg" else 1)
    # 3. within the node: the owners' records of who contributed
    if s2 is not None:
        owner_record(layout, slice_len, s1.contributors, s2.contributors, own_record)
    else:
        own_record[:] = 0
    s3 = stages.intra(lambda d: stage(
        ALLGATHER, d.record(), own_record.view(np.int64), records.view(np.int64)))
    # 4. within the node: every slice to every rank of the node
    if layout.uniform and stages.failure is None:
        recv[first:first + slice_len] = mine
        mine = recv[first:first + slice_len]
    s4 = stages.intra(lambda d: stage(ALLGATHER, d.rest(), mine, wide_recv))
    if stages.failure is not None:
        stages.failure.throw(h.calls)
    assert s1 is not None and s3 is not None and s4 is not None
    # a slice whose values or whose record did not come back within the
    # node: this rank's own contribution stands in for it (its record says so)
    came = s3.contributors.received().reshape(layout.local_size, per_owner).all(axis=1)
    arrived: Optional[np.ndarray] = None
    if not s4.contributors.members().any(axis=1).all():     # (per element only then)
        arrived = s4.contributors.received()
        if not layout.uniform:
            arrived = np.concatenate([arrived[s * width:s * width + hi - lo]
                                      for s, (lo, hi) in enumerate(slices)])
    for s, (lo, hi) in enumerate(slices):
        if hi > lo and not came[s]:
            if arrived is None:
                arrived = np.ones(count, bool)
            arrived[lo:hi] = False
    missed = None if arrived is None else ~arrived
    fallback = 0 if missed is None else int(missed.sum())
    own = send[missed] if fallback else None    # (before recv, which may be send, changes)
    if not layout.uniform:
        for s, (lo, hi) in enumerate(slices):
            recv[lo:hi] = wide_recv[s * width:s * width + hi - lo]
    if weighted and op == "sum":
        recv *= recv.dtype.type(h.total)
    if own is not None:
        recv[missed] = _stand_in(h, own, op)

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
        collective="allreduce", timeout=stages.timeout(), agreed=agreed,
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
