"""Communicator.barrier() and bcast(): exact over every rank, plain and
elastic, and bad input refused on every rank with the buffers untouched.
(Ranks lost while the others wait in them: tests/control/test_elastic_waits.py.)"""

import time

import numpy as np
import pytest

import mpilossy
from helpers import all_ranks_raise


@pytest.fixture(params=[False, True], ids=["plain", "elastic"])
def reliable(comm, request):
    with mpilossy.Communicator(comm, timeout=0.5, elastic=request.param) as c:
        yield c


@pytest.mark.mpi
@pytest.mark.parametrize("dtype, shape", [("float64", (1000,)), ("float32", (7, 5)),
                                          ("int64", (3,)), ("uint8", (0,))])
def test_bcast_gives_every_rank_the_roots_values(comm, reliable, dtype, shape):
    for root in sorted({0, comm.size - 1}):
        buf = np.full(shape, comm.rank + 1, dtype=dtype)
        reliable.bcast(buf, root=root)
        assert buf.shape == shape and buf.dtype == dtype
        assert (buf == root + 1).all(), (root, buf)
    reliable.barrier()
    stats = reliable.allreduce(np.ones(64), op="avg")     # (the lossy calls go on as before)
    assert stats.delivered == 1.0


@pytest.mark.mpi
def test_bcast_leaves_the_roots_array_as_it_was(comm, reliable):
    buf = np.arange(100.0) + comm.rank
    reliable.bcast(buf, root=0)
    assert (buf == np.arange(100.0)).all()


def _refused(comm, reliable, make, root, exc_type):
    buf = make(comm.rank)
    before = np.array(buf, copy=True)
    message = all_ranks_raise(comm, lambda: reliable.bcast(buf, root=root), exc_type)
    assert np.array_equal(np.asarray(buf), before)      # (untouched on every rank)
    reliable.barrier()                                   # (and the communicator goes on)
    return message


@pytest.mark.mpi
def test_bcast_refuses_mismatched_arrays_on_every_rank(comm, reliable):
    if comm.size == 1:
        pytest.skip("a mismatch needs two ranks")
    _refused(comm, reliable, lambda r: np.zeros(10 + (r == 1)), 0, mpilossy.MismatchError)
    _refused(comm, reliable, lambda r: np.zeros(4, "float32" if r == 1 else "int32"), 0,
             mpilossy.MismatchError)
    buf = np.zeros(4)
    all_ranks_raise(comm, lambda: reliable.bcast(buf, root=comm.rank), mpilossy.MismatchError)


@pytest.mark.mpi
def test_bcast_refuses_bad_buffers_and_roots_on_every_rank(comm, reliable):
    last = comm.size - 1

    def read_only(rank):
        buf = np.zeros(4)
        buf.flags.writeable = rank != last
        return buf

    if comm.size > 1:       # (the root's may be read-only: it is only read)
        message = _refused(comm, reliable, read_only, 0, (BufferError, mpilossy.MPILossyError))
        assert ("read-only" if comm.rank == last else f"rank {last} cannot") in message
    _refused(comm, reliable, lambda r: np.zeros((4, 4))[:, ::2] if r == last
             else np.zeros((4, 2)), 0, (BufferError, mpilossy.MPILossyError))
    _refused(comm, reliable, lambda r: np.zeros(4), comm.size, (ValueError, mpilossy.MPILossyError))
    all_ranks_raise(comm, lambda: reliable.bcast([0.0] * 4, root=0),
                    (TypeError, mpilossy.MPILossyError))


@pytest.mark.mpi
def test_barrier_waits_for_every_rank(comm, reliable):
    """Rank 0 enters 0.3 s late: nobody leaves before that."""
    if comm.size == 1:
        pytest.skip("nobody to wait for")
    comm.Barrier()
    began = time.monotonic()
    if comm.rank == 0:
        time.sleep(0.3)
    reliable.barrier()
    assert time.monotonic() - began >= 0.29
