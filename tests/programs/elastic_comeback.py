"""Communicator(elastic=True, spares=S): ranks that hang, are excluded, wake
and come back (docs/elastic.md, "Coming back").  Launch with ``mpiexec
-disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python elastic_comeback.py CHANNEL SPARES V@C[,W@D...] CALLS [HANG]

The last SPARES ranks are spares.  Rank V stops itself (SIGSTOP) before
call C, woken HANG seconds later (default 2) by a process it started; the
others exclude it meanwhile, and when it wakes its next call raises
EvictedError: it then calls stand_by() again, offering itself, and goes on
as a spare.  Each call is an all-reduce (direct, op avg, deadline 0.2 s) of
(original rank + 1 + call / 1000), 0.1 s apart; the "model" moves by each
result; after lc.grow() says ranks joined, rank 0 broadcasts the call
number and the model, which a rank called in receives right after
stand_by().  Every block of every result is checked against the mean over
the ranks its call records.  Every rank prints one JSON line at the end:
its rank, whether its last stand_by() returned False (released), the
calls it made, wrong blocks, the times it came in, the growths it saw
(call, ranks), the state sent at each growth it took part in, the members
and the sum of its model; then lines {"tail": rank, "calls": [...]} with
each call since the last growth as (call, sum of the result, whether its
record names every member in every block: a call that lost something may
differ from rank to rank), ten a line (srun splits lines past 1 KiB).
Everyone ends with os._exit."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy import EvictedError

comm = MPI.COMM_WORLD
channel, spares, spec, calls = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
hang = float(sys.argv[5]) if len(sys.argv) > 5 else 2.0
stops = [tuple(int(x) for x in part.split("@")) for part in spec.split(",") if part]
me = comm.rank
N = 1003
lc = mpilossy.Communicator(comm, channel=channel, elastic=True, evict_after=5, elastic_wait=2.0,
                           timeout=0.2, spares=spares)
model = np.zeros(N)
state = {"call": 0, "wrong": 0, "joined": [], "sent": [], "evicted": 0, "tail": []}
lc.on_growth(lambda joined, members: state["joined"].append((state["call"], list(joined))))


def send_state():
    """Collective over the ranks in and the newcomers: where the run is."""
    step = np.array([state["call"]], dtype=np.int64)
    lc.bcast(step, root=0)
    lc.bcast(model, root=0)
    state["sent"].append((int(step[0]), float(model.sum())))
    state["call"] = int(step[0])
    state["tail"] = []


def finish(released):
    print(json.dumps({"rank": me, "released": released, "calls": state["call"],
                      "wrong": state["wrong"], "arrivals": lc.arrivals,
                      "evicted": state["evicted"], "joined": state["joined"],
                      "sent": state["sent"], "model": float(model.sum()),
                      "members": [] if released else list(lc.members)}), flush=True)
    for first in range(0, len(state["tail"]), 10):
        print(json.dumps({"tail": me, "calls": state["tail"][first:first + 10]}), flush=True)
    if not released:
        lc.free()
    os._exit(0)


x, out = np.empty(N), np.empty(N)
excluded = False
while True:
    if lc.spare or excluded:
        excluded = False
        if not lc.stand_by(timeout=60.0):
            finish(True)
        state["joined"].append(None)        # (this rank's own arrival)
        send_state()
    try:
        while state["call"] < calls:
            call = state["call"] + 1
            if (me, call) in stops:
                subprocess.Popen(["sh", "-c", f"sleep {hang}; kill -CONT {os.getpid()}"],
                                 start_new_session=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.1)
            x[:] = me + 1 + call / 1000
            members = lc.members
            stats = lc.allreduce(x, out, op="avg", algorithm="direct")
            state["call"] = call
            firsts, lengths = stats.contributors.blocks()
            for first, length, row in zip(firsts, lengths, stats.contributors.members()):
                ranks = [members[r] for r in np.flatnonzero(row)]
                if length and not (ranks and np.allclose(
                        out[first:first + length],
                        np.mean([r + 1 + call / 1000 for r in ranks]), rtol=0, atol=1e-9)):
                    state["wrong"] += 1
            model += out
            state["tail"].append((call, float(out.sum()),
                                  bool(stats.contributors.members().all())))
            if lc.grow():
                send_state()
        break
    except EvictedError:
        state["evicted"] += 1
        excluded = True
lc.barrier()
finish(False)
