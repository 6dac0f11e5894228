"""What an all-reduce benchmark is asked (BenchConfig), what it reports per
size and algorithm (Row), and the inputs every rank sends (small_ints):
shared by the side-by-side table (allreduce.py) and the tail scenarios
(tail.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .harness import Timeout


@dataclass
class BenchConfig:
    sizes: Sequence[int]
    dtype: str = "float32"
    op: str = "sum"
    algorithms: Sequence[str] = ("ring",)
    channels: Sequence[str] = ("rma",)
    timeout: Timeout = None
    loss: Optional[str] = None
    iters: int = 20
    warmup: int = 5
    block_bytes: Optional[int] = None
    weighted: bool = False        # op="avg" with weight = rank + 1
    compression: Optional[str] = None   # "int8" or "int4": low-bit payloads
    topk: Optional[float] = None  # aligned Top-K at this density (mpilossy.compression)
    redundancy: Optional[Tuple[int, int]] = None  # (k, m); also measured without, side by side


@dataclass
class Row:
    size: int                    # bytes
    count: int                   # elements
    type: str
    redop: str
    algorithm: str
    channel: str
    time_us: float               # mean over iterations of the slowest rank
    algbw: float                 # GB/s
    busbw: float                 # GB/s
    wrong: int                   # elements off the exact result (rank 0)
    mpi_time_us: float
    mpi_busbw: float
    ratio: float                 # mpi time / lossy time (>1: lossy faster)
    delivered: float             # mean over iterations and ranks
    max_err: float               # largest |result - exact| / max|exact|, any rank, any iteration
    p50_us: float
    p99_us: float
    mpi_p99_us: float
    times_us: List[float] = field(default_factory=list, repr=False)
    mpi_times_us: List[float] = field(default_factory=list, repr=False)
    datagrams: float = 0.0       # sent per call and rank (channel ud), mean over ranks
    payload: int = 0             # bytes of the vector as it travels (direct; compressed)
    rebuilt: float = 0.0         # blocks rebuilt from parity per call and rank (redundancy)
    plain_time_us: float = 0.0   # redundancy: the same calls with redundancy=None
    plain_delivered: float = 0.0


def small_ints(count: int, rank: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Small integers: exact sums in every dtype, so #wrong is exact."""
    return ((np.arange(count, dtype=np.int64) * 7 + 3 * rank + salt) % 23).astype(dtype)
