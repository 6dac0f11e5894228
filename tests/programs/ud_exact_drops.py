"""Exact (no deadline) all-reduces over channel='ud' on a network that drops
datagrams, each followed by a blocking MPI collective, as a training loop
mixes them (a parameter broadcast, a barrier).  A rank that has its result
must still answer its peers' requests for what they lost; had it returned
to the MPI collective, a peer still asking would wait for ever.

    ip netns exec NS mpiexec -n N python ud_exact_drops.py

Rank 0 prints one JSON line: the wrong elements per (algorithm, size) over
all ranks, and the NACKs and resent datagrams summed over the ranks."""

import json

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.bench.allreduce import small_ints

comm = MPI.COMM_WORLD
SIZES = (3, 1000, 70_001, 1 << 20)
wrong = {}
with mpilossy.Communicator(comm, channel="ud", timeout=None, loss=None) as lc:
    for algorithm in ("ring", "tree", "direct"):
        for n in SIZES:
            x = small_ints(n, comm.rank, np.float32)     # sums exact in any order
            out = np.empty_like(x)
            lc.allreduce(x, out, algorithm=algorithm)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)              # blocking, not served by mpilossy
            wrong[f"{algorithm}-{n}"] = comm.allreduce(int(np.sum(out != ref)))
    info = lc.channel_info()
nacks = comm.allreduce(info["nacks"])
resent = comm.allreduce(info["resent"])
if comm.rank == 0:
    print("EXACT_DROPS " + json.dumps({"wrong": wrong, "nacks": nacks, "resent": resent,
                                       "provider": info["provider"]}), flush=True)
