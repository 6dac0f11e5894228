"""A call that this rank answers alone, as a call in which nothing from any
other rank arrived would end: its own contribution, scaled without bias.

Elastic communicators use it to line survivors up again (docs/elastic.md):
a rank that reached the agreement on who is out after call c, while others
reached it after call c + d, answers its next d calls this way, so that
every survivor's next call on the survivors' communicator is the same
call.  No message is sent: the ranks that went ahead already made these
calls without this rank's data."""

from __future__ import annotations

import time
from typing import Any, Tuple

import numpy as np

from .._core import ALLGATHER, ALLREDUCE, AVG, DIRECT, REDUCE_SCATTER
from .buffers import chunk_bounds
from .contributors import Contributors
from .stats import ALGORITHM_NAMES, COLLECTIVE_NAMES, CollectiveStats

__all__ = ["answer_alone"]


def answer_alone(bufs: Any, spec: Any, rank: int, size: int, scaling: str,
                 seq: int) -> CollectiveStats:
    """Write this rank's lone result of the call `spec` (CallSpec) into
    `bufs` (call/buffers.py, finished here) and return its statistics.

    All-reduce: every chunk holds this rank's contribution (op="sum":
    times `size`, the unbiased estimate of the sum from one rank; "avg" and
    weighted: as it is).  With scaling="zero-fill" only this rank's chunk
    holds it (sum / size, where the sum is its own), the others zeros.
    Reduce-scatter: this rank's chunk of that.  All-gather: this rank's
    chunk; the others keep what recvbuf held.  `seq`: the call number the
    ranks that went ahead gave this call."""
    began = time.perf_counter()
    collective = spec.collective
    count = bufs.recv.size if collective == ALLGATHER else bufs.send.size
    lo, hi = chunk_bounds(count, size, rank)
    ok = False
    try:
        if bufs.segments is None:
            _write(bufs.send, bufs.recv, collective, spec.op, size, scaling, (lo, hi))
        for k, (first, stop) in enumerate(bufs.segments or ()):    # (all-reduces only)
            bufs.ready(k)
            inside = (min(max(lo, first), stop) - first, min(max(hi, first), stop) - first)
            _write(bufs.send[first:stop], bufs.recv[first:stop], collective, spec.op, size,
                   scaling, inside)
            bufs.deliver(k)
        if spec.residual is not None:
            spec.residual[...] = 0          # (nothing was quantised)
        ok = True
    finally:
        bufs.finish(ok=ok)
    own = (hi - lo) / count if count else 1.0
    zero_fill = scaling == "zero-fill" and collective != ALLGATHER
    everywhere = collective == ALLREDUCE and not zero_fill   # (own data in every chunk)
    if collective == ALLGATHER:
        delivered = own                 # (of the elements: its own chunk arrived)
    elif collective == REDUCE_SCATTER:
        delivered = 1.0 / size
    else:
        delivered = (1.0 if everywhere else own) / size
    lone = size > 1
    return CollectiveStats(
        delivered=delivered, elapsed=time.perf_counter() - began, deadline_hit=lone,
        fallback=1.0 - own if everywhere else 0.0,
        min_contributors=0 if lone and collective != REDUCE_SCATTER and not everywhere else 1,
        algorithm=ALGORITHM_NAMES[spec.algorithm], nbytes=spec.nbytes, seq=seq,
        lost_blocks=(0, 0, size - 1, 0), collective=COLLECTIVE_NAMES[collective],
        timeout=None if spec.timeout < 0 else spec.timeout,
        agreed=(own if collective != REDUCE_SCATTER else 1.0) / size,
        contributors=_record(count, size, rank, collective, everywhere)
        if spec.algorithm == DIRECT else None,
        redundancy=(spec.fec_k, spec.fec_m) if spec.fec_k else None, alone=True)


def _write(send: np.ndarray, recv: np.ndarray, collective: int, op: int, size: int,
           scaling: str, own: Tuple[int, int]) -> None:
    """One segment (the whole call if not pipelined); `own`: this rank's
    chunk, as offsets into the segment (empty if it lies outside)."""
    lo, hi = own
    if collective == ALLGATHER:
        recv[lo:hi] = send              # (a copy onto itself when in place)
        return
    if collective == REDUCE_SCATTER:
        send, lo, hi = send[lo:hi], 0, recv.size
    if scaling == "zero-fill":          # (sum / size: only this rank's chunk is summed)
        np.multiply(send[lo:hi], 1.0 / size if op == AVG else 1.0, out=recv[lo:hi],
                    casting="unsafe")
        recv[:lo] = 0
        recv[hi:] = 0
    elif op == AVG or size == 1:
        recv[...] = send
    else:
        np.multiply(send, size, out=recv, casting="unsafe")


def _record(count: int, size: int, rank: int, collective: int, everywhere: bool
            ) -> Contributors:
    """One block per chunk: this rank's bit in its own chunk, and in every
    other chunk where its data stands in for the sum (`everywhere`: the
    unbiased all-reduce's fallback); nobody's elsewhere."""
    chunks = (rank,) if collective == REDUCE_SCATTER else tuple(range(size))
    words = (size + 63) // 64
    bits = np.zeros((len(chunks), words), np.uint64)
    for row, chunk in enumerate(chunks):
        if chunk == rank or everywhere:
            bits[row, rank // 64] = np.uint64(1) << np.uint64(rank % 64)
    block = max(-(-count // size), 1)
    return Contributors((bits.tobytes(), len(chunks), 1, block, words), size=size, rank=rank,
                        count=count, chunks=chunks)
