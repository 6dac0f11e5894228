"""What END repeats cost while ranks wait in their calls: datagrams each
rank sent per call, and how many of them were repeated ENDs.

    mpiexec -n N python ud_end_repeats.py [CALLS]          # a straggler
    mpiexec -n N python ud_end_repeats.py CALLS lossy      # 10% injected loss

The first: the last rank enters each call 0.5 s late, the others wait for
it with every END of theirs sent (1000 float32, 1 s deadline).  The second:
every rank in the call, 10% of the blocks lost by injection, 64 Ki float32,
0.5 s deadline.  Rank 0 prints one JSON line: per rank, datagrams sent and
END repeats per call (-1 where the build does not count repeats), and the
median call time."""

import json
import sys

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.loss import Bernoulli, Straggler

comm = MPI.COMM_WORLD
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 3
lossy = sys.argv[2:] == ["lossy"]
if lossy:
    timeout, n, loss = 0.5, 1 << 16, [Bernoulli(0.1, seed=2)]
else:
    timeout, n, loss = 1.0, 1000, [Straggler(comm.size - 1, 0.5)]
with mpilossy.Communicator(comm, channel="ud", timeout=timeout, loss=loss) as lc:
    x = np.ones(n, np.float32)
    out = np.empty_like(x)
    lc.allreduce(x, out, algorithm="direct")
    comm.Barrier()
    before = lc.channel_info()
    took = []
    for _ in range(calls):
        took.append(lc.allreduce(x, out, algorithm="direct").elapsed)
    after = lc.channel_info()
seen = comm.gather({"sent": (after["sent"] - before["sent"]) / calls,
                    "end_repeats": (after.get("end_repeats", -calls)
                                    - before.get("end_repeats", 0)) / calls,
                    "median_ms": 1e3 * float(np.median(took))})
if comm.rank == 0:
    print("END_REPEATS " + json.dumps(seen), flush=True)
