"""timeout="auto" with a rank that comes late into every call: rank 1 sleeps
DELAY before each call after ALIGNED calls lined up by a barrier (which
taught the deadlines calls without skew), no barrier after.  Prints one JSON
line from rank 0: per rank, the mean delivered over the last LAST calls and
the deadline in force at the end (the hierarchy's: the stage across nodes),
and how far its longest call ran past the bound of its reported deadline
(FLOOR_SHARE more: what is gone of a deadline before the call comes out of
it down to that share), measured around the call.  (A hierarchical call
reports the sum of its stages' deadlines.)  --every K: late into one call
in K only; --align: a barrier before every call too (the lateness after it).
Used by tests/control/test_late_peers.py and for docs/deadlines.md."""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.spec import FLOOR_SHARE

p = argparse.ArgumentParser()
p.add_argument("--algorithm", default="direct")
p.add_argument("--channel", default="rma")
p.add_argument("--aligned", type=int, default=80)
p.add_argument("--late", type=int, default=170)
p.add_argument("--last", type=int, default=60)
p.add_argument("--delay", type=float, default=0.02)
p.add_argument("--elastic", action="store_true")
p.add_argument("--every", type=int, default=1,
               help="rank 1 is late into one call in this many (1: every call)")
p.add_argument("--align", action="store_true",
               help="a barrier before every call (lateness after it, as a rank "
                    "that loses its core right after the barrier)")
args = p.parse_args()

comm = MPI.COMM_WORLD
x = np.full(1 << 18, float(comm.rank + 1), np.float32)
out = np.empty_like(x)
delivered, exact = [], []
excluded = []
overrun = -1.0          # the longest call's seconds past (1 + FLOOR_SHARE) * its deadline
with mpilossy.Communicator(comm, timeout="auto", channel=args.channel,
                           elastic=args.elastic) as lc:
    for call in range(args.aligned + args.late):
        if call < args.aligned or args.align:
            comm.Barrier()
        if call >= args.aligned and comm.rank == 1 and call % args.every == 0:
            time.sleep(args.delay)
        began = time.perf_counter()
        stats = lc.allreduce(x, out, algorithm=args.algorithm, op="avg")
        overrun = max(overrun, time.perf_counter() - began - (1 + FLOOR_SHARE) * stats.timeout)
        delivered.append(stats.delivered)
        excluded += stats.excluded
        exact.append(bool(np.all(out == (comm.size + 1) / 2)))
    levels = lc.auto_timeouts_by_level
    level = "network" if args.algorithm == "hierarchical" and "network" in levels else "flat"
    deadline = max(levels[level].values(), default=None)
    cap = lc.config.auto_cap
rows = comm.gather({"delivered": float(np.mean(delivered[-args.last:])),
                    "exact": float(np.mean(exact[-args.last:])), "deadline": deadline,
                    "level": level, "cap": cap, "excluded": excluded,
                    "overrun": overrun}, root=0)
if comm.rank == 0:
    print(json.dumps({"algorithm": args.algorithm, "channel": args.channel, "ranks": rows}))
