"""The PyTorch wrappers on Communicator(elastic=True, spares=1): a rank
lost mid-run and a spare taking its place (docs/elastic.md, "Growing
back").  Launch with ``mpiexec -disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python spares_torch.py CHANNEL V@S [STEPS [MODE [W]]]

The last rank is a spare; rank V exits before step S; rank W (if given)
exits as the growth's share() begins on it (its collectives made again
over the survivors, the newcomer among them).  SGD with momentum
(state a newcomer needs), a 2 s deadline, no injected loss.  The spare
builds its model from another seed, wraps it once stand_by() returned
True, and goes on from the step the others had reached.

MODE "replicated" (default): DistributedOptimizer with drift control that
re-synchronises parameters and optimizer state only at the end of a step
that excluded a rank (broadcast_every=1000); at the end each rank compares
its parameters and momentum with rank 0's.

MODE "sharded": ShardedOptimizer with the drift meter every 4 steps (its
schedule must be the same on the spare).  At the growth every rank in
takes a picture of the momentum it holds (its chunk, zeros elsewhere) as
on_growth runs, before the chunks are cut again; right after (the
survivors: the step that reported the growth; the spare: its wrapper's
construction) every rank sums the pictures and the momentum it holds now
over all ranks ("checks"): cutting again must move the momentum, not
change it.  At the end each rank compares its parameters with rank 0's.

MODE "sharded:K": the same with copy_state_every=K; the victim prints
the momentum of its chunk as it exits ({"lost": ...}), and the growth's
check the momentum summed over the ranks before the chunks are cut again
("before"), over the victim's chunk: as restored from the copy kept of it.
Each as a digest, the count of nonzero elements and the largest magnitude.

MODE "ddp": DistributedDataParallel on mpilossy.torch.local_group() with
the DDP hook on the Communicator, a plain SGD and a DriftController given
both (re-synchronising only after an exclusion, as in "replicated"); the
hook state's grow() after each step; the spare builds DDP, optimizer,
controller and hook state the same way.  The same checks as "replicated".

With $SPARES_RENDEZVOUS=DIR there is no spare: the job's communicator
takes newcomers through that rendezvous, and CHANNEL "join" starts one (a
process outside the job: Communicator.join(DIR)), which plays the
spare's part (its rank in the JSON: its member number).

Every rank still running prints one JSON line: its rank, whether it was a
spare, the steps it made and the first of them, the growths its steps
reported, the largest difference from rank 0, and the least delivered
fraction of its steps after the growth.  Everyone ends with os._exit."""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: torch_helpers

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from mpilossy.call.buffers import chunk_bounds  # noqa: E402
from torch_helpers import loss_of, make_model  # noqa: E402

comm = MPI.COMM_WORLD
channel, lose = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
mode = sys.argv[4] if len(sys.argv) > 4 else "replicated"
sharded = mode.startswith("sharded")
copies = int(mode.split(":")[1]) if sharded and ":" in mode else None
share_victim = int(sys.argv[5]) if len(sys.argv) > 5 else None
victim, at = (int(v) for v in lose.split("@"))
directory = os.environ.get("SPARES_RENDEZVOUS")
if channel == "join":
    joined_lc = mpilossy.Communicator.join(directory, timeout=120.0)
    if joined_lc is None:
        print(json.dumps({"rank": -1, "spare": True, "called": False}), flush=True)
        os._exit(0)
    lc, was_spare = joined_lc, True
    me = lc.members[lc.rank]
else:
    me = comm.rank
    lc = mpilossy.Communicator(comm, channel=channel, timeout=2.0, elastic=True, evict_after=5,
                               elastic_wait=2.0, spares=0 if directory else 1,
                               rendezvous=directory)
    was_spare = lc.spare
model = make_model(seed=7 if was_spare else 0)
if lc.spare and not lc.stand_by(timeout=120.0):
    print(json.dumps({"rank": me, "spare": True, "called": False}), flush=True)
    os._exit(0)
size = sum(p.numel() for p in model.parameters())


def momentum() -> torch.Tensor:
    """The momentum this rank holds, where its parameters sit in the flat
    vector of them (sharded: its chunk, zeros elsewhere)."""
    whole = torch.zeros(size, dtype=torch.float64)
    if not sharded:
        return torch.cat([opt.state[p]["momentum_buffer"].reshape(-1).double()
                          for p in model.parameters()])
    for group in opt.param_groups:
        for view in group["params"]:
            state = opt.state.get(view)
            if state:
                lo = view.storage_offset()
                whole[lo:lo + view.numel()] = state["momentum_buffer"].reshape(-1).double()
    return whole


