"""Error feedback and averaging re-synchronisation.

The error-feedback invariant: over many lossy steps, what every rank's
gradients contributed to the applied results equals the sum of the true
gradients minus the residual still held.  With SGD (lr 1, no momentum) the
applied results are the parameters' total change, so the check needs no
access to the library's internals."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import make_model  # noqa: E402

STEPS = 25


def lossy(comm, scaling="zero-fill", p=0.3):
    # Small blocks: many of them per step, so that losses land everywhere.
    return mpilossy.Communicator(comm, timeout=0.2, loss=f"bernoulli:p={p},seed=7",
                                 block_bytes=256, scaling=scaling)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def set_gradients(model, rank, step):
    """Rank- and step-dependent float64 gradients, never exactly zero."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    for p in model.parameters():
        p.grad = torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5


def total(comm, tensor):
    out = np.empty(tensor.numel())
    comm.Allreduce(tensor.numpy(), out, op=MPI.SUM)
    return torch.from_numpy(out)


def residual_flat(opt):
    residual = opt.error_feedback.residual()
    assert list(residual) == [torch.float64]
    return residual[torch.float64]


def run(comm, lc, model, opt, steps=STEPS):
    """Train with the given gradients; return (sum of this rank's true
    gradients, fraction of contributions delivered over the run)."""
    true_sum = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    delivered = []
    for step in range(steps):
        set_gradients(model, comm.rank, step)
        true_sum += torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()
        delivered.append(opt.stats.delivered)
    return true_sum, float(np.mean(delivered))


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("feedback", [True, False])
def test_sharded_contributions_add_up(comm, feedback):
    """The owner's chunk has moved by exactly (sum of true gradients - sum of
    residuals) / size; without feedback it has not (the check can fail)."""
    with lossy(comm) as lc:
        model = make_model(dtype=torch.float64)
        opt = mt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                  model.named_parameters(), lc, error_feedback=feedback)
        before = flat_params(model)
        true_sum, delivered = run(comm, lc, model, opt)
        moved = (before - flat_params(model)) * comm.size
        held = residual_flat(opt) if feedback else torch.zeros_like(true_sum)
        expected = total(comm, true_sum - held)
        lo, hi = lc.chunk_bounds(before.numel())
        # (reduced over ranks before asserting: every rank fails alike)
        gap = comm.allreduce(float((moved[lo:hi] - expected[lo:hi]).abs().max()
                                   / expected[lo:hi].abs().max()), op=MPI.MAX)
        delivered = comm.allreduce(delivered, op=MPI.MAX)
        held = float(total(comm, held).abs().max())
        if comm.size == 1:
            assert delivered == 1.0 and gap <= 1e-9
            return
        assert delivered < 0.95, "the injected loss did not bite"
        if feedback:
            assert gap <= 1e-9, f"contributions and gradients differ by {gap:.2e} (relative)"
            assert held > 0                                     # something is still held
        else:
            assert gap > 1e-3


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_replicated_contributions_add_up(comm):
    """The agreed result (the value of every rank that received the block;
    a rank that missed it applies zeros) sums to the true gradients minus
    the residuals."""
    with lossy(comm) as lc:
        model = make_model(dtype=torch.float64)
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                      model.named_parameters(), lc, bucket_bytes=4096,
                                      error_feedback=True)
        n = sum(p.numel() for p in model.parameters())
        true_sum, agreed_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        fallbacks = 0.0
        for step in range(STEPS):
            set_gradients(model, comm.rank, step)
            true_sum += torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            opt.step()
            applied = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
            high, low = np.empty(n), np.empty(n)
            comm.Allreduce(applied, high, op=MPI.MAX)
            comm.Allreduce(applied, low, op=MPI.MIN)
            # Gradients here are positive: a missed block is 0, the agreed value > 0.
            assert (low >= 0).all()         # (the same arrays on every rank)
            agreed_sum += torch.from_numpy(high)
            fallbacks += opt.stats.fallback
        expected = total(comm, true_sum - residual_flat(opt))
        gap = float((agreed_sum * comm.size - expected).abs().max() / expected.abs().max())
        gap = comm.allreduce(gap, op=MPI.MAX)
        fallbacks = comm.allreduce(fallbacks)
        assert gap <= 1e-9, f"differ by {gap:.2e} (relative)"
        if comm.size > 1:
            assert fallbacks > 0, "no rank ever missed a reduced block"


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_feedback_settings_are_checked_everywhere(comm):
    model = make_model()
    with mpilossy.Communicator(comm, timeout=0.5, loss=None) as unbiased:
        with pytest.raises(ValueError, match="zero-fill"):
            mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), unbiased, error_feedback=True)
        with pytest.raises(ValueError, match="zero-fill"):
            mt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), unbiased, error_feedback=True)
    with mpilossy.Communicator(comm, timeout=0.5, loss=None, scaling="zero-fill") as lc:
        with pytest.raises(TypeError, match="error_feedback must be a bool"):
            mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), lc, error_feedback=1)
        with pytest.raises(ValueError, match="do not combine"):
            mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), lc, error_feedback=True,
                                    tolerance=mt.PhaseAwareTolerance(critical_steps=2))
        if comm.size > 1:       # one rank asking for it alone: every rank raises
            with pytest.raises(mpilossy.MismatchError):
                mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters(), lc,
                                        error_feedback=comm.rank == comm.size - 1)
        with pytest.raises(ValueError, match="resync must be"):
            mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), lc, resync="median")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_lossless_feedback_is_plain_training(comm):
    """Nothing lost: the residual stays exactly zero and the result is the
    exact average."""
    with mpilossy.Communicator(comm, timeout=None, loss=None, scaling="zero-fill") as lc:
        model = make_model(dtype=torch.float64)
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                      model.named_parameters(), lc, error_feedback=True)
        before = flat_params(model)
        true_sum, delivered = run(comm, lc, model, opt, steps=5)
        assert delivered == 1.0
        assert float(residual_flat(opt).abs().max()) == 0.0
        moved = (before - flat_params(model)) * comm.size
        assert torch.allclose(moved, total(comm, true_sum), rtol=1e-12, atol=0)


