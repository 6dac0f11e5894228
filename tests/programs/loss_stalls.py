"""Calls that stall under injected loss: the loss model also drops a
stream's end mark (with probability p squared, both of its datagrams), and
a block missing from such a stream waits for its stage deadline instead of
closing early (docs/gpu.md, "Slow calls under injected loss").

    mpiexec -n N python loss_stalls.py [BYTES] [LOSS] [CALLS] [TIMEOUT]

Defaults: 16 MiB of float32, bernoulli:0.1, 300 calls, 2 s, ring.  Rank 0
prints one JSON line: per rank, the calls slower than a tenth of the
deadline, their times and the median call time."""

import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy

comm = MPI.COMM_WORLD
nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16 << 20
loss = sys.argv[2] if len(sys.argv) > 2 else "bernoulli:0.1"
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0
x = np.ones(nbytes // 4, np.float32)
out = np.empty_like(x)
times = []
with mpilossy.Communicator(comm, timeout=timeout, loss=loss,
                           capacity=2 * x.nbytes + (1 << 20)) as lc:
    for _ in range(calls):
        began = time.perf_counter()
        lc.allreduce(x, out, algorithm="ring")
        times.append(time.perf_counter() - began)
slow = [(i, round(t, 3)) for i, t in enumerate(times) if t > timeout / 10]
every = comm.gather({"slow": len(slow), "first": slow[:8],
                     "median_ms": round(1e3 * statistics.median(times), 2)})
if comm.rank == 0:
    print(json.dumps({"ranks": comm.size, "bytes": nbytes, "loss": loss, "calls": calls,
                      "timeout": timeout, "per_rank": every}))