def summed(mine: torch.Tensor) -> torch.Tensor:
    """Over every rank in (reliable broadcasts from each)."""
    total = torch.zeros_like(mine)
    for root in range(lc.size):
        buf = mine.numpy().copy() if lc.rank == root else torch.zeros_like(mine).numpy()
        lc.bcast(buf, root=root)
        total += torch.from_numpy(buf)
    return total


def conserved(before: torch.Tensor) -> dict:
    old, new = summed(before), summed(momentum())
    check = {"moved": float((new - old).abs().max()), "held": float(old.abs().max()),
             "mine": float(momentum().abs().max())}
    if copies is not None:      # (the momentum the growth found: a lost chunk's restored)
        check["before"] = picture(old)
    return check


def picture(values: torch.Tensor) -> dict:
    """The victim's chunk of `values` (a flat vector of the parameters'
    size): its digest, its nonzero elements and its largest magnitude."""
    lo, hi = chunk_bounds(size, comm.size - 1, victim)      # (the spare holds no chunk)
    chunk = values[lo:hi].contiguous()
    return {"sha256": hashlib.sha256(chunk.numpy().tobytes()).hexdigest(),
            "nonzero": int(torch.count_nonzero(chunk)), "largest": float(chunk.abs().max())}


class HookedDDP:
    """DDP with the hook, shaped like the wrappers for the loop below."""

    def __init__(self) -> None:
        self.net = torch.nn.parallel.DistributedDataParallel(model,
                                                             process_group=mt.local_group())
        self.inner = inner
        self.drift_control = mt.DriftController(self.net, comm=lc, broadcast_every=1000,
                                                optimizer=inner)
        self.hook = mt.AllreduceHookState(lc, model=self.net, optimizer=inner,
                                          drift=self.drift_control)
        self.net.register_comm_hook(self.hook, mt.allreduce_hook)
        self._mpilossy = self.hook._engine

    steps = property(lambda self: self.hook.steps)
    stats = property(lambda self: self.hook.stats)
    state = property(lambda self: self.inner.state)     # (a re-synchronisation replaces it)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()
        self.drift_control.step()
        self.hook.grow()


inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if sharded:
    opt = mt.ShardedOptimizer(inner, model.named_parameters(), lc, measure_every=4,
                              copy_state_every=copies)
elif mode == "ddp":
    opt = HookedDDP()
else:
    opt = mt.DistributedOptimizer(inner, model.named_parameters(), lc, broadcast_every=1000,
                                  broadcast_state=True)
first = opt.steps + 1
if me == share_victim:
    opt._mpilossy.share = lambda optimizer: os._exit(0)     # (gone as the growth's share begins)
checks = []
pictures = []
if sharded and was_spare:
    checks.append(conserved(torch.zeros(size, dtype=torch.float64)))
elif sharded:
    lc.on_growth(lambda joined, members: pictures.append(momentum()))
joined, delivered = [], []
while opt.steps < steps:
    step = opt.steps + 1
    if me == victim and step == at:
        if copies is not None:      # (the momentum of its chunk as it leaves)
            print(json.dumps({"lost": me, "momentum": picture(momentum())}), flush=True)
        os._exit(0)
    opt.zero_grad()
    loss_of(opt.net if mode == "ddp" else model, me, step).backward()
    opt.step()
    assert opt.stats is not None
    if opt.stats.joined:
        joined.append((step, list(opt.stats.joined)))
        if sharded:
            checks.append(conserved(pictures.pop()))
    elif joined or was_spare:
        delivered.append(opt.stats.delivered)

parameters = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
mine = (parameters if sharded else torch.cat([parameters, momentum()])).numpy()
reference = mine.copy()
lc.bcast(reference, root=0)
print(json.dumps({"rank": me, "spare": was_spare, "steps": opt.steps, "first": first,
                  "drift_steps": opt.drift_control.steps, "joined": joined, "checks": checks,
                  "difference": float(abs(mine - reference).max()),
                  "delivered_after": min(delivered, default=None),
                  "members": list(lc.members)}), flush=True)
lc.free()
os._exit(0)
