"""Communicator(elastic=True): ranks that exit, stop for good, or die during
the agreement are excluded by the others, which go on over themselves with
every result exact for the ranks it records (tests/programs/elastic.py,
under its own ``mpiexec -disable-auto-cleanup``); and the settings it
refuses, on every rank."""

import json
import sys

import pytest

import mpilossy
from helpers import PROGRAMS, all_ranks_raise, clean_subprocess_env, mpiexec, run_bounded
from mpilossy.control.failures import reports_failures

needs_failures = pytest.mark.skipif(not reports_failures(),
                                    reason="this MPI does not report failed ranks")


def reports(stdout: str) -> list:
    """Every rank's JSON object (Hydra may forward two on one line)."""
    decoder, out, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at >= 0:
        obj, end = decoder.raw_decode(stdout, at)
        out.append(obj)
        at = stdout.find('{"rank"', end)
    return out


def run(ranks: int, channel: str, scenario: str, calls: int = 25) -> list:
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "elastic.py"), channel, scenario, str(calls)]
    proc = run_bounded(cmd, 90, clean_subprocess_env())
    return reports(proc.stdout), proc.stdout + proc.stderr


def check_survivors(lines, ranks, lost, exclusions, output):
    survivors = [r for r in range(ranks) if r not in lost]
    going_on = [r for r in lines if "calls" in r]
    assert sorted(r["rank"] for r in going_on) == survivors, output
    for r in going_on:
        assert r["wrong"] == 0, r                      # every block exact for its contributors
        assert r["members"] == survivors and r["size"] == len(survivors), r
        assert [e["excluded"] for e in r["exclusions"]] == exclusions, r
        assert [c[0] for c in r["callbacks"]] == exclusions, r
    return going_on


@needs_failures
@pytest.mark.parametrize("ranks, victim, channel",
                         [(3, 0, "rma"), (3, 2, "ud"), (4, 1, "ud"), (4, 3, "rma")])
def test_a_rank_that_exits_is_excluded(ranks, victim, channel):
    lines, output = run(ranks, channel, f"exit:{victim}@6")
    for r in check_survivors(lines, ranks, [victim], [[victim]], output):
        exclusion = r["exclusions"][0]
        # excluded after the call it left in: one 0.2 s deadline and the agreement
        assert exclusion["call"] == 6 and exclusion["after"] < 1.5, r


@needs_failures
@pytest.mark.parametrize("ranks, victim, channel", [(3, 1, "rma"), (4, 0, "ud")])
def test_a_rank_stopped_for_good_is_excluded_and_evicted_when_woken(ranks, victim, channel):
    """SIGSTOP: MPI reports nothing; the others exclude it after missing it
    on evict_after=5 calls, and woken, its next call raises EvictedError."""
    lines, output = run(ranks, channel, f"stop:{victim}@6")
    for r in check_survivors(lines, ranks, [victim], [[victim]], output):
        exclusion = r["exclusions"][0]
        assert 6 + 4 <= exclusion["call"] <= 6 + 6 and exclusion["after"] < 3.0, r
    woken = [r for r in lines if r["rank"] == victim]
    assert len(woken) == 1 and woken[0]["woken"].startswith("EvictedError"), output


@needs_failures
@pytest.mark.parametrize("ranks, channel", [(3, "ud"), (4, "rma")])
def test_two_ranks_lost_at_different_calls(ranks, channel):
    first, second = 0, ranks - 1
    lines, output = run(ranks, channel, f"exit:{first}@5,{second}@12")
    check_survivors(lines, ranks, [first, second], [[first], [second]], output)


@needs_failures
@pytest.mark.parametrize("channel", ["rma", "ud"])
def test_a_rank_lost_during_the_agreement(channel):
    """Rank 1 exits; rank 2 exits as it enters the agreement about rank 1:
    the others exclude both in that one agreement."""
    lines, output = run(4, channel, "during:1@6,2")
    check_survivors(lines, 4, [1, 2], [[1, 2]], output)


