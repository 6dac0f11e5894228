"""timeout="auto" (or --timeout SECONDS) with a straggler present from the first call: rank
size-1 sleeps DELAY before PROB of the calls (the same draws on every rank,
no barrier between calls).  Prints one JSON line from rank 0: for the other
ranks, how many calls the straggler slept before, the deadline each call used, the time inside each call and how far
past its deadline it returned, and the delivered fraction by calls since the
straggler's last sleep (where the loss goes: the calls right after a sleep,
or every call).  Used by tests/core/test_fault_matrix.py and for
docs/deadlines.md."""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpilossy

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=400)
p.add_argument("--bytes", type=int, default=1 << 20)
p.add_argument("--delay", type=float, default=0.02)
p.add_argument("--prob", type=float, default=0.05)
p.add_argument("--algorithm", default="ring")
p.add_argument("--channel", default="rma")
p.add_argument("--timeout", default="auto", help="'auto' or seconds")
p.add_argument("--fixed", action="store_true",
               help="sleep DELAY exactly (default: at least 3 deadlines in force, so that each "
                    "sleep makes a straggler; before the first agreement that is 3 x the cap)")
args = p.parse_args()

comm = MPI.COMM_WORLD
sleeper = comm.size - 1
rng = np.random.default_rng(1)
x = np.ones(args.bytes // 4, np.float32)
out = np.empty_like(x)
rows = []
straggled = 0
since = 10 ** 9          # calls since the straggler's last sleep
timeout = args.timeout if args.timeout == "auto" else float(args.timeout)
used = None
with mpilossy.Communicator(comm, timeout=timeout, channel=args.channel) as lc:
    for call in range(args.calls):
        late = rng.random() < args.prob
        since = 0 if late else since + 1
        if late:
            straggled += 1
            if comm.rank == sleeper:
                # (past the deadline in force, so that each sleep is a straggler)
                time.sleep(max(args.delay, 3 * used) if used and not args.fixed else args.delay)
        began = time.perf_counter()
        stats = lc.allreduce(x, out, algorithm=args.algorithm)
        took = time.perf_counter() - began
        used = stats.timeout
        if timeout == "auto":
            # (the learned deadline: a call that waited for a peer far behind
            # has the cap, and 3 s sleeps would make the straggler a stopped rank)
            used = max(lc.auto_timeouts.values(), default=used)
        if comm.rank != sleeper:
            rows.append((took, stats.timeout, stats.delivered, late, since))
    auto = lc._state.auto
    kind = next(iter(auto.agreed), None)
    agreed = (auto.agreed[kind], auto.scale, auto.floor, auto.cap) if kind else None
every = comm.gather(rows, root=0)
if comm.rank == 0:
    took, timeout, delivered, late, after = (np.array(v) for v in
                                             zip(*[r for rank in every for r in rank]))
    over = took - timeout
    print(json.dumps({
        "ranks": comm.size, "calls": args.calls, "bytes": args.bytes, "straggled": straggled,
        "learned_ms": 1e3 * float(np.median(timeout[len(timeout) // 2:])),
        "p50_ms": 1e3 * float(np.percentile(took, 50)), "p99_ms": 1e3 * float(np.percentile(took, 99)),
        "max_ms": 1e3 * float(took.max()), "max_over_deadline_ms": 1e3 * float(over.max()),
        "over_15ms": int(np.sum(over > 0.015)), "over_30ms": int(np.sum(over > 0.03)),
        "delivered": float(delivered.mean()),
        "delivered_straggled": float(delivered[late].mean()) if late.any() else None,
        # calls 0, 1, ... 9 since a sleep, then 10 or more (None: no such call)
        "delivered_since_sleep": [float(delivered[after == k].mean()) if (after == k).any()
                                  else None for k in range(10)]
        + [float(delivered[after >= 10].mean()) if (after >= 10).any() else None],
        "calls_since_sleep_10_or_more": float(np.mean(after >= 10)),
        # (rank 0's own last deadline: its agreed state is rank 0's, and a
        # rank may apply an agreement a few calls after another, docs/deadlines.md)
        "last_ms": 1e3 * float(every[0][-1][1]),
        "agreed_ms": 1e3 * agreed[0] if agreed else None, "scale": agreed and agreed[1],
        "floor_ms": agreed and 1e3 * agreed[2], "cap_ms": agreed and 1e3 * agreed[3]}))
