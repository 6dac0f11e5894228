"""``mpiexec -n 4 python -m mpilossy.bench allreduce [options]``: lossy
all-reduce against MPI_Allreduce, side by side, nccl-tests style table on
rank 0 (the command ``python -m mpilossy.bench`` runs when given none).
With --scenario, tail latency under a straggler or a microburst instead
(tail.py).

What this command supplies to the harness (harness.py times it): per size,
the inputs and the exact result (`init`); per algorithm, the calls side by
side (`contenders`) and the check after each batch (`Check`); the
all-reduce's bus factor."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.config import COMPRESSIONS, check_redundancy
from mpilossy.call.dtypes import BFLOAT16

from .harness import (BATCH, Contender, Timeout, bandwidth, every_call, max_over_ranks,
                      mean_over_ranks, parse_size, parse_sizes, parse_timeout, percentile, say,
                      size_range, time_contenders, write_json)
from .spec import BenchConfig, Row, small_ints
from .tail import TailRow, format_tail, run_tail_bench

__all__ = ["BenchConfig", "Row", "Data", "Check", "Timeout", "bus_factor", "small_ints", "init",
           "contenders", "run_allreduce_bench", "payload_bytes", "format_table", "document",
           "parse_timeout", "parse_redundancy", "add_arguments", "run"]

TYPE_NAMES = {"float16": "half", "float32": "float", "float64": "double",
              "int32": "int32", "int64": "int64", "bfloat16": "bfloat16"}
# MPI has no 16-bit float types: its side of the comparison reduces float64.
HALF = (np.dtype(np.float16), BFLOAT16)


def bus_factor(nranks: int) -> float:
    """nccl-tests' getBw for all-reduce: busbw = algbw * 2 (n - 1) / n."""
    return 2.0 * (nranks - 1) / nranks if nranks > 1 else 1.0


# -- what the harness runs: init, run, check -------------------------------------

@dataclass
class Data:
    """One size's inputs (nccl-tests' initData): what every rank sends, the
    exact result, its largest magnitude, and how far off counts as wrong."""
    send: np.ndarray
    exact: np.ndarray
    scale: float
    tol: float


