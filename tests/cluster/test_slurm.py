"""The job templates in jobs/, run for real with `sbatch --wait` on a
single-node Slurm that the test starts on 127.0.0.1 (Debian's slurm-wlm and
munge, installed if missing; skipped with the reason where Slurm cannot be
installed or started).  Each template runs on 4 tasks with small sizes; the
output files, named by job id, are checked.  Starts its own processes, so it
runs in the single-rank session only."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_helpers import JOBS, cluster_fixture
from helpers import (PROGRAMS, check_joined, clean_subprocess_env, is_singleton,
                     join_after_loss, json_reports, run_bounded)
from mpilossy import _core

pytestmark = [pytest.mark.skipif(not is_singleton(), reason="starts its own Slurm: runs at size 1"),
              pytest.mark.timeout(180)]

VENV = str(Path(sys.executable).parent.parent)  # the environment running the tests


@pytest.fixture(scope="module")
def slurm():
    yield from cluster_fixture()


def submit(slurm, tmp_path, template, **env):
    return slurm.run_template(template, tmp_path, MPILOSSY_VENV=VENV, **env)


def test_every_template_has_a_header_and_the_parameters():
    templates = sorted(JOBS.glob("*.sbatch"))
    assert [t.name for t in templates] == ["bench.sbatch", "smoke.sbatch", "train.sbatch"]
    for t in templates:
        text = t.read_text()
        head = re.split(r"^#SBATCH", text, maxsplit=1, flags=re.M)[0]
        assert "Edit before use" in head and "Output:" in head, t.name
        assert re.search(r"^#SBATCH --output=\S*%j\S*$", text, re.M), t.name
        assert re.search(r"^#SBATCH --error=\S*%j\S*$", text, re.M), t.name
        assert "module load" in text and "MPILOSSY_VENV" in text, t.name
        assert 'srun --mpi="$SRUN_MPI"' in text and "mpiexec -n" in text, t.name
        # the channel, and the datagram channel's transport, named in the header
        assert re.search(r"^#   CHANNEL +\S", head, re.M), t.name
        assert "MPILOSSY_UD_PROVIDER" in head and "native" in head, t.name


needs_ud = pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                              reason="channel='ud' not built (OpenSSL headers missing)")


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_smoke(slurm, tmp_path, launcher):
    job, code, out, err = submit(slurm, tmp_path, "smoke.sbatch", LAUNCHER=launcher)
    assert code == 0, out + err
    assert f"job {job}: 4 tasks on 1 node(s)" in out
    assert "4 ranks on 1 node(s)" in out, out
    # On one node every rank reads its 3 peers through shared memory.
    assert len(re.findall(r"rank \d on \S+: 3 peers through shared memory, 0 through MPI_Rget",
                          out)) == 4, out
    assert out.rstrip().endswith("SMOKE OK"), out
    # python -m mpilossy info ran first, on every rank
    assert "== python -m mpilossy info" in out and "channel rma: built" in out, out
    assert len(re.findall(r"^  [0-3]: \S+ pid \d+", out, re.M)) == 4, out


# How the emulated cluster (mpilossy.cluster) runs a job across nodes, on one
# node: MPICH over TCP (libfabric's tcp provider) and no shared memory between
# ranks, mpilossy's datagrams through its own UDP sockets.
ETHERNET = dict(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp", MPIR_CVAR_NOLOCAL="1",
                MPILOSSY_UD_PROVIDER="native")


@needs_ud
@pytest.mark.parametrize("launcher", ["srun", "mpiexec-over-tcp"])
def test_smoke_datagram_channel(slurm, tmp_path, launcher):
    """CHANNEL=rma,ud checks both channels; MPILOSSY_UD_PROVIDER (and under
    mpiexec-over-tcp the MPI's own variables, FI_PROVIDER=tcp among them,
    which the datagram channel must not take for its own) reach every rank,
    whose line names the transport, interface and address it used."""
    env = dict(CHANNEL="rma,ud", MPILOSSY_UD_PROVIDER="native")
    if launcher != "srun":
        env.update(ETHERNET, LAUNCHER="mpiexec")
    job, code, out, err = submit(slurm, tmp_path, "smoke.sbatch", **env)
    assert code == 0, out + err
    assert "channel: rma,ud; MPILOSSY_UD_PROVIDER=native" in out, out
    shm = "3 peers through shared memory, 0" if launcher == "srun" else \
        "0 peers through shared memory, 3"
    assert len(re.findall(rf"^rank \d on \S+: {shm} through MPI_Rget", out, re.M)) == 4, out
    ud = re.findall(r"^rank (\d) on \S+: ud through native on lo \(127\.0\.0\.1:(\d+)\), "
                    r"\d+ bytes per datagram; slowest lossy call", out, re.M)
    assert sorted(r for r, _ in ud) == ["0", "1", "2", "3"], out
    assert len({port for _, port in ud}) == 4, out          # one socket per rank
    assert out.rstrip().endswith("SMOKE OK"), out


def test_smoke_refuses_an_unknown_channel(slurm, tmp_path):
    job, code, out, err = submit(slurm, tmp_path, "smoke.sbatch", CHANNEL="rma,tcp")
    assert code == 2, out + err
    assert "CHANNEL must list rma and/or ud, not 'rma,tcp'" in err, err


def test_smoke_sees_the_network_path(slurm, tmp_path):
    """MPIR_CVAR_NOLOCAL=1 (MPICH: no shared memory, as between nodes) passes
    through sbatch and srun to every rank, and the smoke test shows it."""
    job, code, out, err = submit(slurm, tmp_path, "smoke.sbatch", MPIR_CVAR_NOLOCAL="1")
    assert code == 0, out + err
    assert len(re.findall(r"0 peers through shared memory, 3 through MPI_Rget", out)) == 4, out
    assert out.rstrip().endswith("SMOKE OK"), out


def test_smoke_fails_when_ranks_are_singletons(slurm, tmp_path):
    """srun --mpi=none: each task is a one-rank MPI job; the job must fail."""
    job, code, out, err = submit(slurm, tmp_path, "smoke.sbatch", SRUN_MPI="none")
    assert code != 0, out
    assert "SMOKE FAILED" in out and "each task is an MPI job of its own" in out, out


def test_bench(slurm, tmp_path):
    job, code, out, err = submit(slurm, tmp_path, "bench.sbatch", BENCH_SIZES="4K,256K",
                                 BENCH_ITERS="3", BENCH_WARMUP="1", BENCH_TIMEOUT="0.1",
                                 BENCH_LOSS="bernoulli:0.05")
    assert code == 0, out + err
    assert len(re.findall(r"fabric: rank \d on \S+: 3 of 3 peers through shared memory", out)) == 4
    tables = out.split("# mpilossy.bench allreduce: 4 ranks")
    assert len(tables) == 3, out
    for kind in ("lossless", "lossy"):
        doc = json.loads((tmp_path / f"mpilossy-bench-{job}-{kind}.json").read_text())
        assert doc["ranks"] == 4
        rows = {(r["size"], r["algorithm"]) for r in doc["rows"]}
        assert rows == {(s, a) for s in (4096, 262144) for a in ("ring", "tree", "direct")}, rows
        for r in doc["rows"]:
            assert r["time_us"] > 0 and r["mpi_time_us"] > 0
            if kind == "lossless":
                assert r["wrong"] == 0 and r["delivered"] == 1.0, r
            else:
                assert 0 < r["delivered"] <= 1.0, r
    assert "loss bernoulli:0.05" in tables[2]


@needs_ud
def test_bench_datagram_channel(slurm, tmp_path):
    """CHANNEL=ud: the fabric lines name the datagram transport of every rank
    and both runs measure channel ud (lossless: exact)."""
    job, code, out, err = submit(slurm, tmp_path, "bench.sbatch", CHANNEL="ud",
                                 MPILOSSY_UD_PROVIDER="native", BENCH_SIZES="4K,256K",
                                 BENCH_ALGOS="direct", BENCH_ITERS="3", BENCH_WARMUP="1",
                                 BENCH_TIMEOUT="0.1", BENCH_LOSS="bernoulli:0.05")
    assert code == 0, out + err
    assert len(re.findall(r"^fabric: rank \d on \S+: ud through native on lo \(127\.0\.0\.1:\d+\)$",
                          out, re.M)) == 4, out
    assert "through shared memory" not in out, out
    for kind in ("lossless", "lossy"):
        doc = json.loads((tmp_path / f"mpilossy-bench-{job}-{kind}.json").read_text())
        assert {(r["size"], r["channel"]) for r in doc["rows"]} == {(4096, "ud"), (262144, "ud")}
        for r in doc["rows"]:
            assert (r["wrong"] == 0 and r["delivered"] == 1.0) if kind == "lossless" \
                else 0 < r["delivered"] <= 1.0, r


# A tiny model for a few steps: the job's plumbing, not the learning
# (tests/bench/test_example_lm.py checks that).
TINY = ("--width 32 --layers 1 --heads 2 --context 32 --batch 8 --val-windows 32 "
        "--lr 1e-2 --warmup 2 --measure-every 5 --broadcast-every 5")


@pytest.mark.parametrize("channel", ["default", "ud"])
def test_train(slurm, tmp_path, channel):
    """The language-model example on 4 tasks under the training settings:
    deadline, loss and channel reach the example, MPILOSSY_TRACE every rank
    (one trace file per rank), the results folder holds the JSON and the
    summary, which name the fabric used, and the .err file holds one plain
    progress line per 5% of the steps, no carriage-return redraws."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    pytest.importorskip("tqdm", reason="tqdm is not installed")
    env = dict(TRAIN_STEPS="10", TRAIN_TIMEOUT="0.1", TRAIN_LOSS="bernoulli:0.05",
               TRAIN_ARGS=TINY)
    if channel == "ud":
        if not _core.HAVE_DATAGRAM_AUTH:
            pytest.skip("channel='ud' not built (OpenSSL headers missing)")
        env.update(CHANNEL="ud", MPILOSSY_UD_PROVIDER="native")
    job, code, out, err = submit(slurm, tmp_path, "train.sbatch", **env)
    assert code == 0, out + err
    # progress: 10 steps, a line each 5% (so every step), in the .err file only
    assert "\r" not in err and "\r" not in out, err[-2000:]
    steps = re.findall(r"^train step (\d+)/10 \(\d+%\), elapsed \S+, ETA \S+, loss=\S+, "
                       r"delivered=\S+$", err, re.M)
    assert steps == [str(n) for n in range(1, 11)], err
    assert "train step" not in out, out
    assert f"job {job}: 4 tasks on 1 node(s)" in out, out
    assert "python -m mpilossy.examples.lm --steps 10 --timeout 0.1" in out, out
    results = tmp_path / f"mpilossy-train-{job}"
    r = json.loads((results / "result.json").read_text())
    assert r["ranks"] == 4, r
    assert r["config"]["steps"] == 10 and r["config"]["timeout"] == 0.1, r["config"]
    used = "ud" if channel == "ud" else "rma"
    assert r["config"]["channel"] == used, r["config"]
    assert [f["channel"] for f in r["fabric"]] == [used] * 4, r["fabric"]
    assert r["config"]["loss"] == "bernoulli:0.05" and r["config"]["width"] == 32, r["config"]
    assert all(math.isfinite(p) and p > 1 for p in r["val_perplexity_ranks"]), r
    assert 0 < r["delivered"] < 1.0, r                  # the loss was injected
    summary = (results / "summary.txt").read_text()
    assert "ranks 4" in summary and "loss bernoulli:0.05" in summary, summary
    assert re.search(r"^val perplexity +\d+\.\d+", summary, re.M), summary
    fabric = ("ud, 4 ranks on 1 node(s): datagrams through native on lo" if channel == "ud"
              else "rma, 4 ranks on 1 node(s): 3 of 3 peers through shared memory")
    assert re.search(rf"^channel +{re.escape(fabric)}", summary, re.M), summary
    assert f"results: {results}/result.json" in out, out
    traces = results / "trace"
    files = sorted(p.name for p in traces.iterdir())
    assert len(files) == 4, files          # one per rank
    assert all(re.fullmatch(r"trace-\d+-rank[0-3]\.tsv", f) for f in files), files
    lines = (traces / files[0]).read_text().splitlines()
    assert lines[0].startswith("seq\t") and len(lines) > 10, lines[:3]
    assert f"traces: {len(files)} files" in out, out


