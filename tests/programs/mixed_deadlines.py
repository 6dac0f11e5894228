"""Ranks that disagree on whether calls have a deadline: rank 0 waits for
everything (timeout=None), the others have 20 ms.  Whether a call has a
deadline is part of its signature: every rank must raise MismatchError, on
every call, and none may hang.  Before, on channel='ud' under real drops:
the ranks with a deadline ran ahead and reused their send buffers while
rank 0 asked them again for ever.  Then calls that agree (timeout=None per
call on every rank) are exact.

    [ip netns exec NS] mpiexec -n N python mixed_deadlines.py CHANNEL

Rank 0 prints one JSON line: each rank's outcome of each call and the wrong
elements of the agreeing calls."""

import json
import sys

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.bench.allreduce import small_ints

comm = MPI.COMM_WORLD
channel = sys.argv[1]
outcomes = []
with mpilossy.Communicator(comm, channel=channel,
                           timeout=None if comm.rank == 0 else 0.02) as lc:
    x = small_ints(70_001, comm.rank, np.float32)
    out = np.empty_like(x)
    for _ in range(4):
        try:
            lc.allreduce(x, out, algorithm="direct")
            outcomes.append("returned")
        except mpilossy.MPILossyError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    ref = np.empty_like(x)
    comm.Allreduce(x, ref)
    wrong = 0
    for _ in range(2):
        lc.allreduce(x, out, algorithm="direct", timeout=None)
        wrong += int(np.sum(out != ref))
seen = comm.gather({"outcomes": outcomes, "wrong": wrong})
if comm.rank == 0:
    print("MIXED_DEADLINES " + json.dumps(seen), flush=True)
