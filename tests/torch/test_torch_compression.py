"""Gradient compression in mpilossy.torch (LowBit, aligned TopK): the
optimizers and the hook run with it and keep the ranks' models the same,
and settings that do not combine fail on every rank.  (The compressors
themselves: test_compressors.py.)"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from helpers import all_ranks_raise  # noqa: E402
from torch_helpers import backward, flat, make_model, same_on_every_rank  # noqa: E402


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


@pytest.mark.mpi
def test_topk_works_with_an_elastic_communicator(comm):
    """(Its block choice is a bounded wait there.)  Every wrapper takes it,
    and a step gives what the same step gives on a plain communicator."""
    results = []
    for elastic in (True, False):
        model, other = make_model(), make_model()
        with mpilossy.Communicator(comm, timeout=0.5, elastic=elastic) as lc:
            opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model.named_parameters(), lc,
                                          compression=mt.TopK(0.1))
            backward(model, comm.rank, 0)
            opt.step()
            mt.ShardedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                other.named_parameters(), lc, compression=mt.TopK(0.1))
            mt.AllreduceHookState(lc, compression=mt.TopK(0.1))
        results.append(flat(model))
    # (the same step; sums in another order: an ulp apart)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(results[0], flat(make_model()))     # (the step did move it)