"""Loss injection: seeded, reproducible, at the requested rates, and settable
from the environment so that an unmodified program runs under loss."""

import numpy as np
import pytest

import mpilossy
from mpilossy.loss import Bernoulli, GilbertElliott, Straggler, parse


# -- the models as values -------------------------------------------------------
def test_parse_positional_and_named():
    assert parse("bernoulli:0.1") == [Bernoulli(0.1)]
    assert parse("bernoulli:p=0.2,seed=3") == [Bernoulli(0.2, seed=3)]
    assert parse("gilbert-elliott:p_good_to_bad=0.01,p_bad_to_good=0.5") == [
        GilbertElliott(0.01, 0.5)]
    assert parse("straggler:rank=1,delay=0.02,prob=0.05") == [Straggler(1, 0.02, 0.05)]
    assert parse("bernoulli:0.05+straggler:rank=0,delay=0.01") == [
        Bernoulli(0.05), Straggler(0, 0.01)]
    assert parse("") == []


@pytest.mark.parametrize("text", ["bernoulli:1.5", "bernoulli:p=-0.1", "nosuch:1",
                                  "bernoulli:q=0.1", "straggler:rank=0,delay=-1",
                                  "bernoulli:0.1+bernoulli:0.2"])
def test_bad_models_are_rejected(text):
    with pytest.raises((ValueError, TypeError)):
        mpilossy.loss.to_spec(parse(text))


def test_gilbert_elliott_mean_loss():
    ge = GilbertElliott(p_good_to_bad=0.1, p_bad_to_good=0.4, loss_bad=1.0)
    assert ge.mean_loss == pytest.approx(0.2)


# -- the models at work -----------------------------------------------------------
def lost_fraction(comm, model, calls=300, n=4096, block=512, timeout=0.02):
    """Fraction of blocks this rank's loss model dropped, and the results."""
    injected = blocks = 0
    results = []
    with mpilossy.Communicator(comm, timeout=timeout, loss=model, block_bytes=block) as lc:
        for call in range(calls):
            x = np.full(n, float(comm.rank + call))
            out = np.empty_like(x)
            stats = lc.allreduce(x, out, algorithm="ring")
            injected += stats.lost_blocks[0]
            results.append(out)
        # blocks this rank reads per call: (size - 1) reduce-scatter streams and
        # (size - 1) gather streams of ceil(chunk / block) blocks each
        chunk = -(-n // comm.size) * 8
        blocks = calls * 2 * (comm.size - 1) * -(-chunk // block)
    return injected / blocks, np.array(results)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("p", [0.05, 0.2])
def test_bernoulli_rate(comm, p):
    rate, _ = lost_fraction(comm, Bernoulli(p, seed=5))
    rates = comm.allgather(rate)
    blocks_per_rank = 300 * 2 * (comm.size - 1) * 4
    tol = 5 * np.sqrt(p * (1 - p) / blocks_per_rank)
    assert all(abs(r - p) < tol for r in rates), (rates, tol)


@pytest.mark.mpi(min_size=2)
def test_same_seed_same_losses_other_seed_other_losses(comm):
    a, ra = lost_fraction(comm, Bernoulli(0.2, seed=9), calls=60)
    b, rb = lost_fraction(comm, Bernoulli(0.2, seed=9), calls=60)
    c, _ = lost_fraction(comm, Bernoulli(0.2, seed=10), calls=60)
    # Injected losses are decided from counters, so the same seed repeats them.
    # (Results may still differ where a block was late, which timing decides.)
    outcome = comm.allgather((a, b, c))
    assert all(x == y for x, y, _ in outcome)
    assert any(x != z for x, _, z in outcome)


@pytest.mark.mpi(min_size=2)
def test_gilbert_elliott_bursts(comm):
    """Same mean loss as a Bernoulli model, but lost blocks come in runs."""
    ge = GilbertElliott(p_good_to_bad=0.02, p_bad_to_good=0.2, loss_bad=1.0, seed=2)
    calls, runs, lost, total = 200, 0, 0, 0
    with mpilossy.Communicator(comm, timeout=0.02, loss=ge, block_bytes=64) as lc:
        for _ in range(calls):
            x = np.ones(2048)
            stats = lc.allreduce(x, np.empty_like(x), algorithm="ring")
            lost += stats.lost_blocks[0]
    chunk_blocks = -(-(-(-2048 // comm.size) * 8) // 64)
    total = calls * 2 * (comm.size - 1) * chunk_blocks
    rate = comm.allreduce(lost) / comm.allreduce(total)
    assert abs(rate - ge.mean_loss) < 0.5 * ge.mean_loss, rate


@pytest.mark.mpi(min_size=2)
def test_gilbert_elliott_is_burstier_than_bernoulli(comm):
    """Calls under a burst model lose many blocks at once: the spread of
    per-call losses is far larger than for independent losses of equal rate."""
    def per_call_losses(model):
        counts = []
        with mpilossy.Communicator(comm, timeout=0.02, loss=model, block_bytes=64) as lc:
            for _ in range(150):
                x = np.ones(2048)
                counts.append(lc.allreduce(x, np.empty_like(x), algorithm="ring").lost_blocks[0])
        return np.array(counts, float)
    ge = per_call_losses(GilbertElliott(0.02, 0.1, seed=4))
    be = per_call_losses(Bernoulli(GilbertElliott(0.02, 0.1).mean_loss, seed=4))
    ratio = comm.allgather(ge.var() / max(ge.mean(), 1e-9) / max(be.var() / max(be.mean(), 1e-9), 1e-9))
    assert min(ratio) > 2, ratio


@pytest.mark.mpi(min_size=2)
def test_straggler_sleeps_only_on_its_rank(comm):
    delay = 0.05
    model = Straggler(rank=0, delay=delay, prob=1.0)
    with mpilossy.Communicator(comm, timeout=0.01, loss=model) as lc:
        stats = lc.allreduce(np.ones(16))
    slept = comm.allgather(stats.elapsed >= delay)
    assert slept[0] and not any(slept[1:])


@pytest.mark.mpi(min_size=2)
def test_environment_variable(comm, monkeypatch):
    monkeypatch.setenv("MPILOSSY_LOSS", "bernoulli:p=0.5,seed=1")
    monkeypatch.setenv("MPILOSSY_TIMEOUT", "0.01")
    with mpilossy.Communicator(comm) as lc:
        assert lc.loss == [Bernoulli(0.5, seed=1)] and lc.timeout == 0.01
        lost = sum(lc.allreduce(np.ones(4096), algorithm="ring").lost_blocks[0]
                   for _ in range(20))
    assert comm.allreduce(lost) > 0
    monkeypatch.delenv("MPILOSSY_LOSS")
    with mpilossy.Communicator(comm, timeout=0.01) as lc:
        assert lc.loss == []


@pytest.mark.mpi
def test_loss_without_deadline_is_noticed_at_once(comm):
    """timeout=None with a loss model: nothing to wait for, the call returns."""
    with mpilossy.Communicator(comm, timeout=None, loss=Bernoulli(0.5, seed=3)) as lc:
        x = np.full(1000, 2.0)
        out = np.empty_like(x)
        stats = lc.allreduce(x, out, op="avg")
    np.testing.assert_array_equal(out, 2.0)       # avg of twos, however many arrived
    assert stats.elapsed < 5
