"""Unbiasedness under loss, for ranks that hold *different* data.

Over many seeded calls, the mean of the reduced value must equal the exact
average for every element, within a bound computed from the observed
variance (a t statistic per element).  The result is averaged over ranks
first, which cancels the fallbacks that individual ranks use when they miss
the gathered value (they are symmetric by rotation).  The same check must
*fail* for a ring whose chains always start at the same rank and for the
zero-filled result: the test can tell biased from unbiased.
"""

import pytest

from unbiasedness import (CALLS_BIASED, CALLS_ZERO_FILL, T_LIMIT, delivered_floor, max_t,
                          rank_averaged_t, run)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_unbiased_for_different_data(comm, algorithm, p):
    results, _, delivered = run(comm, algorithm, p)
    t = rank_averaged_t(comm, results)
    assert delivered < 0.999, "no loss happened: the test would prove nothing"
    # (a rank that kept only its own data delivers 1/N and is unbiased too)
    assert delivered >= delivered_floor(algorithm, comm.size, p), delivered
    assert t < T_LIMIT, f"biased: max |t| = {t:.2f} (delivered {delivered:.3f})"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_fixed_chain_start_is_biased(comm, algorithm):
    """Without rotation the rank that owns a chunk (roots the tree) is always
    in its sum while others drop out: the check must catch it."""
    results, _, _ = run(comm, algorithm, 0.5, calls=CALLS_BIASED, rotate=False)
    t = rank_averaged_t(comm, results)
    assert t > T_LIMIT, f"expected a detectable bias, max |t| = {t:.2f}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_zero_fill_is_biased(comm, algorithm):
    results, _, _ = run(comm, algorithm, 0.5, calls=CALLS_ZERO_FILL, scaling="zero-fill")
    t = rank_averaged_t(comm, results)
    assert t > T_LIMIT, f"expected a detectable bias, max |t| = {t:.2f}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_each_rank_unbiased_for_look_alike_data(comm, algorithm):
    """Every rank draws fresh noise around a common mean each call: then each
    rank's own result, fallbacks included, is unbiased for that mean."""
    results, inputs, delivered = run(comm, algorithm, 0.1, fresh_noise=True)
    t = max_t(results, 3.0)
    ts = comm.allgather(t)
    assert delivered_floor(algorithm, comm.size, 0.1) <= delivered < 0.999, delivered
    assert max(ts) < T_LIMIT, f"per-rank max |t|: {ts}"
