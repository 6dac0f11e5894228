"""The compiled core's injected loss, decided the same way in the model.

The core decides each lost block at the receiver from counters only
(src_cython/engine/lossmodel.pxi): a hash of (seed, call, link, index),
where link is (peer << 32 | rank) and index counts the records of the
call's streams in the order the algorithm plans them.  Mirroring that rule
lets the model be fed exactly the losses a real run suffers, so the two can
be compared block by block (tests/sim/test_model_agreement.py).

With redundancy=(k, m) a stream's records are its data blocks and, after
each group of k (the last may be shorter), the group's m parity records
(src_cython/engine/lossmodel.pxi: wire_record); a group that lost at most m
of its records rebuilds every data block it lost (src_cython/codecs/
coding.pxi: any k rows in hand, the last group's padding counting as held).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..loss import Bernoulli, GilbertElliott

__all__ = ["mix64", "hash4", "unit", "wire_order", "LossState"]

_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """The core's 64-bit finaliser (mpl_mix64)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash4(a: int, b: int, c: int, d: int) -> int:
    return mix64(mix64(mix64(mix64(a & _M64) ^ (b & _M64)) ^ (c & _M64)) ^ (d & _M64))


def unit(h: int) -> float:
    """Uniform in [0, 1) from the hash's top 53 bits."""
    return (h >> 11) * 2.0 ** -53


def wire_order(nblocks: int, fec: Optional[Tuple[int, int]]) -> List[int]:
    """The records of a stream in the order they are sent: data block b is
    record b, parity record j of group g is nblocks + g m + j."""
    if not fec:
        return list(range(nblocks))
    k, m = fec
    order: List[int] = []
    for g in range(-(-nblocks // k)):
        order += range(g * k, min(nblocks, (g + 1) * k))
        order += range(nblocks + g * m, nblocks + (g + 1) * m)
    return order


def _rebuilt(dropped: List[bool], nblocks: int, fec: Tuple[int, int]) -> List[bool]:
    """Which data blocks stay lost once each group rebuilt what it could."""
    k, m = fec
    lost = dropped[:nblocks]
    for g in range(-(-nblocks // k)):
        data = range(g * k, min(nblocks, (g + 1) * k))
        parity = range(nblocks + g * m, nblocks + (g + 1) * m)
        if sum(dropped[b] for b in data) + sum(dropped[r] for r in parity) <= m:
            for b in data:
                lost[b] = False
    return lost


class LossState:
    """One rank's injected loss: which records of each stream a call loses.

    Keeps the Gilbert-Elliott state of each incoming link from call to call,
    as the core does, so calls must be asked for in order."""

    def __init__(self, rank: int, size: int, models: Sequence[object] = ()) -> None:
        self.rank = rank
        self.bernoulli = next((m for m in models if isinstance(m, Bernoulli)), None)
        self.gilbert = next((m for m in models if isinstance(m, GilbertElliott)), None)
        self.bad = [False] * size

    def drops(self, seq: int, peers: Sequence[int], records: int,
              fec: Optional[Tuple[int, int]] = None) -> List[List[bool]]:
        """drops[i][b]: is data block b of the stream read from peers[i] lost
        (dropped and, with redundancy=fec, not rebuilt)?  `records`: the
        stream's data blocks."""
        out: List[List[bool]] = []
        index = 0
        order = wire_order(records, fec)
        for peer in peers:
            link = (peer << 32) | self.rank
            dropped = [False] * len(order)
            for b in order:
                index += 1
                if self.bernoulli is not None and unit(hash4(
                        self.bernoulli.seed, seq, link, index)) < self.bernoulli.p:
                    dropped[b] = True
                g = self.gilbert
                if g is not None:
                    bad = self.bad[peer]
                    if unit(hash4(g.seed, seq, link, 2 * index)) < (
                            g.p_bad_to_good if bad else g.p_good_to_bad):
                        bad = not bad
                    self.bad[peer] = bad
                    loss = g.loss_bad if bad else g.loss_good
                    if unit(hash4(g.seed, seq, link, 2 * index + 1)) < loss:
                        dropped[b] = True
            out.append(_rebuilt(dropped, records, fec) if fec else dropped)
        return out
