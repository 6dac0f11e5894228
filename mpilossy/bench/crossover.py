"""``mpiexec -n N python -m mpilossy.bench.crossover``: where the tree stops
beating the ring, for this rank count, lossless.  The result feeds
algorithm="auto" (mpilossy/communicator.py, TREE_MAX_BYTES) and can be set
per run with MPILOSSY_TREE_MAX_BYTES."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy


def batch_time(comm, lc, x, out, algorithm, iters):
    """Back-to-back calls (nccl-tests style): the slowest rank's time / calls."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        lc.allreduce(x, out, algorithm=algorithm)
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpilossy.bench.crossover", description=__doc__)
    p.add_argument("--min", type=int, default=1 << 10)
    p.add_argument("--max", type=int, default=4 << 20)
    p.add_argument("-n", "--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="repeat the sweep, take the median")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = []
    s = args.min
    while s <= args.max:
        sizes.append(s)
        s *= 2
    ring = {s: [] for s in sizes}
    tree = {s: [] for s in sizes}
    with mpilossy.Communicator(comm, timeout=None, capacity=4 * args.max) as lc:
        for _ in range(args.rounds):
            for size in sizes:
                x = np.ones(size // 4, np.float32)
                out = np.empty_like(x)
                for algorithm in ("ring", "tree"):          # warm up both
                    lc.allreduce(x, out, algorithm=algorithm)
                ring[size].append(batch_time(comm, lc, x, out, "ring", args.iters))
                tree[size].append(batch_time(comm, lc, x, out, "tree", args.iters))
    if comm.rank == 0:
        print(f"# crossover, {comm.size} ranks, float32, lossless, back-to-back calls; "
              f"median of {args.rounds} sweeps")
        print("#      bytes   ring(us)   tree(us)  tree/ring")
        crossover = 0
        for size in sizes:
            r, t = np.median(ring[size]) * 1e6, np.median(tree[size]) * 1e6
            print(f"{size:12d} {r:10.1f} {t:10.1f} {t / r:10.2f}")
            if t < r and crossover == size // 2:
                crossover = size
            elif t < r and crossover == 0 and size == sizes[0]:
                crossover = size
        print(f"# tree is faster up to {crossover} bytes (0: never)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
