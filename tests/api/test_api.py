"""The public surface: module-level call, lifetime, statistics, buffer kinds,
and isolation from the caller's communicator."""

import numpy as np
import pytest
from mpi4py import MPI

import mpilossy
from helpers import mpi_sum, small_ints


@pytest.mark.mpi
def test_module_level_allreduce(comm, clean_env):
    x = small_ints(1000, comm.rank, np.float32)
    expected = mpi_sum(comm, x)
    stats = mpilossy.allreduce(x, op="sum")
    np.testing.assert_array_equal(x, expected)
    assert isinstance(stats, mpilossy.AllreduceStats)
    assert mpilossy.default_communicator() is mpilossy.default_communicator()


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather"])
def test_module_level_functions_take_what_the_methods_take(name):
    """mpilossy.reduce_scatter once lacked algorithm, compression, residual
    and redundancy: each module-level function has its method's signature."""
    import inspect
    method = inspect.signature(getattr(mpilossy.Communicator, name))
    function = inspect.signature(getattr(mpilossy, name))
    assert list(function.parameters.values()) == list(method.parameters.values())[1:]
    assert function.return_annotation == method.return_annotation


@pytest.mark.mpi
def test_stats_fields(comm, lc):
    stats = lc.allreduce(np.ones(100, np.float64))
    assert stats.delivered == 1.0 and stats.fallback == 0.0
    assert stats.elapsed > 0 and stats.nbytes == 800 and stats.seq == lc.calls
    assert stats.lost_blocks == (0, 0, 0, 0)


@pytest.mark.mpi
def test_context_manager_and_repr(comm):
    with mpilossy.Communicator(comm, timeout=0.1) as lc:
        assert "size=" in repr(lc) and lc.timeout == 0.1 and lc.channel == "rma"
        assert lc.comm != comm                       # a private duplicate
        assert MPI.Comm.Compare(lc.comm, comm) == MPI.CONGRUENT
    assert "freed" in repr(lc)


@pytest.mark.mpi(min_size=2)
def test_callers_communicator_is_untouched(comm):
    """A receive posted on the caller's communicator sees none of our traffic."""
    request = comm.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    with mpilossy.Communicator(comm, timeout=None) as lc:
        for algorithm in ("ring", "tree"):
            lc.allreduce(np.ones(10_000), algorithm=algorithm)
    done, _ = request.test()
    assert not done
    comm.send("bye", dest=comm.rank)                 # complete it ourselves
    assert request.wait() == "bye"


class DLPackOnly:
    """An object that offers nothing but __dlpack__ (as a CPU framework tensor)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.mpi
def test_dlpack_and_buffer_protocol_inputs(comm, lc):
    x = small_ints(1000, comm.rank, np.float64)
    expected = mpi_sum(comm, x)
    out = np.zeros_like(x)
    lc.allreduce(DLPackOnly(x), DLPackOnly(out))     # written through DLPack, no copy
    np.testing.assert_array_equal(out, expected)
    mv = memoryview(small_ints(1000, comm.rank, np.float32))
    out32 = np.empty(1000, np.float32)
    lc.allreduce(mv, out32)
    np.testing.assert_array_equal(out32, mpi_sum(comm, np.asarray(mv)))


@pytest.mark.mpi
def test_multidimensional_arrays(comm, lc):
    x = small_ints(60, comm.rank, np.int32).reshape(3, 4, 5)
    out = np.empty_like(x)
    lc.allreduce(x, out)
    np.testing.assert_array_equal(out, mpi_sum(comm, x))


def test_device_buffers_are_refused_clearly(comm):
    class FakeGPU:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    try:
        import cupy  # noqa: F401
        words = "null device pointer"        # CuPy reads it, and finds it bad
    except ImportError:
        words = "CuPy"                       # without CuPy: no GPU buffers at all
    with mpilossy.Communicator(MPI.COMM_SELF) as lc:
        with pytest.raises(BufferError, match=words):
            lc.allreduce(FakeGPU())


@pytest.mark.mpi
def test_algorithm_names_and_auto(comm, lc):
    assert lc.allreduce(np.ones(8), algorithm="tree").algorithm == "tree"
    assert lc.allreduce(np.ones(8), algorithm="ring").algorithm == "ring"
