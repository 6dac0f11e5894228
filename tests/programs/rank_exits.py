"""A rank exits for good in the middle of lossy all-reduces; the others
notice (MPIX_Comm_get_failed), build the communicator of the survivors and
go on there, exactly.  Launch with ``mpiexec -disable-auto-cleanup`` (else
Hydra ends the whole job when the rank exits; docs/elastic.md).

    mpiexec -disable-auto-cleanup -n N python rank_exits.py CHANNEL VICTIM [CALL]

The victim leaves before call CALL (default 5) with os._exit(0).  Every
survivor prints one JSON line: the rank, the failed ranks it saw, the
seconds from the start of that call until it saw them, and the result of an
exact all-reduce of (rank + 1) on the survivors' communicator.  Everyone
ends with os._exit: MPI_Finalize hangs after a death."""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.control.failures import failed_ranks, survivors

comm = MPI.COMM_WORLD
channel, victim = sys.argv[1], int(sys.argv[2])
leave_at = int(sys.argv[3]) if len(sys.argv) > 3 else 5
x = np.ones(1 << 14, np.float32)
lc = mpilossy.Communicator(comm, channel=channel, timeout=0.2)
for call in range(leave_at + 3):
    if call == leave_at:
        if comm.rank == victim:
            os._exit(0)
        began = time.perf_counter()
    stats = lc.allreduce(x, np.empty_like(x))
    if call >= leave_at and failed_ranks(comm):
        break
gone = failed_ranks(comm)
while not gone and time.perf_counter() - began < 5.0:
    time.sleep(0.005)
    gone = failed_ranks(comm)
seen_after = time.perf_counter() - began
rest = survivors(comm, gone)
with mpilossy.Communicator(rest, channel=channel, timeout=None) as again:
    y = np.full(1000, float(comm.rank + 1))
    again.allreduce(y)
print(json.dumps({"rank": comm.rank, "gone": sorted(gone), "seen_after": round(seen_after, 4),
                  "size": rest.size, "result": float(y[0]), "exact": bool(np.all(y == y[0]))}),
      flush=True)
os._exit(0)
