"""``mpiexec -n 4 python -m mpilossy.bench dtypes``: one element count in
several dtypes, their calls interleaved in one run, each dtype's time per
call against the first's (float32 by default).  bfloat16 and float16 halve
the bytes on the wire; whether the time follows depends on what dominates,
the network or the kernels.  The order of the dtypes turns every round, so
that a noisy neighbour slows them alike.

    python -m mpilossy.cluster run --nodes 4 --ppn 1 --rate 1gbit -- \\
        python -m mpilossy.bench dtypes --elements 1M -a direct,ring -c ud,rma
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.dtypes import BFLOAT16

from .harness import parse_size, parse_timeout

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": BFLOAT16,
          "float16": np.dtype(np.float16), "float64": np.dtype(np.float64)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--elements", type=parse_size, default=parse_size("1M"),
                   help="elements per call (binary suffixes: 1M = 2^20)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated, the first is the reference")
    p.add_argument("-a", "--algorithm", default="direct,ring", help="comma-separated")
    p.add_argument("-c", "--channel", default="rma", help="comma-separated")
    p.add_argument("-t", "--timeout", type=parse_timeout, default=None,
                   help="seconds, 'auto' or 'none' (default: none, lossless)")
    p.add_argument("-n", "--iters", type=int, default=30)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write every row as JSON")


def measure(comm: MPI.Comm, lc: mpilossy.Communicator, algorithm: str,
            dtypes: List[str], elements: int, iters: int, warmup: int) -> Dict[str, dict]:
    """Per dtype: every call's time (the slowest rank's), delivered, and
    `wrong`: elements of the last call off the exact average by more than
    the dtype's rounding (counted where that call lost nothing, else -1)."""
    data = {name: (np.arange(elements) % 23 + comm.rank).astype(DTYPES[name]) for name in dtypes}
    out = {name: np.empty_like(x) for name, x in data.items()}
    times = {name: np.zeros(iters) for name in dtypes}
    delivered = {name: 0.0 for name in dtypes}
    last = {name: 1.0 for name in dtypes}
    for i in range(-warmup, iters):
        k = i % len(dtypes)
        for name in dtypes[k:] + dtypes[:k]:
            comm.Barrier()
            t0 = MPI.Wtime()
            stats = lc.allreduce(data[name], out[name], op="avg", algorithm=algorithm)
            if i >= 0:
                times[name][i] = MPI.Wtime() - t0
                delivered[name] += stats.delivered / iters
                last[name] = stats.delivered
    rows = {}
    for name in dtypes:
        exact = np.empty(elements)
        comm.Allreduce(data[name].astype(np.float64), exact)
        exact /= comm.size
        tol = 2.0 ** -7 if data[name].itemsize == 2 else 1e-6
        off = int(np.count_nonzero(np.abs(out[name].astype(np.float64) - exact)
                                   > tol * np.abs(exact).max()))
        clean = comm.allreduce(last[name] == 1.0, op=MPI.LAND)
        wrong = comm.allreduce(off) if clean else -1
        slowest = np.empty_like(times[name])
        comm.Allreduce(times[name], slowest, op=MPI.MAX)
        rows[name] = {"p50_ms": 1e3 * float(np.median(slowest)),
                      "p99_ms": 1e3 * float(np.percentile(slowest, 99)),
                      "bytes": int(data[name].nbytes),
                      "delivered": comm.allreduce(delivered[name]) / comm.size,
                      "wrong": wrong}
    return rows


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown dtypes {unknown}; choose from {sorted(DTYPES)}")
    rows = []
    for channel in args.channel.split(","):
        with mpilossy.Communicator(comm, channel=channel, timeout=args.timeout) as lc:
            for algorithm in args.algorithm.split(","):
                got = measure(comm, lc, algorithm, dtypes, args.elements, args.iters,
                              args.warmup)
                ref = got[dtypes[0]]["p50_ms"]
                for name in dtypes:
                    rows.append({"channel": channel, "algorithm": algorithm, "dtype": name,
                                 "elements": args.elements, **got[name],
                                 "speedup_p50": ref / got[name]["p50_ms"]})
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {args.elements} elements per call, timeout {args.timeout}; "
              f"speedup = {dtypes[0]}'s p50 / this dtype's p50 (same run, interleaved)")
        print(f"# {'chan':>5} {'algo':>7} {'dtype':>9} {'bytes':>9} {'p50 ms':>8} "
              f"{'p99 ms':>8} {'delivered':>9} {'speedup':>8} {'#wrong':>6}")
        for r in rows:
            print(f"  {r['channel']:>5} {r['algorithm']:>7} {r['dtype']:>9} {r['bytes']:>9} "
                  f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['delivered']:9.4f} "
                  f"{r['speedup_p50']:8.2f} {r['wrong']:6d}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0
