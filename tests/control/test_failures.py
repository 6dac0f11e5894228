"""Ranks that MPI reports as failed (mpilossy/control/failures.py): a rank
that exits for good is seen by the others, which go on exactly on the
communicator of the survivors, on both channels (docs/elastic.md).  The
programs run under their own ``mpiexec -disable-auto-cleanup``."""

import json
import re
import sys

import pytest
from mpi4py import MPI

from mpilossy.control.failures import failed_ranks, reports_failures, survivors
from helpers import PROGRAMS, clean_subprocess_env, mpiexec, run_bounded


@pytest.mark.mpi
def test_nobody_failed_and_everyone_survives(comm):
    assert reports_failures() == ("MPICH" in MPI.Get_library_version())
    assert failed_ranks(comm) == frozenset()
    rest = survivors(comm, [])
    try:
        assert rest.size == comm.size and rest.rank == comm.rank
        assert rest.allreduce(1) == comm.size
    finally:
        rest.Free()


@pytest.mark.mpi(min_size=2)
def test_survivors_without_a_rank_nobody_lost(comm):
    """The communicator without the last rank (alive: it does not take
    part), in the others' order."""
    last = comm.size - 1
    if comm.rank != last:
        rest = survivors(comm, [last])
        try:
            assert rest.size == comm.size - 1 and rest.rank == comm.rank
            assert rest.allreduce(comm.rank) == sum(range(last))
        finally:
            rest.Free()
    comm.Barrier()


@pytest.mark.skipif(not reports_failures(), reason="this MPI does not report failed ranks")
@pytest.mark.parametrize("ranks, victim, channel",
                         [(3, 2, "rma"), (3, 1, "ud"), (4, 1, "rma"), (4, 3, "ud")])
def test_a_rank_exits_and_the_others_go_on(ranks, victim, channel):
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "rank_exits.py"), channel, str(victim)]
    proc = run_bounded(cmd, 90, clean_subprocess_env())
    # (one JSON object per survivor; Hydra may forward two on one line)
    lines = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert sorted(r["rank"] for r in lines) == [r for r in range(ranks) if r != victim], \
        proc.stdout + proc.stderr
    want = sum(r + 1 for r in range(ranks) if r != victim)
    for r in lines:
        assert r["gone"] == [victim] and r["size"] == ranks - 1, r
        assert r["exact"] and r["result"] == want, r
        assert r["seen_after"] < 2.0, r        # (the call's deadline is 0.2 s)


@pytest.mark.skipif(not reports_failures(), reason="this MPI does not report failed ranks")
@pytest.mark.parametrize("how, ranks, victim", [("spare", 4, 1), ("spare", 3, 0),
                                                ("spawn", 3, 2)])
def test_a_rank_exits_and_another_takes_its_place(how, ranks, victim):
    """The MPI a rejoin stands on (tests/programs/rank_replaced.py; not the
    Communicator's yet, docs/elastic.md "Growing back"): a hot spare
    launched with the job joins the survivors' communicator, or a
    replacement that MPI_Comm_spawn started merges with them; the grown
    communicator is back at full size and its all-reduce exact."""
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "rank_replaced.py"), how, str(victim)]
    proc = run_bounded(cmd, 90, clean_subprocess_env())
    lines = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)]
    size = ranks if how == "spawn" else ranks - 1     # (the spare was not working)
    newcomer = -1 if how == "spawn" else ranks - 1
    assert sorted(r["world"] for r in lines) == sorted(
        [r for r in range(ranks) if r != victim and r != newcomer] + [newcomer]), \
        proc.stdout + proc.stderr
    for r in lines:
        assert r["size"] == size and r["result"] == size * (size + 1) // 2, r
        assert r["seconds"] < 10.0, r
    assert sorted(r["rank"] for r in lines) == list(range(size)), lines
