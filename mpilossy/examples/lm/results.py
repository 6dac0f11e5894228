"""The results table of docs/results.md: every row is one command of the
example, run for several seeds and compared seed by seed with its baseline
(same initialisation, same data order); the table and a plot are written
from the saved runs.

    python -m mpilossy.examples.lm.results                       # everything (long)
    python -m mpilossy.examples.lm.results --rows baseline,best-10
    python -m mpilossy.examples.lm.results --tier explore        # only the 3-seed rows
    python -m mpilossy.examples.lm.results --report              # table + plot from saved runs

Rows of the "paired" tier run for 8 seeds, exploratory rows and ablations
for 3.  Runs are saved one JSON file each under --out/runs/, so an
interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .progress import track

GE = "gilbert-elliott:p_good_to_bad=0.02,p_bad_to_good=0.2,loss_bad=1"    # bursts of ~5 blocks, ~9% lost

SEEDS = {"paired": list(range(8)), "explore": [0, 1, 2], "scale": [0, 1, 2],
         "straggle": list(range(8)), "compress": list(range(8)), "redundancy": list(range(8)),
         "fsdp": list(range(8)), "soak": list(range(4))}


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    args: Tuple[str, ...]
    tier: str = "paired"            # "paired" (8 seeds) or "explore" (3)
    ranks: int = 4
    baseline: str = "baseline"      # the row it is paired with
    launcher: Tuple[str, ...] = ()  # mpiexec's own options


# Every lossy row spells its whole configuration, so that its command keeps
# reproducing it when the example's defaults change.  FORMER: the defaults
# these rows were measured with (the example now learns its deadline and
# adds parity blocks, redundancy "auto").
FORMER = ("--timeout", "0.05", "--redundancy", "none")
BEST = (*FORMER, "--mode", "sharded", "--no-error-feedback", "--no-rotate", "--missed",
        "extrapolate")
FEEDBACK = (*FORMER, "--mode", "sharded", "--error-feedback", "--no-rotate", "--missed",
            "extrapolate")
TODAY = (*FORMER, "--mode", "replicated", "--no-error-feedback", "--algorithm", "direct",
         "--rotate")
SHARDED = (*FORMER, "--mode", "sharded")
# the main job (run.sh): the example's defaults today, spelled out
MAIN = ("--mode", "sharded", "--timeout", "auto", "--redundancy", "auto", "--no-error-feedback",
        "--no-rotate", "--missed", "extrapolate")
STRAGGLE = (*BEST, "--loss", "0", "--micro-batches", "4", "--straggle", "0.1:2",
            "--eval-every", "25")
ROWS: List[Row] = [
    Row("baseline", "reliable MPI_Allreduce", ("--reduce", "mpi")),
    Row("aa", "A/A: lossless mpilossy (sharded + error feedback, no loss)",
        (*FEEDBACK, "--loss", "0")),
    Row("best-10", "best: sharded, pinned reducers, extrapolate, 10%", (*BEST, "--loss", "0.1")),
    Row("main-10", "the main job (run.sh): the defaults (learned deadline, redundancy auto), 10%",
        (*MAIN, "--loss", "0.1")),
    Row("best-30", "best: sharded, pinned reducers, extrapolate, 30%", (*BEST, "--loss", "0.3")),
    Row("best-ge", "best: sharded, pinned reducers, extrapolate, GE (~9%)", (*BEST, "--loss", GE)),
    Row("ef-10", "best + error feedback, 10%", (*FEEDBACK, "--loss", "0.1")),
    Row("ef-30", "best + error feedback, 30%", (*FEEDBACK, "--loss", "0.3")),
    Row("ef-ge", "best + error feedback, GE (~9%)", (*FEEDBACK, "--loss", GE)),
    Row("today-10", "previous default: replicated direct, broadcast, 10%", (*TODAY, "--loss", "0.1")),
    Row("today-30", "previous default: replicated direct, broadcast, 30%", (*TODAY, "--loss", "0.3")),
    Row("today-ge", "previous default: replicated direct, broadcast, GE (~9%)", (*TODAY, "--loss", GE)),
    # redundancy (docs/redundancy.md): the same loss, with parity blocks; and
    # the bytes parity costs spent on data instead (a 25% larger batch)
    Row("red-10", "best + redundancy (8, 2), 10%", (*BEST, "--redundancy", "8,2", "--loss", "0.1"),
        "redundancy"),
    Row("red-30", "best + redundancy (4, 3), 30%", (*BEST, "--redundancy", "4,3", "--loss", "0.3"),
        "redundancy"),
    Row("red-ge", "best + redundancy (8, 2), GE (~9%)",
        (*BEST, "--redundancy", "8,2", "--loss", GE), "redundancy"),
    Row("red-auto-10", "best + redundancy auto (target 2.5%), 10%",
        (*BEST, "--redundancy", "auto", "--loss", "0.1"), "redundancy"),
    Row("batch-20-10", "control: best at 10% with 20 windows per rank instead of 16 (25% more "
        "compute, same bytes)", (*BEST, "--batch", "20", "--loss", "0.1"), "redundancy"),
    Row("steps-375-10", "byte budget: best at 10% for 375 steps instead of 300 (25% more bytes "
        "and compute)", (*BEST, "--steps", "375", "--loss", "0.1"), "redundancy"),
    # exploratory rows and ablations (3 seeds)
    Row("ring-10", "replicated ring, broadcast, 10%",
        (*FORMER, "--mode", "replicated", "--no-error-feedback", "--algorithm", "ring",
         "--rotate", "--loss", "0.1"), "explore"),
    Row("average-10", "replicated direct, average re-sync, 10%",
        (*TODAY, "--resync", "average", "--loss", "0.1"), "explore"),
    Row("replicated-ef-10", "replicated direct + error feedback, broadcast, 10%",
        (*FORMER, "--mode", "replicated", "--error-feedback", "--algorithm", "direct",
         "--loss", "0.1"), "explore"),
    Row("sharded-10", "sharded as the paper: rotating reducers, no feedback, keep missed, 10%",
        (*SHARDED, "--no-error-feedback", "--rotate", "--missed", "keep", "--loss", "0.1"),
        "explore"),
    Row("sharded-ef-rotate-10", "sharded + error feedback, rotating reducers (two hops), keep, 10%",
        (*SHARDED, "--error-feedback", "--rotate", "--missed", "keep", "--loss", "0.1"),
        "explore"),
    Row("sharded-ef-keep-10", "sharded + error feedback, pinned reducers, keep missed, 10%",
        (*SHARDED, "--error-feedback", "--no-rotate", "--missed", "keep", "--loss", "0.1"),
        "explore"),
    Row("sharded-pinned-keep-10", "best, but a missed parameter block keeps its value, 10%",
        (*SHARDED, "--no-error-feedback", "--no-rotate", "--missed", "keep", "--loss", "0.1"),
        "explore"),
    Row("delay-only-10", "diagnostic: best with a reliable parameter all-gather every step, 10%",
        (*BEST, "--resync-every", "1", "--loss", "0.1"), "explore"),
    Row("batch-14", "diagnostic: reliable, 14 windows per rank instead of 16 (12.5% less data)",
        ("--reduce", "mpi", "--batch", "14"), "explore"),
    Row("zero-fill-10", "ablation: sharded, no rescaling, no feedback, 10%",
        (*SHARDED, "--no-error-feedback", "--rotate", "--zero-fill", "--missed", "keep",
         "--loss", "0.1"), "explore"),
    Row("no-resync-10", "ablation: best without re-synchronisation, 10%",
        (*BEST, "--no-drift-correction", "--loss", "0.1"), "explore"),
    Row("no-resync-30", "ablation: best without re-synchronisation, 30%",
        (*BEST, "--no-drift-correction", "--loss", "0.3"), "explore"),
    # scale: the same global batch (64 windows) over 8 and 16 ranks
    Row("baseline-8", "8 ranks: reliable MPI_Allreduce", ("--reduce", "mpi", "--batch", "8"),
        "scale", 8, "baseline-8"),
    Row("best-10-8", "8 ranks: best, 10%", (*BEST, "--loss", "0.1", "--batch", "8"),
        "scale", 8, "baseline-8"),
    Row("today-10-8", "8 ranks: previous default, 10%", (*TODAY, "--loss", "0.1", "--batch", "8"),
        "scale", 8, "baseline-8"),
    Row("baseline-16", "16 ranks: reliable MPI_Allreduce", ("--reduce", "mpi", "--batch", "4"),
        "scale", 16, "baseline-16"),
    Row("best-10-16", "16 ranks: best, 10%", (*BEST, "--loss", "0.1", "--batch", "4"),
        "scale", 16, "baseline-16"),
    # stragglers in compute: 4 micro-batches per step, each rank 2x slower on
    # 10% of its steps (drawn per rank and step); paired with the fixed count
    Row("straggle-fixed", "stragglers: 4 micro-batches every step (no compute deadline)",
        STRAGGLE, "straggle", baseline="straggle-fixed"),
    Row("straggle-aa", "stragglers, A/A: the same command again",
        STRAGGLE, "straggle", baseline="straggle-fixed"),
    Row("straggle-deadline", "stragglers: compute deadline auto (DropCompute), weighted average",
        (*STRAGGLE, "--compute-deadline", "auto"), "straggle", baseline="straggle-fixed"),
    Row("straggle-deadline-330", "stragglers: compute deadline auto, 330 steps (10% more)",
        (*STRAGGLE, "--compute-deadline", "auto", "--steps", "330"), "straggle",
        baseline="straggle-fixed"),
]
# gradient compression (8 seeds): the best sharded setting with compressed
# gradients, paired with the same setting in float32, lossless and at 10%
ROWS += [
    Row("c-f32-0", "compression: float32 (the best setting, lossless)",
        (*BEST, "--loss", "0"), "compress", baseline="c-f32-0"),
    Row("c-aa-0", "compression, A/A: float32 lossless again",
        (*BEST, "--loss", "0"), "compress", baseline="c-f32-0"),
    Row("c-f32-10", "compression: float32, 10%", (*BEST, "--loss", "0.1"), "compress",
        baseline="c-f32-10"),
]
for _name, _spec, _what in [("int8", "int8", "int8"), ("int4", "int4", "int4"),
                            ("topk10", "topk:0.1", "Top-K 10%"), ("topk1", "topk:0.01", "Top-K 1%")]:
    ROWS += [
        Row(f"c-{_name}-0", f"compression: {_what} + its error feedback, lossless",
            (*BEST, "--loss", "0", "--compression", _spec), "compress", baseline="c-f32-0"),
        Row(f"c-{_name}-noef-0", f"compression: {_what} without error feedback, lossless",
            (*BEST, "--loss", "0", "--compression", _spec, "--no-compression-feedback"),
            "compress", baseline="c-f32-0"),
        Row(f"c-{_name}-10", f"compression: {_what} + its error feedback, 10%",
            (*BEST, "--loss", "0.1", "--compression", _spec), "compress", baseline="c-f32-10"),
    ]
# FSDP2 (8 seeds): the example's fsdp mode over Gloo (reliable) and over the
# torch.distributed backend "mpilossy" (reduce-scatters lossy, all-gathers
# exact), with the library's defaults: learned deadline, redundancy auto
FSDP = ("--fsdp", "--timeout", "auto")
ROWS += [
    Row("fsdp-gloo", "FSDP2 over Gloo (reliable)", (*FSDP, "--reduce", "mpi"), "fsdp",
        baseline="fsdp-gloo"),
    Row("fsdp-aa", "FSDP2 over the mpilossy backend, lossless", (*FSDP, "--loss", "0"), "fsdp",
        baseline="fsdp-gloo"),
    Row("fsdp-10", "FSDP2 over the mpilossy backend, redundancy auto, 10%",
        (*FSDP, "--redundancy", "auto", "--loss", "0.1"), "fsdp", baseline="fsdp-gloo"),
    Row("fsdp-10-nored", "FSDP2 over the mpilossy backend, no redundancy, 10%",
        (*FSDP, "--redundancy", "none", "--loss", "0.1"), "fsdp", baseline="fsdp-gloo"),
]
# diagnostic (3 seeds): the same with SGD + momentum instead of AdamW, whose
# per-coordinate normalisation turns Top-K's bursts of accumulated residual
# into one normal-sized step
SGD = (*BEST, "--loss", "0", "--optimizer", "sgd", "--lr", "0.3")
ROWS += [
    Row("c-sgd-f32-0", "compression, SGD: float32, lossless", SGD, "explore",
        baseline="c-sgd-f32-0"),
    Row("c-sgd-int4-0", "compression, SGD: int4 + its error feedback", (*SGD, "--compression", "int4"),
        "explore", baseline="c-sgd-f32-0"),
    Row("c-sgd-int4-noef-0", "compression, SGD: int4 without error feedback",
        (*SGD, "--compression", "int4", "--no-compression-feedback"), "explore",
        baseline="c-sgd-f32-0"),
    Row("c-sgd-topk10-0", "compression, SGD: Top-K 10% + its error feedback",
        (*SGD, "--compression", "topk:0.1"), "explore", baseline="c-sgd-f32-0"),
    Row("c-sgd-topk10-noef-0", "compression, SGD: Top-K 10% without error feedback",
        (*SGD, "--compression", "topk:0.1", "--no-compression-feedback"), "explore",
        baseline="c-sgd-f32-0"),
    Row("c-sgd-topk1-0", "compression, SGD: Top-K 1% + its error feedback",
        (*SGD, "--compression", "topk:0.01"), "explore", baseline="c-sgd-f32-0"),
]
# the soak (docs/elastic.md "A soak", issue's commands): 4 working ranks and
# 5 spares; a rank fails before every 15th step, 100 failures (4 exits, the
# others stop for 2.5 s and come back as spares), paired with the same
# processes undisturbed (the spares released at the end); 4 seeds
SPARES = ("--mode", "replicated", "--spares", "5", "--elastic-wait", "1", "--steps", "1515")
FAILURES = ("--soak", "15", "--soak-exits", "4", "--soak-hang", "2.5")
ROWS += [
    Row("soak-ref", "soak: undisturbed (4 ranks, 5 spares standing by)", SPARES, "soak", 9,
        "soak-ref", ("-disable-auto-cleanup",)),
    Row("soak-aa", "soak, A/A: undisturbed again", SPARES, "soak", 9, "soak-ref",
        ("-disable-auto-cleanup",)),
    Row("soak", "soak: 100 failures, channel auto (rma)", (*SPARES, *FAILURES), "soak", 9,
        "soak-ref", ("-disable-auto-cleanup",)),
    Row("soak-ud", "soak: 100 failures, channel ud", (*SPARES, *FAILURES, "--channel", "ud"),
        "soak", 9, "soak-ref", ("-disable-auto-cleanup",)),
]
# the same in the sharded mode, where a lost rank takes its chunk of the
# optimizer's state with it: restored from the copy the next rank kept
# (copy_state_every, 10 by default), or restarted from zeros without copies
SHARDED_SPARES = ("--mode", "sharded", *SPARES[2:])
ROWS += [
    Row("soak-sharded-ref", "soak, sharded: undisturbed", SHARDED_SPARES, "soak", 9,
        "soak-sharded-ref", ("-disable-auto-cleanup",)),
    Row("soak-sharded", "soak, sharded: 100 failures, state copied every 10 steps",
        (*SHARDED_SPARES, *FAILURES), "soak", 9, "soak-sharded-ref", ("-disable-auto-cleanup",)),
    Row("soak-sharded-copy1", "soak, sharded: 100 failures, state copied every step",
        (*SHARDED_SPARES, *FAILURES, "--copy-state-every", "1"), "soak", 9, "soak-sharded-ref",
        ("-disable-auto-cleanup",)),
    Row("soak-sharded-nocopy", "soak, sharded: 100 failures, no copies (a lost chunk's state "
        "restarts from zeros)", (*SHARDED_SPARES, *FAILURES, "--copy-state-every", "0"), "soak",
        9, "soak-sharded-ref", ("-disable-auto-cleanup",)),
]
# Paired comparisons between rows (same seeds): (row, against, what it isolates)
COMPARISONS = [
    ("best-10", "today-10", "the sharded scheme against the previous default, 10%"),
    ("best-30", "today-30", "the same, 30%"),
    ("best-ge", "today-ge", "the same, Gilbert-Elliott"),
    ("ef-10", "best-10", "error feedback added to the best, 10%"),
    ("ef-30", "best-30", "error feedback added to the best, 30%"),
    ("ef-ge", "best-ge", "error feedback added to the best, Gilbert-Elliott"),
    ("sharded-pinned-keep-10", "best-10", "keeping missed parameter blocks instead of extrapolating"),
    ("sharded-10", "best-10", "the paper's rules (rotating reducers, keep) against the best"),
    ("average-10", "today-10", "replicated: average re-synchronisation instead of broadcast"),
    ("delay-only-10", "best-10", "no stale parameters at all (reliable all-gather every step)"),
    ("best-10-8", "today-10-8", "8 ranks: the sharded scheme against the previous default"),
    ("red-10", "best-10", "redundancy (8, 2) added to the best, 10%"),
    ("red-30", "best-30", "redundancy (4, 3) added to the best, 30%"),
    ("red-ge", "best-ge", "redundancy (8, 2) added to the best, Gilbert-Elliott"),
    ("red-auto-10", "best-10", "redundancy auto added to the best, 10%"),
    ("red-auto-10", "red-10", "auto (chosen from the measured rate) against a fixed (8, 2), 10%"),
    ("red-10", "batch-20-10", "(8, 2) at 10% against a 25% larger batch instead"),
    ("red-10", "steps-375-10", "(8, 2) at 10% against its 25% more bytes spent on 25% more steps"),
    *[(f"c-{name}-noef-0", f"c-{name}-0", f"{what}: without its error feedback against with it")
      for name, what in [("int8", "int8"), ("int4", "int4"), ("topk10", "Top-K 10%"),
                         ("topk1", "Top-K 1%")]],
]

# 97.5% quantiles of Student's t for 1..10 degrees of freedom (two-sided 95%).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def interval(values: List[float]) -> Tuple[float, float]:
    """Mean and half-width of its 95% confidence interval (t distribution)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = T975.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def command(row: Row, seed: int, extra: List[str]) -> List[str]:
    return ["mpiexec", *row.launcher, "-n", str(row.ranks), sys.executable, "-m", "mpilossy.examples.lm",
            "--no-progress", "--seed", str(seed), *row.args, *extra]


