"""Timing loop and nccl-tests style table for lossy vs reliable all-reduce."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

import mpilossy

TYPE_NAMES = {"float16": "half", "float32": "float", "float64": "double",
              "int32": "int32", "int64": "int64"}


@dataclass
class BenchConfig:
    sizes: Sequence[int]
    dtype: str = "float32"
    op: str = "sum"
    algorithms: Sequence[str] = ("ring",)
    channels: Sequence[str] = ("rma",)
    timeout: Optional[float] = None
    loss: Optional[str] = None
    iters: int = 20
    warmup: int = 5
    block_bytes: Optional[int] = None


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
    times_us: list = field(default_factory=list, repr=False)
    mpi_times_us: list = field(default_factory=list, repr=False)


def bus_factor(nranks: int) -> float:
    """nccl-tests: busbw = algbw * 2 (n - 1) / n for all-reduce."""
    return 2.0 * (nranks - 1) / nranks if nranks > 1 else 1.0


def _data(count: int, rank: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Small integers: exact sums in every dtype, so #wrong is exact."""
    return ((np.arange(count, dtype=np.int64) * 7 + 3 * rank + salt) % 23).astype(dtype)


def _slowest(comm: MPI.Comm, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def run_allreduce_bench(comm: MPI.Comm, cfg: BenchConfig,
                        progress: Optional[Callable[[str], None]] = None) -> list:
    """Measure every (size, algorithm); return rows (identical on all ranks)."""
    rows = []
    for channel in cfg.channels:
        with mpilossy.Communicator(comm, channel=channel, timeout=cfg.timeout, loss=cfg.loss,
                                   block_bytes=cfg.block_bytes,
                                   capacity=max(4 << 20, 2 * max(cfg.sizes) + (1 << 20))) as lc:
            rows += _sweep(comm, lc, cfg, channel, progress)
    return rows


def _sweep(comm, lc, cfg, channel, progress) -> list:
    dtype = np.dtype(cfg.dtype)
    rows = []
    for size in cfg.sizes:
        count = max(size // dtype.itemsize, 0)
        send = _data(count, comm.rank, dtype)
        exact = np.empty_like(send)
        if dtype == np.float16:
            wide = np.empty(count, np.float64)
            comm.Allreduce(send.astype(np.float64), wide)
            exact = wide.astype(np.float16)
        else:
            comm.Allreduce(send, exact)
        if cfg.op == "avg":
            exact = (exact.astype(np.float64) / comm.size).astype(dtype)
        scale = float(np.max(np.abs(exact.astype(np.float64)))) if count else 1.0
        for algorithm in cfg.algorithms:
            if progress:
                progress(f"{size} B {channel} {algorithm}")
            rows.append(_measure(comm, lc, cfg, channel, algorithm, send, exact, scale))
    return rows


def _measure(comm, lc, cfg, channel, algorithm, send, exact, scale) -> Row:
    recv = np.empty_like(send)
    ref = np.empty_like(send)
    mpi_send = send.astype(np.float64) if send.dtype == np.float16 else send
    mpi_recv = np.empty_like(mpi_send)
    times, mpi_times, delivered = [], [], []
    wrong, max_err = 0, 0.0
    for it in range(cfg.warmup + cfg.iters):
        # MPI_Allreduce and the lossy call alternate, so that drift in the
        # machine's load hits both alike.
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(mpi_send, mpi_recv)
        t_mpi = _slowest(comm, time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        stats = lc.allreduce(send, recv, op=cfg.op, algorithm=algorithm)
        t_lossy = _slowest(comm, time.perf_counter() - t0)
        if it < cfg.warmup:
            continue
        times.append(t_lossy)
        mpi_times.append(t_mpi)
        delivered.append(stats.delivered)
        if recv.size:
            err = np.abs(recv.astype(np.float64) - exact.astype(np.float64))
            max_err = max(max_err, float(err.max()) / (scale or 1.0))
            if it == cfg.warmup:
                tol = 1e-3 if send.dtype == np.float16 else 1e-6
                wrong = int(np.count_nonzero(err > tol * max(scale, 1.0)))
    n = comm.size
    t = float(np.mean(times))
    t_mpi = float(np.mean(mpi_times))
    nbytes = send.nbytes
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    mpi_algbw = nbytes / t_mpi / 1e9 if t_mpi > 0 else 0.0
    return Row(
        size=nbytes, count=send.size, type=TYPE_NAMES[send.dtype.name], redop=cfg.op,
        algorithm=algorithm, channel=channel, time_us=t * 1e6, algbw=algbw, busbw=algbw * bus_factor(n),
        wrong=comm.allreduce(wrong, op=MPI.MAX), mpi_time_us=t_mpi * 1e6,
        mpi_busbw=mpi_algbw * bus_factor(n), ratio=t_mpi / t if t > 0 else math.nan,
        delivered=float(np.mean(comm.allgather(float(np.mean(delivered))))),
        max_err=comm.allreduce(max_err, op=MPI.MAX),
        p50_us=float(np.percentile(times, 50)) * 1e6, p99_us=float(np.percentile(times, 99)) * 1e6,
        mpi_p99_us=float(np.percentile(mpi_times, 99)) * 1e6,
        times_us=[x * 1e6 for x in times], mpi_times_us=[x * 1e6 for x in mpi_times])


HEADER = ("#       size       count    type  redop  root   algo  chan      time   algbw   busbw  #wrong"
          "  mpi-time mpi-busbw  ratio  delivered    max-err   p99-time mpi-p99-time")
UNITS = ("#        (B)  (elements)                                         (us)  (GB/s)  (GB/s)        "
         "      (us)    (GB/s) mpi/us                             (us)         (us)")


def format_table(rows: list, comm: MPI.Comm, cfg: BenchConfig) -> str:
    vendor = " ".join(MPI.Get_library_version().split()[:3])
    lines = [
        f"# mpilossy.bench allreduce: {comm.size} ranks, {vendor}, mpilossy {mpilossy.__version__}",
        f"# channels {','.join(cfg.channels)}, timeout {cfg.timeout}, loss {cfg.loss or 'none'}, "
        f"iters {cfg.iters}, warmup {cfg.warmup}",
        "# time = mean over iterations of the slowest rank; busbw = algbw * 2(n-1)/n;",
        "# ratio = MPI_Allreduce time / mpilossy time in the same run (> 1: mpilossy faster)",
        "#", HEADER, UNITS,
    ]
    for r in rows:
        lines.append(
            f"{r.size:12d} {r.count:11d} {r.type:>7s} {r.redop:>6s} {-1:5d} {r.algorithm:>6s} "
            f"{r.channel:>5s} "
            f"{r.time_us:9.1f} {r.algbw:7.3f} {r.busbw:7.3f} {r.wrong:7d} "
            f"{r.mpi_time_us:9.1f} {r.mpi_busbw:9.3f} {r.ratio:6.2f} {r.delivered:10.4f} "
            f"{r.max_err:10.3g} {r.p99_us:10.1f} {r.mpi_p99_us:12.1f}")
    if rows:
        avg = sum(r.busbw for r in rows) / len(rows)
        lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
        lines.append(f"# Geometric mean ratio : "
                     f"{math.exp(sum(math.log(r.ratio) for r in rows) / len(rows)):.3f}")
    return "\n".join(lines)


def write_json(path: str, rows: list, comm: MPI.Comm, cfg: BenchConfig) -> None:
    doc = {
        "ranks": comm.size,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "mpilossy": mpilossy.__version__,
        "config": asdict(cfg),
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
