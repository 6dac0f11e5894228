"""Tail latency under stragglers and microbursts: ``mpiexec -n 4 python -m
mpilossy.bench allreduce --scenario SCENARIO`` (the allreduce command's
options; allreduce.py hands --scenario over to this module).

Not the harness's batches (harness.py): every call is lined up on its own,
with the disturbance before it, and what counts is each rank's time inside
each call, not a batch's; on a lossy link even the harness's Barrier and
MAX reduction would be traffic on the link (see `_aligner`).  The
aggregation across ranks is the harness's."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

import mpilossy

from .spec import BenchConfig, small_ints
from .harness import every_call, mean_over_ranks, percentile


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
    """'straggler:rank=3,delay=0.02,prob=0.05' (',aligned=0': no barrier
    between calls, see _free_running),
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
        params.setdefault("aligned", 1)
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
    neither is touched; the drops, if any, are the network's own.  --loss
    applies to mpilossy's calls in straggler and link (microburst brings its
    own loss model and refuses another)."""
    s = parse_scenario(scenario)
    rows: List[TailRow] = []
    straggler = int(s["rank"]) if s["kind"] == "straggler" and s["rank"] >= 0 else comm.size - 1
    loss: Any = cfg.loss
    if s["kind"] == "microburst":
        if cfg.loss:
            raise ValueError(f"--scenario microburst brings its own loss model; --loss "
                             f"{cfg.loss!r} (or MPILOSSY_LOSS) cannot be added to it")
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
    calls = _Calls(send, np.empty_like(send), np.empty_like(send))
    if s["kind"] == "straggler" and not s["aligned"]:
        _free_running(comm, lc, cfg, s, straggler, algorithm, calls)
    else:
        _aligned(comm, lc, cfg, s, straggler, algorithm, calls)
    times = every_call(comm, calls.mine)
    mpi_times = every_call(comm, calls.mpi_mine)
    p99, mpi_p99 = percentile(times, 99), percentile(mpi_times, 99)
    name = (f"straggler(rank={straggler},delay={s['delay']},prob={s['prob']}"
            f"{'' if s['aligned'] else ',free'})"
            if s["kind"] == "straggler" else
            f"microburst(gb={s['p_good_to_bad']},bg={s['p_bad_to_good']},rto={s['rto']})"
            if s["kind"] == "microburst" else "link")
    return TailRow(
        scenario=name, size=send.nbytes, algorithm=algorithm, channel=channel,
        timeout=cfg.timeout if not isinstance(cfg.timeout, str) else None,
        mpi_p50_us=percentile(mpi_times, 50), mpi_p99_us=mpi_p99,
        mpi_max_us=float(mpi_times.max()), p50_us=percentile(times, 50),
        p99_us=p99, max_us=float(times.max()), p99_ratio=mpi_p99 / p99 if p99 else math.nan,
        delivered=mean_over_ranks(comm, float(np.mean(calls.delivered))),
        lossy_timeouts=[t for t in calls.timeouts if t is not None][-1:],
        times_us=times.tolist(), mpi_times_us=mpi_times.tolist())


@dataclass
class _Calls:
    """One row's calls: the buffers, and what each rank measured."""
    send: np.ndarray
    recv: np.ndarray
    mpi_recv: np.ndarray
    mine: List[float] = field(default_factory=list)        # seconds inside each lossy call
    mpi_mine: List[float] = field(default_factory=list)    # ...each MPI_Allreduce
    delivered: List[float] = field(default_factory=list)
    timeouts: List[Optional[float]] = field(default_factory=list)

    def lossy(self, lc: mpilossy.Communicator, cfg: BenchConfig, algorithm: str) -> Any:
        return lc.allreduce(self.send, self.recv, op=cfg.op, algorithm=algorithm,
                            redundancy=cfg.redundancy)

    def keep(self, took: float, mpi_took: Optional[float], stats: Any) -> None:
        if stats is not None:
            self.mine.append(took)
            self.delivered.append(stats.delivered)
            self.timeouts.append(stats.timeout)
        if mpi_took is not None:
            self.mpi_mine.append(mpi_took)


def _aligned(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig, s: Dict[str, Any],
             straggler: int, algorithm: str, calls: _Calls) -> None:
    """Each call lined up on its own (_aligner), the lossy one and MPI's in
    turn, the disturbance before each."""
    rng = np.random.default_rng(int(s["seed"]))          # the same draws on every rank
    with _aligner(comm, s) as align:
        for it in range(cfg.warmup + cfg.iters):
            late = s["kind"] == "straggler" and rng.random() < s["prob"]
            align()
            if late and comm.rank == straggler:
                time.sleep(s["delay"])
            t0 = time.perf_counter()
            stats = calls.lossy(lc, cfg, algorithm)
            t_lossy = time.perf_counter() - t0
            burst = comm.allreduce(stats.lost_blocks[0] > 0, op=MPI.LOR) \
                if s["kind"] == "microburst" else False
            align()
            if late and comm.rank == straggler:
                time.sleep(s["delay"])
            t0 = time.perf_counter()
            comm.Allreduce(calls.send, calls.mpi_recv)
            if burst:
                time.sleep(s["rto"])
            t_mpi = time.perf_counter() - t0
            if it >= cfg.warmup:
                calls.keep(t_lossy, t_mpi, stats)


def _free_running(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig,
                  s: Dict[str, Any], straggler: int, algorithm: str, calls: _Calls) -> None:
    """The calls back to back with nothing between them, as in a training
    loop: the straggler's sleeps are not absorbed by a barrier, and a rank
    that falls behind stays behind unless its peers wait for it.  All the
    lossy calls, then all of MPI's, the same draws."""
    for lossy in (True, False):
        rng = np.random.default_rng(int(s["seed"]))
        comm.Barrier()
        for it in range(cfg.warmup + cfg.iters):
            if rng.random() < s["prob"] and comm.rank == straggler:
                time.sleep(s["delay"])
            t0 = time.perf_counter()
            stats = calls.lossy(lc, cfg, algorithm) if lossy else None
            if not lossy:
                comm.Allreduce(calls.send, calls.mpi_recv)
            took = time.perf_counter() - t0
            if it >= cfg.warmup:
                calls.keep(took, None if lossy else took, stats)


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
