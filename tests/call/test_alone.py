"""A call answered alone (mpilossy/call/alone.py): what an elastic
communicator's rank that reached an agreement before other survivors
writes for each call it must catch up, as rank 1 of 3.  One process: the
answer sends nothing.  (Its use: tests/control/test_elastic.py, `late`.)"""

import numpy as np
import pytest
from mpi4py import MPI

import mpilossy
from mpilossy._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from mpilossy.call.request import Request
from mpilossy.call import device
from mpilossy.call.alone import answer_alone
from mpilossy.call.buffers import BufferIntake, chunk_bounds
from fake_gpu import FakeDevice, QueuedCopies

RANK, SIZE, COUNT = 1, 3, 1000
LO, HI = chunk_bounds(COUNT, SIZE, RANK)


@pytest.fixture(scope="module")
def resolver():
    with mpilossy.Communicator(MPI.COMM_SELF, timeout=0.5, loss=None) as lc:
        yield lc._state.resolver


def answer(resolver, collective, send, recv, op="sum", scaling="unbiased", residual=None,
           algorithm="direct", segment_bytes=0):
    bufs = BufferIntake(RANK, SIZE, segment_bytes).take(collective, send, recv)
    request = Request(collective, send, recv, op=op, timeout=0.5, compression=None,
                      algorithm="auto" if collective == ALLGATHER else algorithm,
                      residual=residual)
    spec = resolver.resolve(request, bufs.send, bufs.recv)
    return answer_alone(bufs, spec, RANK, SIZE, scaling, 42)


def data():
    return np.random.default_rng(5).standard_normal(COUNT)


@pytest.mark.parametrize("op, factor", [("sum", SIZE), ("avg", 1)])
def test_allreduce_is_own_data_scaled_without_bias(resolver, op, factor):
    x = data()
    out = np.full(COUNT, np.nan)
    stats = answer(resolver, ALLREDUCE, x, out, op)
    np.testing.assert_array_equal(out, x * factor)
    assert stats.alone and stats.seq == 42 and stats.deadline_hit
    assert stats.delivered == pytest.approx(1 / SIZE)
    record = stats.contributors
    assert record.fraction(RANK) == 1.0
    assert record.fraction(0) == 0.0 and record.fraction(2) == 0.0
    assert stats.fallback == pytest.approx(1 - (HI - LO) / COUNT)


def test_allreduce_in_place_keeps_the_data(resolver):
    x = data()
    kept = x.copy()
    answer(resolver, ALLREDUCE, x, None, "avg")
    np.testing.assert_array_equal(x, kept)


@pytest.mark.parametrize("op, factor", [("sum", 1.0), ("avg", 1 / SIZE)])
def test_zero_fill_sums_only_its_own_chunk(resolver, op, factor):
    x = data()
    out = np.full(COUNT, np.nan)
    stats = answer(resolver, ALLREDUCE, x, out, op, scaling="zero-fill")
    np.testing.assert_allclose(out[LO:HI], x[LO:HI] * factor, rtol=1e-15)
    assert not out[:LO].any() and not out[HI:].any()
    assert stats.min_contributors == 0 and stats.fallback == 0.0
    mine = (np.arange(COUNT) >= LO) & (np.arange(COUNT) < HI)
    np.testing.assert_array_equal(stats.contributors.received(), mine)


def test_reduce_scatter_is_its_chunk(resolver):
    x = data()
    out = np.full(HI - LO, np.nan)
    stats = answer(resolver, REDUCE_SCATTER, x, out, "sum")
    np.testing.assert_array_equal(out, x[LO:HI] * SIZE)
    assert stats.collective == "reduce_scatter" and stats.contributors.fraction() == 1.0


def test_allgather_fills_its_chunk_and_keeps_the_others(resolver):
    mine = data()[:HI - LO]
    out = np.full(COUNT, 7.0)
    stats = answer(resolver, ALLGATHER, mine, out)
    np.testing.assert_array_equal(out[LO:HI], mine)
    assert (out[:LO] == 7.0).all() and (out[HI:] == 7.0).all()
    np.testing.assert_array_equal(stats.contributors.received(),
                                  (np.arange(COUNT) >= LO) & (np.arange(COUNT) < HI))
    assert stats.delivered == pytest.approx((HI - LO) / COUNT)


def test_residual_is_zeroed_nothing_was_quantised(resolver):
    x = data()
    residual = np.ones(COUNT, np.float32)
    answer(resolver, ALLREDUCE, x.astype(np.float32), np.empty(COUNT, np.float32), "avg",
           residual=residual)
    assert not residual.any()


def test_bad_buffers_are_refused_as_in_any_call(resolver):
    with pytest.raises(ValueError, match="chunk"):
        answer(resolver, REDUCE_SCATTER, data(), np.empty(5))
    readonly = data()
    readonly.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="writ|read"):
        answer(resolver, ALLREDUCE, readonly, None)


@pytest.mark.parametrize("scaling", ["unbiased", "zero-fill"])
def test_pipelined_device_call_is_answered_segment_by_segment(resolver, monkeypatch, scaling):
    """A GPU all-reduce staged in segments: every segment waited for,
    answered and copied back; the chunk spans several segments."""
    copies = QueuedCopies()
    monkeypatch.setattr(device, "backend", lambda: copies)
    x = data()
    out = np.full(COUNT, np.nan)
    answer(resolver, ALLREDUCE, FakeDevice(x), FakeDevice(out), "sum", scaling=scaling,
           segment_bytes=1024)
    if scaling == "unbiased":
        np.testing.assert_array_equal(out, x * SIZE)
    else:
        np.testing.assert_array_equal(out[LO:HI], x[LO:HI])
        assert not out[:LO].any() and not out[HI:].any()
