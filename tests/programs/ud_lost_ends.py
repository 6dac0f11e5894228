"""Early close when END datagrams are lost (the test's nftables rule drops
half of them): lossy calls must still end soon after the senders are
done, not at their stage deadline.  Run in that network namespace:

    mpiexec -n N python ud_lost_ends.py [real]

Blocks are lost by injection (10%), or with `real` only by the network
(the rule drops data too; nothing injected, so no end mark is lost by
the loss model, which the early close does not see past).

Rank 0 prints one JSON line: the median and largest time of the calls that
lost contributions, the deadline, the delivered fraction, and the wrong
elements of an exact call afterwards."""

import json
import sys

import numpy as np
from mpi4py import MPI

import mpilossy

comm = MPI.COMM_WORLD
TIMEOUT = 1.0
REAL = sys.argv[1:] == ["real"]
x = ((np.arange(50_000) * 7 + 3 * comm.rank) % 23).astype(np.float64)
out = np.empty_like(x)
lossy_times, delivered = [], []
with mpilossy.Communicator(comm, channel="ud", timeout=TIMEOUT, block_bytes=4096,
                           loss=None if REAL else "bernoulli:p=0.1,seed=5") as lc:
    for call in range(20):
        comm.Barrier()
        stats = lc.allreduce(x, out, op="avg", algorithm="direct")
        delivered.append(stats.delivered)
        if stats.delivered < 1.0:
            lossy_times.append(stats.elapsed)
with mpilossy.Communicator(comm, channel="ud", timeout=None) as lc:
    ref = np.empty_like(x)
    comm.Allreduce(x, ref)
    lc.allreduce(x, out, algorithm="direct")
    wrong = int(np.sum(out != ref))
times = comm.gather(lossy_times)
wrongs = comm.gather(wrong)
if comm.rank == 0:
    every = np.concatenate([np.asarray(t) for t in times]) if times else np.zeros(0)
    print("LOST_ENDS " + json.dumps({
        "lossy_calls": int(every.size), "median_s": float(np.median(every)) if every.size else None,
        "max_s": float(every.max()) if every.size else None, "timeout": TIMEOUT,
        "delivered": float(np.mean(delivered)), "wrong": wrongs}), flush=True)
