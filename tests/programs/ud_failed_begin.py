"""One rank's datagram channel cannot start a call: its address space is
capped (RLIMIT_AS) so that the call's outbox cannot be allocated.  Every
rank hears of it; afterwards the channel must take calls again, small and
large, with exact results, and the peers' datagrams of the failed call
must not land in buffers sized for another call (issue 27, item 1).

    mpiexec -n N python ud_failed_begin.py TIMEOUT      # seconds or "none"

Rank 0 prints one JSON line: every rank's outcome of the failed call and
the wrong elements of the calls after it (with a deadline, "again" says
whether the large call delivered anything)."""

import json
import resource
import sys

import numpy as np
from mpi4py import MPI

import mpilossy

comm = MPI.COMM_WORLD
timeout = None if sys.argv[1] == "none" else float(sys.argv[1])
culprit = comm.size - 1
BIG = 8 << 20                       # float32 values: 32 MiB, and an outbox as large


def values(n):
    return ((np.arange(n) * 7 + 3 * comm.rank) % 23 + comm.rank).astype(np.float32)


def wrong(lc, n):
    """Elements of an exact direct all-reduce of n values that differ from MPI's."""
    x = values(n)
    ref = np.empty_like(x)
    comm.Allreduce(x, ref)
    out = np.empty_like(x)
    lc.allreduce(x, out, algorithm="direct")
    return int(np.sum(out != ref))


def virtual_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


with mpilossy.Communicator(comm, channel="ud", timeout=timeout, loss=None) as lc:
    before = wrong(lc, 1000)
    big = values(BIG)                       # allocated before the cap
    limits = resource.getrlimit(resource.RLIMIT_AS)
    comm.Barrier()
    if comm.rank == culprit:
        resource.setrlimit(resource.RLIMIT_AS, (virtual_bytes() + (16 << 20), limits[1]))
    try:
        lc.allreduce(big, algorithm="direct")
        outcome = "returned"
    except MemoryError:
        outcome = "MemoryError"
    except mpilossy.MPILossyError as exc:
        outcome = f"MPILossyError: {exc}"
    finally:
        if comm.rank == culprit:
            resource.setrlimit(resource.RLIMIT_AS, limits)
    del big
    after = [wrong(lc, n) for n in (1000, 3, 70_001)]
    # The call that failed, now with memory (exact without a deadline; a
    # deadline may cut 32 MiB of datagrams short on a loopback).
    again = wrong(lc, BIG) if timeout is None else int(lc.allreduce(
        values(BIG), algorithm="direct").delivered > 0)
    info = lc.channel_info()
    report = comm.gather({"outcome": outcome, "before": before, "after": after, "again": again,
                          "unexpected": info["unexpected"], "seq": lc.calls}, root=0)
if comm.rank == 0:
    print("FAILED_BEGIN " + json.dumps(report), flush=True)
