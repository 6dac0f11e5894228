"""`train`: the example language model under each condition, two arms per
seed back to back (MPI over TCP, then mpilossy, by default), and the paired
comparison of the arms: time for the same steps, time to the same
perplexity, perplexity, each as a mean with its 95% interval over seeds."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..examples.lm.results import interval

ARMS = ("mpi", "mpilossy")


def parse_arms(text: str) -> List[str]:
    """'mpi,mpilossy' (the default), or an A/A pair such as 'mpilossy,mpilossy'."""
    arms = [a.strip() for a in text.split(",")]
    if len(arms) != 2 or any(a not in ARMS for a in arms):
        raise ValueError(f"--arms takes two of {', '.join(ARMS)}, got {text!r}")
    return arms


def example_command(reduce: str, seed: int, out: Path, args: Any) -> List[str]:
    return [sys.executable, "-m", "mpilossy.examples.lm", "--reduce", reduce,
            "--channel", "ud", "--algorithm", args.algorithm,
            "--timeout", str(args.train_timeout).lower(), "--steps", str(args.steps),
            "--seed", str(seed), "--no-progress", "--json", str(out),
            *args.example_args.split()]


def train(run: Callable[[Any, List[str]], Any], conditions: Sequence[Any],
          args: Any) -> List[Dict[str, Any]]:
    """Every condition x seed x arm; `run(condition, cmd)` runs one job on
    the cluster under that condition and returns its CompletedProcess."""
    rows: List[Dict[str, Any]] = []
    arms = args.arms            # (parse_arms, through the command line)
    with tempfile.TemporaryDirectory() as tmp:
        for cond in conditions:
            for seed in (int(s) for s in args.seeds.split(",")):
                for arm, reduce in enumerate(arms):
                    out = Path(tmp) / "train.json"
                    proc = run(cond, example_command(reduce, seed, out, args))
                    if proc.returncode != 0:
                        raise SystemExit(f"{cond.name} {reduce}: exit {proc.returncode}\n"
                                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                    res = json.loads(out.read_text())
                    row = {"condition": cond.name, "drop": cond.drop, "bursts": cond.bursts,
                           "background": args.background if cond.background else None,
                           "seed": seed, "pace": args.pace, "arm": arm, "reduce": reduce,
                           "timeout": None if reduce == "mpi" else args.train_timeout,
                           **{k: res[k] for k in ("val_perplexity", "delivered", "train_seconds",
                                                  "comm_seconds", "wall_seconds", "curve")},
                           "phase_seconds": res.get("phase_seconds"),
                           "auto_deadlines": res.get("auto_deadlines"),
                           "redundancy_auto": res.get("redundancy_auto")}
                    rows.append(row)
                    print(f"{cond.name:<22} seed {seed} {reduce:<9} train "
                          f"{row['train_seconds']:7.1f} s  comm {row['comm_seconds']:6.1f} s  "
                          f"perplexity {row['val_perplexity']:6.3f}  "
                          f"delivered {row['delivered']:.3f}{phase_line(row)}", flush=True)
    for line in summary(rows):
        print(line, flush=True)
    return rows


def phase_line(row: Dict[str, Any]) -> str:
    """'  compute 30.1 align 2.0 ...' (seconds, mean over the ranks), or ''."""
    phases = row.get("phase_seconds") or {}
    return "".join(f"  {name} {p['mean']:.1f}" for name, p in phases.items())


def time_to(curve: Sequence[Sequence[float]], perplexity: float) -> Optional[float]:
    """Training seconds at the first evaluation at or below `perplexity`."""
    for _step, seconds, ppl in curve:
        if ppl <= perplexity:
            return seconds
    return None


def paired(rows: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, float]]]:
    """Per condition, per seed: the second arm against the first."""
    out: Dict[str, List[Dict[str, float]]] = {}
    by = {(r["condition"], r["seed"], r["arm"]): r for r in rows}
    for (cond, seed, arm), a in sorted(by.items()):
        b = by.get((cond, seed, 1))
        if arm != 0 or b is None:
            continue
        pair = {"time": b["train_seconds"] / a["train_seconds"] - 1,
                "perplexity": b["val_perplexity"] / a["val_perplexity"] - 1,
                "delivered": b["delivered"]}
        # Time to the same perplexity: the worse of the two final ones,
        # which both arms reach, read off each arm's evaluation curve.
        target = max(a["val_perplexity"], b["val_perplexity"])
        ta, tb = time_to(a["curve"], target), time_to(b["curve"], target)
        if ta and tb:
            pair["time_to_perplexity"] = tb / ta - 1
        out.setdefault(cond, []).append(pair)
    return out


def shown(shares: List[float]) -> str:
    """Mean in percent, with the half-width of its 95% interval."""
    mean, half = interval(shares)
    if math.isnan(half):
        return f"{100 * mean:+.2f}%"
    return f"{100 * mean:+.2f}% ± {100 * half:.2f}"


def summary(rows: List[Dict[str, Any]]) -> List[str]:
    """The paired comparison per condition (second arm against the first):
    means with the half-width of their 95% interval over seeds."""
    lines = []
    for cond, pairs in paired(rows).items():
        arms = sorted({(r["arm"], r["reduce"]) for r in rows if r["condition"] == cond})
        names = " against ".join(n for _, n in reversed(arms))
        line = (f"{cond}: {names}, {len(pairs)} seed(s): time {shown([p['time'] for p in pairs])}"
                f"  perplexity {shown([p['perplexity'] for p in pairs])}")
        to_ppl = [p["time_to_perplexity"] for p in pairs if "time_to_perplexity" in p]
        if to_ppl:
            line += f"  time to the same perplexity {shown(to_ppl)} ({len(to_ppl)} seed(s))"
        delivered = [p["delivered"] for p in pairs]
        line += f"  delivered {min(delivered):.3f}-{max(delivered):.3f}"
        lines.append(line)
    return lines
