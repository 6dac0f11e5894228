"""The mutation check: each planted fault (tests/planted/sitecustomize.py)
breaks one promised invariant, and the tests named here, which guard it,
must fail with it planted.  (Unplanted, the same tests pass in the suite.)
A fault that none of its tests catches is a missing test."""

import os
import re
import sys

import pytest

from helpers import HERE, is_singleton, mpiexec, run_bounded

# fault -> (ranks for pytest's own run, 1: the tests launch their own mpiexec;
#           the tests that must catch it, as -k expressions over the files)
CATCHERS = {
    "dropped-but-recorded": (3, ["core/test_weighted.py"], "lossless_is_the_weighted_average"),
    "recorded-lost-but-added": (3, ["core/test_weighted.py"],
                                "each_block_weighs_its_own_contributors and allreduce-rma"),
    "deadline-ten-times": (3, ["core/test_deadline.py"], "sleeping_ten_timeouts and sum-direct"),
    "learned-at-the-cap": (3, ["control/test_auto_timeout.py"],
                           "learned_deadline_is_agreed_and_shrinks"),
    "learned-factor-doubled": (3, ["control/test_auto_timeout.py", "call/test_calls_in_step.py"],
                               "learned_deadline_is_agreed_and_shrinks or straggler"),
    "error-not-told": (3, ["api/test_errors.py"],
                       "(non_contiguous_sendbuf or bad_op) and deadline and not no-deadline"),
    "agreements-late": (3, ["call/test_calls_in_step.py"], "schedule_survives_a_failed_call"),
    "nodes-counted-whole": (1, ["core/test_junctions.py"], "misses_stage_one"),
    "survivor-data-lost": (1, ["control/test_elastic.py"], "rank_that_exits_is_excluded and 4-1"),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", sorted(CATCHERS))
def test_each_planted_fault_is_caught(fault):
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    ranks, files, selection = CATCHERS[fault]
    planted = str(HERE / "planted")
    env = dict(os.environ, PLANTED_FAULT=fault,
               PYTHONPATH=os.pathsep.join([planted, os.environ.get("PYTHONPATH", "")]))
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi",
                  "--timeout=60", "-k", selection, *(str(HERE / f) for f in files)]
    cmd = pytest_run if ranks == 1 else [mpiexec(), "-n", str(ranks), *pytest_run]
    proc = run_bounded(cmd, 180, env)
    # (caught: some rank's tests failed; not a crash, a hang or no tests at all)
    caught = re.search(r"^\d+ failed.* in [\d.]+s", proc.stdout, re.M)
    assert proc.returncode == 1 and caught, \
        f"{fault}: not caught\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}"
