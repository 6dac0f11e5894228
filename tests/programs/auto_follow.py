"""timeout="auto" on the network it runs on: all-reduce calls back to back
(a barrier before each) for --seconds; rank 0 prints, per window of
--window seconds, the calls, their p50/p99 time, the deadline in force and
the delivered fraction, then one JSON line with every call.  On the
emulated cluster, quiet and beside background traffic:

    sudo .venv/bin/python scripts/cluster.py run --nodes 4 --ppn 1 --rate 200mbit \
        --env MPILOSSY_UD_RATE=200mbit [--background 100/400:1] -- \
        .venv/bin/python tests/programs/auto_follow.py --seconds 60
"""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpilossy

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=60.0)
p.add_argument("--window", type=float, default=5.0)
p.add_argument("--bytes", type=int, default=1 << 20)
p.add_argument("--algorithm", default="direct")
p.add_argument("--channel", default="ud")
p.add_argument("--target", type=float, default=None, help="delivered_target (default: the library's)")
args = p.parse_args()

comm = MPI.COMM_WORLD
x = np.ones(args.bytes // 4, np.float32)
out = np.empty_like(x)
rows = []
target = {} if args.target is None else {"delivered_target": args.target}
with mpilossy.Communicator(comm, timeout="auto", channel=args.channel, **target) as lc:
    began = time.monotonic()
    while True:
        comm.Barrier()
        done = comm.bcast(time.monotonic() - began > args.seconds)
        if done:
            break
        t0 = time.monotonic()
        stats = lc.allreduce(x, out, algorithm=args.algorithm)
        rows.append((t0 - began, time.monotonic() - t0, stats.timeout, stats.delivered))
every = comm.gather(rows, root=0)
if comm.rank == 0:
    calls = np.array([r for rank in every for r in rank])
    print(f"{'window (s)':>12} {'calls':>6} {'p50 (ms)':>9} {'p99 (ms)':>9} "
          f"{'deadline (ms)':>13} {'delivered':>9}")
    for start in np.arange(0, args.seconds, args.window):
        w = calls[(calls[:, 0] >= start) & (calls[:, 0] < start + args.window)]
        if len(w):
            print(f"{start:5.0f}-{start + args.window:<6.0f} {len(w) // comm.size:6d} "
                  f"{1e3 * np.percentile(w[:, 1], 50):9.1f} {1e3 * np.percentile(w[:, 1], 99):9.1f} "
                  f"{1e3 * np.median(w[:, 2]):13.1f} {w[:, 3].mean():9.3f}")
    print(json.dumps({"ranks": comm.size, "bytes": args.bytes, "calls": calls.tolist()}))
