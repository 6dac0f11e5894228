"""``mpiexec -n 4 python -m mpilossy.bench deadline``: how far past its timeout
a call returns when a peer never shows up in time.

One rank (the last) sleeps 2x the timeout before `--share` of the calls; the
others must return by start + timeout.  Prints the overshoot (elapsed -
timeout) of the ranks that waited, as percentiles, from rank 0."""

from __future__ import annotations

import argparse
import sys
import time
from typing import List

import numpy as np
from mpi4py import MPI

import mpilossy

from .harness import parse_size, say


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--timeout", type=float, default=0.01)
    p.add_argument("-s", "--size", type=parse_size, default=parse_size("64K"))
    p.add_argument("-a", "--algorithm", default="ring")
    p.add_argument("-n", "--calls", type=int, default=200)
    p.add_argument("--share", type=float, default=0.25, help="fraction of calls the sleeper sleeps")


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    sleeper = comm.size - 1
    rng = np.random.default_rng(0)                  # same draws on every rank
    x = np.ones(args.size // 4, np.float32)
    out = np.empty_like(x)
    overshoot: List[float] = []
    with mpilossy.Communicator(comm, timeout=args.timeout) as lc:
        lc.allreduce(x, out, algorithm=args.algorithm)
        for _ in range(args.calls):
            sleeps = rng.random() < args.share
            comm.Barrier()
            if sleeps and comm.rank == sleeper:
                time.sleep(2 * args.timeout)
            began = time.perf_counter()
            lc.allreduce(x, out, algorithm=args.algorithm)
            took = time.perf_counter() - began
            if sleeps and comm.rank != sleeper:
                overshoot.append(took - args.timeout)
    every = comm.gather(overshoot, root=0)
    if every is not None:                           # rank 0
        o = np.concatenate([np.asarray(v) for v in every]) * 1e3
        say(comm, f"# deadline overshoot: {comm.size} ranks, {args.size} B, {args.algorithm}, "
                  f"timeout {args.timeout * 1e3:g} ms, {len(o)} waiting calls",
            "#   p50(ms)   p90(ms)   p99(ms)   max(ms)",
            f"{np.percentile(o, 50):10.3f}{np.percentile(o, 90):10.3f}"
            f"{np.percentile(o, 99):10.3f}{o.max():10.3f}")
    return 0


if __name__ == "__main__":          # the old spelling: python -m mpilossy.bench.deadline
    from .__main__ import main
    sys.exit(main(["deadline", *sys.argv[1:]]))
