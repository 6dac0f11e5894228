"""Phase-aware loss tolerance: tight early (reliable, exact gradients), loose
later (lossy), repairs when a step loses more than it may, and every rank
takes the same decision."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import (backward, flat, gather_check, make_model, reliable_average,  # noqa: E402
                           same_on_every_rank)


def test_schedule_is_tight_then_ramps_to_late():
    policy = mt.PhaseAwareTolerance(critical_steps=3, ramp_steps=2, early=0.0, late=0.5)
    got = [policy.begin() for _ in range(7)]
    assert got == [0.0, 0.0, 0.0, 0.25, 0.5, 0.5, 0.5]


@pytest.mark.parametrize("bad", [dict(critical_steps=-1), dict(early=1.5), dict(late=-0.1),
                                 dict(grad_norm_threshold=0), dict(window=0),
                                 dict(critical_steps=True)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        mt.PhaseAwareTolerance(**bad)


def grads_after_step(comm, opt, model, step):
    opt.zero_grad()
    backward(model, comm.rank, step)
    opt.step()
    return np.concatenate([p.grad.detach().numpy().ravel() for p in model.parameters()])


def reference_grads(comm, step):
    ref = make_model()
    backward(ref, comm.rank, step)
    reliable_average(comm, list(ref.parameters()))
    return np.concatenate([p.grad.detach().numpy().ravel() for p in ref.parameters()])


@pytest.mark.mpi
def test_critical_phase_is_exact_and_later_phase_lossy(comm):
    # 30% of blocks lost: a lossy step almost surely loses something at 2+ ranks.
    with mpilossy.Communicator(comm, timeout=0.05, loss=mpilossy.loss.Bernoulli(0.3, seed=4),
                               block_bytes=256) as lc:
        model = make_model()
        policy = mt.PhaseAwareTolerance(critical_steps=2)
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      model.named_parameters(), lc, tolerance=policy)
        exact = [np.allclose(grads_after_step(comm, opt, model, s), reference_grads(comm, s),
                             rtol=1e-5, atol=1e-6) for s in range(4)]
        reliable = [opt.stats.reliable]
    gather_check(comm, exact[:2] == [True, True], f"critical steps exact: {exact}")
    assert policy.reliable == 2 and policy.repaired == 0
    if comm.size > 1:
        gather_check(comm, not reliable[0], "a late step went reliable")


@pytest.mark.mpi
def test_step_losing_more_than_its_tolerance_is_repaired(comm):
    with mpilossy.Communicator(comm, timeout=0.05, loss=mpilossy.loss.Bernoulli(0.3, seed=5),
                               block_bytes=256) as lc:
        model = make_model()
        policy = mt.PhaseAwareTolerance(critical_steps=0, late=0.01)
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      model.named_parameters(), lc, tolerance=policy)
        exact = [np.allclose(grads_after_step(comm, opt, model, s), reference_grads(comm, s),
                             rtol=1e-5, atol=1e-6) for s in range(3)]
        repaired = policy.repaired
    # Every rank decided alike, and every step ended exact.
    gather_check(comm, all(exact), f"steps exact: {exact}")
    assert same_on_every_rank(comm, np.array([repaired]))
    if comm.size > 1:
        assert repaired == 3, repaired      # 30% loss is always more than 1%
    assert same_on_every_rank(comm, flat(model))


@pytest.mark.mpi
def test_gradient_norm_signal_ends_the_critical_phase_on_every_rank(comm):
    with mpilossy.Communicator(comm, timeout=None) as lc:
        model = make_model()
        policy = mt.PhaseAwareTolerance(critical_steps=0, grad_norm_threshold=1e9, window=2)
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                      model.named_parameters(), lc, tolerance=policy)
        for step in range(8):
            grads_after_step(comm, opt, model, step)
    # Any finite change is below a threshold of 1e9: the phase ends at the
    # first vote (after two full windows), the same step everywhere.
    assert policy.critical_ended == 5
    assert same_on_every_rank(comm, np.array([policy.critical_ended, policy.reliable]))
    assert policy.reliable == 5


@pytest.mark.mpi
def test_not_a_policy_raises_on_every_rank(comm, lc):
    from helpers import all_ranks_raise
    model = make_model()
    bad = "phase-aware" if comm.rank == 0 else None
    all_ranks_raise(comm, lambda: mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), lc,
        tolerance=bad), TypeError)


@pytest.mark.mpi
def test_reliable_steps_reduce_float16_gradients(comm, lc):
    # Not every MPI has a half type: the reliable path must average float16 anyway.
    model = make_model(dtype=torch.float16)
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  model.named_parameters(), lc,
                                  tolerance=mt.PhaseAwareTolerance(critical_steps=1))
    got = grads_after_step(comm, opt, model, 0)
    ref = make_model(dtype=torch.float16)
    backward(ref, comm.rank, 0)
    local = np.concatenate([p.grad.detach().numpy().ravel() for p in ref.parameters()])
    want = sum(comm.allgather(local.astype(np.float64))) / comm.size
    gather_check(comm, opt.stats.reliable and np.allclose(got, want, rtol=1e-2, atol=1e-3),
                 f"largest difference {np.abs(got - want).max():.3g}")


@pytest.mark.mpi
@pytest.mark.parametrize("reliable", [False, True], ids=["lossy", "reliable"])
def test_bfloat16_gradients_are_averaged(comm, lc, reliable):
    """bfloat16 gradients: the lossy path (float32 sums in the core, one
    rounding) and the reliable one (MPI through float32) average them, to
    bfloat16's precision (2^-8 relative, on the largest gradient)."""
    model = make_model(dtype=torch.bfloat16)
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  model.named_parameters(), lc,
                                  tolerance=mt.PhaseAwareTolerance(critical_steps=1)
                                  if reliable else None)
    opt.zero_grad()
    backward(model, comm.rank, 0)
    opt.step()
    got = np.concatenate([p.grad.float().numpy().ravel() for p in model.parameters()])
    ref = make_model(dtype=torch.bfloat16)
    backward(ref, comm.rank, 0)
    local = np.concatenate([p.grad.float().numpy().ravel() for p in ref.parameters()])
    want = sum(comm.allgather(local.astype(np.float64))) / comm.size
    error = np.abs(got - want)
    gather_check(comm, opt.stats.reliable == reliable
                 and (error <= 2.0 ** -8 * np.abs(want) + 2.0 ** -9 * np.abs(want).max()).all(),
                 f"reliable {opt.stats.reliable}, largest error {error.max():.3g}")