# -- averaging re-synchronisation ------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_average_parameters_and_state(comm):
    model = make_model(seed=comm.rank, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    set_gradients(model, comm.rank, 0)
    opt.step()                          # each rank on its own: states differ
    expected = total(comm, flat_params(model)) / comm.size
    moments = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    expected_moments = total(comm, moments) / comm.size
    mt.average_parameters(model, comm=comm)
    mt.average_optimizer_state(opt, comm=comm)
    assert torch.allclose(flat_params(model), expected, rtol=1e-12, atol=1e-15)
    got = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    assert torch.allclose(got, expected_moments, rtol=1e-12, atol=1e-15)
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())
    assert mt.measure_drift(model, comm=comm) <= 1e-15


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_average_state_structure_must_agree(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = make_model(dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if comm.rank == 0:                  # only rank 0 has state
        set_gradients(model, 0, 0)
        opt.step()
    with pytest.raises(mpilossy.MismatchError):
        mt.average_optimizer_state(opt, comm=comm)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_drift_controller_averages(comm):
    """resync="average" gives every rank the mean of the ranks' parameters
    and momenta (a broadcast would give rank 0's)."""
    model = make_model(seed=comm.rank, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    set_gradients(model, comm.rank, 0)
    opt.step()
    expected = total(comm, flat_params(model)) / comm.size
    momenta = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                         for p in model.parameters()])
    expected_momenta = total(comm, momenta) / comm.size
    rank0 = torch.from_numpy(comm.bcast(flat_params(model).numpy(), root=0))
    control = mt.DriftController(model, comm=comm, broadcast_every=1, optimizer=opt,
                                 resync="average")
    assert control.step().broadcast
    assert torch.allclose(flat_params(model), expected, rtol=1e-12, atol=1e-15)
    got = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    assert torch.allclose(got, expected_momenta, rtol=1e-12, atol=1e-15)
    if comm.size > 1:       # not what a broadcast from rank 0 would give
        assert not torch.allclose(expected, rank0)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_resync_average_under_loss(comm):
    """Through the wrapper: drift measured before, zero right after."""
    with lossy(comm, scaling="unbiased", p=0.2) as lc:
        model = make_model(dtype=torch.float64)
        opt = mt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      model.named_parameters(), lc, broadcast_every=5,
                                      measure_every=4, broadcast_state=True, resync="average")
        for step in range(10):
            set_gradients(model, comm.rank, step)
            opt.step()
        control = opt.drift_control
        assert control.broadcasts == 2 and control.resync == "average"
        if comm.size > 1:
            assert max(d for _, d in control.history) > 0       # it did drift before
        assert mt.measure_drift(model, comm=comm) <= 1e-14
