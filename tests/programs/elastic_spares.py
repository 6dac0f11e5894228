"""Communicator(elastic=True, spares=S): ranks lost mid-run and replaced by
hot spares (docs/elastic.md, "Growing back").  Launch with ``mpiexec
-disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python elastic_spares.py CHANNEL SPARES HOW:V@C[,W@D] [CALLS]

The last SPARES ranks are spares; HOW is exit (os._exit) or stop (SIGSTOP,
woken at the end: it must get EvictedError) for rank V before call C
(a spare with C = 0 exits, or stops, before it stands by: a stopped one,
woken at the end, must be released, not called in).
Every working rank holds a "model" (a vector); each call is an all-reduce
(direct, op avg, deadline 0.5 s) of (original rank + 1 + call / 1000); after each
the model moves by the result ($SPARES_TIMEOUT: another deadline, e.g.
auto; $SPARES_REDUNDANCY: e.g. auto), then lc.grow(); when it says spares
joined, rank 0 broadcasts the call number and the model (lc.bcast); a
spare called in makes the same broadcasts after stand_by() and goes on
from the next call.  on_growth records each growth.
Each block of each result is checked against the mean over the ranks the
call records as contributors.  Every rank still running prints one JSON
line: its original rank, the calls it made, wrong blocks, exclusions and
growths seen (call, ranks), the state sent at each growth it took part in
(call, sum of the model, the learned deadlines, the agreed loss rate),
the members and size at the end, the sum of its
model and whether it was a spare.
A spare never called in prints that stand_by() returned False.  Everyone
ends with os._exit: MPI_Finalize hangs after a death."""

import json
import os
import signal
import sys

import numpy as np
from mpi4py import MPI

import mpilossy
from member_calls import averaged_call, record_membership, send_state
from mpilossy import EvictedError

comm = MPI.COMM_WORLD
channel, spares, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 30
how, _, spec = scenario.partition(":")
leaves = {int(v): int(c) for v, c in (part.split("@") for part in spec.split(",") if part)}
pids = comm.allgather(os.getpid())
me = comm.rank
N = 1003
timeout = os.environ.get("SPARES_TIMEOUT", "0.5")
lc = mpilossy.Communicator(comm, channel=channel, elastic=True, evict_after=5, elastic_wait=2.0,
                           timeout=timeout if timeout == "auto" else float(timeout),
                           redundancy=os.environ.get("SPARES_REDUNDANCY") or None, spares=spares)
model = np.zeros(N)
state = {"call": 0, "wrong": 0, "excluded": [], "joined": [], "sent": []}


record_membership(lc, state)
was_spare = lc.spare
if was_spare and leaves.get(me) == 0:
    if how == "exit":
        os._exit(0)                 # (a spare gone before any call-in: V@0)
    os.kill(os.getpid(), signal.SIGSTOP)    # (one that hangs, woken at the end)
    called = lc.stand_by(timeout=60.0)
    print(json.dumps({"rank": me, "spare": True, "called": bool(called),
                      "woken": "called in" if called else "released"}), flush=True)
    os._exit(0)
if was_spare:
    if not lc.stand_by(timeout=60.0):
        print(json.dumps({"rank": me, "spare": True, "called": False}), flush=True)
        os._exit(0)
    state["call"] = send_state(lc, model, state)
    state["joined"].append((state["call"], [me]))

x = np.empty(N)
while state["call"] < calls:
    call = state["call"] + 1
    if leaves.get(me) == call:
        if how == "exit":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)
        try:                        # woken at the end: excluded meanwhile
            lc.allreduce(x, np.empty(N), op="avg")
            result = "no error"
        except EvictedError as exc:
            result = f"EvictedError: {exc}"
        print(json.dumps({"rank": me, "woken": result}), flush=True)
        os._exit(0)
    averaged_call(lc, me, call, x, model, state)
    if lc.grow():           # (at the end of the step: its result is in the model sent)
        send_state(lc, model, state)

lc.barrier()
if me == min(lc.members):
    for victim in leaves:
        if how == "stop":
            os.kill(pids[victim], signal.SIGCONT)
print(json.dumps({"rank": me, "spare": was_spare, "calls": state["call"],
                  "wrong": state["wrong"], "excluded": state["excluded"],
                  "joined": state["joined"], "sent": state["sent"], "members": list(lc.members), "size": lc.size,
                  "model": float(model.sum())}), flush=True)
lc.free()
os._exit(0)
