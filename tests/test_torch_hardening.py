"""Hardening of mpilossy.torch (issue 27, items 6, 8 and 10): optimizer
state that is not contiguous, a compute deadline that fails on one rank,
checkpoints of the sharded mode, group averaging of float64 parameters,
and the DDP hook's error-feedback residuals across DDP's bucket rebuild.
Every test is bounded and runs at any number of ranks."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from helpers import all_ranks_raise  # noqa: E402
from torch_helpers import same_on_every_rank  # noqa: E402


# -- item 8: a compute deadline that fails on one rank fails on every rank ------------

def micro_gradient(rank, step, i, n):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["distributed", "sharded"])
@pytest.mark.parametrize("timeout", [None, 2.0], ids=["no-deadline", "deadline"])
def test_a_rank_without_micro_batches_fails_the_step_everywhere(comm, wrapper, timeout):
    """The last rank's loader runs dry: no micro-batch, no weight.  The step
    raises the same ValueError on every rank (not on that rank alone, with
    its peers waiting for it or going on a call ahead), nothing is applied,
    and the next step runs normally on every rank."""
    n = 600
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
    deadline = mt.ComputeDeadline(1e9, max_micro_batches=2)
    dry = comm.size - 1
    with mpilossy.Communicator(comm, timeout=timeout) as lc:
        wrap = mt.DistributedOptimizer if wrapper == "distributed" else mt.ShardedOptimizer
        opt = wrap(torch.optim.SGD([p], lr=1.0), [("p", p)], lc, compute_deadline=deadline)

        def step(number, loader):
            opt.zero_grad()
            for i, _ in zip(deadline, loader):
                (p * micro_gradient(comm.rank, number, i, n)).sum().backward()
            opt.step()

        message = all_ranks_raise(comm, lambda: step(0, [] if comm.rank == dry else [0, 1]),
                                  ValueError)
        messages = comm.allgather(message)
        assert all(m == messages[0] for m in messages), messages
        assert f"rank {dry}" in message and "micro-batch" in message, message
        assert torch.count_nonzero(p.detach()) == 0         # nothing applied
        step(1, [0, 1])
        grads = [micro_gradient(r, 1, i, n) for r in range(comm.size) for i in range(2)]
        torch.testing.assert_close(p.detach(), -torch.stack(grads).mean(dim=0),
                                   rtol=1e-10, atol=1e-10)
        assert opt.stats.delivered == 1.0
        assert same_on_every_rank(comm, p.detach().numpy())


# -- item 6: optimizer state and parameters that are not contiguous --------------------

def conv_model(seed, channels_last):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(48, 48, 3), torch.nn.Conv2d(48, 4, 1))
    return model.to(memory_format=torch.channels_last) if channels_last else model


def conv_step(model, opt, rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 48, 6, 6, generator=g).to(memory_format=torch.channels_last)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def state_values(opt):
    """The optimizer state's tensors, flattened in logical order."""
    state = opt.state_dict()["state"]
    return np.concatenate([v.detach().reshape(-1).double().numpy()
                           for k in sorted(state) for _, v in sorted(state[k].items())])


@pytest.mark.mpi
def test_broadcast_channels_last_adam_state(comm):
    """Adam's state of a channels_last model is channels_last (not
    contiguous) and large (a 48x48x3x3 kernel: 83 KB, above FUSE_BELOW): the
    root used to pack it while the receivers, whose fresh state is
    contiguous, broadcast it alone (MPI_ERR_TRUNCATE there, the root went
    on).  Now every rank gets the root's values, in the root's layout."""
    model = conv_model(comm.rank, channels_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if comm.rank == 0:
        conv_step(model, opt, 0)                # state exists on the root only
    weight = model[0].weight
    assert not weight.is_contiguous() and weight.numel() * 4 >= mt.broadcast.FUSE_BELOW
    mt.broadcast_optimizer_state(opt, root_rank=0)
    values = state_values(opt)
    assert same_on_every_rank(comm, values) and np.abs(values).max() > 0
    exp_avg = opt.state[weight]["exp_avg"]
    assert exp_avg.is_contiguous(memory_format=torch.channels_last)
    mt.broadcast_parameters(model, root_rank=0)
    conv_step(model, opt, 1)                    # and Adam goes on alike everywhere
    assert same_on_every_rank(comm, state_values(opt))


@pytest.mark.mpi
def test_broadcast_parameters_of_different_layouts(comm):
    """The root's model is channels_last, the others' contiguous: the
    message layout depends on shapes and dtypes alone, so every rank ends
    with the root's values (in its own layout)."""
    model = conv_model(comm.rank, channels_last=comm.rank == 0)
    mt.broadcast_parameters(model, root_rank=0)
    values = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    assert same_on_every_rank(comm, values)
    assert model[0].weight.is_contiguous() == (comm.rank != 0)


@pytest.mark.mpi
def test_broadcast_into_a_tensor_that_overlaps_itself_fails_everywhere(comm):
    """An expanded tensor (stride 0) cannot receive a broadcast: every rank
    raises the same BufferError before any data moves."""
    tensors = [("ok", torch.zeros(10)), ("expanded", torch.zeros(1).expand(40000))]
    message = all_ranks_raise(comm, lambda: mt.broadcast_parameters(tensors, root_rank=0),
                              BufferError)
    assert "expanded" in message and "overlaps" in message, message
    assert same_on_every_rank(comm, message)
