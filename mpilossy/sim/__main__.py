"""python -m mpilossy.sim: calibrate the scale model against the emulated
cluster's figures, project it to larger fat trees, and print the tables of
docs/scale.md.

    python -m mpilossy.sim calibrate [--out DIR] [--jobs 2]
    python -m mpilossy.sim project [--nodes 8,16,32] [--ppn 8] [--rate 100gbit] [--out DIR]
    python -m mpilossy.sim all --out docs/results/scale --plot docs/scale.png
    python -m mpilossy.sim plot --out docs/results/scale --plot docs/scale.png   # from the JSON
    python -m mpilossy.sim heartbeat [--nodes 1,8,16,64,1024] [--ppn 8] [--out DIR]
    python -m mpilossy.sim scale [--nodes 64,256,1024] [--out DIR]
    python -m mpilossy.sim choose [--nodes 16,64,256,1024] [--ppns 1,8] [--out DIR]

Each scenario runs in a process of its own (SimGrid keeps one engine per
process); --jobs runs that many at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from . import mechanisms
from .engine import Background, Scenario
from .heartbeat import simulate_heartbeat
from .scenario import two_level_tree
from .runner import run_all, run_each

MiB = 1 << 20
PROJECT_BACKGROUND = "100/400:1"
SCALE_BACKGROUND = "20/180:4:aligned"     # MPI_Allreduce p99/p50 about 3 (docs/scale.md)
DEFAULT_SIZES = [25 * MiB, 100 * MiB]
CHOOSE_SIZES = [4 << 10, 64 << 10, MiB, 25 * MiB]


def _rate(text: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            return float(text[:-len(unit)]) * factor
    return float(text)


def _size(text: str) -> int:
    factor = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(text[-1].upper(), 0)
    return int(float(text[:-1]) * factor) if factor else int(text)


def _pct(model: float, measured: float) -> str:
    return f"{100 * (model - measured) / measured:+.0f}%"


def _fit_cores(rows: Sequence[Any], fit: int, fit_copy: int,
               fit_noise: int, sharing: bool) -> Tuple[float, float, float]:
    """The 2-core machine's three figures, each fitted on one row and
    checked on the rest: the rate at which a core sends datagrams (row
    `fit`'s ud p50), at which it copies in the hierarchy's node stages
    (`fit_copy`'s ud p50), and the jitter of a rank's CPU time (`fit_noise`'s
    ud p99 / p50).  The jitter slows the median too (a stage waits for its
    slowest rank), so the three are fitted in turn, twice."""
    def ud(row: Any, calls: int = 0, **fields: Any) -> Tuple[float, float]:
        s = replace(row.scenario, cores=2, sharing=sharing, **fields)
        out = run_all([replace(s, calls=calls or s.calls)], 1)[0]["lossy"]
        return out["p50"], out["p99"]

    rate, copy, jitter = 100e6, 0.0, 1e-3
    for _ in range(2):
        for _ in range(2):
            took = ud(rows[fit], 3, core_rate=rate, jitter=jitter)[0]
            rate *= took / rows[fit].ud[0]
        # the copies' share of a call goes as 1 / rate
        target = rows[fit_copy].ud[0]
        without = ud(rows[fit_copy], 2, core_rate=rate, jitter=jitter)[0]   # (at 2 GB/s)
        copy = 300e6 if target > without else 0.0
        for _ in range(2 if copy else 0):
            copy *= (ud(rows[fit_copy], 2, core_rate=rate, copy_rate=copy,
                        jitter=jitter)[0] - without) / (target - without)
        # a gamma process's spread goes as the square root of its variance
        p50, p99 = ud(rows[fit_noise], core_rate=rate, copy_rate=copy, jitter=jitter)
        want = rows[fit_noise].ud[1] / rows[fit_noise].ud[0] - 1
        jitter *= (want / max(p99 / p50 - 1, 1e-3)) ** 2
    return rate, copy, jitter


def calibrate(args: argparse.Namespace) -> Dict[str, Any]:
    from .mpich import RTO_MIN
    from .reference import FIT, FIT_COPY, FIT_NOISE, FIT_RTO, Run, load, timer_share
    rows_measured = load(args.measured)
    sharing = args.cores == "shared"
    rate, copy, jitter = _fit_cores(rows_measured, FIT, FIT_COPY, FIT_NOISE, sharing)
    # TCP's retransmission timeouts: the share of messages between nodes that
    # wait for the timer, from the share of MPI's calls that did on one row
    # (a timer holds up every rank of the call)
    fit_rto = rows_measured[FIT_RTO]
    probe = replace(fit_rto.scenario, cores=2, core_rate=rate, calls=2, rto_share=0.0)
    per_call = run_all([probe], 1)[0]["messages_tcp"] / probe.calls
    waited = timer_share(fit_rto, 0.75 * RTO_MIN)
    rto_share = (1 - (1 - waited) ** (1 / per_call)) / fit_rto.scenario.drop
    scenarios = [replace(r.scenario, cores=2, sharing=sharing, core_rate=rate, copy_rate=copy,
                         jitter=jitter,
                         rto_share=rto_share, calls=min(r.scenario.calls, args.calls))
                 for r in rows_measured]
    rows = run_all(scenarios, args.jobs)
    print(f"core rate fitted on row {FIT + 1}: {rate / 1e6:.1f} MB/s per core, 2 cores")
    print(f"the hierarchy's copy rate fitted on row {FIT_COPY + 1}: {copy / 1e6:.0f} MB/s per core")
    print(f"the cores' jitter fitted on row {FIT_NOISE + 1}'s ud p99 / p50: {jitter * 1e3:.2f} ms "
          "of variance per second of a rank's CPU work")
    print(f"TCP timers fitted on row {FIT_RTO + 1}: {100 * waited:.1f}% of MPI's calls waited, "
          f"{per_call:.0f} messages between nodes a call: a message waits with "
          f"{rto_share:.2f} x the drop rate\n")
    print("| # | scenario | MPI p50 / p99 (ms): emulated run 1, run 2; model | ud p50 / p99 (ms): "
          "emulated run 1, run 2; model | delivered: run 1, run 2; model | model off the runs' "
          "mean (MPI p50, p99; ud p50, p99) | run 2 off run 1 |")
    print("|---|---|---|---|---|---|---|")

    def ms(pair: Sequence[float]) -> str:
        return f"{pair[0] * 1e3:.1f} / {pair[1] * 1e3:.1f}"

    table = []
    for i, (ref, row) in enumerate(zip(rows_measured, rows), start=1):
        m, u = row["mpi"], row["lossy"]
        offs = [_pct(m["p50"], ref.mpi[0]), _pct(m["p99"], ref.mpi[1]),
                _pct(u["p50"], ref.ud[0]), _pct(u["p99"], ref.ud[1])]
        a, b = ref.runs[0], ref.runs[-1]
        spread = [_pct(b.mpi[0], a.mpi[0]), _pct(b.mpi[1], a.mpi[1]),
                  _pct(b.ud[0], a.ud[0]), _pct(b.ud[1], a.ud[1])]
        fits = [what for row, what in ((FIT, "cores"), (FIT_COPY, "copies"),
                                       (FIT_NOISE, "jitter"), (FIT_RTO, "TCP")) if row == i - 1]
        mark = f" (fit {', '.join(fits)})" if fits else ""
        print(f"| {i}{mark} | {row['label']} | {'; '.join(ms(r.mpi) for r in ref.runs)}; "
              f"**{ms((m['p50'], m['p99']))}** | {'; '.join(ms(r.ud) for r in ref.runs)}; "
              f"**{ms((u['p50'], u['p99']))}** | "
              f"{', '.join(f'{r.delivered:.3f}' for r in ref.runs)}; **{row['delivered']:.3f}** | "
              f"{', '.join(offs)} | {', '.join(spread)} |")
        table.append({**row, "measured": {
            "mpi": ref.mpi, "ud": ref.ud, "delivered": ref.delivered, "source": ref.source,
            "runs": [{"mpi": r.mpi, "ud": r.ud, "delivered": r.delivered} for r in ref.runs]}})

    def close(model: float, measured: float) -> bool:
        return abs(model - measured) <= 0.2 * measured

    def counts(pairs: Sequence[Tuple[Any, Any]]) -> Dict[str, int]:
        """How many (figures, their yardstick) pairs of runs are within 20%
        (0.02 for delivered)."""
        tally = dict.fromkeys(("MPI p50", "MPI p99", "ud p50", "ud p99"), 0)
        tally["delivered (within 0.02)"] = 0
        for a, b in pairs:
            for name, x, y in zip(tally, (*a.mpi, *a.ud, a.delivered),
                                  (*b.mpi, *b.ud, b.delivered)):
                tally[name] += (abs(x - y) <= 0.02 if name.startswith("delivered")
                                else close(x, y))
        return tally

    modelled = [Run((r["mpi"]["p50"], r["mpi"]["p99"]), (r["lossy"]["p50"], r["lossy"]["p99"]),
                    r["delivered"], (), ()) for r in rows]
    model = counts(list(zip(modelled, rows_measured)))
    itself = counts([(ref.runs[-1], ref.runs[0]) for ref in rows_measured])
    n = len(rows_measured)
    print(f"\nof {n} rows, within 20%: the model of the runs' mean: "
          + ", ".join(f"{k} {v}" for k, v in model.items()))
    print(f"of {n} rows, within 20%: run 2 of run 1 (the cluster against itself): "
          + ", ".join(f"{k} {v}" for k, v in itself.items()))
    result = {"cores": args.cores, "core_rate": rate, "copy_rate": copy, "jitter": jitter,
              "rto_share": rto_share,
              "timer_share": waited, "rows": table, "within": model, "runs_within": itself}
    _save(args, "calibration.json", result)
    return result


def _at_scale(args: argparse.Namespace, nodes: int, nbytes: int, **more: Any) -> Scenario:
    """The hierarchy on the fat tree as the command line sets it."""
    return Scenario(nodes=nodes, ppn=args.ppn, rate=_rate(args.rate), nbytes=nbytes,
                    algorithm="hierarchical", deadline=args.deadline, calls=args.calls,
                    latency=1e-6, memory=100e9, tree=two_level_tree(nodes),
                    seal_rate=args.seal_rate, payload=args.payload,
                    redundancy=args.redundancy, **more)


def project(args: argparse.Namespace) -> Dict[str, Any]:
    rate = _rate(args.rate)
    scenarios = []
    for nodes in args.nodes:
        for nbytes in args.sizes:
            base = _at_scale(args, nodes, nbytes, pieces=4)
            scenarios.append(base)
            if args.background:
                scenarios.append(replace(base, background=Background.parse(args.background)))
    rows = run_all(scenarios, args.jobs)
    print("| nodes x ranks | bucket | background | MPI_Allreduce p50 / p99 (ms) | mpilossy "
          "hierarchical p50 / p99 (ms) | time vs MPI (p50) | delivered | messages |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        s, m, u = row["scenario"], row["mpi"], row["lossy"]
        bg = s["background"]
        bg = f"{bg['on_ms']:g}/{bg['off_ms']:g}:{bg['flows']}" if bg else "quiet"
        print(f"| {s['nodes']} x {s['ppn']} | {s['nbytes'] >> 20} MiB | {bg} | "
              f"{m['p50'] * 1e3:.2f} / {m['p99'] * 1e3:.2f} | {u['p50'] * 1e3:.2f} / "
              f"{u['p99'] * 1e3:.2f} | {u['p50'] / m['p50']:.2f}x | {row['delivered']:.3f} | "
              f"{row['messages']:,} |")
    limits = mechanisms.table(ppn=args.ppn, link_bps=rate, step=0.1, share=0.05)
    print()
    mechanisms.print_table(limits)
    result = {"rows": rows, "mechanisms": limits}
    _save(args, "projection.json", result)
    return result


def scale(args: argparse.Namespace) -> Dict[str, Any]:
    """The hierarchy at node level (aggregate.py) up to 1,024 nodes: a fixed
    deadline on a quiet network, then beside the background (aligned on/off
    TCP flows, tuned so that MPI's all-reduce sees p99/p50 of about 3) with
    the fixed deadline and with the learned one, against MPICH's
    MPI_Allreduce and a ring among the leaders."""
    _check_maps(max(args.nodes) * args.calls)
    bg = Background.parse(args.background) if args.background else None
    scenarios = []
    for nodes in args.nodes:
        for nbytes in args.sizes:
            base = _at_scale(args, nodes, nbytes, pieces=1, fanout=args.fanout,
                             ring_steps=args.ring_steps)
            scenarios.append(replace(base, calls=min(args.calls, 8)))
            if bg:
                scenarios += [replace(base, background=bg), replace(base, background=bg, auto=True)]
    rows = run_all(scenarios, args.jobs)
    # the rows of other node counts and buckets that an earlier run left in
    # --out stay (a 1,024-node row takes as long as all the smaller ones together)
    earlier = Path(args.out or ".") / "scale.json"
    if args.out and earlier.exists():
        ran = {(n, b) for n in args.nodes for b in args.sizes}
        kept = [r for r in json.loads(earlier.read_text())["rows"]
                if (r["scenario"]["nodes"], r["scenario"]["nbytes"]) not in ran]
        rows = sorted(kept + rows, key=lambda r: (r["scenario"]["nodes"], r["scenario"]["nbytes"]))
    result = {"rows": rows}
    _save(args, "scale.json", result)
    scale_table(rows, args.step_compute, args.buckets)
    return result


def choose(args: argparse.Namespace) -> Dict[str, Any]:
    """Which algorithm "auto" should pick: every algorithm the model runs at
    each node count and bucket, quiet network, against the library's pick."""
    from .choice import candidates, print_table
    base = Scenario(rate=_rate(args.rate), deadline=args.deadline, calls=args.calls,
                    latency=1e-6, memory=100e9, seal_rate=args.seal_rate,
                    payload=args.payload, datagram_cost=args.datagram_cost, drop=args.drop)
    cands = candidates(base, args.nodes, args.ppns, args.sizes, args.max_messages,
                       args.fanout)
    ran = iter(run_all([c.scenario for c in cands if c.scenario is not None], args.jobs))
    rows = [next(ran) if c.scenario is not None else None for c in cands]
    points = print_table(cands, rows)
    result = {"points": points, "rows": [r for r in rows if r is not None]}
    _save(args, "choice.json", result)
    return result


def _check_maps(node_calls: int) -> None:
    """Each node's reducer actor leaves two memory maps behind per call
    (SimGrid's Python actors; not traced to its cause): refuse a run that
    would pass the kernel's limit and fail half-way, and say how to raise it."""
    needed = 2 * node_calls + 50_000
    path = Path("/proc/sys/vm/max_map_count")
    limit = int(path.read_text()) if path.exists() else needed
    if limit < needed:
        raise SystemExit(f"this run needs about {needed:,} memory maps, the kernel allows "
                         f"{limit:,}: `sudo sysctl -w vm.max_map_count={1 << 20}` (or fewer "
                         f"--calls or --nodes)")


def scale_table(rows: List[Dict[str, Any]], compute: float, buckets: int) -> None:
    """The table of `scale` (and the step it implies: `compute` seconds of
    computation and `buckets` all-reduces, not overlapped)."""
    print("| nodes x ranks | bucket | background | deadline | MPI_Allreduce p50 / p99 (ms) | "
          "ring p50 / p99 (ms) | mpilossy p50 / p99 (ms) | mean time vs ring, vs MPI | "
          "delivered | learned deadline (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    steps = []
    for whole in rows:
        s = whole["scenario"]
        # a learned deadline's row: the calls after its first agreement
        row = whole["learned"] if s["auto"] else whole
        m, r, u = row["mpi"], row["ring"], row["lossy"]
        kind = "quiet" if not s["background"] else str(Background(**s["background"]))
        calls = u["calls"] // s["nodes"]
        learned = "-"
        if s["auto"]:
            tail = whole["timeouts"][-calls:]
            learned = f"{min(tail) * 1e3:.1f}-{max(tail) * 1e3:.1f}"
        print(f"| {s['nodes']} x {s['ppn']} | {s['nbytes'] >> 20} MiB | {kind} | "
              f"{'auto' if s['auto'] else 'fixed'} <= {s['deadline']:g} s, {calls} calls | "
              f"{m['p50'] * 1e3:.2f} / {m['p99'] * 1e3:.2f} | {r['p50'] * 1e3:.2f} / "
              f"{r['p99'] * 1e3:.2f} | {u['p50'] * 1e3:.2f} / {u['p99'] * 1e3:.2f} | "
              f"{u['mean'] / r['mean']:.2f}x, {u['mean'] / m['mean']:.2f}x | "
              f"{row['delivered']:.3f} | {learned} |")
        if s["auto"]:
            step = {k: compute + buckets * row[k]["mean"] for k in ("lossy", "ring", "mpi")}
            steps.append((s, step))
    for s, step in steps:
        print(f"\nstep at {s['nodes']} x {s['ppn']} ({compute * 1e3:g} ms of compute, {buckets} "
              f"buckets of {s['nbytes'] >> 20} MiB, not overlapped), learned deadline: "
              f"mpilossy {step['lossy'] * 1e3:.1f} ms, ring {step['ring'] * 1e3:.1f} ms "
              f"({step['lossy'] / step['ring']:.3f}x), MPI_Allreduce {step['mpi'] * 1e3:.1f} ms "
              f"({step['lossy'] / step['mpi']:.3f}x)")


def heartbeat(args: argparse.Namespace) -> Dict[str, Any]:
    """One call's heartbeats, heartbeat_span=2 (today's default) against
    every peer (before it), up to `--all-peers-up-to` ranks for the latter
    (it is quadratic in messages); 4 ranks on one node and on 4 nodes first,
    the sizes the cost at scale is compared with."""
    rate = _rate(args.rate)
    layouts = [(1, 4), (4, 1)] + [(nodes, args.ppn) for nodes in args.nodes]
    calls = []
    for nodes, ppn in layouts:
        for span in (2, 0):
            if span == 0 and (nodes * ppn > args.all_peers_up_to or nodes * ppn <= 5):
                continue        # (at 2-5 ranks span 2 already reaches every peer)
            calls.append((nodes, ppn, span, rate, two_level_tree(nodes)))
    rows = run_each(simulate_heartbeat, calls, args.jobs)
    print("| nodes x ranks | heartbeat to | datagrams per call | core time per call: p50 / "
          "slowest rank (us) | beats arrived after: p50 / slowest (us) |")
    print("|---|---|---|---|---|")
    for r in rows:
        to = "every peer" if not r["span"] or r["ranks"] <= 5 else "2 neighbours on each side"
        print(f"| {r['nodes']} x {r['ppn']} | {to} | {r['messages']:,} | "
              f"{r['cost_p50_us']:.1f} / {r['cost_max_us']:.1f} | "
              f"{r['arrived_p50_us']:.1f} / {r['arrived_max_us']:.1f} |")
    four = [r for r in rows if r["ranks"] == 4]
    for r in rows:
        if r["span"] and r["ranks"] > 5:
            against = ", ".join(f"{r['cost_max_us'] / f['cost_max_us']:.2f}x {f['nodes']} x "
                                f"{f['ppn']}" for f in four)
            print(f"{r['nodes']} x {r['ppn']}: the slowest rank's core time against 4 ranks: "
                  f"{against}")
    result = {"rows": rows}
    _save(args, "heartbeat.json", result)
    return result


def _save(args: argparse.Namespace, name: str, data: Any) -> None:
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(data, indent=1, default=str) + "\n")


def plot(calibration: Dict[str, Any], projection: Dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, name, marker in (("mpi", "MPI", "o"), ("lossy", "ud", "s")):
        ref = "mpi" if key == "mpi" else "ud"
        for q, fill in (("p50", True), ("p99", False)):
            x = [r["measured"][ref][0 if q == "p50" else 1] * 1e3 for r in calibration["rows"]]
            y = [r[key][q] * 1e3 for r in calibration["rows"]]
            a.scatter(x, y, marker=marker, label=f"{name} {q}",
                      facecolors=None if fill else "none", edgecolors="C0" if key == "mpi" else "C1",
                      c=None if not fill else ("C0" if key == "mpi" else "C1"))
    top = max(max(r["measured"]["mpi"][1], r["measured"]["ud"][1]) for r in calibration["rows"]) * 1e3
    a.plot([10, top], [10, top], "k-", lw=0.8)
    a.fill_between([10, top], [8, 0.8 * top], [12, 1.2 * top], color="0.9")
    a.set(xscale="log", yscale="log", xlabel="emulated cluster (ms)", ylabel="model (ms)",
          title="calibration: per-call time (grey: within 20%)")
    a.legend(fontsize=8)
    rows = [r for r in projection["rows"] if not r["scenario"]["background"]]
    for nbytes in sorted({r["scenario"]["nbytes"] for r in rows}):
        pick = sorted((r for r in rows if r["scenario"]["nbytes"] == nbytes),
                      key=lambda r: r["scenario"]["nodes"])
        ranks = [r["scenario"]["nodes"] * r["scenario"]["ppn"] for r in pick]
        b.plot(ranks, [r["lossy"]["p50"] / r["mpi"]["p50"] for r in pick], "o-",
               label=f"{nbytes >> 20} MiB")
    b.axhline(1.0, color="k", lw=0.8)
    b.set(xscale="log", xlabel="ranks (8 per node, fat tree)", ylabel="mpilossy p50 / MPI_Allreduce p50",
          title="projection, quiet network")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpilossy.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("calibrate", "project", "all", "plot", "heartbeat",
                                         "scale", "choose"))
    parser.add_argument("--out", default="", help="folder for the JSON results (and the plot)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40, help="calls per calibration row (at most)")
    parser.add_argument("--cores", choices=("shared", "fixed"), default="shared",
                        help="calibrate: the emulated cluster's 2 cores serve whichever rank "
                             "has work (shared), or each rank a fixed share (fixed)")
    parser.add_argument("--measured", default=None,
                        help="the emulated cluster's runs (default: docs/results/scale/emulated; "
                             "bash scripts/calibration_runs.sh)")
    parser.add_argument("--nodes", type=lambda t: [int(x) for x in t.split(",")],
                        default=None, help="project: 8,16,32; heartbeat: 1,8,16,64,1024")
    parser.add_argument("--all-peers-up-to", type=int, default=128,
                        help="heartbeat: simulate the every-peer heartbeat up to this many ranks")
    parser.add_argument("--ppn", type=int, default=8)
    parser.add_argument("--rate", default="100gbit")
    parser.add_argument("--sizes", type=lambda t: [_size(x) for x in t.split(",")],
                        default=DEFAULT_SIZES, help="default 25M,100M; choose: 4K,64K,1M,25M")
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--payload", type=int, default=8192,
                        help="datagram payload at scale (jumbo frames / UD verbs: 4096-8192)")
    parser.add_argument("--seal-rate", type=float, default=1.6e9,
                        help="bytes/s one rank seals and checks (docs/ud.md: 1.6 GB/s a core)")
    parser.add_argument("--background", default=None,
                        help=f"project: {PROJECT_BACKGROUND}; scale: {SCALE_BACKGROUND}; '' none")
    parser.add_argument("--plot", default="", help="where to write the plot (all)")
    parser.add_argument("--fanout", type=int, default=8,
                        help="scale: flows per node and stage-2 phase (aggregate.py)")
    parser.add_argument("--ring-steps", type=int, default=16,
                        help="scale: steps the leaders' ring is simulated in")
    parser.add_argument("--step-compute", type=float, default=0.1,
                        help="scale: seconds of computation in the step it prints")
    parser.add_argument("--buckets", type=int, default=4,
                        help="scale: all-reduces in the step it prints")
    parser.add_argument("--ppns", type=lambda t: [int(x) for x in t.split(",")],
                        default=[1, 8], help="choose: ranks per node")
    parser.add_argument("--datagram-cost", type=float, default=mechanisms.UNIT["datagram_s"],
                        help="choose: seconds of a rank's CPU per datagram (default: "
                             "mechanisms.UNIT's datagram_s)")
    parser.add_argument("--drop", type=float, default=0.0,
                        help="choose: random datagram drops on the switch")
    parser.add_argument("--redundancy", type=lambda t: tuple(int(x) for x in t.split(",")),
                        default=(), metavar="K,M",
                        help="project: m parity records per k blocks (the per-rank engine "
                             "only: the node-level engine of scale and choose has no parity)")
    parser.add_argument("--max-messages", type=int, default=300_000,
                        help="choose: the per-rank engine's budget of messages a call")
    parser.add_argument("--table-only", action="store_true",
                        help="scale: print the table of the scale.json in --out")
    args = parser.parse_args(list(argv) or None)
    if args.redundancy and (len(args.redundancy) != 2 or args.redundancy[0] < 1
                            or args.redundancy[1] < 0):
        parser.error(f"--redundancy K,M: k >= 1 and m >= 0, not {args.redundancy}")
    if args.redundancy and args.what not in ("project", "all"):
        parser.error("--redundancy: only project models parity (the node-level engine of "
                     "scale and choose does not)")
    if args.background is None:
        args.background = SCALE_BACKGROUND if args.what == "scale" else PROJECT_BACKGROUND
    if args.nodes is None:
        args.nodes = {"heartbeat": [1, 8, 16, 64, 1024], "scale": [64, 256, 1024],
                      "choose": [16, 64, 256, 1024]}.get(args.what, [8, 16, 32])
    if args.what == "choose":
        args.calls = min(args.calls, 2)
        if args.sizes == DEFAULT_SIZES:
            args.sizes = CHOOSE_SIZES
    if args.what == "plot":               # from the JSON files a run left in --out
        folder = Path(args.out or ".")
        plot(json.loads((folder / "calibration.json").read_text()),
             json.loads((folder / "projection.json").read_text()), Path(args.plot or "scale.png"))
    elif args.what == "heartbeat":
        heartbeat(args)
    elif args.what == "scale" and args.table_only:
        rows = json.loads((Path(args.out) / "scale.json").read_text())["rows"]
        scale_table(rows, args.step_compute, args.buckets)
    elif args.what == "scale":
        scale(args)
    elif args.what == "choose":
        choose(args)
    elif args.what == "calibrate":
        calibrate(args)
    elif args.what == "project":
        args.calls = min(args.calls, 3)
        project(args)
    else:
        cal = calibrate(args)
        print()
        args.calls = 3
        proj = project(args)
        if args.plot:
            plot(cal, proj, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
