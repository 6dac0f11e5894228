"""Bad input: a clear exception on every rank, never a hang or garbage, and
the communicator still works afterwards.  The culprit is one rank only, so
the others can only learn of it through mpilossy."""

import math

import numpy as np
import pytest

import mpilossy
from helpers import all_ranks_raise, mpi_sum, small_ints

TIMEOUTS = [None, 0.5]


def still_works(comm, lc):
    x = small_ints(1000, comm.rank, np.int64)
    out = np.empty_like(x)
    lc.allreduce(x, out)
    np.testing.assert_array_equal(out, mpi_sum(comm, x))


@pytest.fixture(params=TIMEOUTS, ids=["no-deadline", "deadline"])
def lct(request, comm):
    with mpilossy.Communicator(comm, timeout=request.param, loss=None) as c:
        yield c


def culprit(comm):
    return comm.rank == comm.size - 1


# -- disagreements between ranks ----------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_different_sizes(comm, lct, algorithm):
    n = 1001 if culprit(comm) else 1000
    x = np.ones(n, np.float32)
    msg = all_ranks_raise(comm, lambda: lct.allreduce(x, algorithm=algorithm),
                          mpilossy.MismatchError)
    assert "1001" in msg and "1000" in msg
    still_works(comm, lct)


@pytest.mark.mpi(min_size=2)
def test_different_sizes_when_one_rank_must_grow(comm, lct):
    x = np.ones(4_000_000 if culprit(comm) else 10, np.float64)
    all_ranks_raise(comm, lambda: lct.allreduce(x, algorithm="ring"), mpilossy.MismatchError)
    still_works(comm, lct)


@pytest.mark.mpi(min_size=2)
def test_different_dtypes(comm, lct):
    x = np.ones(64, np.float64 if culprit(comm) else np.float32)
    msg = all_ranks_raise(comm, lambda: lct.allreduce(x, algorithm="ring"),
                          mpilossy.MismatchError)
    assert "float64" in msg and "float32" in msg
    still_works(comm, lct)


@pytest.mark.mpi(min_size=2)
def test_different_ops(comm, lct):
    x = np.ones(64, np.float32)
    op = "avg" if culprit(comm) else "sum"
    msg = all_ranks_raise(comm, lambda: lct.allreduce(x, op=op), mpilossy.MismatchError)
    assert "avg" in msg and "sum" in msg
    still_works(comm, lct)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("theirs", ["tree", "direct"])
def test_different_algorithms(comm, lct, theirs):
    x = np.ones(64, np.float32)
    algorithm = theirs if culprit(comm) else "ring"
    all_ranks_raise(comm, lambda: lct.allreduce(x, algorithm=algorithm),
                    mpilossy.MismatchError)
    still_works(comm, lct)


# -- bad buffers on one rank --------------------------------------------------
def one_rank_passes(comm, bad, good):
    return bad if culprit(comm) else good


@pytest.mark.mpi
def test_non_contiguous_sendbuf(comm, lct):
    good = np.ones(100, np.float32)
    bad = np.ones(200, np.float32)[::2]
    x = one_rank_passes(comm, bad, good)
    msg = all_ranks_raise(comm, lambda: lct.allreduce(x, np.empty(100, np.float32)), BufferError)
    assert "contiguous" in msg
    still_works(comm, lct)


@pytest.mark.mpi
def test_read_only_recvbuf(comm, lct):
    out = np.empty(100, np.float32)
    if culprit(comm):
        out.flags.writeable = False
    msg = all_ranks_raise(comm, lambda: lct.allreduce(np.ones(100, np.float32), out),
                          BufferError)
    assert "read-only" in msg
    still_works(comm, lct)


@pytest.mark.mpi
def test_read_only_in_place(comm, lct):
    x = np.ones(100, np.float32)
    if culprit(comm):
        x.flags.writeable = False
    all_ranks_raise(comm, lambda: lct.allreduce(x), BufferError)
    np.testing.assert_array_equal(x, 1.0)        # nothing written
    still_works(comm, lct)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.int8, np.uint32, np.complex64, np.bool_, ">f4"],
                         ids=str)
