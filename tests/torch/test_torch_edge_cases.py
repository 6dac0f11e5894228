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
from mpilossy import _core  # noqa: E402
from helpers import all_ranks_raise  # noqa: E402
from torch_helpers import same_on_every_rank  # noqa: E402


# -- item 8: a compute deadline that fails on one rank fails on every rank ------------

def micro_gradient(rank, step, i, n):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(n, generator=g, dtype=torch.float64)


CHANNELS = ["rma"] + (["ud"] if _core.HAVE_LIBFABRIC and _core.HAVE_DATAGRAM_AUTH else [])


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["distributed", "sharded"])
@pytest.mark.parametrize("timeout", [None, 2.0], ids=["no-deadline", "deadline"])
@pytest.mark.parametrize("channel", CHANNELS)
def test_a_rank_without_micro_batches_fails_the_step_everywhere(comm, wrapper, timeout, channel):
    """The last rank's loader runs dry: no micro-batch, no weight.  The step
    raises the same ValueError on every rank (not on that rank alone, with
    its peers waiting for it or going on a call ahead), nothing is applied,
    and the next step runs normally on every rank."""
    n = 600
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
    deadline = mt.ComputeDeadline(1e9, max_micro_batches=2)
    dry = comm.size - 1
    with mpilossy.Communicator(comm, channel=channel, timeout=timeout) as lc:
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


# -- item 10: checkpoints of the sharded mode -----------------------------------------

def sharded(comm, lc, seed=0, lr=0.05):
    model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = mt.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=lr),
                              model.named_parameters(), lc)
    return model, opt


def train(model, opt, rank, steps, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def values(model):
    return np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])


@pytest.mark.mpi
def test_sharded_checkpoint_loaded_on_one_rank(comm, lc):
    """A checkpoint of the model loaded on rank 0 alone: resynchronize()
    used to be the advice, but the owners' chunks win and every rank ended
    with rank 0's chunk of the checkpoint and the others' stale chunks.
    resynchronize(root_rank=0) gives every rank rank 0's parameters."""
    model, opt = sharded(comm, lc)
    train(model, opt, comm.rank, 2)
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, comm.rank, 2, first=2)
    if comm.rank == 0:
        model.load_state_dict(checkpoint)
    opt.resynchronize(root_rank=0)
    expected = np.concatenate([v.reshape(-1).numpy() for v in checkpoint.values()])
    np.testing.assert_array_equal(values(model), expected)
    assert same_on_every_rank(comm, values(model))
    train(model, opt, comm.rank, 1, first=4)        # and training goes on alike
    assert same_on_every_rank(comm, values(model))
    all_ranks_raise(comm, lambda: opt.resynchronize(root_rank=comm.size), ValueError)


@pytest.mark.mpi
def test_sharded_state_dict_belongs_to_its_rank(comm, lc):
    """A sharded optimizer's state_dict holds this rank's chunk: loaded on
    another rank, or into a run of another size, it must be refused (the
    same error on every rank), not silently applied to the wrong chunk.
    Its own state loads back."""
    model, opt = sharded(comm, lc)
    train(model, opt, comm.rank, 1)
    mine = opt.state_dict()
    everyone = comm.allgather(mine)
    opt.load_state_dict(everyone[comm.rank])        # its own: fine
    if comm.size > 1:
        message = all_ranks_raise(
            comm, lambda: opt.load_state_dict(everyone[(comm.rank + 1) % comm.size]),
            ValueError)
        assert "rank" in message, message
    solo = comm.Split(comm.rank, 0)
    try:
        with mpilossy.Communicator(solo, timeout=None) as alone:
            model1, opt1 = sharded(solo, alone)
            train(model1, opt1, comm.rank, 1)
            single = opt1.state_dict()
    finally:
        solo.Free()
    if comm.size > 1:
        message = all_ranks_raise(comm, lambda: opt.load_state_dict(single), ValueError)
        assert "size" in message, message
    # A plain optimizer's state of the same structure (one tensor as long as
    # this rank's chunk): torch would take it; it is not a chunk of this run.
    chunk = torch.nn.Parameter(torch.zeros(opt.param_groups[0]["params"][0].numel()))
    plain = torch.optim.Adam([chunk])
    chunk.grad = torch.ones_like(chunk)
    plain.step()
    all_ranks_raise(comm, lambda: opt.load_state_dict(plain.state_dict()), ValueError)
    train(model, opt, comm.rank, 1, first=1)        # still usable
    assert same_on_every_rank(comm, values(model))