@pytest.mark.parametrize("launcher, keeps", [
    ("mpiexec", "-disable-auto-cleanup"), ("srun", "--no-kill --kill-on-bad-exit=0")])
def test_train_elastic_survives_a_rank_that_exits(slurm, tmp_path, launcher, keeps):
    """ELASTIC=1: the launch keeps the others alive when rank 2 exits before
    step 5, they exclude it and finish the run, and the job ends with exit
    code 0.  Under srun MPICH does not report the exit (below): the others
    find rank 2 silent in the barrier before the next step, a bounded wait,
    and exclude it after elastic_wait (before the waits were bounded, that
    job hung until its time limit)."""
    out, summary = _train_losing_rank_2(slurm, tmp_path, "", ELASTIC="1", LAUNCHER=launcher)
    assert keeps in out and "--elastic" in out, out
    assert re.search(r"^elastic +ranks \[2\] excluded; 3 went on$", summary, re.M), summary


@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_train_a_spare_takes_a_killed_ranks_place(slurm, tmp_path, launcher):
    """SPARES=1: the last task waits as a hot spare; rank 2 exits before
    step 5, the others exclude it (under srun: found silent, below) and
    call the spare in, which finishes the run with them."""
    out, summary = _train_losing_rank_2(slurm, tmp_path, " --mode replicated", SPARES="1",
                                        LAUNCHER=launcher)
    assert "--elastic" in out and "--spares 1" in out, out
    assert re.search(r"^elastic +ranks \[2\] excluded; 3 went on, spares \[3\] among them$",
                     summary, re.M), summary


