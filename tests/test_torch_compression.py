"""Gradient compression in mpilossy.torch (LowBit, aligned TopK): the same
blocks on every rank, what is sent plus what is kept is the gradient (error
feedback), the optimizers and the hook run with it and keep the ranks'
models the same, and bad settings fail on every rank."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from helpers import all_ranks_raise  # noqa: E402
from torch_helpers import backward, flat, make_model, same_on_every_rank  # noqa: E402


def grad(rank, n, step=0):
    """Each rank's gradient: a shared part with a few strong blocks, and its own noise."""
    rng = np.random.default_rng([step, 99])
    shared = rng.standard_normal(n) * np.repeat(rng.random(-(-n // 64)) ** 4, 64)[:n]
    own = np.random.default_rng([step, rank]).standard_normal(n) * 0.1
    return (shared + own).astype(np.float32)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 1000, 10_007])
def test_topk_sends_the_same_blocks_and_keeps_the_rest(comm, n):
    topk = mt.TopK(0.1, block=64)
    with mpilossy.Communicator(comm, timeout=None) as lc:
        g = grad(comm.rank, n)
        data = g.copy()
        topk.allreduce(lc, "k", data, op="avg")
    nonzero = np.flatnonzero(data)
    assert same_on_every_rank(comm, nonzero.astype(np.float64))
    blocks = np.unique(nonzero // 64)
    assert blocks.size == min(-(-n // 64), max(1, -(-(-(-n // 64)) // 10)))
    mean = comm.allreduce(g.astype(np.float64)) / comm.size
    np.testing.assert_allclose(data[nonzero], mean[nonzero], rtol=1e-5, atol=1e-6)
    residual = topk.residual("k")
    sent = np.zeros(n, bool)
    sent[nonzero] = True
    assert not residual[sent].any()
    np.testing.assert_array_equal(residual[~sent], g[~sent])
    # the chosen blocks hold the most energy (max over ranks): none left out is larger
    energy = np.square(np.pad(g.astype(np.float64), (0, -n % 64))).reshape(-1, 64).sum(axis=1)
    comm.Allreduce(MPI.IN_PLACE, energy, op=MPI.MAX)
    chosen = np.zeros(energy.size, bool)
    chosen[blocks] = True
    if (~chosen).any():
        assert energy[chosen].min() >= energy[~chosen].max()


@pytest.mark.mpi
@pytest.mark.parametrize("make", [lambda: mt.TopK(0.05), lambda: mt.LowBit("int4")],
                         ids=["topk", "int4"])
def test_error_feedback_sends_every_gradient_eventually(comm, make):
    """Lossless: the sum of the reduced gradients over steps is the sum of the
    true averages less the average residual still held (nothing is lost)."""
    compressor = make()
    n, steps = 5000, 12
    total = np.zeros(n)
    truth = np.zeros(n)
    with mpilossy.Communicator(comm, timeout=None, rotate=False) as lc:
        for step in range(steps):
            g = grad(comm.rank, n, step)
            truth += comm.allreduce(g.astype(np.float64)) / comm.size
            lo, hi = lc.chunk_bounds(n)
            out = np.empty(hi - lo, np.float32)
            compressor.reduce_scatter(lc, "g", g.copy(), out, op="avg")
            total[lo:hi] += out
        held = comm.allreduce(compressor.residual("g").astype(np.float64)) / comm.size
    np.testing.assert_allclose(total[lo:hi], (truth - held)[lo:hi], rtol=1e-4, atol=1e-4)
    # and without feedback the same sum misses what was left out
    if comm.size > 1 or isinstance(compressor, mt.TopK):
        assert np.abs(held).max() > 1e-3


@pytest.mark.mpi
@pytest.mark.parametrize("compression", [mt.TopK(1.0), mt.LowBit("int8")], ids=repr)
@pytest.mark.parametrize("wrapper", ["sharded", "replicated"])
def test_optimizers_train_with_compression(comm, wrapper, compression):
    torch.manual_seed(0)
    model = make_model()
    before = flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lc = mpilossy.Communicator(comm, timeout=None, rotate=False)
    if wrapper == "sharded":
        opt = mt.ShardedOptimizer(opt, model.named_parameters(), lc, compression=compression)
    else:
        opt = mt.DistributedOptimizer(opt, model.named_parameters(), lc, compression=compression)
    losses = []
    for step in range(6):
        opt.zero_grad()
        losses.append(backward(model, comm.rank, step))
        opt.step()
    after = flat(model)
    assert same_on_every_rank(comm, after)
    assert not np.array_equal(before, after)
    assert opt.stats.delivered == 1.0
    lc.free()


@pytest.mark.mpi
def test_topk_density_one_is_the_plain_average(comm):
    with mpilossy.Communicator(comm, timeout=None) as lc:
        g = grad(comm.rank, 3000)
        data = g.copy()
        mt.TopK(1.0, error_feedback=False).allreduce(lc, 0, data, op="avg")
        plain = g.copy()
        lc.allreduce(plain, op="avg", algorithm="direct")
    np.testing.assert_allclose(data, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=2)
def test_hook_with_topk_keeps_models_the_same(comm):
    from torch.nn.parallel import DistributedDataParallel as DDP
    mt.init_process_group()
    try:
        lc = mpilossy.Communicator(comm, timeout=None)
        model = DDP(make_model(), bucket_cap_mb=0.004)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = mt.AllreduceHookState(lc, compression=mt.TopK(0.25))
        model.register_comm_hook(state, mt.allreduce_hook)
        for step in range(4):
            opt.zero_grad()
            backward(model, comm.rank, step)
            opt.step()
        assert same_on_every_rank(comm, flat(model))
        assert len(state.compression.residuals) == len(state.bucket_stats) >= 2
        lc.free()
    finally:
        mt.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.parametrize("make,exc", [
    (lambda: mt.TopK(0.0), ValueError), (lambda: mt.TopK(1.5), ValueError),
    (lambda: mt.TopK(0.1, block=0), ValueError), (lambda: mt.LowBit("int2"), ValueError),
    (lambda: mt.LowBit("int8", error_feedback=1), TypeError)])
def test_bad_compressors(make, exc):
    with pytest.raises(exc):
        make()


@pytest.mark.mpi
def test_compression_with_loss_feedback_or_a_stranger_fails_everywhere(comm):
    model = make_model()
    lc = mpilossy.Communicator(comm, timeout=None, scaling="zero-fill")
    for kwargs, exc in [({"compression": mt.TopK(0.1), "error_feedback": True}, ValueError),
                        ({"compression": "int8"}, TypeError)]:
        # (one rank alone asks for it: every rank raises)
        mine = kwargs if comm.rank == comm.size - 1 else {}
        for wrap in (mt.ShardedOptimizer, mt.DistributedOptimizer):
            all_ranks_raise(comm, lambda: wrap(torch.optim.SGD(model.parameters(), lr=0.1),
                                               model.named_parameters(), lc, **mine), exc)
    lc.free()
