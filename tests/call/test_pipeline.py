"""Pipelined staging of GPU all-reduces (mpilossy/call/pipeline.py), on
fake device arrays whose copies run only when waited for (fake_gpu's
QueuedCopies): the same code as on a GPU, with segments of 4 KiB."""

import numpy as np
import pytest

import mpilossy
from mpilossy import MismatchError
from mpilossy.call import device
from mpilossy.call.pipeline import plan
from fake_gpu import FakeDevice, QueuedCopies
from helpers import all_ranks_raise, mpi_sum, small_ints

SEGMENT = 4096


@pytest.fixture
def copies(monkeypatch):
    fake = QueuedCopies()
    monkeypatch.setattr(device, "backend", lambda: fake)
    return fake


@pytest.fixture
def piped(comm, monkeypatch):
    monkeypatch.setenv("MPILOSSY_PIPELINE_BYTES", str(SEGMENT))
    with mpilossy.Communicator(comm, timeout=None, loss=None) as c:
        yield c


def test_plan_cuts_equal_segments_and_leaves_small_calls_whole():
    assert plan(10_000, 4, 0) is None                       # off
    assert plan(4095, 4, SEGMENT) is None                   # under four segments
    cut = plan(5000, 4, SEGMENT)
    assert len(cut) == 5 and cut[0][0] == 0 and cut[-1][1] == 5000
    assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
    lengths = [stop - first for first, stop in cut]
    assert max(lengths) - min(lengths) <= 1 and max(lengths) * 4 <= SEGMENT


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("inplace", [False, True])
def test_pipelined_allreduce_equals_mpi(comm, piped, copies, dtype, inplace):
    x = small_ints(5003, comm.rank, dtype)                 # (not a multiple of anything)
    want = mpi_sum(comm, x)
    before = piped.allreduce(np.ones(4)).seq
    if inplace:
        buf = x.copy()
        stats = piped.allreduce(FakeDevice(buf))
    else:
        buf = np.full_like(x, -1)
        stats = piped.allreduce(FakeDevice(x.copy()), FakeDevice(buf))
    np.testing.assert_array_equal(buf, want)
    segments = len(plan(x.size, x.itemsize, SEGMENT))
    assert segments > 2 and stats.seq == before + segments  # one core call per segment
    assert stats.nbytes == x.nbytes and stats.delivered == 1.0


@pytest.mark.mpi(min_size=2)
def test_segments_overlap_the_copies(comm, piped, copies):
    """Every copy to the host is queued before the first segment travels;
    each segment waits for its own copy only, and its result goes back
    before the next segment travels; one synchronisation, at the end."""
    x = small_ints(5000, comm.rank, np.float32)
    buf = x.copy()
    piped.allreduce(FakeDevice(buf))
    np.testing.assert_array_equal(buf, mpi_sum(comm, x))
    ops = [op[0] for op in copies.log]
    n = len(plan(x.size, 4, SEGMENT))
    assert ops[:2 * n] == ["to_host", "record"] * n
    assert ops[2 * n:2 * n + 2 * n] == ["wait", "to_device"] * n
    assert ops[4 * n:] == ["sync"]


def test_one_rank_never_cuts(copies, monkeypatch):
    """At one rank a call is a copy: nothing travels that copies could overlap."""
    from mpi4py import MPI
    monkeypatch.setenv("MPILOSSY_PIPELINE_BYTES", str(SEGMENT))
    with mpilossy.Communicator(MPI.COMM_SELF) as alone:
        x = small_ints(5000, 0, np.float32)
        buf = x.copy()
        before = alone.allreduce(np.ones(4)).seq
        assert alone.allreduce(FakeDevice(buf)).seq == before + 1
    np.testing.assert_array_equal(buf, x)


@pytest.mark.mpi
def test_small_calls_are_staged_whole(comm, piped, copies):
    x = small_ints(3000, comm.rank, np.float32)             # under four segments
    buf = x.copy()
    before = piped.allreduce(np.ones(4)).seq
    assert piped.allreduce(FakeDevice(buf)).seq == before + 1
    np.testing.assert_array_equal(buf, mpi_sum(comm, x))
    assert "record" not in [op[0] for op in copies.log]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other", ["more segments", "host buffer", "not cut"])
def test_ranks_that_cut_a_call_differently_fail_together(comm, piped, copies, other):
    """Rank 0 cuts its call in 4 segments; the others in 5, or not at all:
    every rank fails with MismatchError (none waits for the others), rank
    0's in-place data is back as it was, and the next call is exact."""
    per = SEGMENT // 4
    x = small_ints(4 * per if comm.rank == 0 else 5 * per, comm.rank, np.float32)
    if comm.rank == 0 or other == "more segments":
        buf = FakeDevice(x.copy())
    elif other == "host buffer":
        buf = x.copy()
    else:
        x = small_ints(per, comm.rank, np.float32)         # under four segments: whole
        buf = FakeDevice(x.copy())
    msg = all_ranks_raise(comm, lambda: piped.allreduce(buf), MismatchError)
    assert "disagree" in msg
    held = buf.array if isinstance(buf, FakeDevice) else buf
    np.testing.assert_array_equal(held, x)                 # nothing lost
    y = small_ints(5000, comm.rank, np.float32)
    out = np.zeros_like(y)
    piped.allreduce(FakeDevice(y), FakeDevice(out))
    np.testing.assert_array_equal(out, mpi_sum(comm, y))


@pytest.mark.mpi
def test_bad_buffer_on_one_rank_fails_before_any_segment(comm, piped, copies):
    x = small_ints(5000, comm.rank, np.float32)
    recv = (FakeDevice(np.zeros(5000, np.float32), readonly=True) if comm.rank == 0
            else FakeDevice(np.zeros(5000, np.float32)))
    msg = all_ranks_raise(comm, lambda: piped.allreduce(FakeDevice(x), recv), BufferError)
    if comm.rank == 0:
        assert "read-only" in msg
    out = np.zeros_like(x)
    piped.allreduce(FakeDevice(x), FakeDevice(out))
    np.testing.assert_array_equal(out, mpi_sum(comm, x))


@pytest.mark.mpi(min_size=2)
def test_pipelined_stats_under_loss_cover_the_whole_call(comm, copies, monkeypatch):
    """Injected loss, algorithm="direct": the segments' statistics merge
    into the call's, and the contributors record covers every element."""
    monkeypatch.setenv("MPILOSSY_PIPELINE_BYTES", str(SEGMENT))
    with mpilossy.Communicator(comm, timeout=2.0, block_bytes=256, algorithm="direct",
                               loss=mpilossy.loss.Bernoulli(0.3, seed=5)) as lossy:
        x = np.full(6000, float(comm.rank + 1), np.float32)
        stats = lossy.allreduce(FakeDevice(x), op="avg")       # in place
        assert stats.seq > 2                               # (it was cut)
    assert stats.nbytes == 6000 * 4 and 0.3 < stats.delivered < 1.0
    assert sum(stats.lost_blocks) > 0
    # the merged record says who is in each element, which the values bear out
    held = np.array([stats.contributors.mask(peer) for peer in range(comm.size)])
    assert held.shape == (comm.size, 6000) and not held.all()
    values = np.arange(1, comm.size + 1, dtype=np.float64)[:, None]
    np.testing.assert_allclose(x, (held * values).sum(0) / held.sum(0), rtol=1e-6)
