"""Hot spares: Communicator(elastic=True, spares=S) grows back after a loss
(docs/elastic.md, "Growing back"; tests/programs/elastic_spares.py)."""

import json
import re
import sys
import time

import pytest
from mpi4py import MPI

import mpilossy
from mpilossy import MPILossyError, _core
from mpilossy.control.failures import reports_failures
from helpers import (PROGRAMS, clean_subprocess_env, is_singleton, json_reports, mpiexec,
                     run_bounded)


def skip_unless_own_job(channel):
    """The scenario tests start their own mpiexec (at size 1) and need failures
    reported; "ud" needs the datagram channel's authentication."""
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    if not reports_failures():
        pytest.skip("this MPI does not report failed ranks")
    if channel == "ud" and not _core.HAVE_DATAGRAM_AUTH:
        pytest.skip("channel='ud' needs OpenSSL's libcrypto at build time")


def run_spares(ranks, channel, spares, scenario, calls, **env):
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "elastic_spares.py"), channel, str(spares), scenario, str(calls)]
    proc = run_bounded(cmd, 120, clean_subprocess_env(**env))
    lines = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)]
    return {line["rank"]: line for line in lines}, proc.stdout + proc.stderr


# (ranks, channel, spares, scenario, calls, the ranks in at the end, the
# spares called in, in order); a stopped rank is woken at the end and must
# be told it is out
SCENARIOS = [
    (4, "rma", 1, "exit:1@10", 30, [0, 2, 3], [3]),
    (5, "ud", 2, "stop:0@8,2@20", 40, [1, 3, 4], [3, 4]),
    (4, "rma", 1, "exit:1@5,2@15", 30, [0, 3], [3]),
    (5, "rma", 1, "exit:3@6,1@6", 30, [0, 2, 4], [4]),
    # a spare gone (or hung) before the loss: the next one is called in (before: the
    # survivors waited for the gone one in MPI_Comm_create_group for ever)
    (5, "rma", 2, "exit:3@0,1@10", 30, [0, 2, 4], [4]),
    (5, "rma", 2, "stop:3@0,1@10", 30, [0, 2, 4], [4]),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks,channel,spares,scenario,calls,members,called", SCENARIOS)
def test_a_spare_takes_a_lost_ranks_place(ranks, channel, spares, scenario, calls, members,
                                          called):
    """The survivors call spares in at the grow() after the call that
    excluded a rank; every rank in at the end made every call, each block the
    mean over the ranks its call records; the ranks and the newcomers
    agree on the state sent at each growth; the spares are the last
    members; with no spare left, the survivors go on smaller."""
    skip_unless_own_job(channel)
    lines, output = run_spares(ranks, channel, spares, scenario, calls)
    lost = {int(part.split("@")[0]) for part in scenario.partition(":")[2].split(",")}
    assert sorted(r for r in lines if r not in lost) == members, output
    for r in members:
        line = lines[r]
        assert line["calls"] == calls and line["wrong"] == 0, line
        assert line["members"] == members and line["size"] == len(members), line
    # growths (call, spare), in order: every working rank saw them all, a
    # spare those from its own on; each at the grow() after the call after
    # which the last survivor saw the exclusion before it (one that saw it
    # a call earlier answers the next call alone before it grows)
    working = [r for r in members if not lines[r]["spare"]]
    seen = {r: [(c, s) for c, joined in lines[r]["joined"] for s in joined] for r in members}
    assert working and all(seen[r] == seen[working[0]] for r in working), seen
    assert [s for _, s in seen[working[0]]] == called, seen
    for r in members:
        if lines[r]["spare"]:
            mine = called.index(r)
            assert seen[r] == seen[working[0]][mine:], seen
    for call, _ in seen[working[0]]:
        before = max(c for r in working for c, _ in lines[r]["excluded"] if c <= call)
        assert call == before, lines
    # the state sent at each growth: the same on every rank that took part
    sent = {}
    for r in members:
        for call, total, deadlines, loss_rate in lines[r]["sent"]:
            sent.setdefault(call, set()).add(json.dumps([total, deadlines, loss_rate]))
    assert sent and all(len(totals) == 1 for totals in sent.values()), sent
    if scenario.startswith("stop"):
        for r in lost:      # (a spare that hung before its call-in: never called, released)
            woken = "released" if r >= ranks - spares and f"{r}@0" in scenario else "EvictedError"
            assert lines[r]["woken"].startswith(woken), lines[r]


# (ranks, channel, spares, stops V@C, calls, members at the end, ranks called in,
# in order, the rank released at the end)
COMEBACKS = [
    (4, "rma", 1, "1@10,2@50,1@90", 120, [0, 3, 2], [3, 1, 2], 1),
    (5, "ud", 1, "0@10,2@50,0@90", 120, [1, 3, 4, 2], [4, 0, 2], 0),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks,channel,spares,stops,calls,members,called,released", COMEBACKS)
def test_an_excluded_rank_that_wakes_comes_back(ranks, channel, spares, stops, calls, members,
                                                called, released):
    """A rank stops for 3 s, is excluded (the spare takes its place), wakes,
    gets EvictedError and stands by again; at the next loss the survivors
    agree on its offer and call it back in; it is excluded again later
    (the root too, on ud), and the rank it replaced comes back in its
    place.  Every block of every call on every rank is the mean over the
    ranks it records; the state sent at each growth is the same on every
    rank; the rank out at the end is released."""
    skip_unless_own_job(channel)
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "elastic_comeback.py"), channel, str(spares), stops, str(calls), "3"]
    proc = run_bounded(cmd, 120, clean_subprocess_env())
    output = proc.stdout + proc.stderr
    lines = {line["rank"]: line for line in json_reports(proc.stdout)}
    assert sorted(lines) == list(range(ranks)), output
    assert all(line["wrong"] == 0 for line in lines.values()), output
    for r in members:
        line = lines[r]
        assert not line["released"] and line["calls"] == calls, line
        assert line["members"] == members, line
    # since the last growth (which sent the model): a call that lost nothing
    # on any rank gives every rank the same result; one that lost something
    # (a rank late past the 0.2 s deadline on loaded cores) may differ
    tails = [{call: (total, full) for part in json_reports(proc.stdout, '{"tail"')
              if part["tail"] == r for call, total, full in part["calls"]} for r in members]
    assert all(tail.keys() == tails[0].keys() for tail in tails), lines
    whole = [call for call in tails[0] if all(tail[call][1] for tail in tails)]
    assert len(tails[0]) >= 10 and len(whole) >= len(tails[0]) - 3, tails
    assert all(len({tail[call][0] for tail in tails}) == 1 for call in whole), tails
    if len(whole) == len(tails[0]):
        assert len({lines[r]["model"] for r in members}) == 1, lines
    out = lines[released]
    assert out["released"] and out["evicted"] == 2 and out["arrivals"] == 1, out
    # the growths, as the rank in from the start saw them: the spare, then each
    # rank back in the place of the next one lost
    first = [r for r in members if lines[r]["arrivals"] == 0]
    assert first, lines
    seen = [s for joined in lines[first[0]]["joined"] for s in joined[1]]
    assert seen == called, lines[first[0]]
    # a rank that came back was excluded once per stop, came in once per growth
    assert lines[called[-1]]["evicted"] == 1 and lines[called[-1]]["arrivals"] == 1, lines
    sent: dict = {}
    for line in lines.values():
        for call, total in line["sent"]:
            sent.setdefault(call, set()).add(total)
    assert len(sent) == len(called) and all(len(t) == 1 for t in sent.values()), sent


