"""DistributedOptimizer on Communicator(elastic=True, spares=1): a rank
lost mid-run and a spare taking its place (docs/elastic.md, "Growing
back").  Launch with ``mpiexec -disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python spares_torch.py CHANNEL V@S [STEPS]

The last rank is a spare; rank V exits before step S.  SGD with momentum
(state a newcomer needs), drift control that re-synchronises parameters
and optimizer state only at the end of a step that excluded a rank
(broadcast_every=1000), a 2 s deadline, no injected loss.  The spare
builds its model from another seed, wraps it once stand_by() returned
True, and goes on from the step the others had reached.  At the end rank
0 broadcasts its parameters and momentum; every rank still running prints
one JSON line: its rank, whether it was a spare, the steps it made and
the first of them, the growths its steps reported, the largest difference
of its parameters and momentum from rank 0's, and the least delivered
fraction of its steps after the growth.  Everyone ends with os._exit."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: torch_helpers

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import loss_of, make_model  # noqa: E402

comm = MPI.COMM_WORLD
channel, lose = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
victim, at = (int(v) for v in lose.split("@"))
me = comm.rank
lc = mpilossy.Communicator(comm, channel=channel, timeout=2.0, elastic=True, evict_after=5,
                           elastic_wait=2.0, spares=1)
was_spare = lc.spare
model = make_model(seed=7 if was_spare else 0)
if was_spare and not lc.stand_by(timeout=120.0):
    print(json.dumps({"rank": me, "spare": True, "called": False}), flush=True)
    os._exit(0)
opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              model.named_parameters(), lc, broadcast_every=1000,
                              broadcast_state=True)
first = opt.steps + 1
joined, delivered = [], []
while opt.steps < steps:
    step = opt.steps + 1
    if me == victim and step == at:
        os._exit(0)
    opt.zero_grad()
    loss_of(model, me, step).backward()
    opt.step()
    assert opt.stats is not None
    if opt.stats.joined:
        joined.append((step, list(opt.stats.joined)))
    elif joined or was_spare:
        delivered.append(opt.stats.delivered)


def flat() -> np.ndarray:
    momenta = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    return torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), *momenta]]
                     ).double().numpy().copy()


mine = flat()
reference = mine.copy()
lc.bcast(reference, root=0)
print(json.dumps({"rank": me, "spare": was_spare, "steps": opt.steps, "first": first,
                  "joined": joined, "difference": float(np.abs(mine - reference).max()),
                  "delivered_after": min(delivered, default=None),
                  "members": list(lc.members)}), flush=True)
lc.free()
os._exit(0)
