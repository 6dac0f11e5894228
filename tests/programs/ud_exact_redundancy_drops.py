"""Calls without deadline on channel='ud' with injected loss and redundancy
together, on a network that really drops datagrams (the test's nftables
rule).  A block dropped by injected loss can only be rebuilt from its
group, so the group's parity must arrive; a reader asks again for parity
it lost as it does for data.  Before: it asked only for data blocks, and
waited for ever.

    ip netns exec NS mpiexec -n N python ud_exact_redundancy_drops.py

Every rank contributes the same values, so every element of an average is
exactly those values whoever contributed.  Rank 0 prints one JSON line: the
wrong elements per (code, algorithm, size) over all ranks, and the blocks
rebuilt, NACKs sent and datagrams resent, summed over the ranks."""

import json

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy import _core

comm = MPI.COMM_WORLD
CODES = [(4, 1)] + ([(4, 2)] if _core.HAVE_ISAL else [])
wrong, rebuilt = {}, 0
for code in CODES:
    with mpilossy.Communicator(comm, channel="ud", timeout=None, block_bytes=4096,
                               loss="bernoulli:p=0.1,seed=7", redundancy=code) as lc:
        for algorithm in ("direct", "ring", "tree"):
            for n in (1000, 70_001):
                x = (np.arange(n) % 13).astype(np.float32)
                out = np.empty_like(x)
                stats = lc.allreduce(x, out, op="avg", algorithm=algorithm)
                rebuilt += stats.rebuilt
                comm.Allreduce(MPI.IN_PLACE, np.zeros(1))       # blocking, not mpilossy's
                wrong[f"{code}-{algorithm}-{n}"] = comm.allreduce(int(np.sum(out != x)))
        info = lc.channel_info()
        nacks, resent = info["nacks"], info["resent"]
totals = [comm.allreduce(v) for v in (rebuilt, nacks, resent)]
if comm.rank == 0:
    print("EXACT_FEC_DROPS " + json.dumps({"wrong": wrong, "rebuilt": totals[0],
                                           "nacks": totals[1], "resent": totals[2]}), flush=True)