@pytest.mark.timeout(150)
def test_a_spare_starts_from_the_learned_deadline_and_loss_rate():
    """timeout="auto", redundancy="auto": a rank exits after the first
    agreements; the spare called in starts from the survivors' learned
    deadlines (below the 1 s cap, the same on every rank at the growth)
    and agreed loss rate, not from the cap."""
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    if not reports_failures():
        pytest.skip("this MPI does not report failed ranks")
    lines, output = run_spares(4, "rma", 1, "exit:1@40", 60, SPARES_TIMEOUT="auto",
                               SPARES_REDUNDANCY="auto")
    assert sorted(lines) == [0, 2, 3], output
    sent = [lines[r]["sent"] for r in (0, 2, 3)]
    # (MPI reports the exit within milliseconds, a few 7 ms calls; evict_after=5
    # bounds it; a rank that saw it a call earlier answers the next call alone, so
    # the first call on the survivors' communicator follows the later one)
    seen = [lines[r]["excluded"] for r in (0, 2)]
    assert all(len(e) == 1 and e[0][1] == [1] and 40 <= e[0][0] <= 45 for e in seen), seen
    excluded_after = max(e[0][0] for e in seen)
    assert all(len(s) == 1 and s[0][0] == excluded_after for s in sent), sent
    deadlines = [s[0][2] for s in sent]
    assert deadlines[0] and all(d == deadlines[0] for d in deadlines), deadlines
    assert all(t < 1.0 for _, t in deadlines[0]), deadlines
    assert all(s[0][3] is not None and s[0][3] == sent[0][0][3] for s in sent), sent
    assert all(lines[r]["calls"] == 60 and lines[r]["wrong"] == 0 for r in (0, 2, 3)), lines


