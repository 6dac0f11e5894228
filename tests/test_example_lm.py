"""The language-model example, short: a tiny model for a few dozen steps at
2 ranks, without and with loss.  The loss must go down and the perplexity
must be finite (and far below the 256 of a uniform guess)."""

import json
import math
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
pytest.importorskip("tqdm", reason="tqdm is not installed")

from helpers import clean_subprocess_env, is_singleton, mpiexec, run_bounded  # noqa: E402

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")

TINY = ["--steps", "40", "--width", "32", "--layers", "1", "--heads", "2", "--context", "32",
        "--batch", "8", "--val-windows", "32", "--lr", "1e-2", "--warmup", "5",
        "--measure-every", "10", "--broadcast-every", "10"]


@pytest.mark.parametrize("extra", [
    ["--reduce", "mpi"], ["--loss", "0"], ["--loss", "0.1"],
    ["--mode", "sharded", "--no-error-feedback", "--loss", "0.1"],
    ["--mode", "replicated", "--error-feedback", "--resync", "average", "--loss", "0.1"],
    ["--mode", "replicated", "--no-error-feedback", "--loss", "0.3", "--phase-aware"]],
    ids=["reliable-baseline", "lossless", "loss-10-defaults", "sharded-loss-10",
         "replicated-feedback-average-loss-10", "replicated-loss-30-phase-aware"])
def test_short_run_learns(tmp_path, extra):
    out = tmp_path / "result.json"
    done = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy.examples.lm",
                        *TINY, *extra, "--json", out], timeout=240,
                       env=clean_subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "val perplexity" in done.stdout
    r = json.loads(out.read_text())
    assert r["ranks"] == 2
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    assert all(math.isfinite(p) and 1 < p < 100 for p in r["val_perplexity_ranks"]), r
    if "--loss" in extra and extra[extra.index("--loss") + 1] != "0":
        assert r["delivered"] < 1.0, r          # loss was really injected
    else:
        assert r["delivered"] == 1.0 and r["final_drift"] == 0.0, r


def test_compute_deadline_under_stragglers(tmp_path):
    """Micro-batches, the straggler scenario and the compute deadline: the
    run learns, records its curve, and cuts micro-batches on slow steps."""
    out = tmp_path / "result.json"
    done = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy.examples.lm",
                        *TINY, "--micro-batches", "4", "--straggle", "0.5:4",
                        "--compute-deadline", "auto", "--eval-every", "10", "--json", out],
                       timeout=240, env=clean_subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "micro-batches" in done.stdout
    r = json.loads(out.read_text())
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    assert [c[0] for c in r["curve"]] == [10, 20, 30, 40], r["curve"]
    assert all(1 < c[2] < 100 for c in r["curve"]), r["curve"]
    # half the steps 4x slower: once the budget is agreed (step 10) those cut
    assert 1.0 <= r["micro_batches"] < 3.9, r
