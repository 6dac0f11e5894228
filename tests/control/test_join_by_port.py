"""A process started after a loss can reach the survivors through MPI's
ports with the mpich wheel (tests/programs/join_by_port.py): the building
block for a restarted rank to come back (docs/elastic.md, "Growing back").
Under srun: tests/cluster/test_slurm.py."""

import sys

import pytest

from helpers import (PROGRAMS, check_joined, clean_subprocess_env, is_singleton, join_after_loss,
                     mpiexec)

pytestmark = [pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1"),
              pytest.mark.timeout(120)]


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_process_started_after_a_loss_connects_to_the_survivors(tmp_path, ranks):
    """mpiexec -disable-auto-cleanup: the last rank exits, the others accept
    a singleton started outside the job."""
    port = tmp_path / "port"
    lines = join_after_loss([mpiexec(), "-disable-auto-cleanup", "-n", ranks, sys.executable,
                             PROGRAMS / "join_by_port.py", "job", port],
                            clean_subprocess_env(), port)
    check_joined(lines, ranks - 1)
