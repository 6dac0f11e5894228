"""The datagram channel under failure and abuse (issue 27): every error path
leaves the channel able to take the next call; errors and the call's
signature reach every rank whatever the loss; a replaying or flooding peer
on the path cannot make a rank resend or recurse without bound.  Each test
starts its own mpiexec (a crash must fail the test, not the suite)."""

import json
import sys

import pytest

from mpilossy import _core
from helpers import HERE, clean_subprocess_env, is_singleton, mpiexec, run_bounded

pytestmark = [
    pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1"),
    pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                       reason="channel='ud' not built (OpenSSL headers missing)"),
]


def launch(script, ranks, *args, timeout=120, **env):
    proc = run_bounded([mpiexec(), "-n", str(ranks), sys.executable, str(HERE / "scripts" / script),
                        *map(str, args)], timeout,
                       clean_subprocess_env(MPILOSSY_UD_PROVIDER="native", **env))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def report(stdout, tag):
    lines = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len(tag) + 1:])


@pytest.mark.parametrize("ranks, timeout", [(2, "none"), (3, "none"), (4, "none"), (3, 0.5)])
def test_a_call_that_cannot_start_leaves_the_channel_usable(ranks, timeout):
    """The last rank has no memory for the call's outbox.  Before: the
    failed begin() kept the old capacity with a freed outbox and installed
    the new layout over buffers sized for an earlier call, so the next call
    wrote through NULL (segmentation fault) and peers' datagrams of the
    failed call were placed out of bounds."""
    ranks_seen = report(launch("ud_failed_begin.py", ranks, timeout), "FAILED_BEGIN")
    assert len(ranks_seen) == ranks
    culprit, others = ranks_seen[-1], ranks_seen[:-1]
    assert culprit["outcome"] == "MemoryError", ranks_seen
    for r in others:
        assert r["outcome"].startswith("MPILossyError") and "could not start call" in \
            r["outcome"], ranks_seen
    for r in ranks_seen:
        assert r["before"] == 0 and r["after"] == [0, 0, 0], ranks_seen
        assert r["again"] == (0 if timeout == "none" else 1), ranks_seen
    assert len({r["seq"] for r in ranks_seen}) == 1, ranks_seen         # calls in step
