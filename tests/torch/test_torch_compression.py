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
def test_topk_with_an_elastic_communicator_fails_everywhere(comm):
    """(mpilossy.compression.TopK.refusal: its block choice cannot survive a
    lost rank.)  Every wrapper says so at construction, on every rank."""
    model = make_model()
    with mpilossy.Communicator(comm, timeout=0.5, elastic=True) as lc:
        for wrap in (mt.ShardedOptimizer, mt.DistributedOptimizer):
            message = all_ranks_raise(
                comm, lambda: wrap(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), lc, compression=mt.TopK(0.1)),
                ValueError)
            assert "elastic=True" in message
        message = all_ranks_raise(comm, lambda: mt.AllreduceHookState(
            lc, compression=mt.TopK(0.1)), ValueError)
        assert "elastic=True" in message