# -- item 10: group averaging keeps float64 ------------------------------------------

@pytest.mark.mpi
def test_group_average_keeps_float64(comm):
    """float64 parameters that differ below float32's resolution average
    to the exact mean (they used to be averaged, and rounded, in float32);
    a float32 tensor beside them stays right too."""
    wide = torch.full((300,), 0.1 + 1e-12 * comm.rank, dtype=torch.float64)
    narrow = torch.full((50,), float(comm.rank), dtype=torch.float32)
    with mpilossy.GroupAverager(comm, group_size=2, timeout=None) as ga:
        for _ in range(max(1, ga.rounds_to_mix)):
            assert mt.group_average_parameters([("w", wide), ("n", narrow)], ga) == 1.0
    exact = 0.1 + 1e-12 * (comm.size - 1) / 2
    np.testing.assert_allclose(wide.numpy(), exact, rtol=1e-15, atol=0)
    assert wide.dtype == torch.float64
    np.testing.assert_allclose(narrow.numpy(), (comm.size - 1) / 2, rtol=1e-6)


# -- item 10: the DDP hook's error-feedback residuals follow the parameters --------------

class Chain(torch.nn.Module):
    """Four parameters used in another order than registered: DDP's buckets,
    made at first in registration order (all four in one), are rebuilt after
    the first backward pass in the order the gradients became ready ([d, b]
    and [c, a] with 4 KB buckets).  With constant parameters a, b, c, d =
    1, 2, 3, 4 the gradients are 24 x, 12 x, 8 x and 6 x."""

    FACTORS = {"a": 24.0, "b": 12.0, "c": 8.0, "d": 6.0}

    def __init__(self, n):
        super().__init__()
        for value, name in enumerate("abcd", 1):
            setattr(self, name, torch.nn.Parameter(torch.full((n,), float(value))))

    def forward(self, x):
        return (x * self.a * self.c * self.b * self.d).sum()


@pytest.fixture(scope="module")
def process_group():
    mt.init_process_group()
    yield
    mt.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_hook_residuals_survive_the_bucket_rebuild(comm, lc, process_group, background):
    """TopK with error feedback in the DDP hook, lossless: what compression
    holds back is sent later, so once the residuals are flushed (steps of
    zero gradient) the applied gradients sum exactly to the true average.
    Residuals keyed by bucket index broke that when DDP rebuilt its buckets
    after the first step (the index then names other parameters: the
    residual was dropped, or added to the wrong ones)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    n, steps, flush = 1024, 3, 4            # TopK(0.25): 4 zero steps empty a residual
    model = DDP(Chain(n), bucket_cap_mb=0.004)
    names = {id(p): name for name, p in model.module.named_parameters()}
    state = mt.AllreduceHookState(lc, compression=mt.TopK(0.25), background=background)
    compositions = []

    def hook(s, bucket):
        compositions[-1].append(tuple(names[id(p)] for p in bucket.parameters()))
        return mt.allreduce_hook(s, bucket)

    model.register_comm_hook(state, hook)
    applied = {name: torch.zeros(n, dtype=torch.float64) for name in names.values()}
    total_x = torch.zeros(n, dtype=torch.float64)
    for step in range(steps + flush):
        compositions.append([])
        x = torch.zeros(n)
        if step < steps:
            x = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + comm.rank))
        model.zero_grad()
        model(x).backward()
        for name, p in model.module.named_parameters():
            applied[name] += p.grad.double()
        everyone = torch.from_numpy(np.sum(comm.allgather(x.double().numpy()), axis=0))
        total_x += everyone / comm.size
    state.close()
    assert sorted(compositions[0]) != sorted(compositions[1]), compositions[:2]   # rebuilt
    for name, factor in Chain.FACTORS.items():
        torch.testing.assert_close(applied[name], factor * total_x, rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"parameter {name}: {m}")