def init(comm: MPI.Comm, cfg: BenchConfig, size: int) -> Data:
    """Small integers and their exact reduction (computed in float64 where
    the reduction is not exact in the dtype itself)."""
    dtype = BFLOAT16 if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    count = max(size // dtype.itemsize, 0)
    send = small_ints(count, comm.rank, dtype)
    exact = np.empty_like(send)
    if cfg.weighted:
        wide = np.empty(count, np.float64)
        comm.Allreduce(send.astype(np.float64) * (comm.rank + 1), wide)
        exact = (wide / (comm.size * (comm.size + 1) / 2)).astype(dtype)
    elif dtype in HALF:
        wide = np.empty(count, np.float64)
        comm.Allreduce(send.astype(np.float64), wide)
        exact = wide.astype(dtype)
    else:
        comm.Allreduce(send, exact)
    if cfg.op == "avg" and not cfg.weighted:
        exact = (exact.astype(np.float64) / comm.size).astype(dtype)
    scale = float(np.max(np.abs(exact.astype(np.float64)))) if count else 1.0
    # quantised payloads: off by up to a step of their group, twice
    tol = (4.0 / (127 if cfg.compression == "int8" else 7) if cfg.compression
           else 1e-2 if dtype == BFLOAT16 else 1e-3 if dtype == np.float16 else 1e-6)
    return Data(send, exact, scale, tol)


def contenders(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig, algorithm: str,
               send: np.ndarray, recv: np.ndarray) -> List[Contender]:
    """One call of each side (nccl-tests' runColl): MPI_Allreduce, mpilossy,
    and with --redundancy the same mpilossy call without it ("plain")."""
    mpi_send = send.astype(np.float64) if send.dtype in HALF else send
    mpi_recv = np.empty_like(mpi_send)
    weight = float(comm.rank + 1) if cfg.weighted else None
    topk = mpilossy.compression.TopK(cfg.topk, error_feedback=False) if cfg.topk else None

    def mpi() -> None:
        comm.Allreduce(mpi_send, mpi_recv)

    def lossy() -> Optional[mpilossy.CollectiveStats]:
        if topk is not None:        # (its own copy: the compressor reduces in place)
            recv[...] = send
            return topk.allreduce(lc, 0, recv, op=cfg.op, weight=weight)
        return lc.allreduce(send, recv, op=cfg.op, algorithm=algorithm, weight=weight,
                            redundancy=cfg.redundancy)

    def plain() -> Optional[mpilossy.CollectiveStats]:
        return lc.allreduce(send, recv, op=cfg.op, algorithm=algorithm, weight=weight,
                            redundancy=None)

    return ([Contender("mpi", mpi), Contender("lossy", lossy)]
            + ([Contender("plain", plain)] if cfg.redundancy else []))


class Check:
    """After each round of batches: mpilossy's result against the exact one.
    #wrong from the first measured round, the largest error over all of
    them (relative to the exact result's largest magnitude)."""

    def __init__(self, data: Data, recv: np.ndarray, topk: bool,
                 again: Optional[Callable[[], Any]]) -> None:
        self.data, self.recv, self.topk, self.again = data, recv, topk, again
        self.wrong, self.max_err, self.done = 0, 0.0, 0

    def __call__(self, measuring: bool) -> None:
        if self.again is not None:
            self.again()    # (redundancy: the error below is the redundant call's)
        recv, d = self.recv, self.data
        if not measuring or not recv.size:
            return
        err = np.abs(recv.astype(np.float64) - d.exact.astype(np.float64))
        if self.topk:
            err[recv == 0] = 0.0    # (the blocks left out; the sent ones are exact)
        self.max_err = max(self.max_err, float(err.max()) / (d.scale or 1.0))
        if self.done == 0:
            self.wrong = int(np.count_nonzero(err > d.tol * max(d.scale, 1.0)))
        self.done += 1


# -- the measurement -------------------------------------------------------------

def run_allreduce_bench(comm: MPI.Comm, cfg: BenchConfig,
                        progress: Optional[Callable[[str], None]] = None) -> List[Row]:
    """Measure every (size, algorithm); return rows (identical on all ranks)."""
    rows: List[Row] = []
    for channel in cfg.channels:
        with mpilossy.Communicator(comm, channel=channel, timeout=cfg.timeout, loss=cfg.loss,
                                   block_bytes=cfg.block_bytes, compression=cfg.compression,
                                   capacity=max(4 << 20, 2 * max(cfg.sizes) + (1 << 20))) as lc:
            for size in cfg.sizes:
                data = init(comm, cfg, size)
                for algorithm in cfg.algorithms:
                    if progress:
                        progress(f"{size} B {channel} {algorithm}")
                    rows.append(_measure(comm, lc, cfg, channel, algorithm, data))
    return rows


def _measure(comm: MPI.Comm, lc: mpilossy.Communicator, cfg: BenchConfig, channel: str,
             algorithm: str, data: Data) -> Row:
    """Batches of MPI_Allreduce and of mpilossy, alternating (harness.py); the
    slowest rank's batch time divided by its calls.  p50/p99 come from every
    call's own duration on every rank."""
    send = data.send
    recv = np.empty_like(send)
    sides = contenders(comm, lc, cfg, algorithm, send, recv)
    lossy = next(c.call for c in sides if c.name == "lossy")
    check = Check(data, recv, bool(cfg.topk), lossy if cfg.redundancy else None)
    sent_before = lc.channel_info().get("sent", 0)
    timed = time_contenders(comm, sides, cfg.iters, cfg.warmup, after_batch=check)
    datagrams = (lc.channel_info().get("sent", 0) - sent_before) / (cfg.iters + cfg.warmup)
    t, t_mpi = timed.seconds("lossy"), timed.seconds("mpi")
    algbw, busbw = bandwidth(send.nbytes, t, bus_factor(comm.size))
    _, mpi_busbw = bandwidth(send.nbytes, t_mpi, bus_factor(comm.size))
    every = every_call(comm, timed.calls["lossy"])
    every_mpi = every_call(comm, timed.calls["mpi"])
    lossy_stats = timed.stats["lossy"]
    plain_stats = timed.stats.get("plain", [])
    return Row(
        size=send.nbytes, count=send.size, type=TYPE_NAMES[send.dtype.name],
        redop="avg(w)" if cfg.weighted else cfg.op,
        algorithm=algorithm, channel=channel, time_us=t * 1e6, algbw=algbw,
        busbw=busbw, wrong=max_over_ranks(comm, check.wrong),
        mpi_time_us=t_mpi * 1e6, mpi_busbw=mpi_busbw,
        ratio=t_mpi / t if t > 0 else math.nan,
        delivered=mean_over_ranks(comm, float(np.mean([s.delivered for s in lossy_stats]))),
        max_err=max_over_ranks(comm, check.max_err),
        p50_us=percentile(every, 50), p99_us=percentile(every, 99),
        mpi_p99_us=percentile(every_mpi, 99),
        times_us=every.tolist(), mpi_times_us=every_mpi.tolist(),
        datagrams=mean_over_ranks(comm, datagrams), payload=payload_bytes(send, cfg),
        rebuilt=mean_over_ranks(comm, float(np.mean([s.rebuilt for s in lossy_stats]))),
        plain_time_us=timed.seconds("plain") * 1e6 if cfg.redundancy else 0.0,
        plain_delivered=mean_over_ranks(
            comm, float(np.mean([s.delivered for s in plain_stats])) if plain_stats else 0.0))


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


# -- the table and the JSON --------------------------------------------------------

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


# -- the command line ------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--sizes", help="comma-separated sizes (overrides -b/-e/-f), e.g. 64K,1M,16M")
    p.add_argument("-d", "--dtype", default="float32",
                   choices=["float16", "bfloat16", "float32", "float64", "int32", "int64"])
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
                   help="tail latency: 'straggler:rank=R,delay=S,prob=P' (',aligned=0': "
                        "no barrier between calls) or "
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
            from .plot import plot
            plot(args.plot, rows, tail)
    return 0
