"""DistributedOptimizer, ShardedOptimizer and the DDP hook on a
Communicator with hot spares: a rank lost and a spare taking its place mid-run
(tests/programs/spares_torch.py, under its own
``mpiexec -disable-auto-cleanup``; docs/elastic.md, "Growing back")."""

import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from mpi4py import MPI  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch  # noqa: E402,F401
from mpilossy import MPILossyError, _core  # noqa: E402
from mpilossy.control.failures import reports_failures  # noqa: E402
from helpers import (PROGRAMS, clean_subprocess_env, is_singleton, json_reports,  # noqa: E402
                     mpiexec, run_bounded)


def run_spares_program(mode, ranks, channel, lose, *extra):
    """The program's JSON lines by rank, and its whole output."""
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    if not reports_failures():
        pytest.skip("this MPI does not report failed ranks")
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "spares_torch.py"), channel, lose, "15", mode, *map(str, extra)]
    proc = run_bounded(cmd, 120, clean_subprocess_env())
    output = proc.stdout + proc.stderr
    return {r["rank"]: r for r in json_reports(proc.stdout)}, output


LOSSES = [(4, "rma", "1@5"), (3, "ud", "0@4")]


def check_growth(lines, output, ranks, lose):
    """One growth, the spare in it, every rank at the end of the run with
    rank 0's parameters and drift control's step count, everything
    delivered after the growth; returns
    (the growth's step, the spare)."""
    victim, at = (int(v) for v in lose.split("@"))
    spare = ranks - 1
    members = [r for r in range(ranks) if r != victim]
    assert sorted(lines) == members, output
    working = [r for r in members if r != spare]
    growth = lines[working[0]]["joined"]
    assert len(growth) == 1 and growth[0][1] == [spare] and growth[0][0] in (at, at + 1), output
    for r in members:
        line = lines[r]
        assert line["steps"] == 15 and line["members"] == members, line
        assert line["drift_steps"] == 15, line
        assert line["difference"] <= 1e-6, line
        assert line["delivered_after"] == 1.0, line
    for r in working:
        assert lines[r]["joined"] == growth and lines[r]["first"] == 1, lines[r]
    assert lines[spare]["spare"] and lines[spare]["first"] == growth[0][0] + 1, lines[spare]
    assert lines[spare]["joined"] == [], lines[spare]
    return growth[0][0], spare


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks, channel, lose, mode",
                         [loss + ("replicated",) for loss in LOSSES] + [LOSSES[0] + ("ddp",)])
def test_a_spare_takes_over_a_lost_ranks_training(ranks, channel, lose, mode):
    """The survivors grow back at the end of the step that excluded the
    lost rank (rank 0 too: the lowest survivor calls the spare in); the
    spare, whose model started from another seed, receives the step count,
    parameters and momenta and trains on: at the end every rank's
    parameters and momenta equal rank 0's, every step delivered whole.
    "ddp": DistributedDataParallel on local_group() with the hook, whose
    grow() does what the wrapper's step() does (DDP's own bucket order in
    the newcomer's first step differs from the others': reduced per
    bucket, its model ended 0.024 away from rank 0's)."""
    lines, output = run_spares_program(mode, ranks, channel, lose)
    check_growth(lines, output, ranks, lose)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks, channel, lose", LOSSES)
def test_a_spare_takes_a_chunk_of_the_sharded_optimizer(ranks, channel, lose):
    """ShardedOptimizer: at the growth the chunks are cut again over the
    survivors and the spare; the momentum summed over every rank is the
    same before and after, to the bit (moved), and the spare holds its
    part of it; then every rank trains on with rank 0's parameters."""
    lines, output = run_spares_program("sharded", ranks, channel, lose)
    _, spare = check_growth(lines, output, ranks, lose)
    for r, line in lines.items():
        assert len(line["checks"]) == 1, line
        check = line["checks"][0]
        assert check["moved"] == 0.0 and check["held"] > 0, line
    assert lines[spare]["checks"][0]["mine"] > 0, lines[spare]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("copies", [1, 0])
def test_a_lost_ranks_chunk_of_the_state_comes_back_from_the_copy_kept_of_it(copies):
    """ShardedOptimizer(copy_state_every=1) on 4 ranks, the last a spare:
    rank 1 exits before step 5.  The momentum of its chunk after the
    exclusion (summed over the ranks as the growth begins) is, to the bit,
    what rank 1 held as it left: the copy rank 2 kept at the end of step 4.
    copy_state_every=0: that chunk's momentum restarts from zeros."""
    lines, output = run_spares_program(f"sharded:{copies}", 4, "rma", "1@5")
    check_growth(lines, output, 4, "1@5")
    lost = json_reports(output, '{"lost"')
    assert len(lost) == 1 and lost[0]["lost"] == 1, output
    left = lost[0]["momentum"]
    assert left["nonzero"] > 1000, left     # (its chunk: a third of the 3,364 parameters)
    for r, line in lines.items():
        before = line["checks"][0]["before"]
        if copies:
            assert before == left, (r, before, left)
        else:
            assert before["nonzero"] == 0, (r, before)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_a_rank_lost_as_the_growth_sends_the_state(mode):
    """5 ranks, the last a spare: rank 1 exits before step 5, and rank 0,
    the root of the growth's broadcasts, exits as they begin.  The checks
    and the state sent at the growth are made again over the survivors
    (rank 2 the root): ranks 2, 3 and the newcomer 4 end the 15 steps
    together with the same parameters and drift control's step count,
    everything delivered after the growth.  (Before: MembershipChanged out
    of the survivors' step() and the newcomer's wrapper.)"""
    lines, output = run_spares_program(mode, 5, "rma", "1@5", 0)
    assert sorted(lines) == [2, 3, 4], output
    growth = lines[2]["joined"]
    assert len(growth) == 1 and growth[0][1] == [4] and growth[0][0] in (5, 6), output
    for r, line in lines.items():
        assert line["steps"] == 15 and line["members"] == [2, 3, 4], line
        assert line["drift_steps"] == 15 and line["difference"] <= 1e-6, line
        assert line["delivered_after"] == 1.0, line
    assert lines[3]["joined"] == growth, lines[3]
    assert lines[4]["spare"] and lines[4]["first"] == growth[0][0] + 1, lines[4]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["replicated", "sharded", "ddp"])