@pytest.mark.timeout(60)
def test_unused_spares_are_released():
    """Nobody lost: when the working ranks free the communicator, the
    spare's stand_by() returns False."""
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    lines, output = run_spares(3, "rma", 1, "none:", 20)
    assert lines[2] == {"rank": 2, "spare": True, "called": False}, output
    assert lines[0]["calls"] == lines[1]["calls"] == 20 and not lines[0]["joined"], output


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_spares_need_elastic_and_a_working_rank():
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError, match="elastic=True"):
        mpilossy.Communicator(comm, timeout=0.5, spares=1)
    with pytest.raises(ValueError, match="leaves no working rank"):
        mpilossy.Communicator(comm, timeout=0.5, elastic=True, spares=comm.size)
    with pytest.raises(ValueError, match="spares"):
        mpilossy.Communicator(comm, timeout=0.5, elastic=True, spares=-1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_spare_stands_by_until_released():
    """In the suite's own job: the last rank is a spare; it refuses
    collectives and working-rank calls with clear errors, and stand_by()
    returns False once the working ranks free the communicator."""
    comm = MPI.COMM_WORLD
    lc = mpilossy.Communicator(comm, timeout=0.5, elastic=True, spares=1)
    assert lc.spare == (comm.rank == comm.size - 1)
    if lc.spare:
        assert lc.members == ()
        with pytest.raises(MPILossyError, match="spare standing by"):
            lc.allreduce(mpilossy_array())
        with pytest.raises(ValueError, match="seconds > 0"):
            lc.stand_by(timeout=-1.0)
        assert lc.stand_by(timeout=30.0) is False
        with pytest.raises(ValueError, match="not called in"):
            lc.stand_by()
    else:
        assert lc.size == comm.size - 1 and lc.members == tuple(range(comm.size - 1))
        with pytest.raises(ValueError, match="not called in"):
            lc.stand_by()
        x = mpilossy_array() + comm.rank
        stats = lc.allreduce(x, op="avg")
        assert stats.delivered < 1.0 or (x == (comm.size - 2) / 2 + 1).all(), stats
    lc.free()
    comm.Barrier()


def mpilossy_array():
    import numpy as np
    return np.ones(64)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(30)
def test_an_offer_heard_after_it_was_taken_never_calls_a_rank_in_again():
    """Offers are numbered by their sender: one that reaches a rank after
    the same offer was taken (it was out or standing by when it came) is
    ignored, and so is the agreed set's copy of it; a rank that offers
    again (it left again) is taken again.  (The soak's stale offer called
    in a rank that had exited since: the survivors hung building the
    grown communicator.)"""
    from mpilossy.control.spares import Spares
    spares = Spares(MPI.COMM_SELF.Dup(), 0)
    spares._file(5, 1)
    assert spares.offers == {5: 1}
    assert spares.enlist({5: 1, 2: 1}, members=[0, 1, 2]) == [5]     # (2 is in: stale)
    assert spares.left == [5] and spares.offers == {} and spares.taken == {5: 1, 2: 1}
    spares.left = []                # (called in, later out for good)
    spares._file(5, 1)              # (a copy read late)
    assert spares.offers == {}
    assert spares.enlist({5: 1}, members=[0, 1]) == [] and spares.left == []
    spares._file(5, 2)              # (back again after a second exclusion)
    assert spares.enlist({5: 2}, members=[0, 1]) == [5] and spares.taken[5] == 2
    spares.parent.Free()


class _Request:
    def __init__(self, done):
        self.done = done

    def Test(self):
        return self.done


class _Parent:
    """A stand-in for the spares' parent duplicate: 8 ranks, this one 7;
    nothing ever arrives; sends to `stuck` ranks never complete."""

    def __init__(self, stuck=()):
        self.stuck, self.sent = set(stuck), []

    def Get_size(self):
        return 8

    def Get_rank(self):
        return 7

    def isend(self, message, dest, tag):
        self.sent.append((dest, message))
        return _Request(dest not in self.stuck)

    def iprobe(self, *args):
        return False


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(30)
def test_a_rank_back_waits_for_those_it_offered_itself_to_and_keeps_no_finished_send(
        monkeypatch):
    """A rank that came back stands by until the ranks it offered itself to
    are all reported failed, whatever became of the launch-time working
    ranks (with ranks coming back, the working ranks move); the requests
    of its offers are dropped once complete, so coming back often keeps no
    growing list of them."""
    from mpilossy.control import spares as module
    failed = set()
    monkeypatch.setattr(module, "failed_ranks", lambda comm: frozenset(failed))
    spares = module.Spares(_Parent(stuck={6}), 2)
    assert spares.callers == [0, 1, 2, 3, 4, 5]
    failed |= {0, 1, 2, 3, 4, 5}
    assert spares.stand_by(bound=0.05) is None          # (a spare: no working rank left)
    failed.clear()
    failed.add(0)
    spares.offer([0, 5, 6])                 # (0 failed: no offer to it)
    assert spares.callers == [5, 6] and spares.parent.sent == [(5, 1), (6, 1)]
    failed |= {1, 2, 3, 4}                  # (every launch-time working rank but 5)
    failed.add(5)
    began = time.monotonic()
    assert spares.stand_by(bound=0.3) is None
    assert time.monotonic() - began >= 0.25, "gave up while a rank it offered itself to lives"
    failed.add(6)
    began = time.monotonic()
    assert spares.stand_by(bound=5) is None
    assert time.monotonic() - began < 1, "waited for callers MPI reports failed"
    failed.clear()
    for _ in range(5):
        spares.offer([5, 6])
    # (each offer drops the sends that completed before it: the stuck rank's
    # 6 stay, and the last offer's send to rank 5)
    assert [r.Test() for r in spares._sends].count(False) == 6 and len(spares._sends) == 7
    assert len(spares.parent.sent) == 2 + 10
