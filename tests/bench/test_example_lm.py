"""The language-model example, short: a tiny model for a few dozen steps at
2 ranks, without and with loss.  The loss must go down and the perplexity
must be finite (and far below the 256 of a uniform guess).  Its progress
output: a line every 5% into a pipe or a file, a bar on a terminal (a
pseudo-terminal in front of mpiexec)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
pytest.importorskip("tqdm", reason="tqdm is not installed")

from helpers import clean_subprocess_env, is_singleton, mpiexec, run_bounded  # noqa: E402
from mpilossy.control.failures import reports_failures  # noqa: E402

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")

TINY = ["--steps", "40", "--width", "32", "--layers", "1", "--heads", "2", "--context", "32",
        "--batch", "8", "--val-windows", "32", "--lr", "1e-2", "--warmup", "5",
        "--measure-every", "10", "--broadcast-every", "10"]


@pytest.mark.parametrize("extra", [
    ["--reduce", "mpi"], ["--loss", "0", "--timeout", "none"], ["--loss", "0.1"],
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
    # one node of 2 ranks: the barrier over all of them (MPI's arm: none, as
    # MPI_Allreduce lines the ranks up itself); its time is a phase
    assert r["align"] == ("none" if "mpi" in extra else "world"), r["align"]
    phases = r["phase_seconds"]
    assert set(phases) == {"compute", "align", "comm", "other"}, phases
    assert phases["compute"]["min"] > 0 and phases["comm"]["mean"] > 0, phases
    assert all(p["min"] <= p["mean"] <= p["max"] for p in phases.values()), phases
    if "mpi" in extra:
        assert phases["align"]["max"] == 0.0, phases      # (MPI's arm has no barrier)
    if "mpi" not in extra and "--timeout" not in extra:
        # the default deadline is learned: below its 1 s cap after the first agreement
        learned = r["auto_deadlines"]
        assert learned and min(learned.values()) < 1.0, learned


def test_two_fake_nodes_each_align_and_learn(tmp_path):
    """4 ranks on two fake nodes (MPIR_CVAR_NUM_CLIQUES): the defaults run
    the hierarchy (its all-gather too, in the sharded mode) after a barrier
    over all ranks; --align node lines up each node's ranks only; both
    learn under loss."""
    env = clean_subprocess_env(OMP_NUM_THREADS="1", MPIR_CVAR_NUM_CLIQUES="2")
    for align in ("auto", "node"):
        out = tmp_path / f"{align}.json"
        done = run_bounded([mpiexec(), "-n", "4", sys.executable, "-m", "mpilossy.examples.lm",
                            *TINY, "--loss", "0.1", "--mode", "sharded", "--align", align,
                            "--json", out], timeout=240, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        r = json.loads(out.read_text())
        assert r["align"] == ("world" if align == "auto" else "node"), r["align"]
        assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
        assert 0.8 < r["delivered"] < 1.0, r
        kinds = " ".join(r["auto_deadlines"])
        assert "network" in kinds and "allgather" in kinds, r["auto_deadlines"]


@pytest.mark.parametrize("cfg, expected", [
    ({}, "world"), ({"algorithm": "ring"}, "world"), ({"align": "node"}, "node"),
    ({"align": "none"}, "none"), ({"reduce": "mpi"}, "none"),
    ({"reduce": "mpi", "align": "world"}, "world"), ({"mode": "fsdp"}, "world"),
    ({"mode": "fsdp", "reduce": "mpi"}, "world"), ({"mode": "fsdp", "align": "none"}, "none")],
    ids=["lossy", "ring", "asked-node", "asked-none", "mpi", "mpi-asked-world", "fsdp",
         "fsdp-gloo", "fsdp-none"])
def test_align_over(cfg, expected):
    from mpilossy.examples.lm.train import Config, align_over
    assert align_over(Config(**cfg)) == expected


def test_fsdp_refuses_a_node_barrier():
    from mpilossy.examples.lm.train import Config, align_over
    with pytest.raises(ValueError, match="fsdp mode lines up all ranks or none"):
        align_over(Config(mode="fsdp", align="node"))


def test_align_argument():
    from mpilossy.examples.lm.__main__ import parser
    assert parser().parse_args([]).align == "auto"
    assert parser().parse_args(["--no-align"]).align == "none"
    assert parser().parse_args(["--align", "node"]).align == "node"
    with pytest.raises(SystemExit):
        parser().parse_args(["--align", "rack"])


def test_fsdp_over_the_backend_lossless_equals_gloo_and_learns_under_loss(tmp_path):
    """--fsdp: FSDP2 over the "mpilossy" backend without loss trains to
    Gloo's losses for 50 steps (the same gradients, within float
    tolerance); at 10% loss it still learns, delivers less than everything
    and never drifts (one owner per shard)."""
    results = {}
    for name, extra in (("gloo", ["--reduce", "mpi", "--steps", "50"]),
                        ("lossless", ["--timeout", "none", "--steps", "50"]),
                        ("loss-10", ["--loss", "0.1", "--steps", "20"])):
        out = tmp_path / f"{name}.json"
        done = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy.examples.lm",
                            *TINY, "--fsdp", *extra, "--json", out],
                           timeout=240, env=clean_subprocess_env(OMP_NUM_THREADS="1"),
                           cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    gloo, lossless, lossy = results["gloo"], results["lossless"], results["loss-10"]
    assert gloo["delivered"] == lossless["delivered"] == 1.0
    assert lossless["val_perplexity"] == pytest.approx(gloo["val_perplexity"], rel=1e-4)
    assert lossless["train_loss_last"] == pytest.approx(gloo["train_loss_last"], rel=1e-4)
    assert lossless["train_loss_first"] == pytest.approx(gloo["train_loss_first"], rel=1e-4)
    assert 0.75 < lossy["delivered"] < 0.99, lossy["delivered"]
    assert lossy["train_loss_last"] < lossy["train_loss_first"] - 0.5, lossy
    assert lossy["final_drift"] == 0.0 and lossy["val_perplexity_ranks"][0] == \
        lossy["val_perplexity_ranks"][1]


def test_fsdp_refuses_what_it_does_not_take():
    from mpilossy.examples.lm.train import Config, check_fsdp
    check_fsdp(Config(mode="fsdp"))
    with pytest.raises(ValueError, match="compression, elastic"):
        check_fsdp(Config(mode="fsdp", compression="int8", elastic=True))


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


# -- progress output -----------------------------------------------------------
# Rank 0 shows progress on stderr: a bar where that reaches a terminal, a line
# every 5% of the steps elsewhere (a Slurm output file, a pipe), never a bar
# redrawn with carriage returns into a file.

PROGRESS_LINE = re.compile(r"train step (\d+)/40 \((\d+)%\), elapsed \d\d:\d\d, ETA \S+, "
                           r"loss=\d+\.\d{3}, delivered=[01]\.\d{3}")


def example(*extra):
    return [mpiexec(), "-n", "2", sys.executable, "-m", "mpilossy.examples.lm", *TINY,
            "--loss", "0.1", *extra]


def run_logged(cmd, tmp_path, where, timeout=240):
    """cmd with stdout and stderr to pipes or to files (as sbatch does), read
    as bytes (text mode would turn a carriage return into a newline);
    returns (exit status, stdout, stderr)."""
    env = clean_subprocess_env(OMP_NUM_THREADS="1")
    with open(tmp_path / "job.out", "w+b") as out_file, \
            open(tmp_path / "job.err", "w+b") as err_file:
        to = subprocess.PIPE if where == "pipe" else None
        proc = subprocess.Popen([str(c) for c in cmd], stdout=to or out_file,
                                stderr=to or err_file, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                start_new_session=True, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {cmd}") from None
        if where != "pipe":
            out_file.seek(0)
            err_file.seek(0)
            out, err = out_file.read(), err_file.read()
    return proc.returncode, out, err


@pytest.mark.parametrize("where", ["pipe", "file"])
def test_progress_in_a_log_is_a_line_every_5_percent(tmp_path, where):
    """Output to a pipe or to files: 20 plain lines for 40 steps (every 2
    steps, the last at 100%), no carriage return anywhere, a few KB in all
    (the bar wrote a carriage-return update every 0.1 s)."""
    code, out, err = run_logged(example(), tmp_path, where)
    assert code == 0, out[-2000:] + err[-3000:]
    assert b"\r" not in err and b"\r" not in out, err[-2000:]
    lines = [m for m in map(PROGRESS_LINE.fullmatch, err.decode().splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == list(range(2, 41, 2)), err.decode()
    assert [int(m.group(2)) for m in lines] == list(range(5, 101, 5)), err.decode()
    assert len(err) < 4000, err.decode()       # about 80 bytes a line
    assert b"val perplexity" in out and b"train step" not in out, out


def test_progress_on_a_terminal_is_a_bar(tmp_path):
    """mpiexec on a pseudo-terminal: the rank writes into a pipe of the
    launcher, which copies it to the terminal; the example sees through that
    and draws tqdm's bar (carriage-return updates), not lines."""
    import pty
    import select
    import tty

    master, slave = pty.openpty()
    tty.setraw(slave)           # no newline translation: a \r is tqdm's own
    proc = subprocess.Popen([str(c) for c in example()], stdin=slave, stdout=slave, stderr=slave,
                            cwd=tmp_path, start_new_session=True,
                            env=clean_subprocess_env(OMP_NUM_THREADS="1", TERM="xterm"))
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:     # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            raise AssertionError("timed out after 240 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "val perplexity" in text, text[-3000:]
    assert text.count("\rtrain:") >= 2 and "40/40" in text, text[-3000:]
    assert not PROGRESS_LINE.search(text), text[-3000:]