def shown(row: Row) -> str:
    return " ".join([" ".join(["mpiexec", *row.launcher, "-n", str(row.ranks),
                               "python -m mpilossy.examples.lm"])]
                    + [shlex.quote(a) for a in row.args] + ["--seed S"])


def run_rows(rows: List[Row], seeds: Optional[List[int]], runs: Path, extra: List[str],
             run_timeout: float) -> None:
    # Seed by seed, the rows in turn: paired runs are minutes apart, not an
    # hour, so that a change in the machine's load falls on both (timings).
    todo = [(row, seed) for row in rows for seed in (seeds or SEEDS[row.tier])
            if not (runs / f"{row.name}-s{seed}.json").exists()]
    todo.sort(key=lambda item: item[1])
    for row, seed in track(todo, "sweep", "run"):
        target = runs / f"{row.name}-s{seed}.json"
        partial = target.with_suffix(".tmp")
        cmd = command(row, seed, extra) + ["--json", str(partial)]
        began = time.time()
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=run_timeout)
        if done.returncode != 0 or not partial.exists():
            print(f"{row.name} seed {seed} failed ({done.returncode}):\n{done.stdout[-3000:]}",
                  file=sys.stderr)
            continue
        result = json.loads(partial.read_text())
        result["row"], result["command"] = row.name, shown(row)
        result["sweep_seconds"] = time.time() - began
        target.write_text(json.dumps(result, indent=1))
        partial.unlink()


