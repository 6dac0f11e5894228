"""The two-level reduce-scatter (docs/hierarchy.md): an exact reduce-scatter
within each node, then the lossy reduce-scatter of each slice across nodes
among the ranks of the same local index.  Nodes of equal size only.

Layout: rank r's chunk of the result (chunk_bounds(count, P, r)) is a piece;
slice j holds the pieces of the ranks of local index j, node by node, each
padded to the widest chunk.  Stage 1 gives local rank j its node's partial
of slice j; stage 2 gives it, of that slice, its own piece reduced across
nodes.  One copy of the vector in (into that order), one of the chunk out.

Weights, and floating-point data with a deadline, travel as weighted
averages, as in the all-reduce (hierarchy/allreduce.py): every block is the
weighted mean over the ranks its record names.  Error feedback: stage 2's
quantisation error, in this rank's units, lands where its pieces lie in
the user's vector.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple

import numpy as np

from .._core import REDUCE_SCATTER
from ..call.request import Request
from ..call.spec import TAG_RESIDUAL, TAG_WEIGHTED
from ..call.stats import CollectiveStats
from .allreduce import node_weight, weighs_nodes
from .levels import Hierarchy
from .record import piece_record
from .stages import INTRA_SHARE, Deadline, Stages

__all__ = ["reduce_scatter"]


def reduce_scatter(h: Hierarchy, request: Request, send: np.ndarray,
                   recv: np.ndarray, spent: float = 0.0) -> CollectiveStats:
    """One two-level reduce-scatter of `send` into this rank's chunk `recv`
    (`request` checked by the caller; nodes of equal size).  A stage that
    fails on this rank is refused in the stage after it, and the call
    raises on every rank; recv is written only when both stages
    succeeded."""
    began = time.perf_counter() - spent     # (spent: before the stages, Deadline)
    layout = h.layout
    h.calls += 1
    op, residual = request.op, request.residual
    pieces = h.pieces(send.size)
    width, nodes = pieces.width, layout.nodes
    wide = h.buffer("scatter", send.dtype, layout.local_size * nodes * width)
    pieces.scatter(send, wide)
    part = h.buffer("part", send.dtype, nodes * width)
    piece = h.buffer("piece", send.dtype, width)
    feedback = None if residual is None else h.buffer("feedback", np.float32, nodes * width)
    deadline = Deadline(request.timeout, h.cap, spent)
    weighted = weighs_nodes(h, request, send)
    w = 1.0 if request.weight is None else float(request.weight)
    tag = ((TAG_WEIGHTED if request.weight is not None else 0)
           | (TAG_RESIDUAL if residual is not None else 0))
    stages = Stages(h, None, deadline)

    def stage(bound: Tuple[Any, Optional[float]], sendbuf: Any, recvbuf: Any,
              **more: Any) -> Request:
        return Request(REDUCE_SCATTER, sendbuf, recvbuf, timeout=bound[0], limit=bound[1],
                       op="avg" if weighted else op, tag=tag, **more)

    # 1. within the node: slice j, reduced over the node
    s1 = stages.intra(lambda d: stage(d.stage(INTRA_SHARE), wide, part,
                                      weight=w if weighted else None))
    # 2. across nodes: this rank's piece of slice j, reduced over the nodes
    weight = node_weight(s1, w) if weighted else None
    s2 = stages.inter(lambda d: stage(
        d.rest(), part, piece, weight=weight, compression=request.compression,
        redundancy=request.redundancy, residual=feedback, algorithm="direct"))
    if stages.failure is not None:
        stages.failure.throw(h.calls, "reduce_scatter")
    assert s1 is not None and s2 is not None
    recv[:] = piece[:recv.size]
    if weighted and op == "sum":
        recv *= recv.dtype.type(h.total)
    if residual is not None and feedback is not None:
        # stage 2's error on this node's partial, in this rank's units,
        # where each piece of slice j lies in the user's vector
        feedback *= np.float32(weight / w if weight is not None
                               else layout.local_size if op == "avg" else 1)
        pieces.gather(feedback, residual, layout.local_rank)
    record, delivered = piece_record(layout, recv.size, layout.node * width,
                                     s1.contributors, s2.contributors)
    held = record.members().sum(axis=1)
    stats = (s1, s2)
    return CollectiveStats(
        delivered=delivered, elapsed=time.perf_counter() - began,
        deadline_hit=any(s.deadline_hit for s in stats), fallback=0.0,
        min_contributors=int(held.min()) if held.size else h.total,
        algorithm="hierarchical", nbytes=send.nbytes, seq=h.calls,
        lost_blocks=tuple(sum(s.lost_blocks[k] for s in stats) for k in range(4)),
        collective="reduce_scatter", timeout=stages.timeout(), agreed=delivered,
        contributors=record, rebuilt=s2.rebuilt, redundancy=s2.redundancy)
