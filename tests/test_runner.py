"""tests/run.py, the suite's runner: a test past its per-test bound ends its
whole session (pytest-timeout's thread method exits the process), and the
runner resumes after it (tests/run_plugin.py) instead of losing every result
that would have come after; a test that failed runs once more, and counts
as passed only if that rerun passes.  Run on a planted suite at 1 and 2
ranks."""

import os
import re
import sys
import textwrap

import pytest

from helpers import HERE, clean_subprocess_env, is_singleton, run_bounded

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own runs: runs at size 1")

PLANTED = '''
import os, time
import pytest

pytestmark = pytest.mark.mpi
FLAG = os.path.join(os.path.dirname(__file__), "hung-once-{size}-" + os.environ.get("PMI_RANK", "0"))

def test_a_passes():
    pass

def test_b_hangs_the_first_time_only():
    if not os.path.exists(FLAG):
        open(FLAG, "w").close()
        time.sleep(60)

def test_c_skips():
    pytest.skip("planted")

def test_d_hangs_every_time():
    time.sleep(60)

def test_e_fails():
    assert False, "planted"

def test_f_passes_after_the_hangs():
    pass

def test_g_fails_the_first_time_only():
    flag = FLAG.replace("hung-once", "failed-once")
    if not os.path.exists(flag):
        open(flag, "w").close()
        assert False, "planted"
'''


@pytest.mark.parametrize("size", [1, 2])
def test_a_hung_test_ends_its_session_and_the_runner_resumes_after_it(tmp_path, size):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ["run_plugin"]\n')
    (suite / "test_planted.py").write_text(textwrap.dedent(PLANTED).replace("{size}", str(size)))
    env = clean_subprocess_env(PYTHONPATH=str(HERE))
    proc = run_bounded([sys.executable, str(HERE / "run.py"), "--sizes", str(size),
                        "--per-test", "4", "--timeout", "150", "--path", str(suite)],
                       170, env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    summary = re.search(rf"== {size} rank\(s\): (\d+) passed, (\d+) failed, (\d+) skipped", out)
    assert summary, out[-4000:]
    # a, b (on its second try), f and g (on its rerun) pass; d (hung twice)
    # and e (on its rerun too) fail; c skips
    assert tuple(int(n) for n in summary.groups()) == (4, 2, 1), out[-4000:]
    assert proc.returncode == 1, out[-4000:]
    assert re.search(r"test_b_hangs_the_first_time_only ended session 1 .*tried once more",
                     out), out[-4000:]
    assert re.search(r"test_d_hangs_every_time ended its session again .*counted as failed",
                     out), out[-4000:]
    assert os.path.exists(suite / f"hung-once-{size}-0")
    assert re.search(r"run once more: \S*test_planted.py::test_g_fails_the_first_time_only: "
                     r"passed on its rerun", out), out[-4000:]
    assert re.search(r"run once more: \S*test_planted.py::test_e_fails: failed again", out), \
        out[-4000:]
    assert "test_d_hangs_every_time: " not in out, out[-4000:]     # (had its second try)
