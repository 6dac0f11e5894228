"""Weighted average: allreduce(..., op="avg", weight=w) gives, per block,
sum(w_r x_r) / sum(w_r) over the ranks whose data reached it (the direct
algorithm; DropCompute's aggregation).  Exact without loss, exact per block
under loss (checked against the contributor bitmaps), unbiased for
contributions that estimate the same mean, and w = 1 everywhere is the
unweighted average bit for bit."""

import numpy as np
import pytest

import mpilossy
from helpers import all_ranks_raise, check_weighted_signatures


def weight_of(rank):
    """Unequal weights, not integers, not sorted by rank."""
    return [3.0, 0.5, 7.25, 1.0, 2.0][rank % 5]


def exact(comm, x, w):
    xs, ws = comm.allgather(x), comm.allgather(w)
    return sum(wi * xi.astype(np.float64) for wi, xi in zip(ws, xs)) / sum(ws)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype,rtol", [(np.float16, 2e-3), (np.float32, 1e-6),
                                        (np.float64, 1e-13)])
@pytest.mark.parametrize("count", [1, 3, 1000, 100_003])
def test_lossless_is_the_weighted_average(comm, dtype, rtol, count):
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(count).astype(dtype)
    w = weight_of(comm.rank)
    ref = exact(comm, x, w)
    with mpilossy.Communicator(comm, timeout=5.0, block_bytes=1024) as lc:
        out = np.empty_like(x)
        stats = lc.allreduce(x, out, op="avg", weight=w)
        assert stats.algorithm == "direct" and stats.delivered == 1.0
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)
        # (arrival order decides the order of the sums: the last bit may differ)
        y = x.copy()
        lc.allreduce(y, op="avg", weight=w)          # in place
        np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol)
        lo, hi = lc.chunk_bounds(count)
        part = np.empty(hi - lo, dtype)
        lc.reduce_scatter(x, part, op="avg", weight=w)
        np.testing.assert_allclose(part, ref[lo:hi], rtol=rtol, atol=rtol)
        # without a deadline too (waits for everything)
        lc.allreduce(x, out, op="avg", weight=w, timeout=None)
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)


@pytest.mark.mpi
def test_weight_one_everywhere_is_the_unweighted_average(comm):
    # small integers: every order of the sums gives the same bits
    x = np.random.default_rng(7 + comm.rank).integers(-50, 50, 50_001).astype(np.float32)
    with mpilossy.Communicator(comm, timeout=5.0, block_bytes=512) as lc:
        plain, weighted = np.empty_like(x), np.empty_like(x)
        lc.allreduce(x, plain, op="avg", algorithm="direct")
        lc.allreduce(x, weighted, op="avg", weight=1)
    np.testing.assert_array_equal(weighted, plain)


def signature(rank):
    return float(2 ** rank)


@pytest.mark.mpi
@pytest.mark.parametrize("channel", ["rma", "ud"])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_each_block_weighs_its_own_contributors(comm, collective, channel):
    """Rank r sends 2**r with weight w_r: a block's value must be
    sum(w_r 2**r) / sum(w_r) over exactly the ranks its bitmap names."""
    n = 1000
    x = np.full(n, signature(comm.rank))
    weights = np.array([weight_of(r) for r in range(comm.size)])
    loss = mpilossy.loss.Bernoulli(0.3, seed=9)
    partial = 0
    with mpilossy.Communicator(comm, timeout=0.5, loss=loss, block_bytes=128,
                               channel=channel) as lc:
        lo, hi = lc.chunk_bounds(n)
        for _ in range(20):
            out = np.full(n if collective == "allreduce" else hi - lo, -1.0)
            call = getattr(lc, collective)
            st = call(x, out, op="avg", weight=weight_of(comm.rank))
            partial += check_weighted_signatures(out, st.contributors, weights, rtol=1e-12)
    if comm.size > 1:
        assert partial > 0, "no loss happened: the test would prove nothing"


@pytest.mark.mpi(min_size=2)
def test_unbiased_for_contributions_of_one_mean(comm):
    """DropCompute's setting: every rank's data estimates the same mean
    (rank r averages w_r samples of it).  Under 30% loss the weighted result
    must average to that mean (t statistic per element), and dividing by the
    count instead of the weights (a plausible bug) must not."""
    calls, elements, mean = 400, 32, 1.5
    rng = np.random.default_rng(100 + comm.rank)
    w = weight_of(comm.rank)
    loss = mpilossy.loss.Bernoulli(0.3, seed=3)
    results = np.empty((calls, elements))
    wrong = np.empty((calls, elements))
    weights = np.array([weight_of(r) for r in range(comm.size)])
    with mpilossy.Communicator(comm, timeout=0.2, loss=loss, block_bytes=64) as lc:
        for i in range(calls):
            # the mean of w samples of N(mean, 1): variance 1/w
            x = mean + rng.standard_normal(elements) / np.sqrt(w)
            st = lc.allreduce(x, results[i], op="avg", weight=w)
            firsts, lengths = st.contributors.blocks()
            members = st.contributors.members()
            per_block = np.array([weights[m].sum() / m.sum() for m in members])
            wrong[i] = results[i] * np.repeat(per_block, lengths)
        delivered = st.delivered
    assert delivered < 1.0 or comm.size == 1
    for series, biased in ((results, False), (wrong, True)):
        t = (series.mean(axis=0) - mean) / (series.std(axis=0, ddof=1) / np.sqrt(calls))
        if biased:
            assert np.abs(t).max() > 5, "the check cannot tell a biased scaling"
        else:
            assert np.abs(t).max() < 5, f"biased: t up to {np.abs(t).max():.1f}"


