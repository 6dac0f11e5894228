"""DistributedOptimizer and the reliable broadcasts: without loss, training
equals reliable gradient averaging; the wrapper behaves as the optimizer
it wraps."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import (assert_matches_reference, backward, flat, gather_check,  # noqa: E402
                           make_model, reliable_average, same_on_every_rank,
                           train_reference)

STEPS = 12
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bucket_bytes", [1000, 4 * 1024 * 1024])
def test_lossless_equals_reliable_averaging(comm, lc, name, bucket_bytes):
    ref = make_model()
    train_reference(comm, ref, OPTIMIZERS[name](ref.parameters()), STEPS)
    model = make_model()
    opt = mt.DistributedOptimizer(OPTIMIZERS[name](model.parameters()),
                                  model.named_parameters(), lc, bucket_bytes=bucket_bytes)
    for step in range(STEPS):
        opt.zero_grad()
        backward(model, comm.rank, step)
        opt.step()
    assert_matches_reference(comm, model, ref)
    stats = opt.stats
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert stats.step == STEPS and stats.delivered == 1.0 and stats.deadline_hits == 0
    assert stats.nbytes == nbytes and stats.calls == -(-nbytes // bucket_bytes)
    assert stats.comm_seconds > 0 and stats.drift is None


@pytest.mark.mpi
def test_is_the_wrapped_optimizer(comm, lc):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = mt.DistributedOptimizer(inner, model.named_parameters(), lc)
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(4):
        opt.zero_grad()
        backward(model, comm.rank, step)
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert opt.stats.step == 4                  # the scheduler's patch of step() kept ours
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    saved = opt.state_dict()
    assert saved["state"].keys() == inner.state_dict()["state"].keys()
    fresh = make_model()
    plain = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(saved)                # a plain optimizer reads it
    opt.load_state_dict(plain.state_dict())     # and the wrapper reads a plain one
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    with pytest.raises(ValueError, match="already wrapped"):
        mt.DistributedOptimizer(opt, communicator=lc)


@pytest.mark.mpi
def test_scheduler_made_before_wrapping(comm, lc):
    """A scheduler patches the instance's step(); wrapping afterwards must
    still run the lossy all-reduce."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = mt.DistributedOptimizer(inner, communicator=lc)
    backward(model, comm.rank, 0)
    opt.step()
    with pytest.warns(UserWarning, match="overridden"):    # (torch says so, once)
        scheduler.step()
    assert opt.stats is not None and opt.stats.calls == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert same_on_every_rank(comm, flat(model))


@pytest.mark.mpi
def test_synchronize_then_clip(comm, lc):
    """synchronize() reduces once; step() then uses the clipped average."""
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=lc)
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            backward(m, comm.rank, step)
        reliable_average(comm, ref.parameters())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        assert opt.stats.calls == 1
    gather_check(comm, np.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6))


@pytest.mark.mpi
def test_non_contiguous_and_missing_gradients(comm, lc):
    """Gradients of any layout are copied into the fused buffer; a parameter
    with no gradient on some ranks counts as zeros there."""
    def build():
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(6, 5).t())        # non-contiguous
        u = torch.nn.Parameter(torch.randn(5))
        return w, u

    def grads(w, u, step):
        x = torch.full((4, 6), 0.1 * (comm.rank + 1) + step)
        loss = (x @ w.t()).sum() + (u.sum() if comm.rank % 2 == 0 else 0)
        loss.backward()

    w0, u0 = build()
    ref_opt = torch.optim.SGD([w0, u0], lr=0.1)
    w1, u1 = build()
    opt = mt.DistributedOptimizer(torch.optim.SGD([w1, u1], lr=0.1), communicator=lc)
    assert not w1.is_contiguous()
    for step in range(3):
        ref_opt.zero_grad()
        grads(w0, u0, step)
        if u0.grad is None:
            u0.grad = torch.zeros_like(u0)
        reliable_average(comm, [w0, u0])
        ref_opt.step()
        opt.zero_grad()
        grads(w1, u1, step)
        opt.step()
    gather_check(comm, np.allclose(flat([w1, u1]), flat([w0, u0]), rtol=1e-6, atol=1e-6))
    assert u1.grad is not None and not w1.is_contiguous()


@pytest.mark.mpi
def test_broadcast_parameters(comm):
    root = comm.size - 1
    model = make_model(seed=10 + comm.rank)
    model.register_buffer("counter", torch.tensor([comm.rank, 7]))
    big = torch.nn.Parameter(torch.full((200, 100), float(comm.rank)))   # broadcast in place
    seconds = mt.broadcast_parameters(list(model.state_dict().items()) + [("big", big)],
                                      root_rank=root)
    expected = make_model(seed=10 + root)
    gather_check(comm, np.array_equal(flat(model), flat(expected)))
    assert model.counter.tolist() == [root, 7] and bool((big == root).all())
    assert seconds >= 0
    mt.broadcast_parameters(model)                              # a module: from rank 0
    assert same_on_every_rank(comm, flat(model))


@pytest.mark.mpi
def test_broadcast_optimizer_state_created_lazily(comm):
    """Adam creates its state at the first step: ranks that have not stepped
    receive the root's state, and everyone takes the root's lr."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (comm.rank + 1))
    if comm.rank == 0:
        backward(model, 0, 0)
        opt.step()
    mt.broadcast_optimizer_state(opt, root_rank=0)
    mt.broadcast_parameters(model, root_rank=0)
    state = opt.state_dict()
    assert len(state["state"]) == len(list(model.parameters()))
    assert state["param_groups"][0]["lr"] == pytest.approx(1e-3)
    moments = np.concatenate([s["exp_avg"].reshape(-1).numpy() for s in state["state"].values()])
    steps = [float(s["step"]) for s in state["state"].values()]
    assert same_on_every_rank(comm, moments) and steps == [1.0] * len(steps)
    assert np.abs(moments).max() > 0
    # ... and optimizing goes on from there on every rank alike
    opt.zero_grad()
    backward(model, 0, 1)
    opt.step()
    assert same_on_every_rank(comm, flat(model))


@pytest.mark.mpi
def test_default_communicator_from_environment(comm, clean_env):
    """Without a communicator the wrapper uses mpilossy.default_communicator()."""
    model = make_model()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.communicator is mpilossy.default_communicator()
    backward(model, comm.rank, 0)
    opt.step()
    assert opt.stats.delivered == 1.0 and same_on_every_rank(comm, flat(model))
