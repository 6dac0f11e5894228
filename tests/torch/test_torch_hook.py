"""The DDP communication hook, under a gloo process group started from MPI."""

import os

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import (assert_matches_reference, backward, flat, gather_check,  # noqa: E402
                           make_model)

STEPS = 8
BUCKET_MB = 0.004           # about 4 KB: the 13 KB model makes several buckets


@pytest.fixture(scope="module", autouse=True)
def process_group():
    mt.init_process_group()
    yield
    mt.destroy_process_group()


@pytest.mark.mpi
def test_process_group_from_mpi(comm):
    assert dist.get_rank() == comm.rank and dist.get_world_size() == comm.size
    where = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    assert len(set(comm.allgather(where))) == 1 and where[0] == "127.0.0.1"
    t = torch.tensor([float(comm.rank)])
    dist.all_reduce(t)
    assert t.item() == comm.size * (comm.size - 1) / 2
    mt.init_process_group()                     # already there: nothing happens


@pytest.mark.mpi
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_lossless_hook_equals_ddp_default(comm, lc, background):
    ref = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = mt.AllreduceHookState(lc, background=background, model=model.module)
    model.register_comm_hook(state, mt.allreduce_hook)
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            backward(m, comm.rank, step)
            o.step()
    state.close()
    assert_matches_reference(comm, model, ref)
    buckets = len(state.bucket_stats)
    assert buckets >= 2, "the test wants several buckets"
    assert state.steps == STEPS
    assert state.stats.calls == buckets and state.stats.delivered == 1.0
    assert state.stats.nbytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.mpi(min_size=2)
def test_hook_under_loss_with_drift_control(comm):
    lc = mpilossy.Communicator(comm, timeout=0.02, block_bytes=512,
                               loss=mpilossy.loss.Bernoulli(0.1, seed=4))
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = mt.AllreduceHookState(lc)
    model.register_comm_hook(state, mt.allreduce_hook)
    control = mt.DriftController(model.module, comm=lc, broadcast_every=5, measure_every=5,
                                 optimizer=opt)
    delivered, drift = [], []
    for step in range(1, 21):
        opt.zero_grad()
        backward(model, comm.rank, step)
        opt.step()
        delivered.append(state.stats.delivered)
        report = control.step()
        if report.broadcast:
            drift.append((report.drift, control.measure()))
    finite = bool(np.isfinite(flat(model)).all())
    lost = comm.allreduce(sum(d < 1 for d in delivered))
    lc.free()
    gather_check(comm, finite)
    assert lost > 0, "nothing was lost: the test proved nothing"
    assert all(after == 0.0 for _, after in drift) and len(drift) == 4, drift
    assert all(before < 0.05 for before, _ in drift), drift


@pytest.mark.mpi
def test_hook_takes_redundancy_through_its_communicator(comm):
    """Lossless: the same model as DDP's own all-reduce, every call coded;
    at 20% loss: blocks rebuilt from parity in the hook's calls."""
    code = (8, 2) if mpilossy._core.HAVE_ISAL else (4, 1)
    with mpilossy.Communicator(comm, timeout=None, block_bytes=512, redundancy=code) as lc:
        ref = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = mt.AllreduceHookState(lc)
        model.register_comm_hook(state, mt.allreduce_hook)
        for step in range(3):
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad()
                backward(m, comm.rank, step)
                o.step()
        assert all(s.redundancy == code for s in state.bucket_stats.values())
        assert_matches_reference(comm, model, ref)
    with mpilossy.Communicator(comm, timeout=0.5, block_bytes=512, redundancy=code,
                               loss=mpilossy.loss.Bernoulli(0.2, seed=9)) as lc:
        model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = mt.AllreduceHookState(lc)
        model.register_comm_hook(state, mt.allreduce_hook)
        rebuilt = 0
        for step in range(6):
            opt.zero_grad()
            backward(model, comm.rank, step)
            opt.step()
            rebuilt += sum(s.rebuilt for s in state.bucket_stats.values())
        gather_check(comm, bool(np.isfinite(flat(model)).all()))
    if comm.size > 1:
        assert comm.allreduce(rebuilt) > 0, "nothing was rebuilt: the test proved nothing"
