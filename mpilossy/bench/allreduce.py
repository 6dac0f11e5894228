"""``mpiexec -n 4 python -m mpilossy.bench allreduce [options]``: lossy
all-reduce against MPI_Allreduce, side by side, nccl-tests style table on
rank 0 (the command ``python -m mpilossy.bench`` runs when given none).
With --scenario, tail latency under a straggler or a microburst instead."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple, Union)

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.config import COMPRESSIONS, check_redundancy

from .harness import figure, parse_size, parse_sizes, save_figure, say, size_range, write_json

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Timeout = Union[float, str, None]     # seconds, "auto" or None

TYPE_NAMES = {"float16": "half", "float32": "float", "float64": "double",
              "int32": "int32", "int64": "int64"}


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


def bus_factor(nranks: int) -> float:
    """nccl-tests: busbw = algbw * 2 (n - 1) / n for all-reduce."""
    return 2.0 * (nranks - 1) / nranks if nranks > 1 else 1.0


def small_ints(count: int, rank: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Small integers: exact sums in every dtype, so #wrong is exact."""
    return ((np.arange(count, dtype=np.int64) * 7 + 3 * rank + salt) % 23).astype(dtype)


def run_allreduce_bench(comm: MPI.Comm, cfg: BenchConfig,
                        progress: Optional[Callable[[str], None]] = None) -> List[Row]:
    """Measure every (size, algorithm); return rows (identical on all ranks)."""
    rows: List[Row] = []
    for channel in cfg.channels:
        with mpilossy.Communicator(comm, channel=channel, timeout=cfg.timeout, loss=cfg.loss,
                                   block_bytes=cfg.block_bytes, compression=cfg.compression,
                                   capacity=max(4 << 20, 2 * max(cfg.sizes) + (1 << 20))) as lc:
            rows += _sweep(comm, lc, cfg, channel, progress)
    return rows


