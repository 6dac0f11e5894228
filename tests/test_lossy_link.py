"""scripts/lossy_link.py, short: a real lossy link (namespace, MTU 1500,
nftables drops) under MPI over TCP and mpilossy's datagram channel.  Needs
root and nft: without them the script exits 3 and these tests skip."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpilossy import _core
from helpers import HERE, clean_subprocess_env, is_singleton, run_bounded

SCRIPT = HERE.parent / "scripts" / "lossy_link.py"

pytestmark = [
    pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1"),
    pytest.mark.skipif(not (_core.HAVE_LIBFABRIC and _core.HAVE_DATAGRAM_AUTH),
                       reason="channel='ud' not built (libfabric or OpenSSL headers missing)"),
]


def namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def run_script(*args: str, timeout: float = 300):
    proc = run_bounded([sys.executable, str(SCRIPT), *args], timeout, clean_subprocess_env())
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip())
    return proc


def test_bench_on_a_dropping_link(tmp_path):
    """20% drops: TCP really retransmits (the kernel's counter), MPI and
    mpilossy both give figures, mpilossy loses contributions but not the
    deadline, and the namespace is gone afterwards."""
    before = namespaces() if os.geteuid() == 0 else set()
    out = tmp_path / "rows.json"
    proc = run_script("bench", "--np", "2", "--drops", "0.2", "--sizes", "256K:0.05",
                      "--iters", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["kernel"]["Tcp.RetransSegs"] > 0, row["kernel"]
    assert row["kernel"]["Udp.OutDatagrams"] > 0, row["kernel"]
    assert 0 < row["delivered"] < 1, row
    assert row["mpi_p50_us"] > 0 and row["p50_us"] > 0, row
    # 50 ms deadline: no call past it by more than scheduling on 2 cores.
    assert row["max_us"] < 50e3 + 200e3, row
    assert namespaces() == before


def test_sigterm_removes_the_namespace(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces and nftables)")
    before = namespaces()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "bench", "--np", "2", "--drops",
                             "0.05", "--sizes", "1M:0.05", "--iters", "1000"],
                            env=clean_subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (namespaces() - before) and time.monotonic() < deadline:
            time.sleep(0.1)
        made = namespaces() - before
        assert made and all(n.startswith("mpilossy-link-") for n in made), made
        time.sleep(2)                   # the job is running inside it now
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert namespaces() == before
    assert not list(Path("/dev/shm").glob("mpilossy-bench-*"))     # the job's meeting folder