@pytest.mark.mpi
def test_elastic_settings_are_checked_on_every_rank(comm):
    for kwargs, exc, words in [
            (dict(timeout=None), ValueError, "needs a deadline"),
            (dict(timeout=0.1, evict_after=0), ValueError, "evict_after"),
            (dict(timeout=0.1, elastic_wait=-1), ValueError, "elastic_wait"),
            (dict(timeout=0.1, evict_after=3 + (comm.rank == comm.size - 1)),
             mpilossy.MismatchError if comm.size > 1 else None, "disagree on evict_after")]:
        if exc is None:
            mpilossy.Communicator(comm, elastic=True, **kwargs).free()
            continue
        msg = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, elastic=True, **kwargs),
                              exc)
        assert words in msg


@pytest.mark.mpi
def test_nothing_lost_nothing_excluded(comm):
    with mpilossy.Communicator(comm, timeout=0.5, elastic=True) as lc:
        assert lc.elastic and lc.members == tuple(range(comm.size))
        import numpy as np
        for _ in range(30):
            x = np.full(1000, float(comm.rank))
            stats = lc.allreduce(x, op="avg")
            assert stats.excluded == () and np.all(x == (comm.size - 1) / 2)
        assert lc.size == comm.size
    with mpilossy.Communicator(comm, timeout=0.5) as plain:
        assert not plain.elastic and plain.members == tuple(range(comm.size))
        with pytest.raises(ValueError, match="elastic=True"):
            plain.on_exclusion(print)


@needs_failures
@pytest.mark.parametrize("channel", ["rma", "ud"])
def test_survivors_that_noticed_at_different_calls_stop_clearly(channel):
    """Rank 2 looks for the loss one call after the others: the survivors'
    calls would pair off by one on the new communicator, so every one of
    them raises the same MPILossyError instead (lining them up is not
    built)."""
    lines, output = run(4, channel, "late:1@6,2")
    assert sorted(r["rank"] for r in lines) == [0, 2, 3], output
    errors = {r["error"] for r in lines}
    assert len(errors) == 1, output
    assert "after different calls" in errors.pop() and "{0: 7, 2: 8, 3: 7}" in output


@needs_failures
@pytest.mark.parametrize("wrapper, ranks, channel, lose", [
    ("sharded", 4, "rma", "exit:2@10"), ("sharded", 3, "ud", "stop:0@8"),
    ("distributed", 4, "ud", "exit:3@10"), ("distributed", 3, "rma", "exit:0@10")])
def test_torch_wrappers_go_on_after_an_exclusion(wrapper, ranks, channel, lose):
    """The survivors train on: their models equal each other's and, within
    float32 rounding, an exact MPI_Allreduce run over the survivors from
    the exclusion on (sharded: SGD with momentum, the reference starting
    from the momenta the survivors carried over); the sharded optimizer's
    chunks are cut again for them, and its momenta travel with them
    (tests/programs/elastic_torch.py)."""
    victim = int(lose.split(":")[1].split("@")[0])
    momentum = "0.9" if wrapper == "sharded" else "0"
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "elastic_torch.py"), wrapper, channel, lose, "30", momentum]
    proc = run_bounded(cmd, 90, clean_subprocess_env())
    lines = reports(proc.stdout)
    survivors = [r for r in range(ranks) if r != victim]
    assert sorted(r["rank"] for r in lines) == survivors, proc.stdout + proc.stderr
    for r in lines:
        assert r["members"] == survivors and len(r["exclusions"]) == 1, r
        # (a datagram the loopback dropped after the exclusion makes a step lossy)
        bound = 1e-4 if r["delivered_after"] == 1.0 else 1e-2
        assert r["same"] and r["from_reference"] < bound, r
        assert r["last"] < r["first"], r
    chunks = [r["chunk"] for r in lines]
    if wrapper == "sharded":
        assert sum(chunks) == lines[0]["total"] and max(chunks) - min(chunks) <= 1, chunks
        # the momenta travelled with the chunks: all but the lost owner's (zeros)
        total = lines[0]["total"]
        lost_chunk = total // ranks + (victim < total % ranks)
        assert all(abs(r["momentum_kept"] - (1 - lost_chunk / total)) < 1e-9 for r in lines), \
            [r["momentum_kept"] for r in lines]
    else:
        assert chunks == [lines[0]["total"]] * len(survivors), chunks