def _sweep(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig, channel: str,
           progress: Optional[Callable[[str], None]]) -> List[Row]:
    dtype = np.dtype(cfg.dtype)
    rows = []
    for size in cfg.sizes:
        count = max(size // dtype.itemsize, 0)
        send = small_ints(count, comm.rank, dtype)
        exact = np.empty_like(send)
        if cfg.weighted:
            wide = np.empty(count, np.float64)
            comm.Allreduce(send.astype(np.float64) * (comm.rank + 1), wide)
            exact = (wide / (comm.size * (comm.size + 1) / 2)).astype(dtype)
        elif dtype == np.float16:
            wide = np.empty(count, np.float64)
            comm.Allreduce(send.astype(np.float64), wide)
            exact = wide.astype(np.float16)
        else:
            comm.Allreduce(send, exact)
        if cfg.op == "avg" and not cfg.weighted:
            exact = (exact.astype(np.float64) / comm.size).astype(dtype)
        scale = float(np.max(np.abs(exact.astype(np.float64)))) if count else 1.0
        for algorithm in cfg.algorithms:
            if progress:
                progress(f"{size} B {channel} {algorithm}")
            rows.append(_measure(comm, lc, cfg, channel, algorithm, send, exact, scale))
    return rows


BATCH = 5   # calls per timed batch


def _measure(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig, channel: str,
             algorithm: str, send: np.ndarray, exact: np.ndarray, scale: float) -> Row:
    """nccl-tests style: back-to-back calls timed in batches, the slowest
    rank's batch time divided by its calls.  Batches of MPI_Allreduce and of
    mpilossy alternate, so that drift in the machine's load hits both alike.
    p50/p99 come from every call's own duration on every rank."""
    recv = np.empty_like(send)
    mpi_send = send.astype(np.float64) if send.dtype == np.float16 else send
    mpi_recv = np.empty_like(mpi_send)
    totals = {"mpi": 0.0, "lossy": 0.0, "plain": 0.0}
    calls: Dict[str, List[float]] = {"mpi": [], "lossy": [], "plain": []}
    delivered: Dict[str, List[float]] = {"lossy": [], "plain": []}
    rebuilt: List[int] = []
    wrong, max_err = 0, 0.0
    done = 0
    # quantised payloads: off by up to a step of their group, twice
    tol = (4.0 / (127 if cfg.compression == "int8" else 7) if cfg.compression
           else 1e-3 if send.dtype == np.float16 else 1e-6)
    sent_before = lc.channel_info().get("sent", 0)

    weight = float(comm.rank + 1) if cfg.weighted else None
    topk = mpilossy.compression.TopK(cfg.topk, error_feedback=False) if cfg.topk else None

    def lossy() -> Optional[mpilossy.CollectiveStats]:
        if topk is not None:        # (its own copy: the compressor reduces in place)
            recv[...] = send
            return topk.allreduce(lc, 0, recv, op=cfg.op, weight=weight)
        return lc.allreduce(send, recv, op=cfg.op, algorithm=algorithm, weight=weight,
                            redundancy=cfg.redundancy)

    def plain() -> Optional[mpilossy.CollectiveStats]:
        return lc.allreduce(send, recv, op=cfg.op, algorithm=algorithm, weight=weight,
                            redundancy=None)

    def mpi() -> None:
        comm.Allreduce(mpi_send, mpi_recv)

    contenders = [("mpi", mpi), ("lossy", lossy)] + ([("plain", plain)] if cfg.redundancy else [])

    fn: Callable[[], Optional[mpilossy.CollectiveStats]]

    for phase, count in (("warmup", cfg.warmup), ("measure", cfg.iters)):
        left = count
        while left > 0:
            batch = min(BATCH, left)
            left -= batch
            for name, fn in contenders:
                comm.Barrier()
                began = time.perf_counter()
                for _ in range(batch):
                    t0 = time.perf_counter()
                    stats = fn()
                    if phase == "measure":
                        calls[name].append(time.perf_counter() - t0)
                        if stats is not None:
                            delivered[name].append(stats.delivered)
                            if name == "lossy":
                                rebuilt.append(stats.rebuilt)
                elapsed = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
                if phase == "measure":
                    totals[name] += elapsed
            if cfg.redundancy:
                lossy()     # (the error below is the redundant call's)
            if phase == "measure" and recv.size:
                err = np.abs(recv.astype(np.float64) - exact.astype(np.float64))
                if topk is not None:
                    err[recv == 0] = 0.0    # (the blocks left out; the sent ones are exact)
                max_err = max(max_err, float(err.max()) / (scale or 1.0))
                if done == 0:
                    wrong = int(np.count_nonzero(err > tol * max(scale, 1.0)))
                done += 1
    datagrams = (lc.channel_info().get("sent", 0) - sent_before) / (cfg.iters + cfg.warmup)
    n = comm.size
    t = totals["lossy"] / max(cfg.iters, 1)
    t_mpi = totals["mpi"] / max(cfg.iters, 1)
    nbytes = send.nbytes
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    mpi_algbw = nbytes / t_mpi / 1e9 if t_mpi > 0 else 0.0
    every = np.concatenate(comm.allgather(np.asarray(calls["lossy"]))) * 1e6
    every_mpi = np.concatenate(comm.allgather(np.asarray(calls["mpi"]))) * 1e6
    return Row(
        size=nbytes, count=send.size, type=TYPE_NAMES[send.dtype.name],
        redop="avg(w)" if cfg.weighted else cfg.op,
        algorithm=algorithm, channel=channel, time_us=t * 1e6, algbw=algbw,
        busbw=algbw * bus_factor(n), wrong=comm.allreduce(wrong, op=MPI.MAX),
        mpi_time_us=t_mpi * 1e6, mpi_busbw=mpi_algbw * bus_factor(n),
        ratio=t_mpi / t if t > 0 else math.nan,
        delivered=float(np.mean(comm.allgather(float(np.mean(delivered["lossy"]))))),
        max_err=comm.allreduce(max_err, op=MPI.MAX),
        p50_us=float(np.percentile(every, 50)), p99_us=float(np.percentile(every, 99)),
        mpi_p99_us=float(np.percentile(every_mpi, 99)),
        times_us=every.tolist(), mpi_times_us=every_mpi.tolist(),
        datagrams=float(np.mean(comm.allgather(datagrams))), payload=payload_bytes(send, cfg),
        rebuilt=float(np.mean(comm.allgather(float(np.mean(rebuilt))))),
        plain_time_us=totals["plain"] / max(cfg.iters, 1) * 1e6,
        plain_delivered=float(np.mean(comm.allgather(
            float(np.mean(delivered["plain"])) if delivered["plain"] else 0.0))))


def payload_bytes(send: np.ndarray, cfg: BenchConfig) -> int:
    """Bytes of the vector as it travels: float32 values; quantised ones
    with their group scales; Top-K's chosen values plus the block energies
    (float32, one per 64 values) of the reliable selection."""
    if cfg.topk:
        blocks = -(-send.size // 64)
        return 4 * min(send.size, 64 * max(1, math.ceil(cfg.topk * blocks))) + 4 * blocks
    if cfg.compression and send.dtype == np.float32:
        return mpilossy._core.quant_bytes(send.size, 64, COMPRESSIONS[cfg.compression])
    return send.nbytes


HEADER = ("#       size       count    type  redop  root   algo  chan      time   algbw   busbw  #wrong"
          "  mpi-time mpi-busbw  ratio  delivered    max-err   p99-time mpi-p99-time  datagrams"
          "     payload")
UNITS = ("#        (B)  (elements)                                         (us)  (GB/s)  (GB/s)        "
         "      (us)    (GB/s) mpi/us                             (us)         (us)  (per call)"
         "         (B)")


def format_table(rows: Sequence[Row], comm: MPI.Comm, cfg: BenchConfig) -> str:
    vendor = " ".join(MPI.Get_library_version().split()[:3])
    lines = [
        f"# mpilossy.bench allreduce: {comm.size} ranks, {vendor}, mpilossy {mpilossy.__version__}",
        f"# channels {','.join(cfg.channels)}, timeout {cfg.timeout}, loss {cfg.loss or 'none'}, "
        f"iters {cfg.iters}, warmup {cfg.warmup}, compression "
        f"{f'topk:{cfg.topk}' if cfg.topk else cfg.compression or 'none'}, redundancy "
        f"{cfg.redundancy or 'none'}",
        "# datagrams = sent per call and rank (channel ud; 0 on rma)",
        f"# time = back-to-back calls in batches of {BATCH}, slowest rank; busbw = algbw * 2(n-1)/n;",
        "# ratio = MPI_Allreduce time / mpilossy time in the same run (> 1: mpilossy faster)",
        "#", HEADER, UNITS,
    ]
    for r in rows:
        lines.append(
            f"{r.size:12d} {r.count:11d} {r.type:>7s} {r.redop:>6s} {-1:5d} {r.algorithm:>6s} "
            f"{r.channel:>5s} "
            f"{r.time_us:9.1f} {r.algbw:7.3f} {r.busbw:7.3f} {r.wrong:7d} "
            f"{r.mpi_time_us:9.1f} {r.mpi_busbw:9.3f} {r.ratio:6.2f} {r.delivered:10.4f} "
            f"{r.max_err:10.3g} {r.p99_us:10.1f} {r.mpi_p99_us:12.1f} {r.datagrams:10.1f} "
            f"{r.payload:11d}")
    if cfg.redundancy:
        lines += ["#", f"# redundancy={cfg.redundancy} against the same calls with redundancy=None "
                  "(batches alternate):",
                  "#       size   algo  chan  rebuilt/call  delivered  none-delivered     time  "
                  "none-time  time/none", "#        (B)                                   "
                  "                             (us)       (us)"]
        for r in rows:
            lines.append(f"{r.size:12d} {r.algorithm:>6s} {r.channel:>5s} {r.rebuilt:13.1f} "
                         f"{r.delivered:10.4f} {r.plain_delivered:15.4f} {r.time_us:8.1f} "
                         f"{r.plain_time_us:10.1f} {r.time_us / r.plain_time_us:10.2f}")
    if rows:
        avg = sum(r.busbw for r in rows) / len(rows)
        lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
        lines.append(f"# Geometric mean ratio : "
                     f"{math.exp(sum(math.log(r.ratio) for r in rows) / len(rows)):.3f}")
    return "\n".join(lines)


def document(rows: Sequence[Row], comm: MPI.Comm, cfg: BenchConfig,
             tail_rows: Sequence[TailRow] = ()) -> Dict[str, Any]:
    """Every number of a run, for --json."""
    return {
        "ranks": comm.size,
        "mpi": " ".join(MPI.Get_library_version().split()[:3]),
        "mpilossy": mpilossy.__version__,
        "config": asdict(cfg),
        "rows": [asdict(r) for r in rows],
        "tail": [asdict(r) for r in tail_rows],
    }


# -- tail latency under stragglers and microbursts ------------------------------

@dataclass
class TailRow:
    scenario: str
    size: int
    algorithm: str
    channel: str
    timeout: Optional[float]
    mpi_p50_us: float
    mpi_p99_us: float
    mpi_max_us: float
    p50_us: float
    p99_us: float
    max_us: float
    p99_ratio: float          # MPI p99 / mpilossy p99 (> 1: mpilossy better)
    delivered: float
    lossy_timeouts: List[float] = field(default_factory=list, repr=False)
    times_us: List[float] = field(default_factory=list, repr=False)
    mpi_times_us: List[float] = field(default_factory=list, repr=False)


def parse_scenario(text: str) -> Dict[str, Any]:
    """'straggler:rank=3,delay=0.02,prob=0.05',
    'microburst:p_good_to_bad=0.01,p_bad_to_good=0.2,rto=0.005', or 'link'
    (nothing injected or emulated: the network itself drops, as in
    scripts/lossy_link.py)."""
    kind, _, args = text.partition(":")
    params: Dict[str, float] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        params[key.strip()] = float(value)
    if kind == "straggler":
        params.setdefault("rank", -1)
        params.setdefault("delay", 0.02)
        params.setdefault("prob", 0.05)
    elif kind == "microburst":
        params.setdefault("p_good_to_bad", 0.01)
        params.setdefault("p_bad_to_good", 0.2)
        params.setdefault("rto", 0.005)
    elif kind != "link":
        raise ValueError(f"unknown scenario {kind!r}: straggler, microburst or link")
    params.setdefault("seed", 1)
    return {"kind": kind, **params}


def run_tail_bench(comm: MPI.Comm, cfg: BenchConfig, scenario: str) -> List[TailRow]:
    """The same disturbance applied to MPI_Allreduce and to mpilossy.

    Each rank's time *inside* the call is recorded, over every call and rank:
    what a slow peer costs everyone else.  straggler: one rank (the last by
    default) sleeps `delay` before `prob` of the calls, on both sides, decided
    by the same seeded draws.  microburst: mpilossy runs under a
    Gilbert-Elliott loss model; MPI_Allreduce, which loses nothing, is
    charged one retransmission timeout `rto` on every rank in each call where
    the burst hit any link (a reliable transport resends after a timeout and
    every rank waits for the slowest) — an emulation, stated as such.  link:
    neither is touched; the drops, if any, are the network's own."""
    s = parse_scenario(scenario)
    rows: List[TailRow] = []
    straggler = int(s["rank"]) if s["kind"] == "straggler" and s["rank"] >= 0 else comm.size - 1
    loss = None
    if s["kind"] == "microburst":
        loss = mpilossy.loss.GilbertElliott(s["p_good_to_bad"], s["p_bad_to_good"],
                                            seed=int(s["seed"]))
    for channel in cfg.channels:
        with mpilossy.Communicator(comm, channel=channel, timeout=cfg.timeout, loss=loss,
                                   block_bytes=cfg.block_bytes,
                                   capacity=max(4 << 20, 2 * max(cfg.sizes) + (1 << 20))) as lc:
            for size in cfg.sizes:
                for algorithm in cfg.algorithms:
                    rows.append(_tail(comm, lc, cfg, s, straggler, size, algorithm, channel))
    return rows


@contextmanager
def _aligner(comm: MPI.Comm, s: Dict[str, Any]) -> Iterator[Callable[[], None]]:
    """What lines the ranks up before each call: MPI_Barrier, except on a
    lossy link with every rank on one host.  There a barrier is itself MPI
    traffic on the link, and now and then holds one rank back by a TCP
    retransmission timeout, which the next lossy call would count as a
    straggler; instead the ranks meet through files in the host's memory
    (/dev/shm), off the network.  MPILOSSY_BENCH_MEET names a folder that
    every rank sees where they are on several hosts (the emulated cluster's
    nodes share the machine's files)."""
    shared = os.environ.get("MPILOSSY_BENCH_MEET")
    one_host = len(set(comm.allgather(MPI.Get_processor_name()))) == 1
    if s["kind"] != "link" or not (one_host or shared):
        yield comm.Barrier
        return
    base = (Path(shared) if shared else
            Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    folder = base / comm.bcast(f"mpilossy-bench-{os.getpid()}-{time.time_ns()}", root=0)
    if comm.rank == 0:
        folder.mkdir()
    comm.Barrier()
    count = [0]

    def meet() -> None:
        count[0] += 1
        (folder / f"{count[0]}.{comm.rank}").touch()
        while sum(1 for _ in folder.glob(f"{count[0]}.*")) < comm.size:
            time.sleep(20e-6)
        (folder / f"{count[0] - 1}.{comm.rank}").unlink(missing_ok=True)

    try:
        yield meet
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _tail(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig, s: Dict[str, Any],
          straggler: int, size: int, algorithm: str, channel: str) -> TailRow:
    dtype = np.dtype(cfg.dtype)
    send = small_ints(max(size // dtype.itemsize, 0), comm.rank, dtype)
    recv, mpi_recv = np.empty_like(send), np.empty_like(send)
    rng = np.random.default_rng(int(s["seed"]))          # the same draws on every rank
    mine: List[float] = []
    mpi_mine: List[float] = []
    delivered: List[float] = []
    timeouts: List[Optional[float]] = []
    with _aligner(comm, s) as align:
        for it in range(cfg.warmup + cfg.iters):
            late = s["kind"] == "straggler" and rng.random() < s["prob"]
            align()
            if late and comm.rank == straggler:
                time.sleep(s["delay"])
            t0 = time.perf_counter()
            stats = lc.allreduce(send, recv, op=cfg.op, algorithm=algorithm)
            t_lossy = time.perf_counter() - t0
            burst = comm.allreduce(stats.lost_blocks[0] > 0, op=MPI.LOR) \
                if s["kind"] == "microburst" else False
            align()
            if late and comm.rank == straggler:
                time.sleep(s["delay"])
            t0 = time.perf_counter()
            comm.Allreduce(send, mpi_recv)
            if burst:
                time.sleep(s["rto"])
            t_mpi = time.perf_counter() - t0
            if it >= cfg.warmup:
                mine.append(t_lossy)
                mpi_mine.append(t_mpi)
                delivered.append(stats.delivered)
                timeouts.append(stats.timeout)
    times = np.concatenate(comm.allgather(np.asarray(mine))) * 1e6
    mpi_times = np.concatenate(comm.allgather(np.asarray(mpi_mine))) * 1e6
    p99, mpi_p99 = float(np.percentile(times, 99)), float(np.percentile(mpi_times, 99))
    name = (f"straggler(rank={straggler},delay={s['delay']},prob={s['prob']})"
            if s["kind"] == "straggler" else
            f"microburst(gb={s['p_good_to_bad']},bg={s['p_bad_to_good']},rto={s['rto']})"
            if s["kind"] == "microburst" else "link")
    return TailRow(
        scenario=name, size=send.nbytes, algorithm=algorithm, channel=channel,
        timeout=cfg.timeout if not isinstance(cfg.timeout, str) else None,
        mpi_p50_us=float(np.percentile(mpi_times, 50)), mpi_p99_us=mpi_p99,
        mpi_max_us=float(mpi_times.max()), p50_us=float(np.percentile(times, 50)),
        p99_us=p99, max_us=float(times.max()), p99_ratio=mpi_p99 / p99 if p99 else math.nan,
        delivered=float(np.mean(comm.allgather(float(np.mean(delivered))))),
        lossy_timeouts=[t for t in timeouts if t is not None][-1:],
        times_us=times.tolist(), mpi_times_us=mpi_times.tolist())


def format_tail(rows: Sequence[TailRow], comm: MPI.Comm, cfg: BenchConfig) -> str:
    lines = [
        f"# tail latency: {comm.size} ranks, timeout {cfg.timeout}, iters {cfg.iters}; "
        "time inside the call, every rank and call",
        "#       size   algo  chan   mpi-p50   mpi-p99   mpi-max   lossy-p50 lossy-p99 "
        "lossy-max  p99-ratio  delivered  deadline  scenario",
        "#        (B)                  (us)      (us)      (us)        (us)      (us)      (us)"
        "  (mpi/lossy)              (s)",
    ]
    for r in rows:
        last = f"{r.lossy_timeouts[-1]:.4f}" if r.lossy_timeouts else "-"
        lines.append(
            f"{r.size:12d} {r.algorithm:>6s} {r.channel:>5s} {r.mpi_p50_us:9.1f} {r.mpi_p99_us:9.1f} "
            f"{r.mpi_max_us:9.1f} {r.p50_us:11.1f} {r.p99_us:9.1f} {r.max_us:9.1f} "
            f"{r.p99_ratio:10.2f} {r.delivered:10.4f} {last:>9s}  {r.scenario}")
    return "\n".join(lines)


def plot(path: str, rows: Sequence[Row], tail_rows: Sequence[TailRow]) -> None:
    """busbw against size (mpilossy and MPI_Allreduce), and, with a scenario,
    the distribution of per-call times (CDF) of both."""
    panels = (1 if rows else 0) + (1 if tail_rows else 0)
    fig, axes = figure(max(panels, 1), 6.5, 4.5)
    if rows:
        _plot_busbw(axes.pop(0), rows)
    if tail_rows:
        _plot_cdf(axes.pop(0), tail_rows)
    save_figure(fig, path)


def _plot_busbw(ax: Axes, rows: Sequence[Row]) -> None:
    groups = sorted({(r.algorithm, r.channel) for r in rows})
    for algorithm, channel in groups:
        sel = sorted((r for r in rows if (r.algorithm, r.channel) == (algorithm, channel)),
                     key=lambda r: r.size)
        ax.plot([r.size for r in sel], [r.busbw for r in sel], "o-",
                label=f"mpilossy {algorithm}/{channel}")
    if rows:
        ref: Dict[int, List[float]] = {}
        for r in rows:
            ref.setdefault(r.size, []).append(r.mpi_busbw)
        sizes = sorted(ref)
        ax.plot(sizes, [float(np.mean(ref[s])) for s in sizes], "k--", label="MPI_Allreduce")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("all-reduce bus bandwidth, same run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_cdf(ax: Axes, tail_rows: Sequence[TailRow]) -> None:
    for r in tail_rows:
        for label, times, style in ((f"mpilossy {r.algorithm}/{r.channel}", r.times_us, "-"),
                                    ("MPI_Allreduce", r.mpi_times_us, "--")):
            t = np.sort(np.asarray(times)) / 1e3
            ax.plot(t, np.arange(1, len(t) + 1) / len(t), style, label=f"{label} ({r.size} B)")
    ax.set_xscale("log")
    ax.set_xlabel("time inside the call (ms), every rank")
    ax.set_ylabel("fraction of calls")
    ax.set_title(tail_rows[0].scenario, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


# -- the command line ------------------------------------------------------------

def parse_timeout(text: str) -> Timeout:
    text = str(text).strip().lower()
    if text in ("", "none", "inf"):
        return None
    return "auto" if text == "auto" else float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--sizes", help="comma-separated sizes (overrides -b/-e/-f), e.g. 64K,1M,16M")
    p.add_argument("-d", "--dtype", default="float32",
                   choices=["float16", "float32", "float64", "int32", "int64"])
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg"])
    p.add_argument("--compression", choices=["int8", "int4"], default=None,
                   help="low-bit payloads (float32, direct)")
    p.add_argument("--topk", type=float, default=None, metavar="DENSITY",
                   help="aligned Top-K (mpilossy.compression.TopK, no error feedback): the "
                   "DENSITY share of 64-value blocks, chosen alike on every rank (float32, "
                   "direct)")
    p.add_argument("--redundancy", type=parse_redundancy, default=None, metavar="K,M",
                   help="m parity blocks with every k (docs/redundancy.md), measured against the "
                        "same calls without, in alternating batches")
    p.add_argument("--weighted", action="store_true",
                   help="weighted average (weight = rank + 1; implies -o avg, direct)")
    p.add_argument("-a", "--algorithm", default="ring",
                   help="ring, tree, auto, or a comma-separated list")
    p.add_argument("-c", "--channel", default="rma", help="rma, ud, or a comma-separated list")
    p.add_argument("-t", "--timeout", type=parse_timeout,
                   default=parse_timeout(os.environ.get("MPILOSSY_TIMEOUT", "none")),
                   help="seconds, 'auto' or 'none' (default: $MPILOSSY_TIMEOUT, else none)")
    p.add_argument("--loss", default=os.environ.get("MPILOSSY_LOSS") or None,
                   help="loss model, MPILOSSY_LOSS syntax (default: $MPILOSSY_LOSS)")
    p.add_argument("--scenario", default=None,
                   help="tail latency: 'straggler:rank=R,delay=S,prob=P' or "
                        "'microburst:p_good_to_bad=A,p_bad_to_good=B,rto=S', applied to "
                        "MPI_Allreduce and mpilossy alike, or 'link': the network's own drops "
                        "(scripts/lossy_link.py)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--block-bytes", type=parse_size, default=None)
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="busbw against size, and the latency CDF "
                   "of the scenario (needs matplotlib)")


def parse_redundancy(text: str) -> Tuple[int, int]:
    """"8,2" -> (8, 2), checked as the communicator checks it."""
    try:
        code = check_redundancy("--redundancy", tuple(int(v) for v in text.split(",")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert isinstance(code, tuple)      # (a pair was given)
    return code


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    sizes = (parse_sizes(args.sizes) if args.sizes
             else size_range(args.minbytes, args.maxbytes, args.stepfactor))
    cfg = BenchConfig(sizes=sizes, dtype=args.dtype, op="avg" if args.weighted else args.op,
                      algorithms=[a.strip() for a in args.algorithm.split(",")],
                      channels=[c.strip() for c in args.channel.split(",")],
                      timeout=args.timeout, loss=args.loss, iters=args.iters,
                      warmup=args.warmup, block_bytes=args.block_bytes,
                      weighted=args.weighted, compression=args.compression, topk=args.topk,
                      redundancy=args.redundancy)
    rows = run_allreduce_bench(comm, cfg) if not args.scenario else []
    tail = run_tail_bench(comm, cfg, args.scenario) if args.scenario else []
    if rows:
        say(comm, format_table(rows, comm, cfg))
    if tail:
        say(comm, format_tail(tail, comm, cfg))
    if comm.rank == 0:
        write_json(args.json, document(rows, comm, cfg, tail))
        if args.plot:
            plot(args.plot, rows, tail)
    return 0
