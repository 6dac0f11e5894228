"""Errors and disagreements over a network that loses every HELLO and
ERROR datagram (the test's nftables rule): they must still reach every
rank, with or without a deadline, and the calls after them be exact
(issue 27, item 5).  Run in that network namespace:

    mpiexec -n N python ud_lost_control.py

Rank 0 prints one JSON line: per case, every rank's outcome; and the
wrong elements of an exact call after each case."""

import json

import numpy as np
from mpi4py import MPI

import mpilossy

comm = MPI.COMM_WORLD
culprit = comm.size - 1


def values(n):
    return ((np.arange(n) * 7 + 3 * comm.rank) % 23 + comm.rank).astype(np.float64)


def exact(lc):
    x = values(10_000)
    ref = np.empty_like(x)
    comm.Allreduce(x, ref)
    out = np.empty_like(x)
    lc.allreduce(x, out, algorithm="direct", timeout=None)
    return int(np.sum(out != ref))


def outcome(call):
    try:
        call()
        return "returned"
    except Exception as exc:            # (which one, and why, is what is compared)
        return f"{type(exc).__name__}: {exc}"


def bad_recvbuf(timeout):
    def call():
        x = values(10_000)
        out = np.empty_like(x)
        out.flags.writeable = comm.rank != culprit
        lc.allreduce(x, out, algorithm="direct", timeout=timeout)
    return call


def other_size():
    x = values(10_001 if comm.rank == culprit else 10_000)
    lc.allreduce(x, algorithm="direct", timeout=None)


report = {}
with mpilossy.Communicator(comm, channel="ud", timeout=None, loss=None) as lc:
    report["warm"] = comm.gather(exact(lc), root=0)
    for name, call in (("error without deadline", bad_recvbuf(None)),
                       ("error with deadline", bad_recvbuf(0.5)),
                       ("mismatch without deadline", other_size)):
        report[name] = comm.gather(outcome(call), root=0)
        report[name + ": next call wrong"] = comm.gather(exact(lc), root=0)
    info = lc.channel_info()
    report["errors heard over MPI"] = comm.gather(info.get("errors_heard_over_mpi", 0), root=0)
if comm.rank == 0:
    print("LOST_CONTROL " + json.dumps(report), flush=True)
