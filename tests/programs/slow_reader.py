"""Calls without deadline that fail on every rank, between calls that must
succeed, with the last rank slow (nice 19, so that it is often still
reading call s while the others have finished it).  A rank may reuse the
memory of call s only once every peer has left it; a fast rank that left a
failed call at once used to rewrite the records of the successful call
before it, and the slow rank failed that call alone ("moved past").

    mpiexec -n N python slow_reader.py CHANNEL ALGORITHM ELEMENTS

Rank 0 prints one JSON line: per rank, the good calls that raised (with the
first message) and the failing calls that did not."""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import mpilossy

comm = MPI.COMM_WORLD
channel, algorithm, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if comm.rank == comm.size - 1:
    os.nice(19)
good_failed, bad_returned, first = 0, 0, ""
with mpilossy.Communicator(comm, channel=channel, timeout=None) as lc:
    x = np.full(n, comm.rank + 1, np.float32)
    out = np.empty_like(x)
    total = comm.size * (comm.size + 1) // 2
    for i in range(40):
        try:
            lc.allreduce(x, out, algorithm=algorithm)
            if not np.all(out == total):
                good_failed += 1
                first = first or f"call {i}: wrong result"
        except mpilossy.MPILossyError as exc:
            good_failed += 1
            first = first or str(exc)
        # A call that fails on every rank, in turn for a local reason (a
        # read-only result on rank 0) and a disagreement (rank 0's op).
        bad = np.empty_like(x)
        op = "sum"
        if comm.rank == 0:
            if i % 2:
                op = "avg"
            else:
                bad.flags.writeable = False
        try:
            lc.allreduce(x, bad, op=op, algorithm=algorithm)
            bad_returned += 1
        except (mpilossy.MPILossyError, BufferError):
            pass
seen = comm.gather({"good_failed": good_failed, "bad_returned": bad_returned, "first": first})
if comm.rank == 0:
    print("SLOW_READER " + json.dumps(seen), flush=True)
