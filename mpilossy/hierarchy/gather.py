"""The two-level all-gather (docs/hierarchy.md): the lossy all-gather of
each rank's chunk across nodes among the ranks of the same local index,
then an exact all-gather within each node.  Nodes of equal size only.

A flat all-gather sends each chunk to every rank of every other node: a
node of S ranks puts S times the bytes of the two-level one on its port.
Here each chunk crosses the network once per node, and the node's ranks
share what each received through shared memory.

Layout: as the two-level reduce-scatter's (hierarchy/scatter.py): rank r's
chunk is a piece; slice j holds the pieces of the ranks of local index j,
node by node, each padded to the widest chunk.  Stage 1 gives local rank j
slice j (the pieces that arrived in time); stage 2 gives every rank of the
node what each slice's holder received (a bit per element); stage 3 the
slices.  A piece that did not arrive, on the network or within the node,
keeps this rank's previous contents of recvbuf, and the record (the
CollectiveStats' contributors) says so, as in the flat all-gather.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple

import numpy as np

from .._core import ALLGATHER
from ..call.contributors import Contributors
from ..call.request import Request
from ..call.stats import CollectiveStats
from ..errors import MismatchError
from .levels import Hierarchy
from .record import pack, words
from .stages import Deadline, Failure, Stages

__all__ = ["allgather"]

COUNT_BYTES = 8         # the trailer of each piece: its rank's element count, int64


def allgather(h: Hierarchy, request: Request, send: np.ndarray,
              recv: np.ndarray, spent: float = 0.0) -> CollectiveStats:
    """One two-level all-gather of this rank's chunk `send` into `recv`
    (`request` checked by the caller; nodes of equal size; `send` may be
    this rank's chunk of `recv`).  A stage that fails on this rank is
    refused in the stages after it, and the call raises on every rank;
    recv is written only when every stage succeeded."""
    began = time.perf_counter() - spent     # (spent: before the stages, Deadline)
    layout = h.layout
    h.calls += 1
    count = recv.size
    pieces = h.pieces(count)
    width, nodes, local, j = pieces.width, layout.nodes, layout.local_size, layout.local_rank
    # Each piece ends in the element count of its rank's recvbuf (8 bytes),
    # which the peers check: counts that differ can pad to the same width,
    # where no stage's size would tell them apart.
    stride = width + max(1, COUNT_BYTES // recv.itemsize)
    span = nodes * stride                   # a slice
    wide = h.buffer("gather", recv.dtype, local * span)
    mine = wide[j * span:(j + 1) * span]
    piece = mine[layout.node * stride:(layout.node + 1) * stride]
    piece[:send.size] = send                # (a copy: send may lie in recv)
    piece[send.size:width] = 0
    _counts(piece[width:])[0] = count
    per_slice = words(span)
    heard = h.buffer("heard", np.uint64, local * per_slice)
    deadline = Deadline(request.timeout, h.cap, spent)
    stages = Stages(h, None, deadline)

    def stage(bound: Tuple[Any, Optional[float]], sendbuf: Any, recvbuf: Any,
              **more: Any) -> Request:
        return Request(ALLGATHER, sendbuf, recvbuf, timeout=bound[0], limit=bound[1], **more)

    # 1. across nodes: slice j, the pieces of the ranks of local index j
    s1 = stages.inter(lambda d: stage(d.network(), piece, mine, redundancy=request.redundancy))
    came = (s1.contributors.received() if s1 is not None and s1.contributors is not None
            else np.ones(span, bool))
    if s1 is not None:
        _check_counts(h, stages, mine, came, width, stride, count)
    # 2. within the node: which pieces of each slice arrived
    own_heard = heard[j * per_slice:(j + 1) * per_slice]
    own_heard[:] = _bits(came, per_slice)
    s2 = stages.intra(lambda d: stage(d.record(), own_heard.view(np.int64),
                                      heard.view(np.int64)))
    # 3. within the node: every slice to every rank of the node
    s3 = stages.intra(lambda d: stage(d.rest(), mine, wide))
    if stages.failure is not None:
        stages.failure.throw(h.calls, "allgather")
    assert s1 is not None and s2 is not None and s3 is not None
    arrived = _arrived(heard, per_slice, span, local, s2, s3)
    arrived[j * span:(j + 1) * span] = came
    own_at = j * span + layout.node * stride
    arrived[own_at:own_at + stride] = True
    firsts, lengths, owners, got = [], [], [], []
    for (_, lo, hi), (slot, owner) in zip(pieces.moves, pieces.slots):
        at = slot * stride
        part, here = wide[at:at + hi - lo], arrived[at:at + hi - lo]
        if here.all():
            recv[lo:hi] = part
        else:
            np.copyto(recv[lo:hi], part, where=here)
        if hi > lo:         # (runs of what arrived and what did not: the record's blocks)
            starts = np.concatenate([[0], np.flatnonzero(np.diff(here)) + 1])
            firsts.append(starts + lo)
            lengths.append(np.diff(np.concatenate([starts, [hi - lo]])))
            owners.append(np.full(starts.size, owner, np.int64))
            got.append(here[starts])
    record, delivered = _record(layout, firsts, lengths, owners, got, recv.size)
    stats = (s1, s2, s3)
    held = record.members().sum(axis=1)
    return CollectiveStats(
        delivered=delivered, elapsed=time.perf_counter() - began,
        deadline_hit=any(s.deadline_hit for s in stats), fallback=0.0,
        min_contributors=int(held.min()) if held.size else 1,
        algorithm="hierarchical", nbytes=recv.nbytes, seq=h.calls,
        lost_blocks=tuple(sum(s.lost_blocks[k] for s in stats) for k in range(4)),
        collective="allgather", timeout=stages.timeout(), agreed=delivered,
        contributors=record, rebuilt=s1.rebuilt, redundancy=s1.redundancy)


def _counts(trailer: np.ndarray) -> np.ndarray:
    """A piece's trailer as the int64 it holds."""
    return trailer.view(np.uint8)[:COUNT_BYTES].view(np.int64)


def _check_counts(h: Hierarchy, stages: Stages, mine: np.ndarray, came: np.ndarray,
                  width: int, stride: int, count: int) -> None:
    """After stage 1: a piece whose trailer arrived with another element
    count than this rank's fails the call here (stages after it refuse,
    so that every rank of the node raises; the ranks of the other nodes
    see this rank's count in its piece)."""
    layout = h.layout
    for n in range(layout.nodes):
        trailer = slice(n * stride + width, (n + 1) * stride)
        theirs = int(_counts(mine[trailer])[0])
        if n != layout.node and came[trailer].all() and theirs != count:
            other = layout.ranks_of(n)[layout.local_rank]
            pair = sorted((layout.rank, other))
            stages.failure = Failure(MismatchError, (
                f"rank {layout.rank}: ranks {pair} passed recvbufs of different sizes "
                f"(rank {layout.rank}: {count} elements, rank {other}: {theirs}); every "
                f"rank passes the same"), None)
            return


def _bits(mask: np.ndarray, n_words: int) -> np.ndarray:
    """A bool per element as `n_words` uint64 words (element i: bit i % 64
    of word i // 64)."""
    out = np.zeros(n_words * 8, np.uint8)
    packed = np.packbits(mask, bitorder="little")
    out[:packed.size] = packed
    return out.view(np.uint64)


def _arrived(heard: np.ndarray, per_slice: int, span: int, local: int,
             records: CollectiveStats, data: CollectiveStats) -> np.ndarray:
    """Per element of the node's slices (two-level order): did its piece
    reach the slice's holder (its record, if the record came) and then
    this rank (stage 3's record)?"""
    bits = heard.reshape(local, per_slice).view(np.uint8)
    arrived = np.unpackbits(bits, axis=1, count=span, bitorder="little").astype(bool)
    if records.contributors is not None:
        came: np.ndarray = records.contributors.received().reshape(local, per_slice)
        arrived &= came.all(axis=1, keepdims=True)
    out = arrived.reshape(-1)
    if data.contributors is not None:
        out &= data.contributors.received()
    return out


def _record(layout: Any, firsts: list, lengths: list, owners: list, got: list,
            count: int) -> Tuple[Contributors, float]:
    """The record of the result in the user's order (a block per run of
    elements of one owner that arrived, or did not), and the fraction of
    the result that holds its owners' data."""
    ranks = len(layout.node_of)
    if not firsts:
        empty = np.zeros(0, np.int64)
        return (Contributors.of_blocks(np.zeros((0, words(ranks)), np.uint64), empty, empty,
                                       size=ranks, rank=layout.rank), 1.0)
    first, length = np.concatenate(firsts), np.concatenate(lengths)
    owner, came = np.concatenate(owners), np.concatenate(got)
    order = np.argsort(first, kind="stable")
    first, length, owner, came = first[order], length[order], owner[order], came[order]
    members = np.zeros((first.size, ranks), bool)
    members[np.arange(first.size), owner] = came
    record = Contributors.of_blocks(pack(members), first, length, size=ranks, rank=layout.rank)
    return record, float(length[came].sum()) / count if count else 1.0
