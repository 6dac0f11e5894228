"""The benchmarks run, print what they promise and write every number:
each command of ``python -m mpilossy.bench`` once, at a small size.
Structure and correctness only: a benchmark is not a timed test."""

import json
import math
import sys

import pytest

from helpers import clean_subprocess_env, is_singleton, mpiexec, run_bounded

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")

ROW_FIELDS = {"size", "count", "type", "redop", "algorithm", "channel", "time_us", "algbw", "busbw",
              "wrong", "mpi_time_us", "mpi_busbw", "ratio", "delivered", "max_err", "p50_us",
              "p99_us", "mpi_p99_us", "times_us", "mpi_times_us", "datagrams", "payload",
              "rebuilt", "plain_time_us", "plain_delivered"}
TAIL_FIELDS = {"scenario", "size", "algorithm", "channel", "timeout", "mpi_p50_us", "mpi_p99_us",
               "mpi_max_us", "p50_us", "p99_us", "max_us", "p99_ratio", "delivered",
               "lossy_timeouts", "times_us", "mpi_times_us"}


def command(tmp_path, *args, nprocs=2, timeout=180, module="mpilossy.bench"):
    """`python -m module args` under mpiexec -n nprocs (none for 0): its output."""
    cmd = [sys.executable, "-m", module, *args]
    if nprocs:
        cmd = [mpiexec(), "-n", str(nprocs), *cmd]
    proc = run_bounded(cmd, timeout, clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def bench(tmp_path, *args, nprocs=2):
    """The all-reduce benchmark: its table and its JSON."""
    out = tmp_path / "bench.json"
    text = command(tmp_path, *args, "--json", str(out), nprocs=nprocs)
    return text, json.loads(out.read_text())


def test_table_and_json(tmp_path):
    text, doc = bench(tmp_path, "allreduce", "--sizes", "1K,8K", "-a", "ring,tree", "-n", "4",
                      "-w", "1", "--plot", str(tmp_path / "p.png"))
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


def test_weighted_rows_are_checked(tmp_path):
    """--weighted: the weighted average, checked against its exact value."""
    _, doc = bench(tmp_path, "allreduce", "--sizes", "1K,64K", "-a", "direct", "--weighted",
                   "-n", "2", "-w", "1", nprocs=3)
    assert [r["redop"] for r in doc["rows"]] == ["avg(w)"] * 2
    for row in doc["rows"]:
        assert row["wrong"] == 0 and row["delivered"] == 1.0 and row["max_err"] < 1e-6, row


def test_redundancy_rows(tmp_path):
    """--redundancy k,m: the same calls with and without, side by side; at
    20% loss blocks are rebuilt and more is delivered than without."""
    text, doc = bench(tmp_path, "allreduce", "--sizes", "256K", "-a", "direct", "-t", "0.5",
                      "--loss", "bernoulli:0.2", "--block-bytes", "4K", "--redundancy", "4,1",
                      "-n", "5", "-w", "1", nprocs=3)
    assert "redundancy=(4, 1) against the same calls with redundancy=None" in text
    row, = doc["rows"]
    assert row["rebuilt"] > 0 and row["plain_time_us"] > 0
    assert row["delivered"] > row["plain_delivered"] + 0.05, row
    assert doc["config"]["redundancy"] == [4, 1]


def test_bad_redundancy_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "mpilossy.bench", "allreduce", "--redundancy", "4,4"]
    proc = run_bounded(cmd, 60, clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "less than k" in proc.stderr


def test_a_microburst_refuses_another_loss_model(tmp_path):
    cmd = [sys.executable, "-m", "mpilossy.bench", "allreduce", "--sizes", "4K", "-n", "2",
           "--scenario", "microburst", "--loss", "bernoulli:0.1"]
    proc = run_bounded(cmd, 60, clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode != 0 and "brings its own loss model" in proc.stderr, proc.stderr


def test_compressed_rows(tmp_path):
    """--compression: the rows are checked against the exact result within
    the quantisation's bound, and on ud they count fewer datagrams."""
    counts = {}
    for compression in (None, "int8"):
        extra = ["--compression", compression] if compression else []
        _, doc = bench(tmp_path, "allreduce", "--sizes", "256K", "-a", "direct", "-c", "ud",
                       "-n", "2", "-w", "1", *extra)
        row = doc["rows"][0]
        assert row["wrong"] == 0 and row["delivered"] == 1.0, row
        counts[compression] = row["datagrams"]
    assert 0 < counts["int8"] < 0.4 * counts[None], counts


def test_topk_rows(tmp_path):
    """--topk: the chosen values are checked against the exact average, the
    payload is the chosen values plus one float32 energy per 64 values, and
    on ud the datagrams follow it."""
    rows = {}
    for topk in (None, "0.1"):
        extra = ["--topk", topk] if topk else []
        _, doc = bench(tmp_path, "allreduce", "--sizes", "256K", "-a", "direct", "-c", "ud",
                       "-o", "avg", "-n", "2", "-w", "1", *extra, nprocs=3)
        rows[topk] = row = doc["rows"][0]
        assert row["wrong"] == 0 and row["delivered"] == 1.0 and row["max_err"] < 1e-6, row
    blocks = (256 << 10) // 4 // 64
    assert rows[None]["payload"] == 256 << 10
    assert rows["0.1"]["payload"] == 4 * 64 * math.ceil(0.1 * blocks) + 4 * blocks
    assert 0 < rows["0.1"]["datagrams"] < 0.2 * rows[None]["datagrams"], rows


def test_lossy_rows_report_loss(tmp_path):
    # No command: allreduce, as before there were commands.
    _, doc = bench(tmp_path, "--sizes", "64K", "-n", "8", "-w", "1", "--loss",
                   "bernoulli:0.3,seed=2", "-t", "0.02", "-c", "rma")
    row = doc["rows"][0]
    assert row["delivered"] < 1.0 and row["max_err"] > 0 and row["wrong"] > 0
    assert doc["config"]["loss"] == "bernoulli:0.3,seed=2"


def test_tail_scenario(tmp_path):
    text, doc = bench(tmp_path, "allreduce", "--sizes", "4K", "-n", "20", "-w", "2",
                      "-t", "0.005", "--scenario", "straggler:delay=0.02,prob=0.2,seed=3")
    assert "p99-ratio" in text
    (tail,) = doc["tail"]
    assert set(tail) == TAIL_FIELDS, set(tail) ^ TAIL_FIELDS
    assert len(tail["times_us"]) == len(tail["mpi_times_us"]) == 2 * 20
    # MPI waits for the straggler: its slowest calls take the whole delay
    assert tail["mpi_max_us"] >= 0.9 * 20_000
    assert tail["delivered"] < 1.0


def test_tail_scenario_free_running(tmp_path):
    """aligned=0: no barrier between calls, MPI's and mpilossy's alike (the
    same draws).  MPI still waits out every sleep; a 5 ms deadline cuts the
    straggler instead."""
    _, doc = bench(tmp_path, "allreduce", "--sizes", "4K", "-n", "20", "-w", "2",
                   "-t", "0.005", "--scenario", "straggler:delay=0.02,prob=0.2,seed=3,aligned=0")
    (tail,) = doc["tail"]
    assert tail["scenario"].endswith(",free)"), tail["scenario"]
    assert len(tail["times_us"]) == len(tail["mpi_times_us"]) == 2 * 20
    assert tail["mpi_max_us"] >= 0.9 * 20_000
    assert tail["delivered"] < 1.0 and tail["p99_us"] < tail["mpi_p99_us"], tail


def test_link_scenario_touches_nothing(tmp_path):
    """--scenario link neither injects nor emulates: on this lossless link
    every contribution arrives and MPI is charged no timeout."""
    _, doc = bench(tmp_path, "allreduce", "--sizes", "64K", "-n", "10", "-w", "2",
                   "-t", "1.0", "--scenario", "link")
    (tail,) = doc["tail"]
    assert tail["scenario"] == "link" and tail["delivered"] == 1.0
    assert tail["mpi_max_us"] < 0.5e6 and len(tail["times_us"]) == 2 * 10


def test_tail_scenario_takes_the_redundancy(tmp_path):
    """--redundancy reaches the tail scenarios' calls too (the emulated
    cluster's bench runs them): at 20% injected loss the calls with parity
    keep more than the same calls without."""
    common = ("allreduce", "--sizes", "256K", "-a", "direct", "-n", "6", "-w", "1", "-t", "0.5",
              "--loss", "bernoulli:0.2,seed=4", "--block-bytes", "4K", "--scenario", "link")
    (tmp_path / "plain").mkdir()
    (tmp_path / "coded").mkdir()
    _, plain = bench(tmp_path / "plain", *common, nprocs=3)
    _, coded = bench(tmp_path / "coded", *common, "--redundancy", "4,1", nprocs=3)
    assert coded["config"]["redundancy"] == [4, 1]
    assert coded["tail"][0]["delivered"] > plain["tail"][0]["delivered"] + 0.05, (
        coded["tail"][0]["delivered"], plain["tail"][0]["delivered"])


def test_kernels(tmp_path):
    text = command(tmp_path, "kernels", "--sizes", "64K", "-r", "3", nprocs=0, timeout=60)
    assert "eff" in text
    line = text.strip().splitlines()[-1].split()
    assert int(line[0]) == 65536 and all(float(x) > 0 for x in line[1:])


def test_quant_kernels(tmp_path):
    text = command(tmp_path, "kernels", "--quant", "--sizes", "64K", "-r", "3", nprocs=0,
                   timeout=60)
    lines = [l for l in text.splitlines() if l.startswith(" ") and "65536" in l]
    assert len(lines) == 2, text            # the quantisation table and the reduction table
    assert all(float(x) > 0 for x in lines[0].split()[1:])


def test_old_module_path_runs_the_command(tmp_path):
    text = command(tmp_path, "--sizes", "4K", "-r", "1", nprocs=0, timeout=60,
                   module="mpilossy.bench.kernels")
    assert text.startswith("# reduction kernels")
    assert text.strip().splitlines()[-1].split()[0] == "4096"


def test_device_on_host_buffers(tmp_path):
    """The GPU benchmark's table, on host buffers (--device cpu): every
    contender timed, lossless rows exact, lossy rows partial."""
    out = tmp_path / "device.json"
    text = command(tmp_path, "device", "--device", "cpu", "--sizes", "64K,256K", "-a", "ring,tree",
                   "--loss", "none,bernoulli:0.2", "-t", "0.5", "-n", "5", "-w", "1",
                   "--json", str(out), nprocs=3, timeout=180)
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["ranks"] == 3 and doc["device"] == "cpu"
    assert [(r["loss"], r["size"], r["algorithm"]) for r in rows] == [
        (loss, size, a) for loss in ("none", "bernoulli:0.2") for size in (65536, 262144)
        for a in ("ring", "tree")]
    for r in rows:
        assert r["time_us"] > 0 and r["mpi_us"] > 0 and r["staging_us"] == 0
        if r["loss"] == "none":
            assert r["wrong"] == 0 and r["delivered"] == 1.0
        else:
            assert r["wrong"] == -1 and 0 < r["delivered"] < 1
    try:
        import torch.distributed  # noqa: F401
        assert all(r["gloo_us"] > 0 for r in rows)
    except ImportError:
        assert all(math.isnan(r["gloo_us"]) for r in rows)
    assert len([l for l in text.splitlines() if not l.startswith("#")]) == len(rows)


def test_device_cuda_without_cupy_is_a_clear_error(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    proc = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy.bench", "device",
                        "--sizes", "4K"], 60, clean_subprocess_env(), cwd=tmp_path)
    assert proc.returncode != 0
    assert "--device cuda needs CuPy" in proc.stderr + proc.stdout


def test_crossover(tmp_path):
    text = command(tmp_path, "crossover", "--min", "1024", "--max", "4096", "-n", "3",
                   "--rounds", "1", timeout=120)
    assert "tree is faster up to" in text
    assert [int(l.split()[0]) for l in text.splitlines() if not l.startswith("#")] == [1024, 2048,
                                                                                      4096]


def test_deadline(tmp_path):
    text = command(tmp_path, "deadline", "-t", "0.01", "-s", "4K", "-n", "12", "--share", "0.5",
                   timeout=120)
    assert text.startswith("# deadline overshoot: 2 ranks, 4096 B, ring, timeout 10 ms")
    assert len(text.strip().splitlines()[-1].split()) == 4


def test_delivery_launches_each_rank_count(tmp_path):
    """--ranks: the command starts itself under mpiexec per rank count."""
    out = tmp_path / "rows.json"
    text = command(tmp_path, "delivery", "--ranks", "2,3", "--loss", "0.2", "-a", "ring,direct",
                   "--calls", "10", "--elements", "1024", "--json", str(out), nprocs=0,
                   timeout=180)
    rows = json.loads(out.read_text())
    assert [(r["ranks"], r["algorithm"]) for r in rows] == [(2, "ring"), (2, "direct"),
                                                            (3, "ring"), (3, "direct")]
    assert all(r["loss"] == 0.2 and r["calls"] == 10 and 0 < r["agreed"] <= 1 for r in rows)
    assert len(text.strip().splitlines()) == 1 + len(rows)


def test_torch_drift(tmp_path):
    pytest.importorskip("torch")
    text = command(tmp_path, "torch", "drift", "--steps", "12", "--modes", "allreduce,sharded",
                   "--measure-every", "4", "--plot", str(tmp_path / "d.png"), timeout=180)
    modes = [l.split()[0] for l in text.splitlines() if l.startswith("  ")]
    assert modes == ["allreduce", "sharded"], text
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_group(tmp_path):
    text = command(tmp_path, "group", "--sizes", "16K", "-n", "3", "--loss", "0,0.3", nprocs=2)
    assert text.startswith("# group averaging, 2 ranks, grid 2")
    lossless, lossy = (line.split() for line in text.strip().splitlines()[-2:])
    assert int(lossless[0]) == 16384 and float(lossless[1]) == 0.0
    assert float(lossless[5]) < 1e-6 and float(lossless[6]) < 1e-6    # exact average
    assert float(lossy[5]) > 1e-3                                     # loss shows


def test_node(tmp_path):
    """The hierarchy's stages within a node against MPI's, on fake nodes of
    2: a row per size, every contender's time, the results equal."""
    out = tmp_path / "node.json"
    proc = run_bounded([mpiexec(), "-n", "4", sys.executable, "-m", "mpilossy.bench", "node",
                        "--sizes", "64K,1000K", "-n", "3", "-w", "1", "--json", str(out)], 180,
                       {**clean_subprocess_env(), "MPIR_CVAR_NUM_CLIQUES": "2"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("# within a node: reduce-scatter + all-gather, 4 ranks, "
                                  "nodes of 2"), proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [65536, 1024000]
    for r in rows:
        assert r["node_ranks"] == 2 and r["exact"], r
        assert min(r["mpilossy_us"], r["mpi_us"], r["mpi_allreduce_us"]) > 0, r
        assert math.isclose(r["mpilossy_over_mpi"], r["mpilossy_us"] / r["mpi_us"]), r


def test_elastic(tmp_path):
    """The heartbeat's cost: a row per size and channel, both sides timed,
    the elastic results exact where nothing was lost, nobody excluded."""
    out = tmp_path / "elastic.json"
    text = command(tmp_path, "elastic", "--sizes", "4K,64K", "-n", "6", "-w", "1",
                   "--json", str(out), nprocs=3)
    assert text.startswith("# elastic=True against a plain Communicator, 3 ranks"), text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["size"], r["channel"]) for r in rows] == [
        (4096, "rma"), (65536, "rma"), (4096, "ud"), (65536, "ud")]
    for r in rows:
        assert r["elastic_us"] > 0 and r["plain_us"] > 0 and r["mpi_us"] > 0, r
        assert r["wrong"] == 0 and r["excluded"] == 0 and r["checked"] > 0, r


def test_dtypes(tmp_path):
    """bfloat16 against float32 on one element count: a row per channel,
    algorithm and dtype, bfloat16 half the bytes, every result right."""
    out = tmp_path / "dtypes.json"
    text = command(tmp_path, "dtypes", "--elements", "64K", "-n", "4", "-w", "1",
                   "-a", "direct,ring", "-c", "rma,ud", "--json", str(out), nprocs=3)
    assert text.startswith("# 3 ranks, 65536 elements per call"), text
    rows = json.loads(out.read_text())
    assert [(r["channel"], r["algorithm"], r["dtype"]) for r in rows] == [
        (c, a, d) for c in ("rma", "ud") for a in ("direct", "ring")
        for d in ("float32", "bfloat16")]
    for r in rows:
        assert r["bytes"] == 65536 * (4 if r["dtype"] == "float32" else 2), r
        assert r["wrong"] == 0 and r["delivered"] == 1.0 and r["p50_ms"] > 0, r



def test_backend(tmp_path):
    """torch.distributed all_reduce over the "mpilossy" backend against
    Gloo: a row per size, both exact without loss, both timed."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    out = tmp_path / "backend.json"
    text = command(tmp_path, "backend", "--sizes", "64K,256K", "-n", "3", "-w", "1",
                   "--json", str(out), nprocs=3)
    assert text.startswith("# 3 ranks, float32 SUM, lossless=True"), text
    rows = json.loads(out.read_text())
    assert [r["bytes"] for r in rows] == [65536, 262144]
    for r in rows:
        assert r["exact"] and r["gloo_s"] > 0 and r["mpilossy_s"] > 0, r
        assert r["ratio"] == pytest.approx(r["mpilossy_s"] / r["gloo_s"]), r