# -- bad input: the same error on every rank ---------------------------------
def culprit(comm):
    return comm.rank == comm.size - 1


@pytest.mark.mpi
@pytest.mark.parametrize("bad,exc", [(-1.0, ValueError), (0.0, ValueError),
                                     (float("nan"), ValueError), (float("inf"), ValueError),
                                     ("2", TypeError), (True, TypeError)])
def test_bad_weight_on_one_rank(comm, bad, exc):
    x = np.ones(100)
    with mpilossy.Communicator(comm, timeout=2.0) as lc:
        w = bad if culprit(comm) else 1.0
        msg = all_ranks_raise(comm, lambda: lc.allreduce(x, op="avg", weight=w), exc)
        assert "weight" in msg
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg", weight=2.0)      # still works
        np.testing.assert_array_equal(out, x)


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs,what", [({"op": "sum"}, "op='avg'"),
                                         ({"op": "avg", "algorithm": "ring"}, "direct"),
                                         ({"op": "avg", "algorithm": "tree"}, "direct")])
def test_weight_needs_a_direct_average(comm, kwargs, what):
    with mpilossy.Communicator(comm, timeout=2.0) as lc:
        msg = all_ranks_raise(comm, lambda: lc.allreduce(np.ones(10), weight=2.0, **kwargs),
                              ValueError)
    assert what in msg


@pytest.mark.mpi
def test_weight_needs_unbiased_scaling(comm):
    with mpilossy.Communicator(comm, timeout=2.0, scaling="zero-fill") as lc:
        msg = all_ranks_raise(comm, lambda: lc.allreduce(np.ones(10), op="avg", weight=2.0),
                              ValueError)
    assert "unbiased" in msg


@pytest.mark.mpi(min_size=2)
def test_some_ranks_weighted_others_not(comm):
    x = np.ones(1000, np.float32)
    with mpilossy.Communicator(comm, timeout=2.0) as lc:
        w = None if culprit(comm) else 2.0
        msg = all_ranks_raise(
            comm, lambda: lc.allreduce(x, op="avg", algorithm="direct", weight=w),
            mpilossy.MismatchError)
        assert "avg(weight=)" in msg
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg", weight=3.0)
        np.testing.assert_array_equal(out, x)


# -- weights that do not fit the data's dtype (issue 27, item 3) ------------------
EXTREME = {
    # name: (dtype, rank -> weight, rank -> value): weights the data's dtype
    # cannot hold times the data, whose sum overflows a double, or that make
    # w * x underflow to zero while w still counts
    "float16 w=1000": (np.float16, lambda r: 1000.0, lambda r: 100.0 + r),
    "float32 w=1e39": (np.float32, lambda r: 1e39 * (r + 1), lambda r: 2.0 * r + 1),
    "float64 w near max": (np.float64, lambda r: 1.5e308, lambda r: 3.0 * r - 1),
    "float32 w=1e-300": (np.float32, lambda r: 1e-300 * (r + 1), lambda r: 1.0 + r),
    "float64 w from 1e-300 to 1e300": (np.float64, lambda r: 10.0 ** (-300 + 200 * r),
                                       lambda r: float(r + 1)),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(EXTREME))
@pytest.mark.parametrize("channel", ["rma", "ud"])
def test_weights_of_any_size_give_the_weighted_average(comm, case, channel):
    """Before: contributions travelled as w * x in the data's dtype and the
    weights summed in a double, so these gave inf, nan or 0 (float16 w=1000
    and x=100: inf where the answer is about 100)."""
    dtype, weight, value = EXTREME[case]
    x = np.full(5000, value(comm.rank), dtype)
    w = weight(comm.rank)
    ws = [weight(r) for r in range(comm.size)]
    vs = [value(r) for r in range(comm.size)]
    top = max(ws)
    ref = sum((wi / top) * vi for wi, vi in zip(ws, vs)) / sum(wi / top for wi in ws)
    with mpilossy.Communicator(comm, timeout=None, block_bytes=1024, channel=channel) as lc:
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg", weight=w)
        lo, hi = lc.chunk_bounds(x.size)
        part = np.empty(hi - lo, dtype)
        lc.reduce_scatter(x, part, op="avg", weight=w)
    rtol = 2e-3 if dtype == np.float16 else 1e-6
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(part)), (out[:3], part[:3])
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol)
    np.testing.assert_allclose(part.astype(np.float64), ref, rtol=rtol)


@pytest.mark.mpi
def test_weights_of_any_size_under_loss_weigh_their_own_contributors(comm):
    """Weights from 1e-200 to 1e200 under 30% loss: each block is the
    weighted average of exactly the ranks its bitmap names."""
    n = 1000
    w = 10.0 ** (-200 + 150 * (comm.rank % 4))
    x = np.full(n, float(comm.rank + 1))
    weights = comm.allgather(w)
    loss = mpilossy.loss.Bernoulli(0.3, seed=4)
    with mpilossy.Communicator(comm, timeout=0.5, loss=loss, block_bytes=128) as lc:
        for _ in range(10):
            out = np.empty_like(x)
            stats = lc.allreduce(x, out, op="avg", weight=w)
            firsts, lengths = stats.contributors.blocks()
            for b, members in enumerate(stats.contributors.members()):
                ranks = np.flatnonzero(members)
                if not lengths[b] or not ranks.size:
                    continue
                top = max(weights[r] for r in ranks)
                want = sum(weights[r] / top * (r + 1) for r in ranks) / \
                    sum(weights[r] / top for r in ranks)
                got = out[firsts[b]:firsts[b] + lengths[b]]
                np.testing.assert_allclose(got, want, rtol=1e-12)
