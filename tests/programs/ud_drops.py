"""Lossy all-reduce over channel='ud' for a number of calls; prints one JSON
line from rank 0: mean/max elapsed, overshoot past the timeout, delivered,
lost blocks, queue drops, and the t statistic of the rank-averaged result
against the exact average (ranks hold different data).  Lateness is counted
net of the time each call's thread waited for a CPU (helpers.cpu_wait); the
raw figures are printed beside it.  Used by
tests/channels/test_ud.py (real kernel drops in a network namespace) and for the
figures in docs/ud.md."""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import cpu_wait  # noqa: E402  (tests/helpers.py)

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=200)
p.add_argument("--timeout", type=float, default=0.05)
p.add_argument("--algorithm", default="ring")
p.add_argument("--elements", type=int, default=4096)
p.add_argument("--loss", default=None)
p.add_argument("--channel", default="ud")
args = p.parse_args()

comm = MPI.COMM_WORLD
e = np.arange(args.elements)
data = comm.rank + 0.5 * np.sin(1.3 * e + comm.rank)
exact = np.mean([r + 0.5 * np.sin(1.3 * e + r) for r in range(comm.size)], axis=0)
results = np.empty((args.calls, args.elements))
elapsed, waited, delivered, lost = [], [], [], np.zeros(4)
with mpilossy.Communicator(comm, channel=args.channel, timeout=args.timeout, loss=args.loss) as lc:
    lc.allreduce(data, np.empty_like(data), op="avg", algorithm=args.algorithm)   # warm up
    for k in range(args.calls):
        began, queued = time.perf_counter(), cpu_wait()
        stats = lc.allreduce(data, results[k], op="avg", algorithm=args.algorithm)
        elapsed.append(time.perf_counter() - began)
        waited.append(cpu_wait() - queued)
        delivered.append(stats.delivered)
        lost += stats.lost_blocks
    info = lc.channel_info()
everything = comm.gather((results, elapsed, delivered, lost, info.get("queue_drops", -1), waited),
                         root=0)
if comm.rank == 0:
    results_, elapsed_, delivered_, lost_, drops_, waited_ = zip(*everything)   # per rank
    z = np.mean(results_, axis=0).mean(axis=1)     # per call
    truth = exact.mean()
    # Without loss every result is exact to rounding: no spread, nothing to test.
    exact_enough = abs(z.mean() - truth) < 1e-9 and z.std() < 1e-9
    t = 0.0 if exact_enough else float(abs(z.mean() - truth) / (z.std(ddof=1) / np.sqrt(len(z))))
    times = np.concatenate(elapsed_)
    net = times - np.concatenate(waited_)      # less the time spent waiting for a CPU
    print(json.dumps({
        "ranks": comm.size, "calls": args.calls, "algorithm": args.algorithm,
        "timeout": args.timeout, "loss": args.loss, "channel": args.channel,
        "mean_ms": 1e3 * float(times.mean()), "p99_ms": 1e3 * float(np.percentile(times, 99)),
        "max_ms": 1e3 * float(times.max()),
        # calls (x ranks) past T + 30 ms, and the worst, net of CPU waits
        "late_30ms": int((net > args.timeout + 0.03).sum()),
        "overshoot_ms": 1e3 * float(max(0.0, net.max() - args.timeout)),
        # the same, as the clock saw them
        "late_30ms_raw": int((times > args.timeout + 0.03).sum()),
        "overshoot_raw_ms": 1e3 * float(max(0.0, times.max() - args.timeout)),
        "cpu_wait_max_ms": 1e3 * float(np.max(np.concatenate(waited_))),
        "delivered": float(np.mean([np.mean(d) for d in delivered_])),
        "lost_blocks": [int(x) for x in sum(lost_)],
        "queue_drops": int(sum(max(q, 0) for q in drops_)),
        "t_unbiased": t,
    }), flush=True)
