"""One outcome per call on every rank (issue 38): a call that fails on one
rank fails on every rank, and a rank that had already returned from it
learns at its next call, named; a rank reuses the memory of a call only
once every peer has left it, so a failed call never makes a good one fail
on a slow rank (src_cython/outcome.pxi, rma.pxi: wait_for_readers)."""

import json
import time

import numpy as np
import pytest

import mpilossy
from mpilossy import _core
from helpers import failures_in_turn, is_singleton, mpi_sum, run_mpi_script, small_ints

CHANNELS = ["rma"] + (["ud"] if _core.HAVE_DATAGRAM_AUTH else [])


def report(proc, tag):
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len(tag) + 1:])


# -- a failed call between good ones, a slow rank ------------------------------------
@pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")
@pytest.mark.parametrize("ranks, channel, algorithm", [
    (2, "rma", "direct"), (3, "rma", "direct"), (4, "rma", "direct"), (3, "rma", "ring"),
    (3, "ud", "direct")])
def test_a_failed_call_never_fails_the_good_call_before_it(ranks, channel, algorithm):
    """40 good calls without deadline, each followed by one that fails on
    every rank; the last rank runs at nice 19.  Before (rma): the fast ranks
    left the failed call at once and rewrote the records of the good call
    that the slow rank was still reading, and it raised "moved past call N"
    alone: 6 to 39 of the 40 good calls at 3 and 4 ranks."""
    if channel == "ud" and not _core.HAVE_DATAGRAM_AUTH:
        pytest.skip("channel='ud' not built")
    seen = report(run_mpi_script("slow_reader.py", ranks, channel, algorithm, "1000",
                                 timeout=120, MPILOSSY_UD_PROVIDER="native"), "SLOW_READER")
    assert [r["good_failed"] for r in seen] == [0] * ranks, seen
    assert [r["bad_returned"] for r in seen] == [0] * ranks, seen


@pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_that_disagree_on_having_a_deadline_raise_on_rma(ranks):
    """The one-sided channel raised already; now every rank raises a
    MismatchError that says which rank waits without deadline."""
    seen = report(run_mpi_script("mixed_deadlines.py", ranks, "rma", timeout=60),
                  "MIXED_DEADLINES")
    for r in seen:
        assert all(o.startswith("MismatchError") for o in r["outcomes"][1:]), seen
        assert r["wrong"] == 0, seen
    assert "timeout=None" in seen[0]["outcomes"][0] and "with a deadline" in seen[0]["outcomes"][0]


# -- a late rank that disagrees ----------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("channel", CHANNELS)
def test_a_late_rank_that_disagrees_makes_every_rank_raise(comm, channel):
    """The last rank arrives at call 2 after its peers' 50 ms deadline, with
    another op.  It raises MismatchError there; the others had returned call
    2 (lossy) and raise at call 3, naming call 2, and so does the late rank:
    call 3 fails on every rank.  Before: only the late rank raised (ud), or
    nobody did (rma: the late rank took its peers' records for gone)."""
    late = comm.rank == comm.size - 1
    outcomes = []
    with mpilossy.Communicator(comm, channel=channel, timeout=0.05) as lc:
        x = small_ints(1000, comm.rank, np.float64)
        out = np.empty_like(x)
        for call in (1, 2, 3, 4):
            comm.Barrier()
            op = "sum"
            if call == 2 and late:
                time.sleep(0.3)
                op = "avg"
            try:
                lc.allreduce(x, out, op=op, algorithm="direct")
                outcomes.append("returned")
            except mpilossy.MPILossyError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
        seen = comm.allgather(outcomes)
        comm.Barrier()
        lc.allreduce(x, out, timeout=None)          # in step, exact
        np.testing.assert_array_equal(out, mpi_sum(comm, x))
    for rank, o in enumerate(seen):
        assert o[0] == "returned" and o[3] == "returned", seen
        if rank == comm.size - 1:
            assert o[1].startswith("MismatchError") and "ranks disagree on call 2" in o[1], seen
        else:
            assert o[1] == "returned", seen
        assert o[2].startswith("MismatchError: allreduce call 3") and \
            "call 2 failed after rank" in o[2] and "ranks disagree on call 2" in o[2], seen


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("channel", CHANNELS)
def test_an_error_after_every_peer_returned_reaches_them_at_their_next_call(comm, channel):
    """The last rank's buffer is read-only at call 2, which it reaches after
    its peers returned it: it raises BufferError, they raise at call 3
    (the call fails on every rank), and call 4 is exact everywhere."""
    late = comm.rank == comm.size - 1
    outcomes = []
    with mpilossy.Communicator(comm, channel=channel, timeout=0.05) as lc:
        x = small_ints(1000, comm.rank, np.float64)
        for call in (1, 2, 3):
            comm.Barrier()
            out = np.empty_like(x)
            if call == 2 and late:
                time.sleep(0.3)
                out.flags.writeable = False
            try:
                lc.allreduce(x, out, algorithm="direct")
                outcomes.append("returned")
            except (mpilossy.MPILossyError, BufferError) as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
        comm.Barrier()
        out = np.empty_like(x)
        lc.allreduce(x, out, timeout=None)
        np.testing.assert_array_equal(out, mpi_sum(comm, x))
        seen = comm.allgather(outcomes)
    for rank, o in enumerate(seen):
        if rank == comm.size - 1:
            assert o[1].startswith("BufferError"), seen
        else:
            assert o[1] == "returned", seen
        assert o[2].startswith("BufferError: allreduce call 3") and "call 2 failed" in o[2], seen


