"""The benchmarks run, print what they promise and write every number.
Structure and correctness only: a benchmark is not a timed test."""

import json
import math

import numpy as np
import pytest

from helpers import clean_subprocess_env, is_singleton, run_bounded

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")

ROW_FIELDS = {"size", "count", "type", "redop", "algorithm", "channel", "time_us", "algbw", "busbw",
              "wrong", "mpi_time_us", "mpi_busbw", "ratio", "delivered", "max_err", "p50_us",
              "p99_us", "mpi_p99_us", "times_us", "mpi_times_us"}
TAIL_FIELDS = {"scenario", "size", "algorithm", "channel", "timeout", "mpi_p50_us", "mpi_p99_us",
               "mpi_max_us", "p50_us", "p99_us", "max_us", "p99_ratio", "delivered",
               "lossy_timeouts", "times_us", "mpi_times_us"}


def bench(tmp_path, *args, nprocs=2):
    out = tmp_path / "bench.json"
    import sys
    from helpers import mpiexec
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, "-m", "mpilossy.bench", *args,
           "--json", str(out)]
    proc = run_bounded(cmd, 180, clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_table_and_json(tmp_path):
    text, doc = bench(tmp_path, "--sizes", "1K,8K", "-a", "ring,tree", "-n", "4", "-w", "1",
                      "--plot", str(tmp_path / "p.png"))
    header = [l for l in text.splitlines() if l.startswith("#       size")][0]
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                   "#wrong", "delivered", "max-err", "p99-time"):
        assert column in header, column
    assert doc["ranks"] == 2 and len(doc["rows"]) == 4
    for row in doc["rows"]:
        assert set(row) == ROW_FIELDS, set(row) ^ ROW_FIELDS
        assert row["wrong"] == 0 and row["delivered"] == 1.0 and row["max_err"] == 0
        assert row["count"] * 4 == row["size"] and row["type"] == "float"
        assert len(row["times_us"]) == len(row["mpi_times_us"]) == 2 * 4     # every rank
        # busbw = algbw * 2 (n - 1) / n, algbw = bytes / time
        assert math.isclose(row["busbw"], row["algbw"] * 2 * (2 - 1) / 2, rel_tol=1e-9)
        assert math.isclose(row["algbw"], row["size"] / row["time_us"] / 1e3, rel_tol=1e-9)
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_lossy_rows_report_loss(tmp_path):
    _, doc = bench(tmp_path, "--sizes", "64K", "-n", "8", "-w", "1", "--loss",
                   "bernoulli:0.3,seed=2", "-t", "0.02", "-c", "rma")
    row = doc["rows"][0]
    assert row["delivered"] < 1.0 and row["max_err"] > 0 and row["wrong"] > 0
    assert doc["config"]["loss"] == "bernoulli:0.3,seed=2"


def test_tail_scenario(tmp_path):
    text, doc = bench(tmp_path, "--sizes", "4K", "-n", "20", "-w", "2", "-t", "0.005",
                      "--scenario", "straggler:delay=0.02,prob=0.2,seed=3")
    assert "p99-ratio" in text
    (tail,) = doc["tail"]
    assert set(tail) == TAIL_FIELDS, set(tail) ^ TAIL_FIELDS
    assert len(tail["times_us"]) == len(tail["mpi_times_us"]) == 2 * 20
    # MPI waits for the straggler: its slowest calls take the whole delay
    assert tail["mpi_max_us"] >= 0.9 * 20_000
    assert tail["delivered"] < 1.0


def test_kernels_and_crossover_run(tmp_path):
    import sys
    proc = run_bounded([sys.executable, "-m", "mpilossy.bench.kernels", "--sizes", "64K",
                        "-r", "3"], 60, clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0 and "eff" in proc.stdout, proc.stderr
    line = proc.stdout.strip().splitlines()[-1].split()
    assert int(line[0]) == 65536 and all(float(x) > 0 for x in line[1:])
    from helpers import mpiexec
    proc = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy.bench.crossover",
                        "--min", "1024", "--max", "4096", "-n", "3", "--rounds", "1"], 120,
                       clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0 and "tree is faster up to" in proc.stdout, proc.stderr
