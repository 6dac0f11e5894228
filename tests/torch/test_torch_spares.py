"""DistributedOptimizer on a Communicator with hot spares: a rank lost and
a spare taking its place mid-run (tests/programs/spares_torch.py, under its
own ``mpiexec -disable-auto-cleanup``; docs/elastic.md, "Growing back")."""

import json
import re
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from mpi4py import MPI  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch  # noqa: E402,F401
from mpilossy import MPILossyError  # noqa: E402
from mpilossy.control.failures import reports_failures  # noqa: E402
from helpers import (PROGRAMS, clean_subprocess_env, is_singleton, mpiexec,  # noqa: E402
                     run_bounded)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks, channel, lose", [(4, "rma", "1@5"), (3, "ud", "0@4")])
def test_a_spare_takes_over_a_lost_ranks_training(ranks, channel, lose):
    """The survivors grow back at the end of the step that excluded the
    lost rank (rank 0 too: the lowest survivor calls the spare in); the
    spare, whose model started from another seed, receives the step count,
    parameters and momenta and trains on: at the end every rank's
    parameters and momenta equal rank 0's, every step delivered whole."""
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    if not reports_failures():
        pytest.skip("this MPI does not report failed ranks")
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / "spares_torch.py"), channel, lose, "15"]
    proc = run_bounded(cmd, 120, clean_subprocess_env())
    output = proc.stdout + proc.stderr
    lines = {r["rank"]: r for r in (json.loads(o) for o in re.findall(r"\{[^{}]*\}",
                                                                      proc.stdout))}
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
        assert line["difference"] <= 1e-6, line
        assert line["delivered_after"] == 1.0, line
    for r in working:
        assert lines[r]["joined"] == growth and lines[r]["first"] == 1, lines[r]
    assert lines[spare]["spare"] and lines[spare]["first"] == growth[0][0] + 1, lines[spare]
    assert lines[spare]["joined"] == [], lines[spare]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_wrappers_that_cannot_take_a_spare_in_say_so():
    """On a Communicator with spares: the sharded optimizer, the DDP hook
    and DistributedOptimizer's error feedback refuse on every working
    rank; the spare's placeholder refuses; then the spare is released."""
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
                                            model.named_parameters(), lc)
        with pytest.raises(ValueError, match="spares"):
            mpilossy.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model.named_parameters(), lc,
                                                error_feedback=True)
        with pytest.raises(ValueError, match="spares"):
            mpilossy.torch.AllreduceHookState(lc)
    lc.free()
    comm.Barrier()
