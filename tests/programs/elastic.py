"""Communicator(elastic=True) losing ranks in the middle of lossy all-reduces
(docs/elastic.md).  Launch with ``mpiexec -disable-auto-cleanup`` (else Hydra
ends the whole job when a rank exits).

    mpiexec -disable-auto-cleanup -n N python elastic.py CHANNEL SCENARIO [CALLS [LOSS]]

SCENARIO, one of:
  exit:V@C         rank V exits (os._exit) before call C
  stop:V@C         rank V stops itself (SIGSTOP) before call C; when the
                   others are done they wake it (SIGCONT) and it must get
                   EvictedError on its next call
  exit:V@C,W@D     two ranks exit at different calls
  during:V@C,W     V exits before call C, W exits as it enters the agreement
  switch:V@C,W     V exits before call C, W exits after the agreement's
                   rounds, as the survivors build their communicator
  none:            nobody is lost
  late:V@C,W       V exits before call C, W looks for it one call later than
                   the others: they must answer that call alone (stats.alone)
                   and go on with W, every call paired as before

Every call is a direct all-reduce ($ELASTIC_ALGORITHM: another; $ELASTIC_EVICT_AFTER: other
than evict_after=5; $ELASTIC_HEARTBEAT_SPAN: other than heartbeat_span=2; $ELASTIC_DROP: one control datagram lost, below) (op avg, deadline
0.2 s, no injected loss unless LOSS, e.g. bernoulli:0.1) of (original rank + 1 + call / 1000); each block of each result is
checked against the mean over the ranks the call records as its
contributors.  Every rank still running at the end prints one JSON line:
its rank, the calls made, the wrong blocks (0 expected), the exclusions it
saw (call, ranks, seconds from the loss to the end of the excluding call)
and the members at the end.  A woken rank prints what its next call
raised.  Everyone ends with os._exit: MPI_Finalize hangs after a death."""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy import survivors as switching
from mpilossy.control import elastic

comm = MPI.COMM_WORLD
channel, scenario = sys.argv[1], sys.argv[2]
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 30
loss = sys.argv[4] if len(sys.argv) > 4 else None      # e.g. bernoulli:0.1 (injected)
kind, _, spec = scenario.partition(":")
leaves = {}             # original rank -> call before which it leaves
during = None           # the rank that exits as it enters the agreement
for part in spec.split(",") if spec else ():
    if "@" in part:
        victim, at = part.split("@")
        leaves[int(victim)] = int(at)
    else:
        during = int(part)
pids = comm.allgather(os.getpid())
me = comm.rank

if me == during and kind == "late":
    original_after_call = elastic.Membership.after_call

    def after_call_one_late(self, waited, patient=False):
        found = original_after_call(self, waited, patient)
        return None if self.calls == min(leaves.values()) + 1 else found   # (call C, from 1)

    elastic.Membership.after_call = after_call_one_late
elif me == during and kind == "switch":

    def switch_then_exit(self, *args):
        sys.stdout.flush()
        os._exit(0)

    switching.Elastic._switch = switch_then_exit
elif kind == "switch":         # the others say where they wait
    create_group = switching.survivors

    def survivors_said(*args):
        print(json.dumps({"rank": me, "entered": "MPI_Comm_create_group"}), flush=True)
        fresh = create_group(*args)
        print(json.dumps({"rank": me, "left": "MPI_Comm_create_group"}), flush=True)
        return fresh

    switching.survivors = survivors_said
elif me == during:

    def agree_then_exit(self, *args):
        sys.stdout.flush()
        os._exit(0)

    elastic.Membership.agree = agree_then_exit

