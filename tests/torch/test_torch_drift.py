"""Drift control: the meter measures what it says, the periodic broadcast
keeps the drift under a bound that does not grow with the number of steps
under 10% loss, and right after a broadcast the drift is exactly 0."""

import logging

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import backward, flat, gather_check, make_model, same_on_every_rank  # noqa: E402

LOSS = 0.1
TIMEOUT = 0.02
BLOCK = 512                 # bytes: about 27 blocks per call for the 13 KB model
CHECKED_STEPS = (20, 40, 80)
BOUND = 0.05                # relative drift, with a broadcast every 10 steps (measured: < 0.03)


def lossy(comm, seed=1):
    return mpilossy.Communicator(comm, timeout=TIMEOUT, block_bytes=BLOCK,
                                 loss=mpilossy.loss.Bernoulli(LOSS, seed=seed))


@pytest.mark.mpi
def test_meter_measures_relative_distance_from_the_average(comm):
    """Rank r holds base * (1 + r/10): the drift is known in closed form."""
    base = [torch.linspace(-1, 2, 30).reshape(5, 6), torch.arange(7.0)]
    mine = [t * (1 + comm.rank / 10) for t in base]
    got = mt.measure_drift(mine)
    x = np.concatenate([t.reshape(-1).numpy().astype(np.float64) for t in base])
    mean = x * np.mean([1 + r / 10 for r in range(comm.size)])
    want = max(np.linalg.norm(x * (1 + r / 10) - mean) for r in range(comm.size)) / np.linalg.norm(mean)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert (got > 0) == (comm.size > 1)
    assert mt.measure_drift(base) == 0.0          # identical parameters: exactly 0


@pytest.mark.mpi(min_size=2)
def test_drift_bounded_with_periodic_broadcast(comm):
    drift, checks = {}, []
    for broadcast_every in (10, None):
        lc = lossy(comm)
        model = make_model()
        opt = mt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(), lc, measure_every=10,
            broadcast_every=broadcast_every, broadcast_state=True)
        losses, delivered, broadcasts = [], [], []
        for step in range(1, CHECKED_STEPS[-1] + 1):
            opt.zero_grad()
            losses.append(backward(model, comm.rank, step))
            opt.step()
            stats = opt.stats
            delivered.append(stats.delivered)
            broadcasts.append(stats.broadcast)
            if step in CHECKED_STEPS:
                drift[broadcast_every, step] = stats.drift
        control = opt.drift_control
        after = control.measure()              # right after the broadcast of step 80
        momentum = flat([opt.state[p]["momentum_buffer"] for p in model.parameters()])
        same_momentum = same_on_every_rank(comm, momentum)
        lc.free()
        checks += [(np.isfinite(flat(model)).all(), "parameters finite"),
                   (np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), "training progressed"),
                   (min(delivered) < 1.0, "something was lost (else the test proves nothing)")]
        if broadcast_every:
            checks += [(after == 0.0, f"drift right after a broadcast is {after!r}, not 0"),
                       (same_momentum, "broadcast_state=True: same momentum everywhere"),
                       (broadcasts == [s % 10 == 0 for s in range(1, 81)], "broadcast steps"),
                       (control.broadcasts == 8 and control.broadcast_seconds > 0, "cost")]
    gather_check(comm, all(ok for ok, _ in checks), [why for ok, why in checks if not ok])
    bounded = [drift[10, s] for s in CHECKED_STEPS]
    assert all(0 < d < BOUND for d in bounded), f"drift at steps {CHECKED_STEPS}: {bounded}"
    # Without the broadcast the ranks drift further apart.
    assert drift[None, 80] > 2 * drift[10, 80], drift


@pytest.mark.mpi(min_size=2)
def test_drift_controller_with_ddp_style_loop(comm, caplog):
    """The controller on its own (as with the DDP hook): broadcast every 5
    steps of the parameters and buffers of a module; drift logged."""
    caplog.set_level(logging.INFO, logger="mpilossy.torch")
    model = make_model()
    model.register_buffer("seen", torch.zeros(3))
    lc = lossy(comm, seed=5)
    params = list(model.parameters())
    control = mt.DriftController(model, comm=lc, broadcast_every=5, measure_every=5)
    opt = torch.optim.SGD(params, lr=0.1)
    reports = []
    for step in range(1, 16):
        opt.zero_grad()
        backward(model, comm.rank, step)
        for p in params:
            lc.allreduce(p.grad, op="avg")
        opt.step()
        model.seen += comm.rank
        reports.append(control.step())
    assert [r.broadcast for r in reports] == [s % 5 == 0 for s in range(1, 16)]
    assert [r.drift is not None for r in reports] == [s % 5 == 0 for s in range(1, 16)]
    assert control.history[-1] == (15, reports[-1].drift)
    assert control.measure() == 0.0
    assert model.seen.tolist() == [0.0, 0.0, 0.0]     # rank 0's buffer, broadcast too
    lc.free()
    logged = [r.getMessage() for r in caplog.records if "drift" in r.getMessage()]
    assert len(logged) == (4 if comm.rank == 0 else 0), logged      # the root logs
    assert logged == [] or logged[0].startswith("step 5: drift ")


@pytest.mark.mpi
def test_bad_periods_raise_everywhere(comm, lc):
    from helpers import all_ranks_raise
    model = make_model()
    bad = 0 if comm.rank == comm.size - 1 else 10
    all_ranks_raise(comm, lambda: mt.DriftController(model, comm=lc, broadcast_every=bad),
                    ValueError)
    different = 10 + comm.rank
    if comm.size > 1:
        all_ranks_raise(comm, lambda: mt.DriftController(model, comm=lc,
                                                         measure_every=different),
                        mpilossy.MismatchError)
