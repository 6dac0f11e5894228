"""float16 sums and averages (issue 27, item 3): float16 holds nothing above
65504, so partial sums are kept in float32 and rounded to float16 once;
before, a sum of values near the top overflowed to inf where their average
(or the whole sum) would not."""

import numpy as np
import pytest

import mpilossy
from helpers import mpi_sum

ALGORITHMS = ["ring", "tree", "direct"]


@pytest.mark.mpi
@pytest.mark.parametrize("channel", ["rma", "ud"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_average_of_large_values_does_not_overflow(comm, algorithm, channel):
    x = np.full(3001, 60000.0 + 32 * comm.rank, np.float16)
    want = np.float16(np.mean([60000.0 + 32 * r for r in range(comm.size)]))
    with mpilossy.Communicator(comm, timeout=None, block_bytes=512, channel=channel) as lc:
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg", algorithm=algorithm)
        np.testing.assert_array_equal(out, np.full_like(x, want))
        lo, hi = lc.chunk_bounds(x.size)
        if algorithm != "tree":
            part = np.empty(hi - lo, np.float16)
            lc.reduce_scatter(x, part, op="avg", algorithm=algorithm)
            np.testing.assert_array_equal(part, np.full_like(part, want))


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_sum_that_fits_is_exact_however_large_its_partial_sums(comm, algorithm):
    """Signs alternate: partial sums reach far beyond 65504, the sum fits."""
    sign = 1.0 if comm.rank % 2 == 0 else -1.0
    x = np.full(2000, sign * 60000.0, np.float16)
    want = 60000.0 * (comm.size % 2)
    with mpilossy.Communicator(comm, timeout=None, block_bytes=512) as lc:
        out = np.empty_like(x)
        lc.allreduce(x, out, op="sum", algorithm=algorithm)
    np.testing.assert_array_equal(out, np.full_like(x, want))


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_under_loss_large_averages_stay_finite_and_right(comm, algorithm):
    x = np.full(4096, 65000.0, np.float16)
    loss = mpilossy.loss.Bernoulli(0.3, seed=2)
    with mpilossy.Communicator(comm, timeout=0.3, loss=loss, block_bytes=256) as lc:
        for _ in range(5):
            out = np.empty_like(x)
            lc.allreduce(x, out, op="avg", algorithm=algorithm)
            np.testing.assert_array_equal(out, x)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_small_integers_are_still_exact(comm, algorithm):
    """The float32 partial sums round once, at the end: sums of small
    integers equal MPI_Allreduce's bit for bit."""
    x = ((np.arange(10_007) * 7 + 3 * comm.rank) % 23 + comm.rank).astype(np.float16)
    with mpilossy.Communicator(comm, timeout=None, block_bytes=1000) as lc:
        out = np.empty_like(x)
        lc.allreduce(x, out, op="sum", algorithm=algorithm)
    np.testing.assert_array_equal(out, mpi_sum(comm, x))
