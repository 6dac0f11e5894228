"""Who contributed to each block of a hierarchical all-reduce's result.

The blocks are those of the stage across nodes (the direct algorithm's, one
record per block).  The owner of a slice knows which nodes' partial sums
reached each block of it (stage 2's record) and which ranks of its own node
reached its slice within the node (stage 1's); it sends its node's ranks one
bitmap per block, a bit per rank of the parent communicator, and every rank
assembles the record of the whole result from its node's owners.

What an owner cannot see: a rank of another node whose data missed that
node's stage 1 (a stopped rank).  That node's partial sum counts as whole
here (docs/hierarchy.md).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..call.buffers import chunk_bounds
from ..call.contributors import Contributors
from .layout import NodeLayout

__all__ = ["capacity", "network_spans", "owner_record", "piece_record", "assemble", "pack", "words"]

HEAD = 2        # words before an owner's bitmaps: the network stage's block_elems, blocks


def words(ranks: int) -> int:
    """uint64 words of one block's bitmap."""
    return (ranks + 63) // 64


def capacity(longest: int, nodes: int, ranks: int, itemsize: int, block_bytes: int,
             max_block: int) -> int:
    """Words of one owner's record for slices of at most `longest` elements:
    enough for the most blocks the stage across nodes can cut a slice into
    (its blocks hold at least what a block_bytes record less its trailer,
    bitmap and parity header holds; compressed blocks hold more)."""
    smallest = max(1, (min(block_bytes, max_block) - 8 * words(nodes) - 24) // itemsize)
    return HEAD + (-(-longest // smallest) + nodes) * words(ranks)


def network_spans(length: int, nodes: int, block_elems: int) -> Tuple[np.ndarray, np.ndarray]:
    """(first, length) of the non-empty blocks of the direct all-reduce of
    `length` elements over `nodes` ranks: chunk by chunk, `block_elems` per
    block (as Contributors.blocks() lays them out)."""
    firsts, lengths = [], []
    for n in range(nodes):
        lo, hi = chunk_bounds(length, nodes, n)
        f = np.arange(lo, hi, block_elems, dtype=np.int64)
        firsts.append(f)
        lengths.append(np.minimum(hi - f, block_elems))
    return np.concatenate(firsts), np.concatenate(lengths)


def _within(record: Optional[Contributors], firsts: np.ndarray, lengths: np.ndarray,
            width: int) -> np.ndarray:
    """(spans, width) bool: True where every block of `record` (stage 1's,
    over the same slice) that overlaps the span holds that member.  None (a
    stage without a record: an exact one): everyone."""
    if record is None or record.members().all():
        return np.ones((firsts.size, width), bool)
    src_first, src_len = record.blocks()
    keep = src_len > 0
    src_first, src_end = src_first[keep], src_first[keep] + src_len[keep]
    missing = np.concatenate([np.zeros((1, width), np.int64),
                              np.cumsum(~record.members()[keep], axis=0)])
    lo = np.searchsorted(src_end, firsts, side="right")
    hi = np.searchsorted(src_first, firsts + lengths, side="left")
    return (missing[hi] - missing[lo]) == 0


def pack(members: np.ndarray) -> np.ndarray:
    """(blocks, ranks) bool -> (blocks, words) uint64, rank r in bit r % 64
    of word r // 64 (as Contributors reads them)."""
    padded = np.zeros((members.shape[0], words(members.shape[1]) * 64), bool)
    padded[:, :members.shape[1]] = members
    return np.packbits(padded, axis=1, bitorder="little").view("<u8").astype(np.uint64)


def _spans_of(across: Contributors, length: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, length, members over nodes) of the non-empty blocks of stage
    2's record within its first `length` elements."""
    firsts, lengths = across.blocks()
    keep = (lengths > 0) & (firsts < length)
    firsts = firsts[keep]
    return firsts, np.minimum(lengths[keep], length - firsts), across.members()[keep]


def _members(layout: NodeLayout, firsts: np.ndarray, lengths: np.ndarray, offset: int,
             within: Optional[Contributors], nodes: np.ndarray) -> np.ndarray:
    """(blocks, ranks) bool: the ranks of every node whose partial reached
    each block (`nodes`: stage 2's members), less the ranks of this node
    whose data missed it in stage 1 (`within`, whose record starts
    `offset` elements before these blocks)."""
    members = nodes[:, list(layout.node_of)]
    mine = _within(within, firsts + offset, lengths, layout.local_size)
    for local, rank in enumerate(layout.ranks_of(layout.node)):
        members[:, rank] &= mine[:, local]
    return members


def owner_record(layout: NodeLayout, length: int, within: Optional[Contributors],
                 across: Optional[Contributors], out: np.ndarray) -> None:
    """Write this owner's record into `out` (uint64 words: block_elems,
    blocks, then one bitmap per block) for its slice of `length` elements:
    `within` is stage 1's record (this node's ranks), `across` stage 2's
    (one member per node).  Left all zeros where there is nothing to say."""
    out[:] = 0
    if across is None or length == 0:
        return
    firsts, lengths, nodes = _spans_of(across, length)
    size = HEAD + firsts.size * words(len(layout.node_of))
    if size > out.size:         # (capacity() bounds it; should it not, say nothing)
        return
    out[0], out[1] = across.block_elems, firsts.size
    out[HEAD:size] = pack(_members(layout, firsts, lengths, 0, within, nodes)).reshape(-1)


def piece_record(layout: NodeLayout, length: int, offset: int, within: Optional[Contributors],
                 across: Contributors) -> Tuple[Contributors, float]:
    """The record of this rank's chunk (`length` elements) of a two-level
    reduce-scatter, and the fraction of all contributions in it: stage 2's
    blocks, `offset` the chunk's first element in stage 1's slice."""
    ranks = len(layout.node_of)
    firsts, lengths, nodes = _spans_of(across, length)
    members = _members(layout, firsts, lengths, offset, within, nodes)
    record = Contributors.of_blocks(pack(members), firsts, lengths, size=ranks, rank=layout.rank)
    held = float((lengths * members.sum(axis=1)).sum())
    return record, (held / (length * ranks) if length else 1.0)


def assemble(layout: NodeLayout, slices: Sequence[Tuple[int, int]], records: np.ndarray,
             came: Sequence[bool], missed: Optional[np.ndarray],
             own: bool) -> Tuple[Contributors, float, float]:
    """The record of this rank's whole result; the fraction of all
    contributions (ranks x elements) in it; that fraction where the slice
    came back within the node (`agreed`).  records: (owners, words) every
    owner's record; came[s]: did owner s's arrive; missed: per element of
    the result, True where its slice did not come back within the node and
    this rank's own contribution stands in (`own`; False: nothing does, as
    with scaling="zero-fill")."""
    ranks = len(layout.node_of)
    w = words(ranks)
    alone = np.zeros((1, w), np.uint64)
    if own:
        alone[0, layout.rank // 64] = np.uint64(1) << np.uint64(layout.rank % 64)
    firsts: List[np.ndarray] = []
    lengths: List[np.ndarray] = []
    bits: List[np.ndarray] = []
    fell: List[np.ndarray] = []
    for s, (lo, hi) in enumerate(slices):
        if hi == lo:
            continue
        record = records[s]
        block_elems, blocks = int(record[0]), int(record[1])
        f, n = np.zeros(1, np.int64), np.array([hi - lo], np.int64)
        b = alone                 # nothing known: one block, this rank's own
        if came[s] and block_elems > 0 and HEAD + blocks * w <= record.size:
            cut = network_spans(hi - lo, layout.nodes, block_elems)
            if cut[0].size == blocks:
                f, n = cut
                b = record[HEAD:HEAD + blocks * w].reshape(blocks, w)
        gone = (np.logical_or.reduceat(missed[lo:hi], f) if missed is not None
                else np.zeros(f.size, bool))
        firsts.append(f + lo)
        lengths.append(n)
        bits.append(np.where(gone[:, None], alone, b))
        fell.append(gone)
    if not bits:
        empty = np.zeros(0, np.int64)
        return (Contributors.of_blocks(np.zeros((0, w), np.uint64), empty, empty,
                                       size=ranks, rank=layout.rank), 1.0, 1.0)
    record = Contributors.of_blocks(np.concatenate(bits), np.concatenate(firsts),
                                    np.concatenate(lengths), size=ranks, rank=layout.rank)
    span = np.concatenate(lengths)
    held = span * record.members().sum(axis=1)
    kept = ~np.concatenate(fell)
    delivered = float(held.sum()) / (float(span.sum()) * ranks)
    whole = float(span[kept].sum()) * ranks
    agreed = float(held[kept].sum()) / whole if whole else 1.0
    return record, delivered, agreed