def load(runs: Path) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for path in sorted(runs.glob("*.json")):
        result = json.loads(path.read_text())
        out.setdefault(result["row"], []).append(result)
    return out


def paired(data: Dict[str, List[dict]], row: Row, against: Optional[str] = None) -> List[float]:
    """Per seed: 100 * (row / other - 1), for the seeds both have; the other
    row is the row's baseline unless given."""
    base = {r["config"]["seed"]: r["val_perplexity"]
            for r in data.get(against or row.baseline, [])}
    return [100 * (r["val_perplexity"] / base[r["config"]["seed"]] - 1)
            for r in sorted(data[row.name], key=lambda r: r["config"]["seed"])
            if r["config"]["seed"] in base]


def report(runs: Path, out: Path) -> str:
    data = load(runs)
    lines = [
        "| row | seeds | val perplexity (mean ± sd) | paired change vs its baseline, mean "
        "[95% interval] | delivered | final drift | max drift | train time vs baseline |",
        "|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        if row.name not in data or row.tier in ("straggle", "soak"):
            continue
        rs = data[row.name]
        ppls = [r["val_perplexity"] for r in rs]
        sd = statistics.stdev(ppls) if len(ppls) > 1 else 0.0
        changes = paired(data, row) if row.name != row.baseline else []
        if changes:
            mean, half = interval(changes)
            change = f"{mean:+.2f}% [{mean - half:+.2f}, {mean + half:+.2f}]" \
                if not math.isnan(half) else f"{mean:+.2f}%"
        else:
            change = "(baseline)" if row.name == row.baseline else "–"
        base_time = [r["train_seconds"] for r in data.get(row.baseline, [])]
        speed = (f"{statistics.fmean(r['train_seconds'] for r in rs) / statistics.fmean(base_time):.2f}x"
                 if base_time else "–")
        lines.append(
            f"| {row.what} | {len(rs)} | {statistics.fmean(ppls):.3f} ± {sd:.3f} | {change} "
            f"| {statistics.fmean(r['delivered'] for r in rs):.3f} "
            f"| {statistics.fmean(r['final_drift'] for r in rs):.1e} "
            f"| {max(r['max_drift'] for r in rs):.1e} | {speed} |")
    lines += ["", "Paired comparisons between rows (same seeds), val perplexity change:", "",
              "| comparison | seeds | change, mean [95% interval] |", "|---|---|---|"]
    rows = {row.name: row for row in ROWS}
    for name, other, what in COMPARISONS:
        if name in data and other in data:
            changes = paired(data, rows[name], other)
            if len(changes) > 1:
                mean, half = interval(changes)
                lines.append(f"| {what} (`{name}` vs `{other}`) | {len(changes)} | "
                             f"{mean:+.2f}% [{mean - half:+.2f}, {mean + half:+.2f}] |")
    lines += straggler_report(data)
    lines += soak_report(data)
    lines += ["", "Commands (S = seed; each row ran seeds 0 to its count of seeds - 1):", ""]
    lines += [f"- {row.what}: `{shown(row)}`" for row in ROWS if row.name in data]
    table = "\n".join(lines) + "\n"
    (out / "lm-table.md").write_text(table)
    plot(data, out / "lm.png")
    return table


def time_to(curve: List[list], target: float, tolerance: float = 1e-4) -> float:
    """Training seconds at which the perplexity curve first reaches `target`
    (within `tolerance`, relative: runs that differ only in the order of
    floating-point sums end a few 1e-6 apart; linear between evaluations);
    inf if it never does."""
    target *= 1 + tolerance
    prev_t, prev_p = 0.0, math.inf
    for _, t, p in curve:
        if p <= target:
            if math.isinf(prev_p):
                return t
            return prev_t + (t - prev_t) * (prev_p - target) / (prev_p - p)
        prev_t, prev_p = t, p
    return math.inf


def straggler_report(data: Dict[str, List[dict]]) -> List[str]:
    """Rows of the straggler tier, paired by seed with `straggle-fixed`: time
    per step, time to the baseline's final perplexity, perplexity change."""
    base = {r["config"]["seed"]: r for r in data.get("straggle-fixed", [])}
    rows = [row for row in ROWS if row.tier == "straggle" and row.name in data
            and row.name != "straggle-fixed"]
    if not base or not rows:
        return []
    lines = ["", "Stragglers in compute (paired by seed with `straggle-fixed`):", "",
             "| row | seeds | micro-batches per step | time per step vs fixed, mean [95%] "
             "| time to fixed's final perplexity vs fixed's time [95%] (reached) "
             "| val perplexity change [95%] |", "|---|---|---|---|---|---|"]

    def shown_interval(values: List[float], fmt: str) -> str:
        mean, half = interval(values)
        return f"{mean:{fmt}} [{mean - half:{fmt}}, {mean + half:{fmt}}]"

    for row in rows:
        pairs = [(r, base[r["config"]["seed"]]) for r in data[row.name]
                 if r["config"]["seed"] in base]
        if len(pairs) < 2:
            continue
        step = [r["step_seconds"] / b["step_seconds"] for r, b in pairs]
        reach = [time_to(r["curve"], b["val_perplexity"]) / b["train_seconds"] for r, b in pairs]
        finite = [x for x in reach if math.isfinite(x)]
        ppl = [100 * (r["val_perplexity"] / b["val_perplexity"] - 1) for r, b in pairs]
        lines.append(
            f"| {row.what} | {len(pairs)} "
            f"| {statistics.fmean(r['micro_batches'] for r, _ in pairs):.2f} "
            f"| {shown_interval(step, '.3f')}x "
            f"| {shown_interval(finite, '.3f') + 'x' if len(finite) > 1 else '–'} "
            f"({len(finite)} of {len(pairs)}) "
            f"| {shown_interval(ppl, '+.2f')}% |")
    return lines


def soak_report(data: Dict[str, List[dict]]) -> List[str]:
    """Rows of the soak tier, paired by seed with their undisturbed row
    (`soak-ref`, `soak-sharded-ref`): perplexity change, and what the
    failures cost (the runs' `soak` records)."""
    rows = [row for row in ROWS if row.tier == "soak" and row.name in data
            and row.baseline in data and row.name != row.baseline]
    if not rows:
        return []
    lines = ["", "The soak (paired by seed with its undisturbed row; a failure's cost: "
             "seconds its step and the 9 after it took beyond the median step):", "",
             "| row | seeds | val perplexity change, mean [95%] (each seed) | failures (exits) "
             "| a failure's cost p50 / p90 / max, worst seed | steps to full size, max "
             "| time a step vs undisturbed |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        base = {r["config"]["seed"]: r for r in data[row.baseline]}
        pairs = [(r, base[r["config"]["seed"]]) for r in
                 sorted(data[row.name], key=lambda r: r["config"]["seed"])
                 if r["config"]["seed"] in base]
        if not pairs:
            continue
        ppl = [100 * (r["val_perplexity"] / b["val_perplexity"] - 1) for r, b in pairs]
        mean, half = interval(ppl)
        change = (f"{mean:+.2f}%" + ("" if math.isnan(half) else
                                     f" [{mean - half:+.2f}, {mean + half:+.2f}]")
                  + " (" + ", ".join(f"{x:+.2f}" for x in ppl) + ")")
        soaks = [r["soak"] for r, _ in pairs if r.get("soak")]
        if soaks:
            counts = sorted({f"{s['failures']} ({s['exits']})" for s in soaks})
            failures = counts[0] + " each" if len(counts) == 1 else ", ".join(counts)
            worst = max((s["costs"]["extra_seconds_p50_p90_max"] for s in soaks),
                        key=lambda c: c[2])
            cost = " / ".join(f"{x:.2f}" for x in worst) + " s"
            full = f"{max(s['costs']['steps_to_full_size_p50_p90_max'][2] for s in soaks):.0f}"
        else:
            failures, cost, full = "0", "–", "–"
        step = statistics.fmean(r["step_seconds"] / b["step_seconds"] for r, b in pairs)
        lines.append(f"| {row.what} | {len(pairs)} | {change} | {failures} | {cost} | {full} "
                     f"| {step:.2f}x |")
    return lines


def plot(data: Dict[str, List[dict]], path: Path) -> None:
    """Paired change with its 95% interval, one bar per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown_rows = [row for row in ROWS if row.name in data and row.name != row.baseline
                  and row.tier not in ("straggle", "soak") and paired(data, row)]
    if not shown_rows:
        return
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(shown_rows) + 1.4))
    lows, highs = [0.0], [0.0]
    for y, row in enumerate(shown_rows):
        mean, half = interval(paired(data, row))
        half = 0.0 if math.isnan(half) else half
        lows.append(mean - half)
        highs.append(mean + half)
        color = {"paired": "C0", "explore": "C1", "scale": "C2", "compress": "C3",
                 "redundancy": "C4", "fsdp": "C5"}[row.tier]
        ax.errorbar([mean], [y], xerr=[[half], [half]], fmt="o", color=color, capsize=3)
    ax.axvline(0, color="0.4", lw=1)
    for target, label in ((0.5, "10% target"), (2.0, "30% target")):
        ax.axvline(target, color="0.6", lw=1, ls="--")
        ax.text(target, -0.8, label, fontsize=7, ha="center", color="0.4")
    ax.set_xlim(min(lows) - 0.3, max(highs) + 0.3)
    ax.set_yticks(range(len(shown_rows)), [row.what for row in shown_rows], fontsize=7)
    ax.set_ylim(len(shown_rows) - 0.5, -1.2)
    ax.set_xlabel("val perplexity change vs reliable MPI_Allreduce, paired by seed (%), "
                  "95% interval")
    ax.set_title("Byte-level transformer. Blue: 8 seeds; orange: 3 seeds; "
                 "green: 8 and 16 ranks, 3 seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpilossy.examples.lm.results",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="seeds for every row run (default: by tier, 8 or 3)")
    ap.add_argument("--rows", type=lambda s: s.split(","), default=None,
                    help=f"rows to run (default all): {','.join(r.name for r in ROWS)}")
    ap.add_argument("--tier", choices=sorted(SEEDS), default=None, help="only this tier's rows")
    ap.add_argument("--out", type=Path, default=Path("docs/results"),
                    help="where runs/, lm-table.md and lm.png go")
    ap.add_argument("--report", action="store_true", help="only rebuild the table and plot")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("extra", nargs=argparse.REMAINDER,
                    help="after --: more arguments for every run (e.g. -- --steps 100)")
    opts = ap.parse_args(argv)
    extra = [a for a in opts.extra if a != "--"]
    unknown = set(opts.rows or ()) - {r.name for r in ROWS}
    if unknown:
        ap.error(f"unknown rows: {', '.join(sorted(unknown))}")
    rows = [r for r in ROWS if (not opts.rows or r.name in opts.rows)
            and (opts.tier is None or r.tier == opts.tier)]
    runs = opts.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if not opts.report:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        run_rows(rows, opts.seeds, runs, extra, opts.run_timeout)
    print(report(runs, opts.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
