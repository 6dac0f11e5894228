"""``mpiexec -n N python -m mpilossy.bench crossover``: where the tree stops
beating the ring, for this rank count, lossless.  The result feeds
algorithm="auto" (mpilossy/call/plan.py, TREE_MAX_BYTES) and can be set
per run with MPILOSSY_TREE_MAX_BYTES."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Dict, List

import numpy as np
from mpi4py import MPI

import mpilossy

from .harness import Contender, say, size_range, time_contenders


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min", type=int, default=1 << 10)
    p.add_argument("--max", type=int, default=4 << 20)
    p.add_argument("-n", "--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="repeat the sweep, take the median")


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    sizes = size_range(args.min, args.max, 2)
    ring: Dict[int, List[float]] = {s: [] for s in sizes}
    tree: Dict[int, List[float]] = {s: [] for s in sizes}
    with mpilossy.Communicator(comm, timeout=None, capacity=4 * args.max) as lc:
        for _ in range(args.rounds):
            for size in sizes:
                x = np.ones(size // 4, np.float32)
                out = np.empty_like(x)
                # one call of each to warm up, then one batch of --iters back-to-back
                # calls each, the slowest rank's time / calls (nccl-tests style)
                sides = [Contender(a, partial(lc.allreduce, x, out, algorithm=a))
                         for a in ("ring", "tree")]
                timed = time_contenders(comm, sides, args.iters, warmup=1, batch=args.iters)
                ring[size].append(timed.seconds("ring"))
                tree[size].append(timed.seconds("tree"))
    lines = [f"# crossover, {comm.size} ranks, float32, lossless, back-to-back calls; "
             f"median of {args.rounds} sweeps",
             "#      bytes   ring(us)   tree(us)  tree/ring"]
    crossover = 0
    for size in sizes:
        r, t = np.median(ring[size]) * 1e6, np.median(tree[size]) * 1e6
        lines.append(f"{size:12d} {r:10.1f} {t:10.1f} {t / r:10.2f}")
        if t < r and crossover == size // 2:
            crossover = size
        elif t < r and crossover == 0 and size == sizes[0]:
            crossover = size
    lines.append(f"# tree is faster up to {crossover} bytes (0: never)")
    say(comm, *lines)
    return 0


if __name__ == "__main__":          # the old spelling: python -m mpilossy.bench.crossover
    from .__main__ import main
    sys.exit(main(["crossover", *sys.argv[1:]]))
