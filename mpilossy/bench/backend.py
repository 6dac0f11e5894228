"""``mpiexec -n 4 python -m mpilossy.bench backend``: torch.distributed's
all_reduce through the "mpilossy" backend against the same call through
Gloo, same tensor, same ranks, the two groups' calls interleaved (the order
turns every round, so that a noisy neighbour slows both alike).  Lossless by
default (``--timeout none``): the backend's cost over Gloo where nothing is
lost.  Each size's result is checked against the exact sum.

    mpiexec -n 4 python -m mpilossy.bench backend --sizes 1M,4M,16M
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Dict, List

from mpi4py import MPI

from .harness import parse_size, parse_timeout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1M,4M,16M",
                   help="tensor sizes in bytes of float32, comma-separated (1M = 2^20)")
    p.add_argument("-t", "--timeout", type=parse_timeout, default=None,
                   help="the backend communicator's deadline: seconds, 'auto' or 'none' "
                        "(default: none, lossless)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="write every row as JSON")


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import mpilossy
    import mpilossy.torch as mt

    comm = MPI.COMM_WORLD
    mt.init_process_group("gloo")
    lc = mpilossy.Communicator(comm, timeout=args.timeout, loss=None)
    ranks = list(range(comm.size))
    groups = {"gloo": dist.new_group(ranks, backend="gloo"),
              "mpilossy": dist.new_group(ranks, backend="mpilossy",
                                         pg_options=mt.BackendOptions(communicator=lc))}
    names = list(groups)
    rows: List[Dict[str, Any]] = []
    if comm.rank == 0:
        print(f"# {comm.size} ranks, float32 SUM, lossless={args.timeout is None}, "
              f"median of {args.iters} (the slowest rank's time per call)")
        print(f"{'bytes':>10} {'gloo ms':>9} {'mpilossy ms':>12} {'ratio':>7} {'exact':>6}")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        n = size // 4
        mine = (torch.arange(n, dtype=torch.float32) % 13) + comm.rank
        want = (torch.arange(n, dtype=torch.float32) % 13) * comm.size + sum(ranks)
        times: Dict[str, List[float]] = {name: [] for name in names}
        exact = True
        for i in range(-args.warmup, args.iters):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t = mine.clone()
                comm.Barrier()
                began = time.perf_counter()
                dist.all_reduce(t, group=groups[name])
                spent = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
                if i >= 0:
                    times[name].append(spent)
                exact = exact and bool(torch.equal(t, want))
        exact = all(comm.allgather(exact))
        row = {"bytes": size, "ranks": comm.size, "exact": exact,
               **{f"{name}_s": statistics.median(times[name]) for name in names}}
        row["ratio"] = row["mpilossy_s"] / row["gloo_s"]
        rows.append(row)
        if comm.rank == 0:
            print(f"{size:>10} {1e3 * row['gloo_s']:>9.2f} {1e3 * row['mpilossy_s']:>12.2f} "
                  f"{row['ratio']:>6.2f}x {'yes' if exact else 'NO':>6}")
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    lc.free()
    mt.destroy_process_group()
    return 0 if all(r["exact"] for r in rows) or args.timeout is not None else 1
