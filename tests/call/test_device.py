"""GPU buffers.  The intake and staging path runs everywhere with fake
device arrays over host memory (the way mpi4py tests its GPU paths without
a GPU): a fake exposes __cuda_array_interface__, and a fake copy backend
moves bytes with memmove where CuPy would call cudaMemcpyAsync.  The same
paths on a real GPU: tests/call/test_gpu.py."""

import numpy as np
import pytest
from mpi4py import MPI

import mpilossy
from mpilossy.call import device
from fake_gpu import FakeDevice, HostCopies
from helpers import all_ranks_raise, mpi_sum, small_ints


class DLPackOnlyDevice:
    def __dlpack_device__(self):
        return (device.KDL_CUDA, 0)

    def __dlpack__(self, stream=None):
        raise BufferError("not on the host")


@pytest.fixture
def copies(monkeypatch):
    fake = HostCopies()
    monkeypatch.setattr(device, "backend", lambda: fake)
    return fake


@pytest.mark.mpi
@pytest.mark.parametrize("inplace", [False, True])
def test_device_allreduce_equals_mpi_and_reuses_staging(comm, lc, copies, inplace):
    for n in (1000, 300, 1000):
        x = small_ints(n, comm.rank, np.float32)
        want = mpi_sum(comm, x)
        if inplace:
            buf = x.copy()
            lc.allreduce(FakeDevice(buf))
        else:
            buf = np.full_like(x, -1)
            lc.allreduce(FakeDevice(x.copy()), FakeDevice(buf))
        np.testing.assert_array_equal(buf, want)
    assert copies.pinned_calls == 1             # allocated once, then reused
    if not inplace:                             # recvbuf's old contents are never read
        assert ("to_host", 7) in copies.log and copies.log.count(("to_host", 7)) == 3


@pytest.mark.mpi
def test_device_reduce_scatter_and_allgather(comm, lc, copies):
    x = small_ints(103, comm.rank, np.float64)
    lo, hi = lc.chunk_bounds(x.size)
    chunk = np.zeros(hi - lo)
    lc.reduce_scatter(FakeDevice(x), FakeDevice(chunk))
    np.testing.assert_array_equal(chunk, mpi_sum(comm, x)[lo:hi])
    full = np.zeros(x.size)
    lc.allgather(FakeDevice(chunk), FakeDevice(full))
    np.testing.assert_array_equal(full, mpi_sum(comm, x))
    # in place: sendbuf is this rank's chunk of recvbuf, on the device too
    again = np.zeros(x.size)
    again[lo:hi] = chunk
    lc.allgather(FakeDevice(again[lo:hi]), FakeDevice(again))
    np.testing.assert_array_equal(again, mpi_sum(comm, x))


@pytest.mark.mpi
def test_copies_follow_the_array_stream_and_finish_before_return(comm, lc, copies):
    buf = np.ones(64, np.float32)
    lc.allreduce(FakeDevice(buf, stream=42))
    assert copies.log[0] == ("to_host", 42)
    assert copies.log[-2:] == [("to_device", 42), ("sync", 42)]
    np.testing.assert_array_equal(buf, np.full(64, comm.size, np.float32))


BAD = {
    "read-only": (lambda x: FakeDevice(x, readonly=True), BufferError, "read-only"),
    "strided": (lambda x: FakeDevice(x, strides=(8,)), BufferError, "contiguous"),
    "dtype": (lambda x: FakeDevice(x.astype(np.uint8)), TypeError, "dtype"),
    "host-and-device": (lambda x: x, BufferError, "same side"),
    "size": (lambda x: FakeDevice(x[:16]), ValueError, "elements"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_device_buffer_on_one_rank_raises_everywhere(comm, lc, copies, case):
    make, exc, words = BAD[case]
    x = np.ones(32, np.float32)
    good = FakeDevice(np.ones(32, np.float32))
    bad = make(x) if comm.rank == 0 else FakeDevice(x)
    msg = all_ranks_raise(comm, lambda: lc.allreduce(good, bad), exc)
    if comm.rank == 0:
        assert words in msg
    np.testing.assert_array_equal(x, np.ones(32, np.float32))    # untouched


def test_without_cupy_a_device_buffer_is_a_clear_error():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    with mpilossy.Communicator(MPI.COMM_SELF) as lc:
        for buf in (FakeDevice(np.ones(4, np.float32)), DLPackOnlyDevice()):
            with pytest.raises(BufferError, match="CuPy"):
                lc.allreduce(buf)


def test_malformed_interface_is_refused(copies):
    class Broken:
        __cuda_array_interface__ = {"shape": (4,), "version": 3}
    with mpilossy.Communicator(MPI.COMM_SELF) as lc:
        with pytest.raises(BufferError, match="malformed"):
            lc.allreduce(Broken())
