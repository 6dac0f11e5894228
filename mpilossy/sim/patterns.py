"""mpilossy's all-reduce algorithms as message patterns.

For each algorithm: how a call cuts the vector into chunks and blocks
(`Geometry`), and what each rank reads from whom, in which order and
deadline stage (`streams`).  This is the compiled core's plan
(src_cython/algorithms/{ring,direct,tree}.pxi) restated: the stream order
matters, since injected loss is decided in that order (injected.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from .injected import mix64

__all__ = ["ALGORITHMS", "Geometry", "Stream", "geometry", "streams", "rotation",
           "tree_shape", "BLOCK_BYTES"]

ALGORITHMS = ("direct", "ring", "tree")
BLOCK_BYTES = 256 * 1024          # the Communicator's default block_bytes
_ROTATION_SALT = {"ring": 0x52494E47, "direct": 0x444952454354, "tree": 0x54524545}


@dataclass(frozen=True)
class Geometry:
    """Chunks and blocks of one call: every chunk is cut in `nblocks` blocks
    of `block_elems` elements (the last ones of a short chunk may be empty)."""

    size: int
    count: int
    block_elems: int
    nblocks: int
    chunk_lo: Tuple[int, ...]
    chunk_len: Tuple[int, ...]
    stage_end: Tuple[float, ...]
    wire_itemsize: int          # bytes per element in a partial-sum record

    def block_len(self, chunk: int, block: int) -> int:
        rest = self.chunk_len[chunk] - block * self.block_elems
        return max(0, min(rest, self.block_elems))

    def block_first(self, chunk: int, block: int) -> int:
        return self.chunk_lo[chunk] + block * self.block_elems


@dataclass(frozen=True)
class Stream:
    """What one rank reads from `peer`: every block of `slot` (the peer's
    record area), resolved by the end of deadline `stage`."""

    peer: int
    slot: int
    stage: int
    role: str      # "partial" (ring/tree, up), "contribution" (direct), "result"


def _chunks(count: int, size: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    base, extra = divmod(count, size)
    lens = tuple(base + (1 if c < extra else 0) for c in range(size))
    los = tuple(sum(lens[:c]) for c in range(size))
    return los, lens


def tree_levels(size: int, radix: int) -> int:
    levels, width = 0, 1
    while width < size:
        width *= radix
        levels += 1
    return levels


def geometry(algorithm: str, size: int, count: int, itemsize: int = 4,
             block_bytes: int = BLOCK_BYTES, max_block: int = 1 << 30,
             acc_itemsize: int = 0, radix: int = 4, ranks_words: int = 1) -> Geometry:
    """The core's layout of a call (max_block: the channel's largest record,
    2^30 on rma, the datagram payload on ud)."""
    acc = acc_itemsize or itemsize
    block_elems = max(1, min(block_bytes, max_block) // itemsize)
    if algorithm == "tree":
        levels = tree_levels(size, radix)
        block_elems = max(1, min(block_elems * itemsize // acc, count))
        nblocks = max(1, -(-count // block_elems))
        nstages = max(1, 2 * levels)
        return Geometry(size, count, block_elems, nblocks, (0,), (count,),
                        tuple((s + 1.0) / nstages for s in range(nstages)), acc)
    los, lens = _chunks(count, size)
    if algorithm == "ring":
        block_elems = max(1, block_elems * itemsize // acc)
        ends = tuple((k + 1) / (2.0 * (size - 1)) for k in range(size - 1)) + (1.0,)
        wire = acc
    elif algorithm == "direct":
        trailer = 8 * ranks_words
        if -(-block_elems * itemsize // 8) * 8 + trailer > max_block:
            block_elems = (max_block - trailer - 8) // itemsize
        ends = (0.5, 1.0)
        wire = itemsize
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    block_elems = max(1, min(block_elems, lens[0]))
    nblocks = max(1, -(-lens[0] // block_elems))
    return Geometry(size, count, block_elems, nblocks, los, lens, ends, wire)


def rotation(algorithm: str, seq: int, size: int, rotate: bool = True) -> int:
    """The call's rotation: the reducer of chunk c is (c + rotation) % size
    (ring, direct), or the tree's root."""
    return mix64(seq ^ _ROTATION_SALT[algorithm]) % size if rotate else 0


def tree_shape(rank: int, size: int, root: int, radix: int) -> Tuple[List[int], List[int], int]:
    """(children, their levels, parent or -1) of `rank` in the call's tree."""
    v = (rank - root) % size
    children: List[int] = []
    levels: List[int] = []
    level, width = 0, 1
    while width < size:
        if v % (width * radix):
            break
        for d in range(1, radix):
            u = v + d * width
            if u >= size:
                break
            children.append((u + root) % size)
            levels.append(level)
        level += 1
        width *= radix
    parent = -1 if v == 0 else (v - (v // width % radix) * width + root) % size
    return children, levels, parent


def tree_depth(v: int, radix: int) -> int:
    depth = 0
    while v > 0:
        if v % radix:
            depth += 1
        v //= radix
    return depth


def streams(algorithm: str, rank: int, size: int, seq: int, rotate: bool = True,
            radix: int = 4) -> List[Stream]:
    """What `rank` reads in one all-reduce, in the core's order."""
    rot = rotation(algorithm, seq, size, rotate)
    out: List[Stream] = []
    if algorithm == "ring":
        left = (rank - 1) % size
        out += [Stream(left, j - 1, j - 1, "partial") for j in range(1, size)]
        for k in range(1, size):
            reducer = (rank - k) % size
            out.append(Stream(reducer, size - 1, size - 1, "result"))
    elif algorithm == "direct":
        others = [(rank - k) % size for k in range(1, size)]
        mine = (rank - rot) % size
        out += [Stream(p, mine, 0, "contribution") for p in others]
        out += [Stream(p, (p - rot) % size, 1, "result") for p in others]
    elif algorithm == "tree":
        children, levels, parent = tree_shape(rank, size, rot, radix)
        out += [Stream(c, 0, lv, "partial") for c, lv in zip(children, levels)]
        if parent >= 0:
            depth = tree_depth((rank - rot) % size, radix)
            out.append(Stream(parent, 1, tree_levels(size, radix) + depth - 1, "result"))
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    return out
