"""The results table of docs/results.md: every row is one command of the
example, run for several seeds; the table and a plot are written from them.

    python -m mpilossy.examples.lm.results                 # everything (long)
    python -m mpilossy.examples.lm.results --rows baseline,bernoulli-10
    python -m mpilossy.examples.lm.results --report        # table + plot from saved runs

Runs are saved one JSON file each under --out/runs/, so an interrupted sweep
resumes where it stopped; --report rebuilds the table and plot from them.
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
from pathlib import Path
from typing import Dict, List, Tuple

GE = "gilbert-elliott:p_good_to_bad=0.02,p_bad_to_good=0.2,loss_bad=1"    # bursts of ~5 blocks, ~9% lost

# (name, what it shows, arguments of the example)
# The lossy rows measured before algorithm="auto" chose direct name the ring
# explicitly, so that their commands reproduce their figures.
RING = ["--algorithm", "ring"]
ROWS: List[Tuple[str, str, List[str]]] = [
    ("baseline", "reliable MPI_Allreduce", ["--reduce", "mpi"]),
    ("bernoulli-1", "Bernoulli 1%", ["--loss", "0.01", *RING]),
    ("bernoulli-5", "Bernoulli 5%", ["--loss", "0.05", *RING]),
    ("bernoulli-10", "Bernoulli 10%", ["--loss", "0.1", *RING]),
    ("bernoulli-20", "Bernoulli 20%", ["--loss", "0.2", *RING]),
    ("bernoulli-30", "Bernoulli 30%", ["--loss", "0.3", *RING]),
    ("microburst", "Gilbert-Elliott microbursts (~9%)", ["--loss", GE, *RING]),
    ("zero-fill-10", "10%, no rescaling (zero-fill)", ["--loss", "0.1", "--zero-fill", *RING]),
    ("zero-fill-30", "30%, no rescaling (zero-fill)", ["--loss", "0.3", "--zero-fill", *RING]),
    ("no-drift-10", "10%, no drift correction", ["--loss", "0.1", "--no-drift-correction", *RING]),
    ("no-drift-30", "30%, no drift correction", ["--loss", "0.3", "--no-drift-correction", *RING]),
    ("phase-aware-10", "10%, phase-aware tolerance", ["--loss", "0.1", "--phase-aware", *RING]),
    ("phase-aware-30", "30%, phase-aware tolerance", ["--loss", "0.3", "--phase-aware", *RING]),
    ("tree-10", "10%, tree all-reduce (a lost block costs one contribution)",
     ["--loss", "0.1", "--algorithm", "tree"]),
    ("tree-phase-aware-10", "10%, tree all-reduce and phase-aware tolerance",
     ["--loss", "0.1", "--algorithm", "tree", "--phase-aware"]),
    ("unaligned-10", "10%, ranks not lined up (compute skew adds straggler loss)",
     ["--loss", "0.1", "--no-align", *RING]),
    ("direct-10", "10%, direct all-reduce (one hop; early close)",
     ["--loss", "0.1", "--algorithm", "direct"]),
    ("direct-30", "30%, direct all-reduce (one hop; early close)",
     ["--loss", "0.3", "--algorithm", "direct"]),
]


def command(np_: int, args: List[str], seed: int, extra: List[str]) -> List[str]:
    return ["mpiexec", "-n", str(np_), sys.executable, "-m", "mpilossy.examples.lm",
            "--no-progress", "--seed", str(seed)] + args + extra


def shown(np_: int, args: List[str], extra: List[str]) -> str:
    return " ".join(["mpiexec -n", str(np_), "python -m mpilossy.examples.lm"]
                    + [shlex.quote(a) for a in args + extra] + ["--seed S"])


def run_rows(opts: argparse.Namespace, runs: Path) -> None:
    wanted = [r for r in ROWS if not opts.rows or r[0] in opts.rows]
    todo = [(name, args, seed) for name, _, args in wanted for seed in opts.seeds
            if not (runs / f"{name}-s{seed}.json").exists()]
    try:
        from tqdm import tqdm
        todo_iter = tqdm(todo, desc="runs", unit="run")
    except ImportError:
        todo_iter = todo
    for name, args, seed in todo_iter:
        target = runs / f"{name}-s{seed}.json"
        partial = target.with_suffix(".tmp")
        cmd = command(opts.np, args, seed, opts.extra) + ["--json", str(partial)]
        began = time.time()
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=opts.run_timeout)
        if done.returncode != 0 or not partial.exists():
            print(f"{name} seed {seed} failed ({done.returncode}):\n{done.stdout[-3000:]}",
                  file=sys.stderr)
            continue
        result = json.loads(partial.read_text())
        result["row"], result["command"] = name, shown(opts.np, args, opts.extra)
        result["sweep_seconds"] = time.time() - began
        target.write_text(json.dumps(result, indent=1))
        partial.unlink()


def load(runs: Path) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for path in sorted(runs.glob("*.json")):
        result = json.loads(path.read_text())
        out.setdefault(result["row"], []).append(result)
    return out


def spread(values: List[float]) -> Tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def report(runs: Path, out: Path) -> str:
    data = load(runs)
    if "baseline" not in data:
        raise SystemExit("no baseline runs yet: run the 'baseline' row first")
    base_ppl, base_sd = spread([r["val_perplexity"] for r in data["baseline"]])
    base_time = statistics.fmean(r["train_seconds"] for r in data["baseline"])
    base_by_seed = {r["config"]["seed"]: r["val_perplexity"] for r in data["baseline"]}
    lines = [
        "| row | val perplexity (mean ± sd) | change of the mean | paired change (mean ± sd) "
        "| delivered | final drift | max drift | train time vs baseline | seeds |",
        "|---|---|---|---|---|---|---|---|---|"]
    for name, what, _ in ROWS:
        if name not in data:
            continue
        rs = data[name]
        ppl, sd = spread([r["val_perplexity"] for r in rs])
        change = 100 * (ppl / base_ppl - 1)
        drift = statistics.fmean(r["final_drift"] for r in rs)
        max_drift = max(r["max_drift"] for r in rs)
        delivered = statistics.fmean(r["delivered"] for r in rs)
        speed = statistics.fmean(r["train_seconds"] for r in rs) / base_time
        # Same seed, same initialisation and data order: the per-seed
        # difference from the baseline is far less noisy than the means.
        paired = [100 * (r["val_perplexity"] / base_by_seed[r["config"]["seed"]] - 1)
                  for r in rs if r["config"]["seed"] in base_by_seed]
        pm, ps = spread(paired) if paired else (math.nan, math.nan)
        lines.append(f"| {what} | {ppl:.3f} ± {sd:.3f} | {change:+.2f}% | {pm:+.2f}% ± {ps:.2f} "
                     f"| {delivered:.3f} | {drift:.1e} | {max_drift:.1e} | {speed:.2f}x "
                     f"| {len(rs)} |")
    noise = 100 * base_sd / base_ppl
    lines += ["", f"Baseline seed noise: sd {base_sd:.3f} = {noise:.2f}% of its mean "
              f"perplexity {base_ppl:.3f}.", "", "Commands (S = seed):", ""]
    # The row's command as it reproduces the row today (runs saved before a
    # default changed carry an older spelling of it).
    lines += [f"- {what}: `{shown(data[name][0]['ranks'], args, [])}`"
              for name, what, args in ROWS if name in data]
    table = "\n".join(lines) + "\n"
    (out / "lm-table.md").write_text(table)
    plot(data, base_ppl, base_sd, out / "lm.png")
    return table


def plot(data: Dict[str, List[dict]], base_ppl: float, base_sd: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.axhspan(base_ppl - base_sd, base_ppl + base_sd, color="0.85", label="MPI_Allreduce ± sd")
    ax.axhline(base_ppl, color="0.4", lw=1)
    series = [("bernoulli-{}", "unbiased + drift correction", "o-"),
              ("zero-fill-{}", "zero-fill", "s--"), ("no-drift-{}", "no drift correction", "^--"),
              ("phase-aware-{}", "phase-aware tolerance", "d:")]
    for pattern, label, style in series:
        xs, ys, es = [], [], []
        for pct in (1, 5, 10, 20, 30):
            rs = data.get(pattern.format(pct))
            if rs:
                m, s = spread([r["val_perplexity"] for r in rs])
                xs.append(pct), ys.append(m), es.append(s)
        if xs:
            ax.errorbar(xs, ys, yerr=es, fmt=style, capsize=3, label=label)
    for name, x, style, label in (("microburst", 9, "*", "Gilbert-Elliott (~9%)"),
                                  ("tree-10", 10.4, "P", "tree all-reduce (10%)")):
        if name in data:
            m, s = spread([r["val_perplexity"] for r in data[name]])
            ax.errorbar([x], [m], yerr=[s], fmt=style, ms=9, capsize=3, label=label)
    ax.set_xlabel("injected block loss (%)")
    ax.set_ylabel("validation perplexity (lower is better)")
    ax.set_title("Byte-level transformer, 4 ranks, stdlib corpus")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpilossy.examples.lm.results",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--rows", type=lambda s: s.split(","), default=None,
                    help=f"rows to run (default all): {','.join(r[0] for r in ROWS)}")
    ap.add_argument("--out", type=Path, default=Path("docs/results"),
                    help="where runs/, lm-table.md and lm.png go")
    ap.add_argument("--report", action="store_true", help="only rebuild the table and plot")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("extra", nargs=argparse.REMAINDER,
                    help="after --: more arguments for every run (e.g. -- --steps 100)")
    opts = ap.parse_args(argv)
    opts.extra = [a for a in opts.extra if a != "--"]
    runs = opts.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if not opts.report:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        run_rows(opts, runs)
    print(report(runs, opts.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
