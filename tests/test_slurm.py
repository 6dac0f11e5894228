"""The job templates in jobs/, run for real with `sbatch --wait` on a
single-node Slurm that the test starts on 127.0.0.1 (Debian's slurm-wlm and
munge, installed if missing; skipped with the reason where Slurm cannot be
installed or started).  Each template runs on 4 tasks with small sizes; the
output files, named by job id, are checked.  Starts its own processes, so it
runs in the single-rank session only."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from cluster_helpers import JOBS, cluster_fixture
from helpers import is_singleton

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


# A tiny model for a few steps: the job's plumbing, not the learning
# (tests/test_example_lm.py checks that).
TINY = ("--width 32 --layers 1 --heads 2 --context 32 --batch 8 --val-windows 32 "
        "--lr 1e-2 --warmup 2 --measure-every 5 --broadcast-every 5")


def test_train(slurm, tmp_path):
    """The language-model example on 4 tasks under the training settings:
    deadline and loss reach the example, MPILOSSY_TRACE every rank (one trace
    file per rank), and the results folder holds the JSON and the summary."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    pytest.importorskip("tqdm", reason="tqdm is not installed")
    job, code, out, err = submit(slurm, tmp_path, "train.sbatch", TRAIN_STEPS="10",
                                 TRAIN_TIMEOUT="0.1", TRAIN_LOSS="bernoulli:0.05",
                                 TRAIN_ARGS=TINY)
    assert code == 0, out + err
    assert f"job {job}: 4 tasks on 1 node(s)" in out, out
    assert "python -m mpilossy.examples.lm --steps 10 --timeout 0.1" in out, out
    results = tmp_path / f"mpilossy-train-{job}"
    r = json.loads((results / "result.json").read_text())
    assert r["ranks"] == 4, r
    assert r["config"]["steps"] == 10 and r["config"]["timeout"] == 0.1, r["config"]
    assert r["config"]["loss"] == "bernoulli:0.05" and r["config"]["width"] == 32, r["config"]
    assert all(math.isfinite(p) and p > 1 for p in r["val_perplexity_ranks"]), r
    assert 0 < r["delivered"] < 1.0, r                  # the loss was injected
    summary = (results / "summary.txt").read_text()
    assert "ranks 4" in summary and "loss bernoulli:0.05" in summary, summary
    assert re.search(r"^val perplexity +\d+\.\d+", summary, re.M), summary
    assert f"results: {results}/result.json" in out, out
    traces = results / "trace"
    files = sorted(p.name for p in traces.iterdir())
    assert len(files) == 4, files          # one per rank
    assert all(re.fullmatch(r"trace-\d+-rank[0-3]\.tsv", f) for f in files), files
    lines = (traces / files[0]).read_text().splitlines()
    assert lines[0].startswith("seq\t") and len(lines) > 10, lines[:3]
    assert f"traces: {len(files)} files" in out, out