# -- failures back to back, and notes of a freed communicator -----------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("timeout", [None, 0.5], ids=["no-deadline", "deadline"])
def test_bad_calls_back_to_back(comm, channel, timeout):
    """Each rank in turn fails three calls in a row, the others calling as
    fast as they can (nothing here synchronises the ranks): every rank
    raises for each of them, and the call after is exact (with a deadline
    it may lose data, never fail).  (A rank used to
    keep only the first of several notes peers sent of calls it had not
    reached, and a rank failing calls back to back overwrites its in-band
    error: a slow rank returned a partial result of a call that failed
    elsewhere.)"""
    took: list = []
    with mpilossy.Communicator(comm, channel=channel, timeout=timeout, loss=None) as lc:
        seen = failures_in_turn(comm, lc, 2 * comm.size, took)
    every = comm.allgather((seen, took))
    # (with a deadline a good call may lose data to a slow rank, never fail)
    good = {"exact"} if timeout is None else {"exact", "partial"}
    expected = ([{"BufferError"}] * 3 + [good]) * (2 * comm.size)
    # A rank whose deadline ended before the failing rank's note reached it
    # (its call lasted the whole deadline: the machine stalled the other)
    # returns what it has and raises at its next call, and so does every
    # rank there (docs/deadlines.md, "One outcome per call on every rank").
    late = {(rank, call) for rank, (ranks, spent) in enumerate(every)
            for call in range(len(expected) - 1)
            if timeout is not None and expected[call] == {"BufferError"}
            and ranks[call] == "partial" and spent[call] >= 0.99 * timeout
            and ranks[call + 1] == "BufferError"}
    after = {call + 1 for _, call in late}

    def allowed(rank: int, call: int) -> set:
        return (expected[call] | ({"partial"} if (rank, call) in late else set())
                | ({"BufferError"} if call in after else set()))

    wrong = [(call, [ranks[call] for ranks, _ in every]) for call in range(len(expected))
             if any(ranks[call] not in allowed(rank, call)
                    for rank, (ranks, _) in enumerate(every))]
    assert not wrong, (wrong[:5], sorted(late))


@pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")
@pytest.mark.parametrize("ranks, channel", [(2, "rma"), (3, "rma"), (3, "ud")])
def test_failures_back_to_back_when_mpi_postpones_the_notes(ranks, channel):
    """The same as above, 60 rounds, with MPICH's shared-memory cells made
    scarce (2 per queue), so that MPI postpones the notes of failed calls
    and sends them only when the failing rank drives progress.  A rank that
    waited for its readers on a shared-memory word made no MPI call, its
    peer gave up waiting for the note, and raised "moved past call N"
    instead of the BufferError (rma at 2 ranks: 47 calls of 300 rounds;
    seen once in CI with the usual cells)."""
    if channel == "ud" and not _core.HAVE_DATAGRAM_AUTH:
        pytest.skip("channel='ud' not built")
    seen = report(run_mpi_script("failures_back_to_back.py", ranks, channel, "60", timeout=120,
                                 MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS="2",
                                 MPILOSSY_UD_PROVIDER="native"), "BACK_TO_BACK")
    assert [r["wrong"] for r in seen] == [{}] * ranks, seen


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("channel", CHANNELS)
def test_notes_of_a_freed_communicator(comm, channel):
    """Every rank fails the last call of a communicator (each tells the others
    over MPI), which is then freed; the next communicator's call of the same
    number must not take those notes for its own (MPI gives a freed
    communicator's context to a new one: a note nobody had read failed the
    new call)."""
    x = small_ints(100, comm.rank, np.int64)
    want = mpi_sum(comm, x)
    for good in range(1, 6):
        with mpilossy.Communicator(comm, channel=channel, timeout=0.5, loss=None) as lc:
            out = np.empty_like(x)
            for call in range(good):         # (the last one failed before: call `good`)
                lc.allreduce(x, out)
                np.testing.assert_array_equal(out, want)
            with pytest.raises(ValueError):
                lc.allreduce(x, out, op="bogus")


# -- a rank behind its peers ---------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_rank_behind_does_not_wait_for_notes_of_calls_its_peers_left(comm):
    """The last rank sleeps through calls 2-4 of its peers (50 ms deadline),
    then makes them.  In call 2 it finds its peers' records rewritten (two
    calls on: the slots alternate) and must know whether they failed that
    call.  Their done notes, sent to it because it was not in the call,
    say they did not: it does not wait for a failure note.  Without them it
    waited NOTE_WAIT_LOSSY (5 ms) in that call, every call it was behind
    (`note_waits_out` 1 on the late rank at 2 and 4 ranks), which kept a
    straggler behind for good.  rma only: the datagram channel tells only
    readers in the call (docs/ud.md)."""
    late = comm.rank == comm.size - 1
    x = small_ints(10_000, comm.rank, np.float64)
    out = np.empty_like(x)
    delivered = []
    with mpilossy.Communicator(comm, channel="rma", timeout=0.05, loss=None,
                               algorithm="direct") as lc:
        comm.Barrier()
        for call in (1, 2, 3, 4):
            if late and call == 2:
                time.sleep(0.5)
            delivered.append(lc.allreduce(x, out).delivered)
        comm.Barrier()
        info = lc.channel_info()
    seen = comm.allgather((info["note_waits_out"], info["done_notes"], delivered))
    assert [waits for waits, _, _ in seen] == [0] * comm.size, seen
    # each of the others told the late rank, absent from calls 2-4, it was done with them
    assert all(notes >= 3 for _, notes, _ in seen[:-1]), seen
    assert all(1 / comm.size <= d <= 1 for _, _, ds in seen for d in ds), seen
