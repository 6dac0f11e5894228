"""Low-bit payloads (compression="int8"/"int4"): float32 values travel
quantised per group with a scale each and stochastic rounding.  Close to the
exact result without loss and the same on every rank; unbiased over calls;
a lost block changes only its own values; composes with weights; fewer bytes
per value on the wire; bad settings fail on every rank."""

import numpy as np
import pytest

import mpilossy
from helpers import all_ranks_raise, check_weighted_signatures

BITS = {"int8": 8, "int4": 4}


def data(rank, n, seed=0):
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)


def group_bound(comm, xs, group, bits):
    """Per element, a bound on the quantisation error of the average: each
    contribution off by less than one step of its group, the average once
    more by one step of the result's group."""
    maxcode = 127 if bits == 8 else 7
    n = xs[0].size
    steps = np.zeros(n)
    for x in xs:
        amax = np.abs(x.astype(np.float64))
        for lo in range(0, n, group):
            steps[lo:lo + group] += amax[lo:lo + group].max() / maxcode
    return steps / len(xs) + 2 * np.abs(sum(x.astype(np.float64) for x in xs)).max() / (
        len(xs) * maxcode)


@pytest.mark.mpi
@pytest.mark.parametrize("compression", ["int8", "int4"])
@pytest.mark.parametrize("count", [1, 5, 1000, 70_001])
@pytest.mark.parametrize("channel", ["rma", "ud"])
def test_close_to_exact_and_the_same_everywhere(comm, compression, count, channel):
    x = data(comm.rank, count)
    xs = comm.allgather(x)
    exact = sum(v.astype(np.float64) for v in xs) / comm.size
    with mpilossy.Communicator(comm, timeout=5.0, compression=compression,
                               compression_group=32, channel=channel) as lc:
        out = np.empty_like(x)
        st = lc.allreduce(x, out, op="avg")
        assert st.algorithm == "direct" and st.delivered == 1.0
        if comm.size > 1:
            assert np.all(np.abs(out - exact) <= group_bound(comm, xs, 32, BITS[compression]))
            if count >= 1000:
                assert np.any(out != exact.astype(np.float32)), "nothing was quantised"
        else:
            np.testing.assert_array_equal(out, x)     # one rank: a copy
        gathered = comm.allgather(out)
        for other in gathered:
            np.testing.assert_array_equal(other, out)  # every rank holds the same values
        lo, hi = lc.chunk_bounds(count)
        part = np.empty(hi - lo, np.float32)
        lc.reduce_scatter(x, part, op="avg")
        if comm.size > 1:
            assert np.all(np.abs(part - exact[lo:hi])
                          <= group_bound(comm, xs, 32, BITS[compression])[lo:hi])
        # a per-call override: off
        lc.allreduce(x, out, op="avg", compression=None, timeout=None)
        np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(comm, compression):
    """Fixed inputs, fresh rounding every call: the mean over calls must be
    the exact average (t statistic per element).  Rounding to nearest (what
    numpy's round of the same codes gives) must fail the same check: the test
    can tell."""
    calls, n, group = 300, 64, 16
    x = (np.linspace(-1, 1, n) * (1 + comm.rank) + 0.013 * comm.rank).astype(np.float32)
    exact = sum(v.astype(np.float64) for v in comm.allgather(x)) / comm.size
    results = np.empty((calls, n))
    with mpilossy.Communicator(comm, timeout=5.0, compression=compression,
                               compression_group=group) as lc:
        for i in range(calls):
            out = np.empty_like(x)
            lc.allreduce(x, out, op="avg")
            results[i] = out
    sd = results.std(axis=0, ddof=1)
    varying = sd > 0
    # only a group's largest values encode exactly (always the same result)
    assert varying.mean() > 0.8, "the rounding is not random"
    np.testing.assert_allclose(results.mean(axis=0)[~varying], exact[~varying], rtol=1e-5)
    # float32 sums round: a few ulp of the values is not a rounding bias
    noise = np.sqrt(sd ** 2 / calls + (1e-6 * np.abs(exact).max()) ** 2)[varying]
    t = (results.mean(axis=0) - exact)[varying] / noise
    assert np.abs(t).max() < 5, f"biased: |t| up to {np.abs(t).max():.1f}"
    # the negative control: deterministic rounding of the same groups
    maxcode = 127 if compression == "int8" else 7
    nearest = np.zeros(n)
    for v in comm.allgather(x):
        for lo in range(0, n, group):
            g = v[lo:lo + group].astype(np.float64)
            step = np.abs(g).max() / maxcode
            nearest[lo:lo + group] += np.round(g / step) * step
    nearest /= comm.size
    t_nearest = (nearest - exact)[varying] / noise
    assert np.abs(t_nearest).max() > 5, "the check cannot tell a biased rounding"


def signature(rank):
    return float(2 ** rank)


