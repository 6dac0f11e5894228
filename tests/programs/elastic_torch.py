"""The torch wrappers on an elastic communicator going on after a rank is
lost (docs/elastic.md).  Launch with ``mpiexec -disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python elastic_torch.py WRAPPER CHANNEL HOW:V@S [STEPS [MOMENTUM]]

WRAPPER: distributed, sharded or ddp (DistributedDataParallel over Gloo
with the lossy hook and a DriftController, which re-synchronises at the
end of the step that excluded a rank; the model has no buffers, so DDP's
own process group is used only at construction); sharded+feedback (error
feedback, zero-filled scaling) or sharded+topk (TopK of every block: the
same values, through its block choice). HOW: exit (os._exit) or stop
(SIGSTOP) of rank V before step S, or late:V@S,W: V exits and W looks
for it one call later than the others (sharded: after the step's
all-gather, the others after its reduce-scatter; they answer the
all-gather alone). A suffix /POINT moves the loss into a reliable wait
of step S: /feedback (V leaves before error feedback's bitmap
all-reduce, after the step's reduce-scatter), /choice (before TopK's
block choice), /recut:W (V leaves before step S, then rank W before the
survivors' re-cut of the chunks: a second loss during it), /barrier (every
rank makes lc.barrier() before each opt.step(), as the example lines its
ranks up; V leaves before step S and the survivors exclude it in the
barrier: the reference then starts from their parameters before step S's
update, which is checked too; momentum 0 only). No injected
loss, a 0.2 s deadline. Every rank still running at the end prints one
JSON line: the exclusions, the loss of the first and last five steps,
whether its parameters equal every other survivor's, the size of its
optimizer's chunk, and the largest difference from a reference: the same
model trained by MPI_Allreduce over the survivors only from the
exclusion's step on, started from the survivors' parameters right after
it, and the least delivered fraction of a step after the exclusion."""

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: torch_helpers

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import batch, make_model  # noqa: E402

comm = MPI.COMM_WORLD
wrapper, channel, lose = sys.argv[1], sys.argv[2], sys.argv[3]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 30
momentum = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
lose, _, point = lose.partition("/")
point, _, second_text = point.partition(":")
second = int(second_text) if second_text else None
how, _, where = lose.partition(":")
where, _, late = where.partition(",")
victim, at = (int(v) for v in where.split("@"))
me = comm.rank
pids = comm.allgather(os.getpid())
alone = []              # steps with a call this rank answered alone
step = 0


def leave() -> None:
    sys.stdout.flush()
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def leave_inside(owner, name, when) -> None:
    """This rank leaves as it enters owner.name, when `when()`."""
    original = getattr(owner, name)

    def entered(*args, **kwargs):
        if when():
            leave()
        return original(*args, **kwargs)

    setattr(owner, name, entered)


if point == "feedback" and me == victim:
    from mpilossy.torch.feedback import ErrorFeedback
    leave_inside(ErrorFeedback, "record", lambda: step == at)
elif point == "choice" and me == victim:
    from mpilossy.compression import TopK
    leave_inside(TopK, "_select", lambda: step == at)
elif point == "recut" and me == second:
    from mpilossy.torch import recut
    leave_inside(recut, "_from_old_owners", lambda: True)

if late and me == int(late):
    from mpilossy.control import elastic
    original_after_call = elastic.Membership.after_call

    def after_call_one_late(self, waited, patient=False):
        found = original_after_call(self, waited, patient)
        return None if self.calls == 2 * at + 1 else found     # (step `at`'s first call)

    elastic.Membership.after_call = after_call_one_late

torch.manual_seed(0)
model = make_model(1)
# (error feedback needs the plain average: zero-filled scaling)
lc = mpilossy.Communicator(comm, channel=channel, timeout=0.2, algorithm="direct",
                           elastic=True, evict_after=5, elastic_wait=1.0,
                           scaling="zero-fill" if wrapper == "sharded+feedback" else "unbiased")
inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
hook = None
if wrapper == "sharded":
    opt = mt.ShardedOptimizer(inner, model.named_parameters(), lc)
elif wrapper == "sharded+feedback":
    opt = mt.ShardedOptimizer(inner, model.named_parameters(), lc, error_feedback=True)
elif wrapper == "sharded+topk":
    from mpilossy.compression import TopK
    opt = mt.ShardedOptimizer(inner, model.named_parameters(), lc,
                              compression=TopK(1.0, error_feedback=False))
elif wrapper == "ddp":
    mt.init_process_group("gloo", comm=lc.comm)
    ddp = torch.nn.parallel.DistributedDataParallel(model)     # (no buffers to sync)
    hook = mt.AllreduceHookState(lc)
    ddp.register_comm_hook(hook, mt.allreduce_hook)
    opt = inner
    # (its first re-synchronisation: at the end of the step that excluded a rank)
    drift = mt.DriftController(model, comm=lc, broadcast_every=1000)