def test_redundancy_target_applies_while_the_tolerance_is_tight():
    policy = mt.PhaseAwareTolerance(critical_steps=2, ramp_steps=2, early=0.2,
                                    redundancy_target=0.001)
    got = []
    for _ in range(6):
        policy.begin()
        got.append(policy.redundancy_target_now())
    assert got == [0.001] * 3 + [None] * 3      # critical phase and ramp (< late), then none
    assert mt.PhaseAwareTolerance().redundancy_target_now() is None


@pytest.mark.parametrize("bad", [0, 1, -0.5, "0.01", True])
def test_bad_redundancy_targets_are_refused(bad):
    with pytest.raises(ValueError, match="redundancy_target"):
        mt.PhaseAwareTolerance(redundancy_target=bad)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_critical_phase_raises_auto_redundancy(comm):
    """redundancy="auto" at 10% loss: once the loss rate is agreed, the
    critical steps carry more parity (their lower target) than the later
    ones, on every rank alike."""
    from mpilossy import _core
    from mpilossy.control.deadline import LAG, PERIOD
    if not _core.HAVE_ISAL:
        pytest.skip("m >= 2 needs a build with Intel ISA-L (libisal-dev)")
    critical = PERIOD + LAG + 6
    with mpilossy.Communicator(comm, timeout=0.5, loss=mpilossy.loss.Bernoulli(0.1, seed=6),
                               block_bytes=256, redundancy="auto") as lc:
        model = make_model()
        policy = mt.PhaseAwareTolerance(critical_steps=critical, early=0.9,
                                        redundancy_target=0.001)
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      model.named_parameters(), lc, tolerance=policy)
        codes = []
        real = lc.allreduce

        def spy(*args, **kwargs):
            stats = real(*args, **kwargs)
            codes.append(stats.redundancy)
            return stats
        lc.allreduce = spy
        for step in range(critical + 6):
            grads_after_step(comm, opt, model, step)
    assert len(codes) == critical + 6           # one call per step (one bucket)
    assert all(c == codes for c in comm.allgather(codes))
    if comm.size == 1:
        assert set(codes) == {None}
        return
    raised, later = set(codes[PERIOD + LAG:critical]), set(codes[critical:])
    assert len(raised) == 1 and len(later) == 1, (raised, later)
    (k, m_raised), (_, m_later) = raised.pop(), later.pop()
    assert m_raised > m_later >= 1


@pytest.mark.mpi
def test_redundancy_target_needs_an_auto_communicator(comm, lc):
    from helpers import all_ranks_raise
    model = make_model()
    message = all_ranks_raise(comm, lambda: mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), lc,
        tolerance=mt.PhaseAwareTolerance(redundancy_target=0.01)), ValueError)
    assert "redundancy='auto'" in message
