"""Communicator(elastic=True, rendezvous=DIR): ranks lost mid-run, and
processes started outside the job take their places through
Communicator.join(DIR) (docs/elastic.md, "Growing back").

    mpiexec -disable-auto-cleanup -n N python elastic_rejoin.py job CHANNEL DIR V@C[,W@D] [CALLS]
    python elastic_rejoin.py new DIR [SECONDS]      (a newcomer: a singleton)

Rank V exits (os._exit) before call C.  Every rank holds a "model" (a
vector); each call is an all-reduce (direct, op avg, deadline 0.5 s) of
(member + 1 + call / 1000), member being the rank's number in lc.members
($REJOIN_TIMEOUT: another deadline, e.g. auto; $REJOIN_REDUNDANCY: e.g. auto);
after each the model moves by the result, then lc.grow(); when it says
newcomers joined, rank 0 broadcasts the call number and the model
(lc.bcast), which a newcomer makes too right after join().  The run goes
on past CALLS until the communicator is back at N ranks (at most
$REJOIN_EXTRA calls more, default 1,000, 10 ms apart).  Each block of each result is checked against
the mean over the members the call records as contributors.  Every
process still running prints one JSON line: its member number, its role,
the calls it made, wrong blocks, exclusions and growths seen (call,
members), the state sent at each growth it took part in (call, sum of the
model, the learned deadlines, the agreed loss rate), the members and size
at the end, the sum of its model, the calls that lost blocks on it and
whether the membership's messages went as datagrams (across nodes).  A
newcomer nobody took in prints "joined": false.
Everyone ends with os._exit: MPI_Finalize hangs after a death."""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from member_calls import averaged_call, record_membership, send_state

N = 1003
EXTRA = int(os.environ.get("REJOIN_EXTRA", 1000))     # calls past CALLS, at most
role = sys.argv[1]
state = {"call": 0, "wrong": 0, "excluded": [], "joined": [], "sent": [], "partial": []}
model = np.zeros(N)

if role == "job":
    comm = MPI.COMM_WORLD
    channel, directory, spec = sys.argv[2], sys.argv[3], sys.argv[4]
    calls = int(sys.argv[5]) if len(sys.argv) > 5 else 30
    size = comm.size
    leaves = {int(v): int(c) for v, c in (part.split("@") for part in spec.split(",") if part)}
    timeout = os.environ.get("REJOIN_TIMEOUT", "0.5")
    lc = mpilossy.Communicator(comm, channel=channel, elastic=True, evict_after=5,
                               elastic_wait=2.0, rendezvous=directory,
                               timeout=timeout if timeout == "auto" else float(timeout),
                               redundancy=os.environ.get("REJOIN_REDUNDANCY") or None)
    info = {"calls": calls, "size": size}
    if comm.rank == 0:                  # (what a newcomer needs to know about the run)
        with open(os.path.join(directory, "run.json.tmp"), "w") as f:
            json.dump(info, f)
        os.replace(os.path.join(directory, "run.json.tmp"), os.path.join(directory, "run.json"))
else:
    directory = sys.argv[2]
    bound = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    leaves = {}
    began = time.monotonic()
    lc = mpilossy.Communicator.join(directory, timeout=bound)
    if lc is None:
        print(json.dumps({"role": "new", "joined": False,
                          "seconds": round(time.monotonic() - began, 3)}), flush=True)
        os._exit(0)
    with open(os.path.join(directory, "run.json")) as f:
        info = json.load(f)
    calls, size = info["calls"], info["size"]


record_membership(lc, state)
me = lc.members[lc.rank]
if role == "new":
    state["call"] = send_state(lc, model, state)
    state["joined"].append((state["call"], [me]))

x = np.empty(N)
while not (state["call"] >= calls and lc.size == size) and state["call"] < calls + EXTRA:
    call = state["call"] + 1
    if leaves.get(me) == call:
        os._exit(0)
    if call > calls:
        time.sleep(0.01)            # (waiting for a newcomer)
    averaged_call(lc, me, call, x, model, state)
    if lc.grow():           # (at the end of the step: its result is in the model sent)
        send_state(lc, model, state)

lc.barrier()
print(json.dumps({"member": me, "role": role, "calls": state["call"], "wrong": state["wrong"],
                  "excluded": state["excluded"], "joined": state["joined"],
                  "sent": state["sent"], "members": list(lc.members), "size": lc.size,
                  "arrivals": lc.arrivals, "model": float(model.sum()),
                  "partial": state["partial"],
                  # (across nodes the membership's messages go as datagrams)
                  "datagram_signals": not lc._elastic.membership.signals.reliable}),
      flush=True)
lc.free()
os._exit(0)