# (test only) $ELASTIC_DROP=NAME:S>R[#N]: rank S loses its N-th (default: first) datagram
# of tag elastic.NAME (ROUND_1, ROUND_2; ACK/ROUND_2: a confirmation of a ROUND_2) to
# rank R in the first agreement, as if the network dropped it (datagrams only: nodes)
drop = os.environ.get("ELASTIC_DROP")
if drop:
    from mpilossy.control import signals
    name, _, pair = drop.partition(":")
    (name, _, of), (pair, _, nth) = name.partition("/"), pair.partition("#")
    drop_tag, (drop_from, drop_to) = getattr(elastic, name, -1), map(int, pair.split(">"))
    left = [int(nth or 1)]
    original_send_to = signals.Signals.send_to

    def send_to_but_one(self, address, tag, epoch, number=0, *args):
        if (me == drop_from and tag == drop_tag and epoch == 0 and address ==
                self.addresses[drop_to] and (not of or number == getattr(elastic, of))):
            left[0] -= 1
            if left[0] == 0:
                print(f"# rank {me} dropped {drop} (datagram {number})", file=sys.stderr,
                      flush=True)
                return
        return original_send_to(self, address, tag, epoch, number, *args)

    signals.Signals.send_to = send_to_but_one

algorithm = os.environ.get("ELASTIC_ALGORITHM", "direct")     # (hierarchical: fake nodes)
evict_after = int(os.environ.get("ELASTIC_EVICT_AFTER", "5"))
span = int(os.environ.get("ELASTIC_HEARTBEAT_SPAN", "2"))
lc = mpilossy.Communicator(comm, channel=channel, timeout=0.2, algorithm=algorithm,
                           elastic=True, evict_after=evict_after, elastic_wait=1.0, loss=loss,
                           heartbeat_span=span)
seen = []
lc.on_exclusion(lambda excluded, members: seen.append((list(excluded), list(members))))
n = 3000                # (several blocks at any size)
wrong = 0
exclusions = []
alone = []              # calls this rank answered alone
delivered = []          # each call's
algorithms = set()      # what the calls ran (an elastic communicator builds no hierarchy)
lost_at = None          # when the first rank left, as this rank saw the call begin
for call in range(calls):
    if leaves.get(me) == call:
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            # woken by the others when they are done: the next call must refuse
            try:
                lc.allreduce(np.ones(n), op="avg")
                outcome = "returned a result"
            except mpilossy.EvictedError as exc:
                outcome = f"EvictedError: {exc}"
            print(json.dumps({"rank": me, "woken": outcome}), flush=True)
            os._exit(0)
        sys.stdout.flush()
        os._exit(0)
    if call in leaves.values() and lost_at is None:
        lost_at = time.perf_counter()
    members = lc.members if not lc.behind else before     # (a call answered alone: the
    x = np.full(n, me + 1 + call / 1000.0)                 # old communicator's, its ranks)
    try:
        stats = lc.allreduce(x, op="avg")
    except mpilossy.MPILossyError as exc:
        print(json.dumps({"rank": me, "call": call, "error": f"{type(exc).__name__}: {exc}"}),
              flush=True)
        time.sleep(3.0)     # (a peer may still be in the agreement: leaving now would
        os._exit(0)         # make this rank a failure that it sees)
    record = stats.contributors
    if record is not None:
        firsts, lengths = record.blocks()
        who = record.members()
        for first, length, row in zip(firsts, lengths, who):
            if length == 0:
                continue
            ranks = [members[r] for r in np.flatnonzero(row)]
            want = np.mean([r + 1 + call / 1000.0 for r in ranks])
            if not np.allclose(x[first:first + length], want, rtol=0, atol=1e-9):
                wrong += 1
    delivered.append(round(stats.delivered, 4))
    if stats.alone:
        alone.append(call)
    algorithms.add(stats.algorithm)
    if stats.excluded:
        before = members
        exclusions.append({"call": call, "excluded": list(stats.excluded),
                           "after": None if lost_at is None
                           else round(time.perf_counter() - lost_at, 3),
                           "delivered": round(stats.delivered, 3)})
        lost_at = None
print(json.dumps({"rank": me, "calls": calls, "wrong": wrong, "exclusions": exclusions,
                  "callbacks": seen, "members": list(lc.members), "size": lc.size,
                  "alone": alone, "algorithms": sorted(algorithms), "delivered": delivered}),
      flush=True)
if kind == "stop":
    for victim in leaves:
        try:    # (every survivor wakes it: one that comes later may find it gone)
            os.kill(pids[victim], signal.SIGCONT)
        except ProcessLookupError:
            pass
    time.sleep(3.0)     # (the woken rank's call reads this rank's windows)
os._exit(0)
