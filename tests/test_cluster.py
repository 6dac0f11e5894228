"""scripts/cluster.py, the emulated cluster itself: its bench of MPI over TCP
against mpilossy's datagrams across a dropping switch (and the former
lossy link, scripts/lossy_link.py, now its loopback mode), a switch port
that overflows under incast, and cleanup on every way out (SIGTERM; a
SIGKILLed run's leftovers removed by the next start).  Needs root and the
tools cluster.py names: without them the script exits 3 and these tests
skip."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpilossy import _core
from helpers import HERE, clean_subprocess_env, is_singleton, run_bounded

sys.path.insert(0, str(HERE.parent / "scripts"))
import cluster as emulated  # noqa: E402

SCRIPT = HERE.parent / "scripts" / "cluster.py"
ALIAS = HERE.parent / "scripts" / "lossy_link.py"

pytestmark = [
    pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1"),
]
needs_ud = pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                              reason="channel='ud' not built (OpenSSL headers missing)")


def ours() -> set:
    """Namespaces and state folders of emulated clusters (lossy_link's too)."""
    if os.geteuid() != 0:
        return set()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return ({n for n in names if n.startswith(emulated.PREFIX)}
            | {str(p) for p in emulated.STATE_ROOT.glob(emulated.PREFIX + "*")})


def run_script(script: Path, *args: str, timeout: float = 300):
    proc = run_bounded([sys.executable, str(script), *args], timeout, clean_subprocess_env())
    if proc.returncode == emulated.UNAVAILABLE:
        pytest.skip(proc.stderr.strip())
    return proc


def bench_row(script: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "rows.json"
    proc = run_script(script, "bench", *args, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1, rows
    return rows[0]


@needs_ud
def test_bench_across_a_dropping_switch(tmp_path):
    """Two nodes, the switch drops 20%: TCP really retransmits (the kernel's
    counter), the drop rule counted its drops, MPI and mpilossy both give
    figures, mpilossy loses contributions but not the deadline, and nothing
    of the cluster is left afterwards."""
    before = ours()
    row = bench_row(SCRIPT, tmp_path, "--nodes", "2", "--ppn", "1", "--drops", "0.2",
                    "--sizes", "256K:0.05", "--iters", "8")
    assert row["kernel"]["Tcp.RetransSegs"] > 0, row["kernel"]
    assert row["kernel"]["Udp.OutDatagrams"] > 0, row["kernel"]
    assert row["switch_drops"] > 0, row
    assert 0 < row["delivered"] < 1, row
    assert row["mpi_p50_us"] > 0 and row["p50_us"] > 0, row
    # 50 ms deadline: no call past it by more than scheduling on 2 cores.
    assert row["max_us"] < 50e3 + 200e3, row
    assert ours() <= before, ours() - before


@needs_ud
def test_lossy_link_is_the_loopback_mode(tmp_path):
    """scripts/lossy_link.py still runs its documented commands: one node,
    ranks through its loopback, drops on the loopback."""
    before = ours()
    row = bench_row(ALIAS, tmp_path, "--np", "2", "--drops", "0.05", "--sizes", "64K:0.05",
                    "--iters", "4")
    assert row["switch_drops"] > 0 and row["kernel"]["Udp.OutDatagrams"] > 0, row
    assert row["max_us"] < 50e3 + 200e3, row
    assert ours() <= before, ours() - before


def test_switch_port_overflows_under_incast():
    """Two nodes blast UDP at a third: its switch port (100 Mbit/s, 16 KB of
    queue) drops what does not fit, and counts it; the senders' own ports
    drop nothing."""
    why = emulated.unavailable()
    if why:
        pytest.skip(why)
    blast = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
             "for _ in range(2000):\n"
             "    try: s.sendto(bytes(1400), ('node3', 9))\n"
             "    except OSError: pass\n")
    try:
        c = emulated.Cluster(nodes=3, rate="100mbit", queue="16kb", node_rate=None).open()
    except emulated.ClusterUnavailable as exc:
        pytest.skip(str(exc))
    with c:
        senders = [c.popen(c.on_node(n, [sys.executable, "-c", blast]), env=clean_subprocess_env())
                   for n in (1, 2)]
        for proc in senders:
            assert proc.wait(timeout=60) == 0
        ports = c.counters()["ports"]
    assert ports["p3"]["drops"] > 500, ports
    assert ports["p3"]["packets"] > 100, ports
    assert ports["p1"]["drops"] == ports["p2"]["drops"] == 0, ports


def test_launcher_passes_shellcheck():
    """The launcher wrapper that cluster.py writes for hydra (POSIX sh)."""
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (scripts/system-packages.sh installs it)")
    why = emulated.unavailable()
    if why:
        pytest.skip(why)
    with emulated.Cluster(nodes=2) as c:
        done = subprocess.run([shellcheck, str(c.wrapper)], capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_not_root_says_why_and_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert emulated.main(["run", "--", "true"]) == emulated.UNAVAILABLE
    assert "needs root" in capsys.readouterr().err


def start_job(*extra: str) -> subprocess.Popen:
    """cluster.py run with ranks that sleep; returns once they run on node 2."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "run", "--nodes", "2", "--ppn", "1",
                             *extra, "--", sys.executable, "-c", "import time; time.sleep(300)"],
                            env=clean_subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    node2 = f"{emulated.PREFIX}{proc.pid}-1-n2"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if len(emulated._netns_pids(node2)) >= 2:       # hydra's proxy and the rank
            return proc
        time.sleep(0.1)
    proc.kill()
    out, err = proc.communicate()
    if proc.returncode == emulated.UNAVAILABLE:
        pytest.skip(err.strip())
    raise AssertionError(f"the job did not start on node 2: {out[-2000:]}{err[-2000:]}")


def processes_on(names) -> list:
    return [p for n in names if n.startswith(emulated.PREFIX) and "/" not in n
            for p in emulated._netns_pids(n)]


def alive(pids, wait: float = 5.0) -> list:
    """Those of `pids` that still run (zombies, dead and waiting for init to
    reap them, do not count), after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        out = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def test_sigterm_removes_everything():
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    before = ours()
    proc = start_job()
    try:
        made = ours() - before
        assert any(n.endswith("-sw") for n in made), made
        job = processes_on(made)
        assert job
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert ours() <= before, ours() - before
    assert not alive(job), job


def test_sigkilled_run_is_cleaned_up_by_the_next():
    """SIGKILL leaves the namespaces and the job in them; the next start
    finds them by name, sees that their owner is gone, kills the job and
    removes them (and leaves a live run alone)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    before = ours()
    live = start_job()
    dead = start_job()
    try:
        dead_made = {n for n in ours() - before if f"{emulated.PREFIX}{dead.pid}-" in n}
        live_made = {n for n in ours() - before if f"{emulated.PREFIX}{live.pid}-" in n}
        assert dead_made and live_made
        job = processes_on(dead_made)
        assert job
        dead.kill()
        dead.wait()
        assert dead_made <= ours()                  # left behind
        proc = run_script(SCRIPT, "run", "--nodes", "1", "--ppn", "1", "--", "true",
                          timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not dead_made & ours()
        assert not alive(job), job
        assert live_made <= ours() and live.poll() is None
    finally:
        for p in (live, dead):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
    assert ours() <= before, ours() - before