def test_a_process_started_outside_the_job_takes_over_a_lost_ranks_training(mode, tmp_path):
    """No spare: 3 ranks on a rendezvous (channel ud), rank 1 exits before
    step 5; a process started beside the job (mpiexec -n 1, join()) takes
    its place as member 3, receives the step count, parameters and
    optimizer state, and trains on: the same checks as a spare's (sharded:
    the momentum moved, not changed, when the chunks are cut again)."""
    if not _core.HAVE_DATAGRAM_AUTH:
        pytest.skip("channel='ud' needs OpenSSL's libcrypto at build time")
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    if not reports_failures():
        pytest.skip("this MPI does not report failed ranks")
    env = clean_subprocess_env(SPARES_RENDEZVOUS=str(tmp_path))
    program = [sys.executable, str(PROGRAMS / "spares_torch.py")]
    job = subprocess.Popen([mpiexec(), "-disable-auto-cleanup", "-n", "3"] + program
                           + ["ud", "1@5", "15", mode], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        new = run_bounded([mpiexec(), "-n", "1"] + program + ["join", "1@0", "15", mode],
                          120, env)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    output = out + err + new.stdout + new.stderr
    lines = {r["rank"]: r for r in json_reports(out + new.stdout)}
    _, newcomer = check_growth(lines, output, 4, "1@5")
    if mode == "sharded":
        for line in lines.values():
            check = line["checks"][0]
            assert len(line["checks"]) == 1 and check["moved"] == 0.0, line
        assert lines[newcomer]["checks"][0]["mine"] > 0, lines[newcomer]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_wrappers_that_cannot_take_a_spare_in_say_so():
    """On a Communicator with spares: the optimizers' error feedback and the
    DDP hook without the model and optimizer a newcomer receives refuse on
    every working rank; the spare's placeholder refuses; then the spare is
    released."""
    comm = MPI.COMM_WORLD
    lc = mpilossy.Communicator(comm, timeout=0.5, elastic=True, spares=1,
                               scaling="zero-fill")
    model = torch.nn.Linear(4, 2)
    if lc.spare:
        with pytest.raises(MPILossyError, match="spare standing by"):
            mpilossy.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model.named_parameters(), lc)
        assert lc.stand_by(timeout=30.0) is False
    else:
        with pytest.raises(ValueError, match="spares"):
            mpilossy.torch.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            model.named_parameters(), lc, error_feedback=True)
        with pytest.raises(ValueError, match="spares"):
            mpilossy.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model.named_parameters(), lc,
                                                error_feedback=True)
        with pytest.raises(ValueError, match="spares.*model= and optimizer="):
            mpilossy.torch.AllreduceHookState(lc)
        with pytest.raises(ValueError, match="model= and optimizer="):
            mpilossy.torch.AllreduceHookState(lc, model=model)
    lc.free()
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_the_ddp_hook_on_a_growing_communicator_refuses_what_cannot_grow(tmp_path_factory):
    """A Communicator with a rendezvous (every rank working): the hook
    refuses compression (per-rank residuals) and a DDP whose own process
    group spans the ranks (it cannot take a newcomer in), on every rank;
    DDP on local_group() is taken."""
    if not _core.HAVE_DATAGRAM_AUTH:
        pytest.skip("a rendezvous needs channel='ud', which needs OpenSSL's libcrypto at build time")
    comm = MPI.COMM_WORLD
    directory = comm.bcast(str(tmp_path_factory.mktemp("rendezvous")) if comm.rank == 0
                           else None)
    lc = mpilossy.Communicator(comm, channel="ud", timeout=0.5, elastic=True,
                               rendezvous=directory)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="compression"):
        mpilossy.torch.AllreduceHookState(lc, model=model, optimizer=optimizer,
                                          compression=mpilossy.torch.LowBit("int8"))
    mpilossy.torch.init_process_group("gloo", comm=comm)
    try:
        spanning = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match="local_group"):
            mpilossy.torch.AllreduceHookState(lc, model=spanning, optimizer=optimizer)
    finally:
        mpilossy.torch.destroy_process_group()
    local = torch.nn.parallel.DistributedDataParallel(
        model, process_group=mpilossy.torch.local_group())
    state = mpilossy.torch.AllreduceHookState(lc, model=local, optimizer=optimizer)
    assert state.grow() == ()       # (nobody knocked)
    lc.free()
    comm.Barrier()
