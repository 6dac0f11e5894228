"""The call path of mpilossy/call/, one layer at a time and without peers:
the buffers of a call (BufferIntake) and its resolved arguments
(CallResolver -> CallSpec).  The same rules on every rank are what make an
error the same everywhere (tests/api/test_errors.py checks that across ranks)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpilossy import _core
from mpilossy.call.buffers import BufferIntake, HostBuffers, chunk_bounds
from mpilossy.call.config import UNSET, Config
from mpilossy.call.request import Request
from mpilossy.call.spec import TREE_MAX_BYTES, CallResolver, asks_for_auto
from mpilossy.control.deadline import AutoDeadline


@pytest.fixture
def deadlines():
    auto = AutoDeadline(MPI.COMM_SELF.Dup(), floor=1e-3, cap=0.5)
    yield auto
    auto.close()
    auto.comm.Free()


def resolver(deadlines, size=4, **arguments):
    config, _ = Config.build(arguments, environ={})
    return CallResolver(config, size, deadlines)


# -- buffers ----------------------------------------------------------------------------
def test_host_buffers_are_views_and_need_nothing_afterwards():
    x, out = np.arange(10.0), np.empty(10)
    bufs = BufferIntake(rank=0, size=1).take(_core.ALLREDUCE, x, out)
    assert isinstance(bufs, HostBuffers)
    assert np.shares_memory(bufs.send, x) and np.shares_memory(bufs.recv, out)
    bufs.finish(True)                             # nothing to copy back
    in_place = BufferIntake(rank=0, size=1).take(_core.ALLREDUCE, x, None)
    assert in_place.send is in_place.recv


@pytest.mark.parametrize("collective, send, recv, words", [
    (_core.ALLREDUCE, 10, 9, "recvbuf has 9 elements, sendbuf 10"),
    (_core.REDUCE_SCATTER, 10, 10, "this rank's chunk of 10 has 3"),
    (_core.ALLGATHER, 2, 10, "sendbuf has 2 elements; this rank's chunk of 10 has 3"),
])
def test_each_collective_checks_its_shapes(collective, send, recv, words):
    intake = BufferIntake(rank=1, size=3)           # chunks of 10: 4, 3, 3
    with pytest.raises(ValueError, match=words):
        intake.take(collective, np.ones(send), np.ones(recv))


def test_reduce_scatter_needs_a_separate_recvbuf():
    intake = BufferIntake(rank=0, size=1)
    x = np.ones(4)
    with pytest.raises(TypeError, match="recvbuf is required"):
        intake.take(_core.REDUCE_SCATTER, x, None)
    with pytest.raises(ValueError, match="different buffers"):
        intake.take(_core.REDUCE_SCATTER, x, x)


def test_allgather_in_place_takes_this_ranks_chunk_only():
    intake = BufferIntake(rank=1, size=3)
    full = np.zeros(10)
    lo, hi = chunk_bounds(10, 3, 1)
    intake.take(_core.ALLGATHER, full[lo:hi], full)                   # this rank's chunk
    with pytest.raises(ValueError, match="without being this rank's chunk"):
        intake.take(_core.ALLGATHER, full[lo + 1:hi + 1], full)


def test_chunks_cover_the_vector_with_the_longer_first():
    bounds = [chunk_bounds(10, 4, r) for r in range(4)]
    assert bounds == [(0, 3), (3, 6), (6, 8), (8, 10)]


# -- the call's spec ----------------------------------------------------------------------
def resolve(r, collective, send, recv, spent=0.0, **arguments):
    return r.resolve(Request(collective, send, recv, **arguments), send, recv, spent)


def test_auto_picks_the_tree_then_direct_with_a_deadline_or_the_ring_without(deadlines):
    r = resolver(deadlines, size=4)
    small = np.ones(TREE_MAX_BYTES[4] // 8)
    large = np.ones(TREE_MAX_BYTES[4])
    algorithm = lambda x, timeout: resolve(r, _core.ALLREDUCE, x, x, timeout=timeout).algorithm
    assert algorithm(small, None) == _core.TREE
    assert algorithm(large, 0.5) == _core.DIRECT
    assert algorithm(large, None) == _core.RING
    # reduce-scatter has no tree
    chunk = np.ones(small.size // 4)
    assert resolve(r, _core.REDUCE_SCATTER, small, chunk, algorithm="auto").algorithm != _core.TREE


def test_weights_and_compression_ride_on_direct(deadlines):
    r = resolver(deadlines)
    x = np.ones(64, np.float32)
    spec = resolve(r, _core.ALLREDUCE, x, x, op="avg", weight=2.0)
    assert (spec.algorithm, spec.weight) == (_core.DIRECT, 2.0)
    spec = resolve(r, _core.ALLREDUCE, x, x, compression="int4")
    assert (spec.algorithm, spec.qbits, spec.qgroup) == (_core.DIRECT, 4, 64)
    assert resolve(resolver(deadlines, compression="int8"), _core.ALLREDUCE, x, x).qbits == 8
    assert resolve(resolver(deadlines, compression="int8"), 
        _core.ALLREDUCE, x, x, compression=None).qbits == 0       # off for this call


@pytest.mark.parametrize("arguments, exc, words", [
    (dict(op="max"), ValueError, "op must be one of"),
    (dict(op="avg", weight=0.0), ValueError, "finite and > 0"),
    (dict(op="sum", weight=1.0), ValueError, "needs op='avg'"),
    (dict(op="avg", weight=1.0, algorithm="ring"), ValueError, "needs algorithm='direct'"),
    (dict(compression="int8", algorithm="tree"), ValueError, "needs algorithm='direct'"),
    (dict(algorithm="butterfly"), ValueError, "algorithm must be"),
    (dict(timeout=-1), ValueError, "positive number of seconds"),
    (dict(residual=np.zeros(3, np.float32)), ValueError, "residual has 3 elements"),
    (dict(residual=np.zeros(64)), TypeError, "float32"),
])
def test_bad_call_arguments_say_what_is_wrong(deadlines, arguments, exc, words):
    x = np.ones(64, np.float32)
    with pytest.raises(exc, match=words):
        resolve(resolver(deadlines), _core.ALLREDUCE, x, np.empty_like(x), **arguments)


def test_avg_and_compression_need_floats(deadlines):
    ints = np.ones(64, np.int32)
    with pytest.raises(TypeError, match="floating-point"):
        resolve(resolver(deadlines), _core.ALLREDUCE, ints, ints, op="avg")
    doubles = np.ones(64)
    with pytest.raises(TypeError, match="float32"):
        resolve(resolver(deadlines), _core.ALLREDUCE, doubles, doubles, compression="int8")


def test_the_learned_deadline_pays_for_its_agreement(deadlines):
    r = resolver(deadlines, timeout="auto")
    x = np.ones(1024)
    assert asks_for_auto(UNSET, r.config) and not asks_for_auto(0.5, r.config)
    spec = resolve(r, _core.ALLREDUCE, x, x)
    assert spec.timeout == deadlines.cap and spec.budget == deadlines.cap
    spec = resolve(r, _core.ALLREDUCE, x, x, spent=0.1)
    assert spec.budget == pytest.approx(deadlines.cap - 0.1)
    spec = resolve(r, _core.ALLREDUCE, x, x, spent=10.0)         # never below a quarter
    assert spec.budget == pytest.approx(0.25 * deadlines.cap)


def test_the_spec_says_what_the_statistics_report(deadlines):
    x = np.ones(100, np.float64)
    spec = resolve(resolver(deadlines, size=4), _core.ALLREDUCE, x, x, timeout=0.5)
    assert (spec.nbytes, spec.elements, spec.timeout) == (800, 100, 0.5)
    lo, hi = chunk_bounds(100, 4, 0)
    full = np.zeros(100)
    spec = resolve(resolver(deadlines, size=4), _core.ALLGATHER, full[lo:hi], full)
    assert (spec.algorithm, spec.elements, spec.timeout) == (_core.DIRECT, 100, -1.0)
