"""Run under `MPIR_CVAR_NOLOCAL=1 mpiexec -n K`: MPI shares no memory between
the ranks, so mpilossy reads its peers through MPI_Rget (the path taken
between nodes).  Prints one line per check; exits non-zero on failure.
A call's time past its deadline is counted net of the time its thread
waited for a CPU (helpers.cpu_wait): the site-MPI test runs this beside
the builds and the one-rank suite on two cores."""

import itertools
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import cpu_wait  # noqa: E402  (tests/helpers.py)

comm = MPI.COMM_WORLD
mode = sys.argv[1]
ALLOWED = np.round([sum(2 ** r for r in ranks) * comm.size / k
                    for k in range(1, comm.size + 1)
                    for ranks in itertools.combinations(range(comm.size), k)], 9)
failures = []


def check(name, ok):
    if not ok:
        failures.append(name)


with mpilossy.Communicator(comm, timeout=None if mode == "lossless" else 0.1,
                           loss=None if mode == "lossless" else mpilossy.loss.Bernoulli(0.1, seed=3)) as lc:
    check("no shared memory", lc.shared_memory_peers == 0)
    outliers = 0
    worst = [0.0, 0.0]    # the slowest call's time: on the clock, net of CPU waits
    for algorithm in ("ring", "tree", "direct"):
        lossy_calls = deadline_calls = 0
        for n in (1, 1000, 100_003):
            for call in range(5 if mode == "lossless" else 20):
                # Different data on every call: rank r sends 2**r * w, w
                # depending on the element and the call, so a block of
                # another call or place cannot pass for the right one.
                w = 1.0 + (np.arange(n) + 3 * call) % 11
                x = (2.0 ** comm.rank) * w
                ref = np.empty_like(x)
                comm.Allreduce(x, ref)
                out = np.full_like(x, np.nan)
                began, queued = time.monotonic(), cpu_wait()
                stats = lc.allreduce(x, out, algorithm=algorithm)
                took = time.monotonic() - began
                net = took - (cpu_wait() - queued)
                worst = max(worst, [took, net], key=lambda w: w[1])
                if mode == "lossless":
                    check(f"{algorithm} {n} equals MPI_Allreduce", np.array_equal(out, ref))
                else:
                    # Every element the unbiased sum of whole contributions of
                    # some set S of ranks: out / w * |S| / size is S's bits.
                    check(f"{algorithm} {n} whole contributions",
                          bool(np.all(np.isin(np.round(out / w, 9), ALLOWED))))
                    # the documented margin on shared cores (docs/deadlines.md):
                    # + 50 ms, and one outlier per run under + 200 ms
                    check(f"{algorithm} {n} within deadline + 200 ms", net <= 0.1 + 0.2)
                    outliers += net > 0.1 + 0.05
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
    if mode == "lossy":
        check(f"at most one call past deadline + 50 ms ({outliers})", outliers <= 1)
        # The same communicator, loss off, no deadline: exact again.
        lc._state.core.configure_loss({})
        x = (2.0 ** comm.rank) * (1.0 + np.arange(100_003) % 11)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        out = np.empty_like(x)
        lc.allreduce(x, out, timeout=None)
        check("exact after the lossy calls", np.array_equal(out, ref))
print(f"rank {comm.rank}: {mode} {'ok' if not failures else 'FAILED ' + ', '.join(sorted(set(failures)))}"
      f" (slowest call {1e3 * worst[0]:.0f} ms, {1e3 * worst[1]:.0f} ms net of CPU waits)",
      flush=True)
sys.exit(1 if failures else 0)
