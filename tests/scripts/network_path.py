"""Run under `MPIR_CVAR_NOLOCAL=1 mpiexec -n K`: MPI shares no memory between
the ranks, so mpilossy reads its peers through MPI_Rget (the path taken
between nodes).  Prints one line per check; exits non-zero on failure."""

import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy

comm = MPI.COMM_WORLD
mode = sys.argv[1]
failures = []


def check(name, ok):
    if not ok:
        failures.append(name)


with mpilossy.Communicator(comm, timeout=None if mode == "lossless" else 0.1,
                           loss=None if mode == "lossless" else mpilossy.loss.Bernoulli(0.1, seed=3)) as lc:
    check("no shared memory", lc.shared_memory_peers == 0)
    for algorithm in ("ring", "tree", "direct"):
        lossy_calls = deadline_calls = 0
        for n in (1, 1000, 100_003):
            x = (np.arange(n) % 13 + comm.rank).astype(np.float64)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)
            for _ in range(5 if mode == "lossless" else 20):
                out = np.empty_like(x)
                began = time.monotonic()
                stats = lc.allreduce(x, out, algorithm=algorithm)
                took = time.monotonic() - began
                if mode == "lossless":
                    check(f"{algorithm} {n} equals MPI_Allreduce", np.array_equal(out, ref))
                else:
                    # Unbiased sum of values in [0, 12 + size): bounded, finite,
                    # each element the scaled sum of whole contributions.
                    check(f"{algorithm} {n} finite", bool(np.all(np.isfinite(out))))
                    check(f"{algorithm} {n} within deadline", took <= 0.1 + 0.05)
                    check(f"{algorithm} {n} delivered", 0 < stats.delivered <= 1)
                    lossy_calls += stats.lost_blocks[0] > 0
                    # At the deadline with nothing late: only injected loss
                    # kept it waiting, which early close should have ended.
                    deadline_calls += stats.deadline_hit and stats.lost_blocks[1] == 0
        if mode == "lossy":
            # Early close through MPI_Rget of the producers' end words: a call
            # that lost a block ends when the senders are done, except where
            # an end mark was lost too (1% of streams).  (Blocks late on this
            # oversubscribed path are a different cause, not counted.)
            check(f"{algorithm} ends lossy calls early ({deadline_calls} of {lossy_calls})",
                  lossy_calls > 10 and deadline_calls < 0.3 * lossy_calls)
print(f"rank {comm.rank}: {mode} {'ok' if not failures else 'FAILED ' + ', '.join(sorted(set(failures)))}",
      flush=True)
sys.exit(1 if failures else 0)
