"""Unbiasedness under loss, for ranks that hold *different* data.

Over many seeded calls, the mean of the reduced value must equal the exact
average for every element, within a bound computed from the observed
variance (a t statistic per element).  The result is averaged over ranks
first, which cancels the fallbacks that individual ranks use when they miss
the gathered value (they are symmetric by rotation).  The same check must
*fail* for a ring whose chains always start at the same rank and for the
zero-filled result: the test can tell biased from unbiased.
"""

import numpy as np
import pytest

import mpilossy

CALLS = 1000
CALLS_BIASED = 1500       # enough to expose the biased variants (p = 0.5)
ELEMENTS = 64
BLOCK = 64                # bytes: 8 doubles per block, so chunks have several blocks
TIMEOUT = 0.01
T_LIMIT = 5.0             # |t| above this on any element means biased


def fixed_data(rank):
    """Rank r's vector: around r, different per element."""
    e = np.arange(ELEMENTS)
    return rank + 0.5 * np.sin(1.3 * e + rank)


def run(comm, algorithm, p, fresh_noise=False, calls=CALLS, **options):
    """Results of `calls` calls on this rank, shape (calls, ELEMENTS), and inputs."""
    loss = mpilossy.loss.Bernoulli(p, seed=11)
    results = np.empty((calls, ELEMENTS))
    inputs = np.empty((calls, ELEMENTS))
    rng = np.random.default_rng(1234 + comm.rank)
    with mpilossy.Communicator(comm, timeout=TIMEOUT, loss=loss, block_bytes=BLOCK,
                               **options) as lc:
        delivered = 0.0
        for call in range(calls):
            x = (3.0 + rng.standard_normal(ELEMENTS)) if fresh_noise else fixed_data(comm.rank)
            inputs[call] = x
            stats = lc.allreduce(x, results[call], op="avg", algorithm=algorithm)
            delivered += stats.delivered
    return results, inputs, delivered / calls


def max_t(samples, truth):
    """Largest |t| over elements of mean(samples) against truth."""
    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    t = np.abs(mean - truth) / np.where(se > 0, se, np.inf)
    exact_miss = np.any((se == 0) & (mean != truth))
    return np.inf if exact_miss else float(t.max())


def rank_averaged_t(comm, results):
    gathered = comm.gather(results, root=0)
    verdict = None
    if comm.rank == 0:
        z = np.mean(gathered, axis=0)                      # per call, averaged over ranks
        exact = np.mean([fixed_data(r) for r in range(comm.size)], axis=0)
        verdict = max_t(z, exact)
    return comm.bcast(verdict, root=0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_unbiased_for_different_data(comm, algorithm, p):
    results, _, delivered = run(comm, algorithm, p)
    t = rank_averaged_t(comm, results)
    assert delivered < 0.999, "no loss happened: the test would prove nothing"
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
    results, _, _ = run(comm, algorithm, 0.5, calls=CALLS_BIASED, scaling="zero-fill")
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
    assert delivered < 0.999
    assert max(ts) < T_LIMIT, f"per-rank max |t|: {ts}"
