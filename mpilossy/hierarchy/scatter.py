"""The two-level reduce-scatter (docs/hierarchy.md): an exact reduce-scatter
within each node, then the lossy reduce-scatter of each slice across nodes
among the ranks of the same local index.  Nodes of equal size only.

Layout: rank r's chunk of the result (chunk_bounds(count, P, r)) is a piece;
slice j holds the pieces of the ranks of local index j, node by node, each
padded to the widest chunk.  Stage 1 gives local rank j its node's partial
of slice j; stage 2 gives it, of that slice, its own piece reduced across
nodes.  One copy of the vector in (into that order), one of the chunk out.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .._core import REDUCE_SCATTER
from ..call.stats import CollectiveStats
from .levels import Hierarchy
from .record import piece_record
from .stages import INTRA_SHARE, Deadline, Stages

__all__ = ["reduce_scatter"]


def reduce_scatter(h: Hierarchy, send: np.ndarray, recv: np.ndarray, op: str, timeout: Any,
                   compression: Any, redundancy: Any) -> CollectiveStats:
    """One two-level reduce-scatter of `send` into this rank's chunk `recv`
    (checked by the caller; nodes of equal size).  A stage that fails on
    this rank is refused in the stage after it, and the call raises on
    every rank; recv is written only when both stages succeeded."""
    began = time.perf_counter()
    layout = h.layout
    h.calls += 1
    pieces = h.pieces(send.size)
    width, nodes = pieces.width, layout.nodes
    wide = h.buffer("scatter", send.dtype, layout.local_size * nodes * width)
    pieces.scatter(send, wide)
    part = h.buffer("part", send.dtype, nodes * width)
    piece = h.buffer("piece", send.dtype, width)
    deadline = Deadline(timeout)
    stages = Stages(h, None, deadline)
    inter: Any = h.inter
    # 1. within the node: slice j, reduced over the node
    s1 = stages.intra(lambda d: h.intra.reduce_scatter(
        wide, part, op=op, timeout=d.stage(INTRA_SHARE)), REDUCE_SCATTER)
    # 2. across nodes: this rank's piece of slice j, reduced over the nodes
    s2 = stages.inter(lambda d: inter.reduce_scatter(
        part, piece, op=op, timeout=d.rest(), compression=compression,
        redundancy=redundancy, algorithm="direct"), REDUCE_SCATTER)
    if stages.failure is not None:
        stages.failure.throw(h.calls, "reduce_scatter")
    assert s1 is not None and s2 is not None
    recv[:] = piece[:recv.size]
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
        collective="reduce_scatter", timeout=deadline.seconds, agreed=delivered,
        contributors=record, rebuilt=s2.rebuilt, redundancy=s2.redundancy)