else:
    # (re-synchronised every step: the survivors start the reference equal)
    opt = mt.DistributedOptimizer(inner, model.named_parameters(), lc, broadcast_every=1)


def flat(m):
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in m.parameters()])


def momenta(opt):
    """Sharded: the momentum of every parameter, from its new owner (the
    chunks in rank order make the flat vector); replicated: this rank's."""
    views = [v for g in opt.param_groups for v in g["params"]]
    mine = np.concatenate([opt.state[v]["momentum_buffer"].double().reshape(-1).numpy()
                           if "momentum_buffer" in opt.state.get(v, {}) else
                           np.zeros(v.numel()) for v in views]) if views else np.zeros(0)
    if wrapper.startswith("sharded"):
        return np.concatenate(lc.comm.allgather(mine))
    return mine


losses, exclusions, delivered_after = [], [], []
snapshot = None             # (step, parameters) right after the exclusion
residual = None            # error feedback's, right after the exclusion
for step in range(steps):
    if me == victim and step == at and point in ("", "recut", "barrier"):
        leave()
    opt.zero_grad()
    x, y = batch(me, step)
    loss = torch.nn.functional.mse_loss((model if hook is None else ddp)(x), y)
    loss.backward()
    if point == "barrier":
        lc.barrier()
        if lc.size < comm.size and snapshot is None:    # (excluded in it: the step is checked)
            exclusions.append({"step": step, "size": lc.size, "members": list(lc.members)})
            snapshot = (step, flat(model), None)
    opt.step()
    if hook is not None:
        drift.step()
    losses.append(loss.item())
    stats = opt.stats if hook is None else hook.stats
    if snapshot is not None:
        delivered_after.append(stats.delivered)
    if stats.alone:
        alone.append(step)
    if lc.size < comm.size and snapshot is None:
        exclusions.append({"step": step, "size": lc.size, "members": list(lc.members)})
        snapshot = (step + 1, flat(model), momenta(opt))
        if wrapper == "sharded+feedback":
            residual = opt._mpilossy.feedback.residual()[torch.float32].double().numpy().copy()

# The reference: plain SGD over the survivors, exact, from the snapshot on.
survivors = lc.comm
ref = make_model(1)
at_step, values, moment = snapshot
values = survivors.bcast(values, root=0)        # (replicated: rank 0's copy wins)
moment = survivors.bcast(moment, root=0)
assert moment is not None or not momentum, "/barrier: momentum 0 (the momenta are not taken)"
offset = 0
with torch.no_grad():
    for p in ref.parameters():
        p.copy_(torch.from_numpy(values[offset:offset + p.numel()]).view_as(p))
        offset += p.numel()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum)
if momentum:        # (the momenta the survivors carried over)
    offset = 0
    for p in ref.parameters():
        ref_opt.state[p]["momentum_buffer"] = torch.from_numpy(
            moment[offset:offset + p.numel()]).float().view_as(p).clone()
        offset += p.numel()
for step in range(at_step, steps):
    ref_opt.zero_grad()
    x, y = batch(me, step)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    offset = 0
    for p in ref.parameters():
        g = p.grad.numpy()
        if residual is not None and step == at_step:    # (error feedback sends it again)
            g += residual[offset:offset + g.size].reshape(g.shape).astype(g.dtype)
        offset += g.size
        survivors.Allreduce(MPI.IN_PLACE, g)
        g /= survivors.size
    ref_opt.step()

mine = flat(model)
every = survivors.allgather(mine)
chunk = sum(p.numel() for g in opt.param_groups for p in g["params"])
print(json.dumps({"rank": me, "exclusions": exclusions, "members": list(lc.members),
                  "first": float(np.mean(losses[:5])), "last": float(np.mean(losses[-5:])),
                  "same": all(np.array_equal(v, every[0]) for v in every),
                  "chunk": chunk, "total": int(mine.size),
                  "delivered_after": min(delivered_after, default=1.0),
                  "lossy_after": sum(d < 1.0 for d in delivered_after),
                  "momentum_kept": float(np.mean(moment != 0)) if momentum else None,
                  "alone": alone,
                  "residual": None if residual is None else float(np.abs(residual).max()),
                  "from_reference": float(np.abs(mine - flat(ref)).max())}), flush=True)
if how == "stop":
    survivors.Barrier()
    if survivors.rank == 0:
        for gone in {victim, second} - {None}:
            os.kill(pids[gone], signal.SIGCONT)     # (it exits when woken)
os._exit(0)