def _train_losing_rank_2(slurm, tmp_path, args: str, **env: str):
    """train.sbatch, 10 tiny steps with a 0.2 s deadline, rank 2 exiting
    before step 5 (TRAIN_ARGS gets `args` too): the job ends with exit code
    0 and ranks 0, 1, 3 in, with a finite perplexity.  (job output, its
    summary.txt)"""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    pytest.importorskip("tqdm", reason="tqdm is not installed")
    job, code, out, err = submit(slurm, tmp_path, "train.sbatch", TRAIN_STEPS="10",
                                 TRAIN_TIMEOUT="0.2",
                                 TRAIN_ARGS=TINY + args + " --kill-rank 2 --at-step 5", **env)
    assert code == 0, out + err
    folder = tmp_path / f"mpilossy-train-{job}"
    r = json.loads((folder / "result.json").read_text())
    assert r["members"] == [0, 1, 3] and math.isfinite(r["val_perplexity"]), r
    return out, (folder / "summary.txt").read_text()


def test_srun_reports_no_exit_and_lossy_calls_go_on_by_heartbeat(slurm, tmp_path):
    """Why an elastic job under srun finds an exit late (docs/elastic.md, "The
    launch"): under srun (PMI2) MPICH does not report a rank that exited,
    so an exit is a silent rank, excluded after evict_after=5 calls by the
    heartbeats (not in the call it was lost in, as under mpiexec
    -disable-auto-cleanup); lossy calls alone go on that way, every block
    exact for the ranks recorded."""
    env = slurm.env(PATH=str(Path(sys.executable).parent) + ":" + slurm.env()["PATH"])
    cmd = ["srun", "--mpi=pmi2", "--no-kill", "--kill-on-bad-exit=0", "-n", "4", "-t", "1",
           sys.executable, str(PROGRAMS / "elastic.py"), "ud", "exit:2@6", "20"]
    proc = run_bounded(cmd, 90, env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    survivors = [r for r in json_reports(proc.stdout) if "calls" in r]
    assert sorted(r["rank"] for r in survivors) == [0, 1, 3], proc.stdout[-2000:]
    for r in survivors:
        assert r["wrong"] == 0 and r["members"] == [0, 1, 3], r
        # (with the exit reported it would be call 6)
        assert [e["excluded"] for e in r["exclusions"]] == [[2]], r
        assert r["exclusions"][0]["call"] >= 6 + 4, r


def test_srun_a_process_started_after_a_loss_connects_to_the_survivors(slurm, tmp_path):
    """Under srun (PMI2, --no-kill) too, MPI's ports reach the survivors of
    an exit from a process started outside the job step
    (tests/programs/join_by_port.py; the mpiexec case and the check:
    tests/control/test_join_by_port.py)."""
    env = slurm.env(PATH=str(Path(sys.executable).parent) + ":" + slurm.env()["PATH"])
    port = tmp_path / "port"
    lines = join_after_loss(["srun", "--mpi=pmi2", "--no-kill", "--kill-on-bad-exit=0", "-n", "3",
                             "-t", "1", sys.executable, PROGRAMS / "join_by_port.py", "job", port],
                            env, port, cwd=str(tmp_path))
    check_joined(lines, 2)


@needs_ud
@pytest.mark.parametrize("newcomer", ["singleton", "srun"])
def test_srun_a_process_started_after_a_loss_takes_its_place(slurm, tmp_path, newcomer):
    """The library's rendezvous under srun (PMI2, --no-kill: the exit is
    found as a silent rank): 3 tasks on ud, rank 1 exits before call 10, a
    process started outside the step (a singleton, or a step of its own:
    `srun -n 1`) joins as member 3; every block right, everyone back at 3
    ranks (tests/programs/elastic_rejoin.py; the mpiexec cases:
    tests/control/test_rejoin.py)."""
    env = slurm.env(PATH=str(Path(sys.executable).parent) + ":" + slurm.env()["PATH"])
    directory = tmp_path / "rendezvous"
    directory.mkdir()
    program = [sys.executable, str(PROGRAMS / "elastic_rejoin.py")]
    job = subprocess.Popen(["srun", "--mpi=pmi2", "--no-kill", "--kill-on-bad-exit=0", "-n", "3",
                            "-t", "1"] + program + ["job", "ud", str(directory), "1@10", "30"],
                           env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if newcomer == "srun":
            new = run_bounded(["srun", "--mpi=pmi2", "-n", "1", "-t", "1"] + program
                              + ["new", str(directory), "60"], 90, env, cwd=str(tmp_path))
        else:
            new = run_bounded(program + ["new", str(directory), "60"], 90,
                              clean_subprocess_env())
        out, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    output = out[-2000:] + err[-3000:] + new.stdout[-2000:] + new.stderr[-3000:]
    lines = {r["member"]: r for r in json_reports(out + new.stdout, '{"member"')}
    assert sorted(lines) == [0, 2, 3], output
    for line in lines.values():
        assert line["members"] == [0, 2, 3] and line["size"] == 3, line
        assert line["wrong"] == 0 and line["calls"] == lines[0]["calls"], line
    assert lines[3]["role"] == "new" and lines[3]["joined"] == lines[0]["joined"], output


def test_srun_a_rank_that_hung_comes_back(slurm, tmp_path):
    """Under srun (PMI2) too, a rank excluded while it was stopped comes back
    when it wakes (Communicator.stand_by after EvictedError): the
    scenario of tests/control/test_spares.py's rma row, 4 tasks with one
    spare; at the end rank 1 is out (released) and ranks 0, 3, 2 are in,
    every block right."""
    env = slurm.env(PATH=str(Path(sys.executable).parent) + ":" + slurm.env()["PATH"])
    cmd = ["srun", "--mpi=pmi2", "--no-kill", "--kill-on-bad-exit=0", "-n", "4", "-t", "2",
           sys.executable, str(PROGRAMS / "elastic_comeback.py"), "rma", "1",
           "1@10,2@50,1@90", "120", "3"]
    proc = run_bounded(cmd, 110, env, cwd=str(tmp_path))
    lines = {r["rank"]: r for r in json_reports(proc.stdout, '{"rank"')}
    output = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(lines) == [0, 1, 2, 3] and lines[1]["released"], output
    for r in (0, 3, 2):
        assert lines[r]["members"] == [0, 3, 2] and lines[r]["calls"] == 120, lines[r]
    assert all(line["wrong"] == 0 for line in lines.values()), lines


def test_srun_a_hot_spare_takes_an_exited_ranks_place(slurm, tmp_path):
    """Under srun (PMI2) a hot spare launched with the job, outside the
    working ranks, joins the survivors' MPI_Comm_create_group after a rank
    exits (tests/programs/rank_replaced.py; the MPI a rejoin would stand on,
    docs/elastic.md "Growing back").  MPI_Comm_spawn did not end there in
    60 s (tried; under mpiexec it works), so only the spare is tested."""
    env = slurm.env(PATH=str(Path(sys.executable).parent) + ":" + slurm.env()["PATH"])
    cmd = ["srun", "--mpi=pmi2", "--no-kill", "--kill-on-bad-exit=0", "-n", "4", "-t", "1",
           sys.executable, str(PROGRAMS / "rank_replaced.py"), "spare", "1", "silent"]
    proc = run_bounded(cmd, 90, env, cwd=str(tmp_path))
    lines = json_reports(proc.stdout, '{"world"')
    assert sorted(r["world"] for r in lines) == [0, 2, 3], proc.stdout[-2000:] + proc.stderr
    for r in lines:
        assert r["size"] == 3 and r["result"] == 6, r
    assert sorted(r["rank"] for r in lines) == [0, 1, 2], lines
