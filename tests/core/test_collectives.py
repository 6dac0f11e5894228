"""reduce_scatter and allgather: equal to MPI without loss, and under loss
the same guarantees as allreduce (deadlines, counts, nothing overwritten by
mistake)."""

import numpy as np
import pytest

import mpilossy
from helpers import DTYPES, all_ranks_raise, mpi_sum, small_ints

SIZES = [0, 1, 7, 100_003]


def chunks(comm, lc, n):
    return [lc.chunk_bounds(n, r) for r in range(comm.size)]


VALID = [(d, op) for d in DTYPES for op in ("sum", "avg")
         if op == "sum" or np.dtype(d).kind == "f"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("dtype,op", VALID, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_equals_mpi(comm, lc, dtype, n, op, algorithm):
    x = small_ints(n, comm.rank, dtype)
    lo, hi = lc.chunk_bounds(n)
    out = np.full(hi - lo, 99, dtype)
    stats = lc.reduce_scatter(x, out, op=op, algorithm=algorithm)
    assert stats.algorithm == algorithm
    expected = mpi_sum(comm, x)[lo:hi].astype(np.float64) / (comm.size if op == "avg" else 1)
    tol = 1e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol)
    assert stats.collective == "reduce_scatter" and stats.delivered == 1.0
    # MPI's own reduce-scatter cuts the same way.
    if dtype != np.float16:
        counts = [b - a for a, b in chunks(comm, lc, n)]
        ref = np.empty(hi - lo, dtype)
        comm.Reduce_scatter(x, ref, recvcounts=counts)
        if op == "sum":
            np.testing.assert_array_equal(out, ref)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_allgather_equals_mpi(comm, lc, dtype, n):
    bounds = chunks(comm, lc, n)
    lo, hi = bounds[comm.rank]
    mine = small_ints(hi - lo, comm.rank, dtype)
    full = np.full(n, 99, dtype)
    stats = lc.allgather(mine, full)
    expected = np.concatenate([small_ints(b - a, r, dtype) for r, (a, b) in enumerate(bounds)])
    np.testing.assert_array_equal(full, expected)
    assert stats.collective == "allgather" and stats.delivered == 1.0
    if dtype != np.float16 and n:
        ref = np.empty(n, dtype)
        comm.Allgatherv(mine, [ref, [b - a for a, b in bounds]])
        np.testing.assert_array_equal(full, ref)


@pytest.mark.mpi
def test_allgather_in_place(comm, lc):
    n = 10_001
    full = np.full(n, -1.0)
    lo, hi = lc.chunk_bounds(n)
    full[lo:hi] = comm.rank
    lc.allgather(full[lo:hi], full)
    for r, (a, b) in enumerate(chunks(comm, lc, n)):
        np.testing.assert_array_equal(full[a:b], r)


@pytest.mark.mpi(min_size=2)
def test_allgather_under_loss_keeps_previous_values(comm):
    """Every chunk is either the sender's data or what was there before."""
    n = 40_000
    with mpilossy.Communicator(comm, timeout=0.02, block_bytes=1024,
                               loss=mpilossy.loss.Bernoulli(0.3, seed=7)) as lc:
        bounds = chunks(comm, lc, n)
        lo, hi = bounds[comm.rank]
        kept = 0.0
        for call in range(30):
            previous = np.full(n, -7.0)
            full = previous.copy()
            stats = lc.allgather(np.full(hi - lo, float(100 * call + comm.rank)), full)
            for r, (a, b) in enumerate(bounds):
                ok = (full[a:b] == 100 * call + r) | (full[a:b] == -7.0)
                assert ok.all(), f"call {call}, chunk {r}: {np.unique(full[a:b])}"
            # The arrival record says exactly which elements arrived, and from whom.
            arrived = stats.contributors.received()
            np.testing.assert_array_equal(arrived, full != -7.0)
            for r, (a, b) in enumerate(bounds):
                np.testing.assert_array_equal(stats.contributors.mask(r)[a:b], arrived[a:b])
                assert not stats.contributors.mask(r)[:a].any()
            assert arrived[lo:hi].all()                 # my own chunk
            kept += stats.fallback
            assert stats.delivered == pytest.approx(1.0 - stats.fallback)
    assert comm.allreduce(kept) > 0, "nothing was lost: the test proved nothing"


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_unbiased_for_look_alike_data(comm):
    calls, n = 600, 256
    rng = np.random.default_rng(50 + comm.rank)
    with mpilossy.Communicator(comm, timeout=0.01, block_bytes=64,
                               loss=mpilossy.loss.Bernoulli(0.2, seed=3)) as lc:
        lo, hi = lc.chunk_bounds(n)
        results = np.empty((calls, hi - lo))
        delivered = 0.0
        for call in range(calls):
            stats = lc.reduce_scatter(5.0 + rng.standard_normal(n), results[call], op="avg")
            delivered += stats.delivered / calls
    t = np.abs(results.mean(0) - 5.0) / (results.std(0, ddof=1) / np.sqrt(calls))
    outcome = comm.allgather((float(t.max()), delivered))
    assert all(d < 0.999 for _, d in outcome), outcome
    assert all(tt < 5 for tt, _ in outcome), outcome


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_scaling_under_loss(comm):
    """Every rank holds ones: whatever arrives, the unbiased sum is `size` and
    the average is 1 (a zero-filled result would come out smaller)."""
    with mpilossy.Communicator(comm, timeout=0.02, block_bytes=256,
                               loss=mpilossy.loss.Bernoulli(0.3, seed=1)) as lc:
        lo, hi = lc.chunk_bounds(9999)
        lost = 0
        for _ in range(40):
            out = np.empty(hi - lo)
            stats = lc.reduce_scatter(np.ones(9999), out, op="sum")
            np.testing.assert_allclose(out, comm.size)
            lost += sum(stats.lost_blocks)
    assert comm.allreduce(lost) > 0


@pytest.mark.mpi
def test_bad_sizes_raise_everywhere(comm, lc):
    n = 1000
    lo, hi = lc.chunk_bounds(n)
    wrong = comm.rank == comm.size - 1
    out = np.empty(hi - lo + (1 if wrong else 0))
    all_ranks_raise(comm, lambda: lc.reduce_scatter(np.ones(n), out), ValueError)
    mine = np.ones(hi - lo + (1 if wrong else 0))
    all_ranks_raise(comm, lambda: lc.allgather(mine, np.empty(n)), ValueError)
    all_ranks_raise(comm, lambda: lc.reduce_scatter(np.ones(n), None), TypeError)
    x = np.ones(n)
    lc.allreduce(x)                                   # still works afterwards


@pytest.mark.mpi(min_size=2)
def test_different_collectives_raise_everywhere(comm, lc):
    n = 1000
    lo, hi = lc.chunk_bounds(n)
    if comm.rank == comm.size - 1:
        call = lambda: lc.allgather(np.ones(hi - lo), np.empty(n))
    else:
        call = lambda: lc.reduce_scatter(np.ones(n), np.empty(hi - lo))
    msg = all_ranks_raise(comm, call, mpilossy.MismatchError)
    assert "allgather" in msg and "reduce_scatter" in msg


def test_chunk_bounds_cover_the_vector(comm):
    with mpilossy.Communicator(comm) as lc:
        for n in (0, 1, 7, 10, 100_003):
            bounds = [lc.chunk_bounds(n, r) for r in range(comm.size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