def test_unsupported_dtype(comm, lct, dtype):
    x = one_rank_passes(comm, np.ones(10, dtype), np.ones(10, np.float32))
    msg = all_ranks_raise(comm, lambda: lct.allreduce(x, np.empty_like(x)), TypeError)
    assert "dtype" in msg
    still_works(comm, lct)


@pytest.mark.mpi
def test_recvbuf_of_wrong_size(comm, lct):
    out = np.empty(99 if culprit(comm) else 100, np.float32)
    msg = all_ranks_raise(comm, lambda: lct.allreduce(np.ones(100, np.float32), out), ValueError)
    assert "99" in msg
    still_works(comm, lct)


@pytest.mark.mpi
def test_recvbuf_of_other_dtype(comm, lct):
    out = np.empty(100, np.float64 if culprit(comm) else np.float32)
    all_ranks_raise(comm, lambda: lct.allreduce(np.ones(100, np.float32), out), TypeError)
    still_works(comm, lct)


@pytest.mark.mpi
def test_overlapping_buffers(comm, lct):
    base = np.ones(150, np.float32)
    send, recv = base[:100], (base[50:] if culprit(comm) else np.empty(100, np.float32))
    all_ranks_raise(comm, lambda: lct.allreduce(send, recv), ValueError)
    np.testing.assert_array_equal(base, 1.0)
    still_works(comm, lct)


@pytest.mark.mpi
@pytest.mark.parametrize("thing", ["list", "masked", "str"])
def test_not_a_buffer(comm, lct, thing):
    bad = {"list": [1.0, 2.0], "masked": np.ma.masked_array(np.ones(2, np.float32)),
           "str": "ab"}[thing]
    x = one_rank_passes(comm, bad, np.ones(2, np.float32))
    all_ranks_raise(comm, lambda: lct.allreduce(x), TypeError)
    still_works(comm, lct)


@pytest.mark.mpi
def test_bad_op(comm, lct):
    op = one_rank_passes(comm, "max", "sum")
    all_ranks_raise(comm, lambda: lct.allreduce(np.ones(4, np.float32), op=op), ValueError)
    still_works(comm, lct)


@pytest.mark.mpi
def test_avg_of_integers(comm, lct):
    dtype = one_rank_passes(comm, np.int32, np.float32)
    x = np.ones(4, dtype)
    all_ranks_raise(comm, lambda: lct.allreduce(x, op="avg"), TypeError)
    still_works(comm, lct)


@pytest.mark.mpi
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "1s"], ids=repr)
def test_bad_timeout_in_a_call(comm, lct, bad):
    timeout = one_rank_passes(comm, bad, 0.5)
    exc = TypeError if isinstance(bad, str) else ValueError
    all_ranks_raise(comm, lambda: lct.allreduce(np.ones(4, np.float32), timeout=timeout), exc)
    still_works(comm, lct)


# -- lifetime ----------------------------------------------------------------
@pytest.mark.mpi
def test_use_after_free(comm):
    lc = mpilossy.Communicator(comm)
    lc.free()
    lc.free()                                    # twice is harmless
    with pytest.raises(mpilossy.MPILossyError, match="freed"):
        lc.allreduce(np.ones(4, np.float32))
    with pytest.raises(mpilossy.MPILossyError, match="freed"):
        with lc:
            pass


@pytest.mark.mpi
def test_error_leaves_inputs_untouched(comm, lct):
    x = np.arange(100, dtype=np.float32) + comm.rank
    out = np.full(99 if culprit(comm) else 100, -1, np.float32)
    all_ranks_raise(comm, lambda: lct.allreduce(x, out), ValueError)
    np.testing.assert_array_equal(x, np.arange(100, dtype=np.float32) + comm.rank)
    assert np.all(out == -1)

