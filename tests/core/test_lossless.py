"""Without a deadline and without injected loss, the lossy all-reduce is an
all-reduce: it equals MPI_Allreduce, on every rank, for every dtype."""

import numpy as np
import pytest

from helpers import DTYPES, FLOATS, mpi_sum, same_everywhere, small_ints

SIZES = [0, 1, 7, 100_003]            # elements; 100003 is prime
BIG = 16 * 1024 * 1024                # bytes


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_sum_equals_mpi_allreduce(comm, lc, algorithm, dtype, n):
    x = small_ints(n, comm.rank, dtype)
    out = np.full_like(x, 99)
    stats = lc.allreduce(x, out, op="sum", algorithm=algorithm)
    np.testing.assert_array_equal(out, mpi_sum(comm, x))
    assert stats.delivered == 1.0
    assert not stats.deadline_hit
    assert stats.fallback == 0.0
    assert stats.min_contributors == comm.size
    assert stats.algorithm == algorithm
    np.testing.assert_array_equal(x, small_ints(n, comm.rank, dtype))   # input untouched


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sum_16MiB(comm, lc, algorithm, dtype):
    n = BIG // np.dtype(dtype).itemsize
    x = small_ints(n, comm.rank, dtype)
    out = np.empty_like(x)
    lc.allreduce(x, out, op="sum", algorithm=algorithm)
    np.testing.assert_array_equal(out, mpi_sum(comm, x))


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 7, 100_003, BIG // 4])
def test_avg_is_sum_over_size(comm, lc, algorithm, dtype, n):
    x = small_ints(n, comm.rank, dtype)
    out = np.empty_like(x)
    lc.allreduce(x, out, op="avg", algorithm=algorithm)
    expected = mpi_sum(comm, x).astype(np.float64) / comm.size
    tol = 1e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_random_floats_match_to_rounding(comm, lc, algorithm, dtype):
    rng = np.random.default_rng(1000 + comm.rank)
    x = rng.standard_normal(100_003).astype(dtype)
    out = np.empty_like(x)
    lc.allreduce(x, out, op="sum", algorithm=algorithm)
    ref = mpi_sum(comm, x)
    eps = np.finfo(dtype).eps
    bound = comm.size * eps * comm.allreduce(np.abs(x).astype(np.float64)) + eps
    assert np.all(np.abs(out.astype(np.float64) - ref) <= bound)
    # Every rank holds the very same bits.
    assert same_everywhere(comm, out.tobytes())


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_in_place(comm, lc, algorithm, op):
    # avg multiplies by 1/size: equal to sum/size to rounding.
    x = small_ints(100_003, comm.rank, np.float64)
    expected = mpi_sum(comm, x) / (comm.size if op == "avg" else 1)
    lc.allreduce(x, op=op, algorithm=algorithm)            # no recvbuf
    np.testing.assert_allclose(x, expected, rtol=1e-15)
    y = small_ints(1000, comm.rank, np.float32)
    expected = mpi_sum(comm, y) / (comm.size if op == "avg" else 1)
    lc.allreduce(y, y, op=op, algorithm=algorithm)         # recvbuf is sendbuf
    np.testing.assert_allclose(y, expected, rtol=1e-7)


@pytest.mark.mpi
def test_sizes_change_between_calls(comm, lc):
    """Calls of different sizes, dtypes and algorithms, back to back: a fast
    rank's next call must not disturb a slow rank's current one."""
    rng = np.random.default_rng(7)          # same sequence on every rank
    for _ in range(60):
        n = int(rng.integers(0, 20_000))
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        algorithm = ["ring", "tree", "direct", "auto"][int(rng.integers(4))]
        x = small_ints(n, comm.rank, dtype)
        out = np.empty_like(x)
        lc.allreduce(x, out, algorithm=algorithm)
        np.testing.assert_array_equal(out, mpi_sum(comm, x))


@pytest.mark.mpi
def test_auto_picks_tree_up_to_the_crossover(comm, monkeypatch):
    import mpilossy
    monkeypatch.setenv("MPILOSSY_TREE_MAX_BYTES", "4096")
    with mpilossy.Communicator(comm, timeout=None) as lc:
        assert lc.allreduce(np.ones(1024, np.float32), algorithm="auto").algorithm == "tree"
        assert lc.allreduce(np.ones(1025, np.float32), algorithm="auto").algorithm == "ring"


@pytest.mark.mpi
def test_window_grows_on_demand_and_keeps_working(comm):
    import mpilossy
    with mpilossy.Communicator(comm, timeout=None) as lc:
        for n in (10, 100_000, 10, 3_000_000, 1000):
            x = small_ints(n, comm.rank, np.int64)
            out = np.empty_like(x)
            lc.allreduce(x, out)
            np.testing.assert_array_equal(out, mpi_sum(comm, x))