@pytest.mark.mpi
@pytest.mark.parametrize("compression", ["int8", "int4"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_lost_block_changes_only_its_own_values(comm, compression, weighted):
    """Rank r sends 2**r (a constant block quantises exactly), weight r + 1:
    every block is the (weighted) average of exactly the ranks its bitmap
    names, under 30% loss."""
    n = 5000
    x = np.full(n, signature(comm.rank), np.float32)
    weights = np.arange(1, comm.size + 1, dtype=np.float64) if weighted \
        else np.ones(comm.size)
    loss = mpilossy.loss.Bernoulli(0.3, seed=4)
    partial = 0
    with mpilossy.Communicator(comm, timeout=0.5, loss=loss, block_bytes=512,
                               compression=compression) as lc:
        for _ in range(10):
            out = np.full(n, -1.0, np.float32)
            st = lc.allreduce(x, out, op="avg", weight=weights[comm.rank] if weighted else None)
            partial += check_weighted_signatures(out, st.contributors, weights, rtol=1e-5)
    if comm.size > 1:
        assert partial > 0, "no loss happened: the test would prove nothing"


@pytest.mark.mpi(min_size=2)
def test_more_values_per_block(comm):
    """The same bytes per record carry about 4x (int8) and 7x (int4) the
    float32 values."""
    n = 200_000
    x = data(comm.rank, n)
    counts = {}
    for compression in (None, "int8", "int4"):
        with mpilossy.Communicator(comm, timeout=5.0, block_bytes=4096,
                                   compression=compression) as lc:
            counts[compression] = lc.allreduce(x, op="avg").contributors.block_elems
    assert 3.5 < counts["int8"] / counts[None] <= 4.0, counts
    assert 6.5 < counts["int4"] / counts[None] <= 8.0, counts


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs,exc,what", [
    ({"compression": "int2"}, ValueError, "compression"),
    ({"compression": "int8", "algorithm": "ring"}, ValueError, "direct"),
    ({"compression": "int4", "dtype": np.float64}, TypeError, "float32")])  # (16-bit: widened)
def test_bad_calls_fail_everywhere(comm, kwargs, exc, what):
    kwargs = dict(kwargs)
    x = np.ones(100, kwargs.pop("dtype", np.float32))
    with mpilossy.Communicator(comm, timeout=2.0) as lc:
        msg = all_ranks_raise(comm, lambda: lc.allreduce(x, op="avg", **kwargs), exc)
        assert what in msg
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg")              # still works
        np.testing.assert_array_equal(out, x)


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs", [{"compression": "fp8"}, {"compression_group": 3},
                                    {"compression_group": 0}, {"compression_group": "64"}])
def test_bad_settings_at_construction(comm, kwargs):
    all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, **kwargs), ValueError)


@pytest.mark.mpi(min_size=2)
def test_ranks_disagree_on_compression(comm):
    mine = "int8" if comm.rank == comm.size - 1 else None
    all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, compression=mine),
                    mpilossy.MismatchError)
    with mpilossy.Communicator(comm, timeout=2.0) as lc:
        all_ranks_raise(comm, lambda: lc.allreduce(np.ones(1000, np.float32), op="avg",
                                                   algorithm="direct", compression=mine),
                        mpilossy.MismatchError)


@pytest.mark.mpi
@pytest.mark.parametrize("compression", ["int8", "int4"])
@pytest.mark.parametrize("channel", ["rma", "ud"])
def test_residual_is_what_quantisation_took(comm, compression, channel):
    """residual= for error feedback: zeros on the owner's own chunk, at most
    one step of its group elsewhere, and the owner's reduce-scatter result is
    exactly the average of what travelled (x - residual): nothing else
    quantised it."""
    if channel == "ud" and not mpilossy._core.HAVE_DATAGRAM_AUTH:
        pytest.skip("built without OpenSSL headers: channel='ud' absent")
    n, group = 70_001, 64
    x = data(comm.rank, n, seed=3)
    residual = np.full(n, 7.0, np.float32)      # overwritten everywhere
    with mpilossy.Communicator(comm, channel=channel, timeout=None, rotate=False,
                               compression=compression, compression_group=group) as lc:
        lo, hi = lc.chunk_bounds(n)
        out = np.empty(hi - lo, np.float32)
        lc.reduce_scatter(x, out, op="avg", residual=residual)
    assert not residual[lo:hi].any()
    # (groups start at block starts: an element's group lies within group - 1 of it)
    near = np.lib.stride_tricks.sliding_window_view(
        np.pad(np.abs(x), group - 1), 2 * group - 1).max(axis=1)
    steps = near / (127 if compression == "int8" else 7)
    assert np.all(np.abs(residual) <= steps * (1 + 1e-5)), np.abs(residual / steps).max()
    if comm.size > 1:
        assert np.abs(residual).max() > 0
    sent = (x - residual).astype(np.float64)
    expected = comm.allreduce(sent)[lo:hi] / comm.size
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_residual_without_compression_is_zero(comm):
    x = data(comm.rank, 1000)
    residual = np.full_like(x, 7.0)
    with mpilossy.Communicator(comm, timeout=None) as lc:
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg", algorithm="direct", residual=residual)
    assert not residual.any()


@pytest.mark.mpi
@pytest.mark.parametrize("residual,exc", [
    (np.zeros(100, np.float64), TypeError), (np.zeros(99, np.float32), ValueError),
    (np.zeros(200, np.float32)[::2], ValueError), ([0.0] * 100, TypeError)])
def test_bad_residuals_fail_everywhere(comm, residual, exc):
    x = np.ones(100, np.float32)
    with mpilossy.Communicator(comm, timeout=2.0, compression="int8") as lc:
        # (a bad buffer on the last rank only: every rank raises)
        mine = residual if comm.rank == comm.size - 1 else np.zeros(100, np.float32)
        all_ranks_raise(comm, lambda: lc.allreduce(x, np.empty_like(x), op="avg",
                                                   residual=mine), exc)
        frozen = np.zeros(100, np.float32)
        frozen.flags.writeable = False
        all_ranks_raise(comm, lambda: lc.allreduce(x, np.empty_like(x), op="avg",
                                                   residual=frozen), ValueError)
        all_ranks_raise(comm, lambda: lc.allreduce(x, op="avg", residual=x), ValueError)
