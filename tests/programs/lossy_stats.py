"""Many lossy all-reduce calls, then statistics: bias against the exact
average, delivered fraction, losses by cause, time per call, who is on which
node.  Run inside an MPI job (scripts/cluster.py run ... -- python THIS ...);
rank 0 prints one JSON line.

    python lossy_stats.py --channel rma --algorithm ring --calls 400 --timeout 0.2 \\
        --loss 0.2 --count 1024 --block-bytes 512

Rank r sends 10 r + N(0, 1) (a new draw every call), so the exact average
moves from call to call and every rank's mean differs.  Per element, the
error of each call against the exact average (MPI_Allreduce / size) is
averaged over the calls; z = that mean / its standard error.  An unbiased
result has |z| > 4 for about 0.006% of the elements."""

import argparse
import json
import socket
import time

import numpy as np
from mpi4py import MPI

import mpilossy

ap = argparse.ArgumentParser()
ap.add_argument("--channel", default="rma")
ap.add_argument("--algorithm", default="ring")
ap.add_argument("--op", default="avg")
ap.add_argument("--calls", type=int, default=400)
ap.add_argument("--timeout", type=float, default=0.2)
ap.add_argument("--loss", type=float, default=0.2)
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--count", type=int, default=1024)
ap.add_argument("--block-bytes", type=int, default=512)
ap.add_argument("--barrier", action="store_true", help="MPI_Barrier before every call")
ap.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' between calls")
args = ap.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
host = socket.gethostname()
hosts = comm.allgather(host)
loss = mpilossy.loss.Bernoulli(args.loss, seed=args.seed) if args.loss > 0 else None
errors = np.zeros((args.calls, args.count))
elapsed, delivered, deadline_hit = [], [], []
lost = np.zeros(4, np.int64)
began = time.monotonic()
with mpilossy.Communicator(comm, channel=args.channel, timeout=args.timeout, loss=loss,
                           block_bytes=args.block_bytes) as lc:
    shared = lc.shared_memory_peers if args.channel == "rma" else None
    out = np.empty(args.count)
    for call in range(args.calls):
        # Every rank draws every rank's data: the exact average without traffic.
        xs = [10.0 * r + np.random.default_rng([args.seed, call, r]).standard_normal(args.count)
              for r in range(size)]
        x = xs[rank]
        exact = np.mean(xs, axis=0)
        if args.barrier:
            comm.Barrier()
        if args.sleep:
            time.sleep(args.sleep)
        t = time.monotonic()
        stats = lc.allreduce(x, out, op=args.op, algorithm=args.algorithm)
        elapsed.append(time.monotonic() - t)
        delivered.append(stats.delivered)
        deadline_hit.append(stats.deadline_hit)
        lost += stats.lost_blocks
        errors[call] = out - exact if args.op == "avg" else out / size - exact
wall = time.monotonic() - began
mean = errors.mean(axis=0)
se = errors.std(axis=0, ddof=1) / np.sqrt(args.calls)
z = np.divide(mean, se, out=np.zeros_like(mean), where=se > 0)
mine = {
    "rank": rank, "host": host, "shared_memory_peers": shared,
    "delivered": float(np.mean(delivered)),
    "biased_4se": float(np.mean(np.abs(z) > 4)),
    "mean_z": float(np.mean(z)),
    "elapsed_p50_ms": float(np.median(elapsed) * 1e3),
    "elapsed_p99_ms": float(np.quantile(elapsed, 0.99) * 1e3),
    "elapsed_max_ms": float(np.max(elapsed) * 1e3),
    "deadline_hit": float(np.mean(deadline_hit)),
    "lost_blocks": dict(zip(("injected", "late", "gone", "torn"), map(int, lost))),
    "wall_s": wall,
}
everyone = comm.gather(mine, root=0)
all_errors = comm.gather(errors, root=0)
if rank == 0:
    # Averaged over ranks first: that cancels the fallbacks (a rank that
    # missed a reduced block uses its own partial sum: docs/unbiasedness.md).
    avg = np.mean(all_errors, axis=0)
    se = avg.std(axis=0, ddof=1) / np.sqrt(args.calls)
    z = np.divide(avg.mean(axis=0), se, out=np.zeros(args.count), where=se > 0)
    print(json.dumps({"args": vars(args), "size": size, "nodes": len(set(hosts)),
                      "delivered": float(np.mean([r["delivered"] for r in everyone])),
                      "biased_4se": float(np.mean(np.abs(z) > 4)),
                      "max_abs_z": float(np.max(np.abs(z))),
                      "per_rank_biased_4se": [r["biased_4se"] for r in everyone],
                      "wall_s": max(r["wall_s"] for r in everyone),
                      "ranks": everyone}))