def test_progress_choice(tmp_path):
    """The choice itself: a terminal gives a bar, a file, a pipe and
    /dev/null give lines (this process has no launcher above it), an
    explicit mode wins, and a bad one is refused."""
    import pty

    from mpilossy.examples.lm.progress import choose, progress

    master, slave = pty.openpty()
    with open(slave, "w") as terminal, open(tmp_path / "log", "w") as log, \
            open(os.devnull, "w") as null:
        read_end, write_end = os.pipe()
        with open(write_end, "w") as pipe:
            assert choose("auto", terminal) == "bar"
            assert [choose("auto", f) for f in (log, pipe, null)] == ["lines"] * 3
            assert choose("bar", log) == "bar" and choose("lines", terminal) == "lines"
            assert choose("none", terminal) == "none"
            with pytest.raises(ValueError, match="progress must be one of"):
                choose("tty", log)
            # 7 steps at every 5%: a line each step, the last at the end only once
            shown = progress(7, "train", "step", "lines", log)
            for _ in range(7):
                shown.update()
            shown.close()
        os.close(read_end)
    os.close(master)
    lines = (tmp_path / "log").read_text().splitlines()
    assert [line.split()[2] for line in lines] == [f"{n}/7" for n in range(1, 8)], lines


@pytest.mark.skipif(not reports_failures(), reason="this MPI does not report failed ranks")
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_spares_a_spare_takes_the_killed_ranks_place(tmp_path, mode):
    """--spares 1 --kill-rank 1 --at-step 15 at 4 ranks: rank 1 exits, the
    others exclude it, the spare (rank 3) takes its place with their model
    and optimizer state (sharded: the chunks cut again over the three),
    and the three finish the run with one model."""
    out = tmp_path / "result.json"
    done = run_bounded([mpiexec(), "-disable-auto-cleanup", "-n", "4", sys.executable, "-m",
                        "mpilossy.examples.lm", *TINY, "--mode", mode, "--spares", "1",
                        "--kill-rank", "1",
                        "--at-step", "15", "--json", out], timeout=240,
                       env=clean_subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ranks [1] excluded; 3 went on, spares [3] among them" in done.stdout, done.stdout
    r = json.loads(out.read_text())
    assert r["members"] == [0, 2, 3] and r["ranks"] == 3, r
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    ppl = r["val_perplexity_ranks"]
    assert all(math.isfinite(p) and 1 < p < 100 for p in ppl), r
    assert max(ppl) / min(ppl) < 1.01, r        # (drift control keeps one model)


@pytest.mark.skipif(not reports_failures(), reason="this MPI does not report failed ranks")
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_soak_stopped_ranks_come_back_and_an_exit_is_replaced(tmp_path, mode):
    """--soak 30 at 4 working ranks and two spares, 120 steps: three
    failures, in turn, the third an exit; the two pre-launched spares fill
    the first two places, and the rank stopped first wakes, is told it is
    out and comes back as a spare, taking the third lost rank's place (with
    a new wrapper of its optimizer; sharded: its chunk).  The run ends at
    full size with one model, every failure's place filled.

    Two spares, not one: a failure finds a spare standing by whatever the
    step time.  With one, the third failure's place waits for the second
    failure's rank to wake (2 s after it stopped), which at 9 ms a step
    came after the run's end (steps to full size None; seen in CI)."""
    out = tmp_path / "result.json"
    done = run_bounded([mpiexec(), "-disable-auto-cleanup", "-n", "6", sys.executable, "-m",
                        "mpilossy.examples.lm", *TINY, "--steps", "120", "--mode", mode,
                        "--spares", "2", "--soak", "30", "--soak-hang", "2",
                        "--soak-exits", "1", "--elastic-wait", "1", "--json", out],
                       timeout=240, env=clean_subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    soak = r["soak"]
    assert soak["failures"] == 3 and soak["exits"] == 1, soak
    # back at four ranks within 3 steps of each failure, and at the end; among
    # them a rank that was excluded and came back (not a pre-launched spare, 4 or 5)
    assert r["ranks"] == 4 and len(set(r["members"])) == 4, r
    assert all(back is not None and back <= 3 for _, _, back in soak["costs"]["each"]), soak
    assert any(a >= 1 for m, a in zip(r["members"], soak["arrivals"]) if m < 4), r
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    ppl = r["val_perplexity_ranks"]
    assert all(math.isfinite(p) and 1 < p < 100 for p in ppl), r
    assert max(ppl) / min(ppl) < 1.01, r        # (one model: the newcomers took it over)


def test_spares_refuse_what_a_newcomer_cannot_take_over():
    from mpilossy.examples.lm.train import Config, train
    from mpi4py import MPI
    with pytest.raises(ValueError, match="spares .* do not take: mode fsdp"):
        train(Config(spares=1, mode="fsdp", steps=1), MPI.COMM_WORLD, progress=False)
    with pytest.raises(ValueError, match="spares .* do not take: error_feedback"):
        train(Config(spares=1, mode="sharded", error_feedback=True, steps=1), MPI.COMM_WORLD,
              progress=False)


def test_forget_state_zeroes_the_moments_and_keeps_the_step():
    """The soak's control arm (soak.forget_state): AdamW's moments of every
    parameter the optimizer holds restart from zeros, its step count and the
    parameters themselves stay."""
    import torch
    from mpilossy.examples.lm.soak import forget_state
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    adamw = torch.optim.AdamW(params, lr=0.1)
    for _ in range(3):
        adamw.zero_grad()
        sum((p ** 2).sum() for p in params).backward()
        adamw.step()
    before = [p.detach().clone() for p in params]
    assert forget_state(adamw) == 2 * (15 + 7)
    for p, b in zip(params, before):
        state = adamw.state[p]
        assert torch.equal(p.detach(), b)
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any(), state
        assert float(state["step"]) == 3.0, state


def test_forget_zeroes_each_ranks_chunk_in_turn(tmp_path):
    """--forget 10 over 40 steps at 3 ranks (chunks of unequal size): three
    times, each rank's chunk once, so both moments of every parameter
    element are zeroed once in all; replicated mode is refused."""
    out = tmp_path / "forget.json"
    done = run_bounded([mpiexec(), "-n", "3", sys.executable, "-m", "mpilossy.examples.lm",
                        *TINY, "--mode", "sharded", "--forget", "10", "--json", out],
                       timeout=150, env=clean_subprocess_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["forgotten"] == {"times": 3, "elements": 2 * r["parameters"]}, r
    assert r["parameters"] % 3, r       # (the chunks are unequal)
    assert math.isfinite(r["val_perplexity"]) and r["train_loss_last"] < r["train_loss_first"], r
    from mpilossy.examples.lm.train import Config, train
    from mpi4py import MPI
    with pytest.raises(ValueError, match="forget_every .* needs .* mode 'sharded'"):
        train(Config(forget_every=10, mode="replicated", steps=1), MPI.COMM_WORLD,
              progress=False)


def test_timeout_argument():
    from mpilossy.examples.lm.__main__ import parser
    assert parser().parse_args([]).timeout == "auto"
    assert parser().parse_args(["--timeout", "none"]).timeout is None
    assert parser().parse_args(["--timeout", "0.25"]).timeout == 0.25
    with pytest.raises(SystemExit):
        parser().parse_args(["--timeout", "soon"])


@pytest.mark.skipif(not reports_failures(), reason="this MPI does not report failed ranks")
@pytest.mark.parametrize("mode", ["sharded", "replicated"])
def test_kill_rank_the_others_go_on(tmp_path, mode):
    """--kill-rank 1 --at-step 15 at 3 ranks (mpiexec -disable-auto-cleanup):
    rank 1 exits, the others exclude it and finish, the lowest survivor
    reports, and every process ends (os._exit: MPI_Finalize would hang)."""
    out = tmp_path / "result.json"
    done = run_bounded([mpiexec(), "-disable-auto-cleanup", "-n", "3", sys.executable, "-m",
                        "mpilossy.examples.lm", *TINY, "--mode", mode, "--kill-rank", "1",
                        "--at-step", "15", "--json", out], timeout=240,
                       env=clean_subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ranks [1] excluded; 2 went on" in done.stdout, done.stdout
    r = json.loads(out.read_text())
    assert r["members"] == [0, 2] and r["ranks"] == 2, r
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    assert all(math.isfinite(p) and 1 < p < 100 for p in r["val_perplexity_ranks"]), r


def test_a_spares_warm_up_leaves_the_model_and_the_random_state_as_they_were(monkeypatch):
    """The spare's warm-up step (before it stands by) trains a copy: the
    model it will receive the survivors' state into, and the random draws
    of the run, are untouched; the copy did move (a step was taken)."""
    import copy

    import numpy as np
    import torch

    from mpilossy.examples.lm import corpus as corpus_mod
    from mpilossy.examples.lm.model import TinyGPT
    from mpilossy.examples.lm.train import Config, warm_up

    cfg = Config(width=32, layers=1, heads=2, context=32, batch=8)
    model = TinyGPT(corpus_mod.VOCAB, cfg.context, cfg.width, cfg.layers, cfg.heads)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    text = np.arange(4096, dtype=np.int64) % corpus_mod.VOCAB
    copies = []
    deepcopy = copy.deepcopy

    def kept(obj, *args):
        twin = deepcopy(obj, *args)
        if obj is model:
            copies.append(twin)
        return twin

    monkeypatch.setattr(copy, "deepcopy", kept)
    warm_up(model, cfg, text, torch.device("cpu"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert copies and any(not torch.equal(before[k], v)
                          for k, v in copies[0].state_dict().items())
