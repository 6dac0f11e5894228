"""Each rank in turn fails three calls without deadline in a row, then one
good call follows (tests/helpers.py: failures_in_turn).  Every rank must
raise BufferError for each failed call, and the good call must be exact.
The test runs it with MPICH's shared-memory cells made scarce
(MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS), so that MPI postpones the
notes of failed calls and only the sender's own progress sends them.

    mpiexec -n N python failures_back_to_back.py CHANNEL ROUNDS

Rank 0 prints one JSON line: per rank, the outcomes that were wrong, counted
by kind, with the first of each kind."""

import json
import os
import sys
from collections import Counter

from mpi4py import MPI

import mpilossy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import failures_in_turn  # noqa: E402 (the tests' folder, added above)

comm = MPI.COMM_WORLD
channel, rounds = sys.argv[1], int(sys.argv[2])
with mpilossy.Communicator(comm, channel=channel, timeout=None, loss=None) as lc:
    seen = failures_in_turn(comm, lc, rounds)
expected = ["BufferError"] * 3 + ["exact"]
wrong: Counter = Counter()
first: dict = {}
for i, outcome in enumerate(seen):
    if outcome != expected[i % 4]:
        kind = outcome.split(":")[0]
        wrong[kind] += 1
        first.setdefault(kind, f"call {i}: {outcome}")
every = comm.gather({"wrong": dict(wrong), "first": first})
if comm.rank == 0:
    print("BACK_TO_BACK " + json.dumps(every), flush=True)
