"""Lossy all-reduce over channel='ud' for a number of calls; prints one JSON
line from rank 0: mean/max elapsed, overshoot past the timeout, delivered,
lost blocks, queue drops, and the t statistic of the rank-averaged result
against the exact average (ranks hold different data).  Used by
tests/channels/test_ud.py (real kernel drops in a network namespace) and for the
figures in docs/ud.md."""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpilossy

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
elapsed, delivered, lost = [], [], np.zeros(4)
with mpilossy.Communicator(comm, channel=args.channel, timeout=args.timeout, loss=args.loss) as lc:
    lc.allreduce(data, np.empty_like(data), op="avg", algorithm=args.algorithm)   # warm up
    for k in range(args.calls):
        began = time.perf_counter()
        stats = lc.allreduce(data, results[k], op="avg", algorithm=args.algorithm)
        elapsed.append(time.perf_counter() - began)
        delivered.append(stats.delivered)
        lost += stats.lost_blocks
    info = lc.channel_info()
everything = comm.gather((results, elapsed, delivered, lost, info.get("queue_drops", -1)), root=0)
if comm.rank == 0:
    z = np.mean([r for r, *_ in everything], axis=0).mean(axis=1)     # per call
    truth = exact.mean()
    # Without loss every result is exact to rounding: no spread, nothing to test.
    exact_enough = abs(z.mean() - truth) < 1e-9 and z.std() < 1e-9
    t = 0.0 if exact_enough else float(abs(z.mean() - truth) / (z.std(ddof=1) / np.sqrt(len(z))))
    times = np.concatenate([np.asarray(el) for _, el, *_ in everything])
    print(json.dumps({
        "ranks": comm.size, "calls": args.calls, "algorithm": args.algorithm,
        "timeout": args.timeout, "loss": args.loss, "channel": args.channel,
        "mean_ms": 1e3 * float(times.mean()), "p99_ms": 1e3 * float(np.percentile(times, 99)),
        "max_ms": 1e3 * float(times.max()),
        "overshoot_ms": 1e3 * float(max(0.0, times.max() - args.timeout)),
        "late_30ms": int((times > args.timeout + 0.03).sum()),   # calls (x ranks) past T + 30 ms
        "delivered": float(np.mean([np.mean(d) for *_, d, _, _ in everything])),
        "lost_blocks": [int(x) for x in sum(l for *_, l, _ in everything)],
        "queue_drops": int(sum(max(q, 0) for *_, q in everything)),
        "t_unbiased": t,
    }), flush=True)
