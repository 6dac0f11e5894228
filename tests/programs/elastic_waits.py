"""Communicator(elastic=True)'s reliable collectives (barrier, bcast, free)
losing a rank while the others wait in them (docs/elastic.md).  Launch
with ``mpiexec -disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python elastic_waits.py CHANNEL HOW:V@WHERE

HOW: exit (os._exit) or stop (SIGSTOP; woken by the others at the end, its
next barrier must raise EvictedError); WHERE: the collective rank V misses:
barrier, bcast (rank 0's values; V=0: the root is lost), topk (a TopK
all-reduce: its block choice), free.

Every rank makes 3 direct all-reduces (op avg, deadline 0.2 s), a
barrier, a bcast from rank 0, a TopK all-reduce (half the blocks) of
rank + 1, 3 more all-reduces and free(), with
evict_after=1000: no lossy call can exclude anyone, only the waits.  Each
all-reduce's blocks are checked against the mean of the ranks the call
records as contributors.  Every survivor prints one JSON line: seconds
in the barrier, the bcast, the TopK all-reduce and free, what the bcast
and the TopK all-reduce gave (or raised), the
exclusions (on_exclusion), the members, the delivered fraction and the
wrong blocks of the calls after it."""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.compression import TopK

WAIT = 1.0          # elastic_wait: seconds a wait gives a silent neighbour

comm = MPI.COMM_WORLD
channel, scenario = sys.argv[1], sys.argv[2]
how, _, rest = scenario.partition(":")
victim_text, _, where = rest.partition("@")
victim = int(victim_text)
me = comm.rank
pids = comm.allgather(os.getpid())
lc = mpilossy.Communicator(comm, channel=channel, timeout=0.2, algorithm="direct",
                           elastic=True, evict_after=1000, elastic_wait=WAIT)
seen = []
lc.on_exclusion(lambda excluded, members: seen.append((list(excluded), list(members))))
n = 3000
report = {"rank": me, "wrong": 0, "delivered": []}


def lossy(call: int) -> None:
    members = lc.members
    x = np.full(n, me + 1 + call / 1000.0)
    stats = lc.allreduce(x, op="avg")
    firsts, lengths = stats.contributors.blocks()
    for first, length, row in zip(firsts, lengths, stats.contributors.members()):
        ranks = [members[r] for r in np.flatnonzero(row)]
        want = np.mean([r + 1 + call / 1000.0 for r in ranks])
        if length and not np.allclose(x[first:first + length], want, rtol=0, atol=1e-9):
            report["wrong"] += 1
    if call >= 3:
        report["delivered"].append(round(stats.delivered, 4))


def leave_if_victim(point: str) -> None:
    if me != victim or where != point:
        return
    sys.stdout.flush()
    if how == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGSTOP)
    try:        # woken by the others when they are done
        lc.barrier()
        outcome = "returned"
    except mpilossy.EvictedError as exc:
        outcome = f"EvictedError: {exc}"
    print(json.dumps({"rank": me, "woken": outcome}), flush=True)
    os._exit(0)


for call in range(3):
    lossy(call)
leave_if_victim("barrier")
began = time.perf_counter()
lc.barrier()
report["barrier"] = round(time.perf_counter() - began, 3)
leave_if_victim("bcast")
values = np.full(n, float(me))
began = time.perf_counter()
try:
    lc.bcast(values, root=0)
    report["bcast"] = sorted(set(values.tolist()))
except mpilossy.MPILossyError as exc:
    report["bcast"] = f"{type(exc).__name__}: {exc}"
report["bcast_s"] = round(time.perf_counter() - began, 3)
leave_if_victim("topk")
chosen = np.full(n, me + 1.0, np.float32)
began = time.perf_counter()
TopK(0.5, error_feedback=False).allreduce(lc, "g", chosen, op="avg")
report["topk"] = sorted({round(v, 4) for v in chosen.tolist()})
report["topk_s"] = round(time.perf_counter() - began, 3)
for call in range(3, 6):
    lossy(call)
leave_if_victim("free")
report["members"], report["size"] = list(lc.members), lc.size
began = time.perf_counter()
lc.free()
report["free"] = round(time.perf_counter() - began, 3)
report["exclusions"] = seen
print(json.dumps(report), flush=True)
if how == "stop":
    try:        # (every survivor wakes it: one that comes later finds it gone)
        os.kill(pids[victim], signal.SIGCONT)
    except ProcessLookupError:
        pass
    time.sleep(3.0)     # (the woken rank is told it is out by a survivor's signals)
os._exit(0)
