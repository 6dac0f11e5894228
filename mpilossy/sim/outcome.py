"""Who contributes to which block of each rank's result, given which blocks
each rank lost (injected, dropped on the wire, or late).

This is the algorithms' reaction to loss, restated from the compiled core
(src_cython/algorithms): a lost ring or tree partial restarts the sum with
the reader's own data, a lost direct contribution is left out, and a rank
whose reduced block is lost falls back on its own partial sum (ring, tree)
or its own contribution (direct).  Sets are bitmasks of ranks.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .injected import LossState
from .patterns import Geometry, rotation, streams, tree_shape

__all__ = ["contributors", "injected", "Lost", "Result"]

Lost = Sequence[Sequence[Sequence[bool]]]     # [rank][stream][block]
Result = List[Dict[Tuple[int, int], int]]     # [rank][(chunk, block)] -> bitmask


def contributors(algorithm: str, size: int, seq: int, geo: Geometry, lost: Lost,
                 rotate: bool = True, radix: int = 4) -> Result:
    """Each rank's result, block by block, as the set of ranks summed in it."""
    if size == 1:
        return [{(c, b): 1 for c in range(len(geo.chunk_len)) for b in range(geo.nblocks)}]
    if algorithm == "ring":
        return _ring(size, seq, geo, lost, rotate)
    if algorithm == "direct":
        return _direct(size, seq, geo, lost, rotate)
    if algorithm == "tree":
        return _tree(size, seq, geo, lost, rotate, radix)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _ring(size: int, seq: int, geo: Geometry, lost: Lost, rotate: bool) -> Result:
    rot = rotation("ring", seq, size, rotate)
    # partial[r][j][b]: what rank r holds at position j of the chain of the
    # chunk it sees there (position 0 starts a chain, size - 1 reduces).
    partial = [[[0] * geo.nblocks for _ in range(size)] for _ in range(size)]
    for j in range(size):
        for r in range(size):
            left = (r - 1) % size
            for b in range(geo.nblocks):
                me = 1 << r
                if j and not lost[r][j - 1][b]:
                    me |= partial[left][j - 1][b]
                partial[r][j][b] = me
    out: Result = []
    for r in range(size):
        blocks: Dict[Tuple[int, int], int] = {}
        for chunk in range(size):
            reducer = (chunk + rot) % size
            position = (r - reducer - 1) % size
            for b in range(geo.nblocks):
                if reducer == r:
                    blocks[chunk, b] = partial[r][size - 1][b]
                    continue
                k = (r - reducer) % size                  # stream size - 1 + k - 1
                if lost[r][size - 2 + k][b]:
                    blocks[chunk, b] = partial[r][position][b]
                else:
                    blocks[chunk, b] = partial[reducer][size - 1][b]
        out.append(blocks)
    return out


def _direct(size: int, seq: int, geo: Geometry, lost: Lost, rotate: bool) -> Result:
    rot = rotation("direct", seq, size, rotate)
    reduced = []
    for r in range(size):
        row = []
        for b in range(geo.nblocks):
            mask = 1 << r
            for k in range(1, size):
                if not lost[r][k - 1][b]:
                    mask |= 1 << ((r - k) % size)
            row.append(mask)
        reduced.append(row)
    out: Result = []
    for r in range(size):
        blocks: Dict[Tuple[int, int], int] = {}
        for chunk in range(size):
            reducer = (chunk + rot) % size
            for b in range(geo.nblocks):
                if reducer == r:
                    blocks[chunk, b] = reduced[r][b]
                    continue
                k = (r - reducer) % size                  # others[k - 1]
                gone = lost[r][size - 1 + k - 1][b]
                blocks[chunk, b] = 1 << r if gone else reduced[reducer][b]
        out.append(blocks)
    return out


def _tree(size: int, seq: int, geo: Geometry, lost: Lost, rotate: bool, radix: int) -> Result:
    root = rotation("tree", seq, size, rotate)
    order = sorted(range(size), key=lambda r: (r - root) % size)
    shape = {r: tree_shape(r, size, root, radix) for r in range(size)}
    partial = {r: [1 << r] * geo.nblocks for r in range(size)}
    for r in reversed(order):                       # children before parents
        children = shape[r][0]
        for i, c in enumerate(children):
            for b in range(geo.nblocks):
                if not lost[r][i][b]:
                    partial[r][b] |= partial[c][b]
    result: Dict[int, List[int]] = {}
    valid: Dict[int, List[bool]] = {}
    for r in order:                                 # parents before children
        children, _, parent = shape[r]
        if parent < 0:
            result[r], valid[r] = list(partial[r]), [True] * geo.nblocks
            continue
        at = len(children)                          # the parent's stream comes last
        result[r], valid[r] = [], []
        for b in range(geo.nblocks):
            # a parent that lost the result sends a record with count 0
            ok = valid[parent][b] and not lost[r][at][b]
            result[r].append(result[parent][b] if ok else partial[r][b])
            valid[r].append(ok)
    return [{(0, b): result[r][b] for b in range(geo.nblocks)} for r in range(size)]


def injected(algorithm: str, size: int, seq: int, records: int, states: Sequence[LossState],
             rotate: bool = True, radix: int = 4,
             fec: Optional[Tuple[int, int]] = None) -> List[List[List[bool]]]:
    """lost[rank][stream][block] from each rank's injected.LossState (with
    redundancy=fec: what its groups did not rebuild)."""
    return [states[r].drops(seq, [s.peer for s in streams(algorithm, r, size, seq, rotate, radix)],
                            records, fec) for r in range(size)]
