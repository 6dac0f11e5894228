"""mpiexec -n 4 python -m mpilossy.examples.lm [--loss 0.1] [options]

Trains the byte-level transformer on the standard library's sources with
mpilossy and prints validation perplexity, drift and delivered fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from mpi4py import MPI

from mpilossy.call.environment import to_timeout

from .progress import MODES
from .train import ALIGN, Config, train


def loss_spec(text: str) -> str:
    """--loss 0.1 means Bernoulli 10%; anything else is an MPILOSSY_LOSS spec."""
    try:
        p = float(text)
    except ValueError:
        return text
    return f"bernoulli:p={p}" if p > 0 else ""


def fabric_line(ranks: List[dict]) -> str:
    """The channel and fabric of the run, from every rank's fabric()."""
    nodes = len({f["host"] for f in ranks})
    first = ranks[0]
    where = f"{first['channel']}, {len(ranks)} ranks on {nodes} node(s): "
    if first["channel"] == "ud":
        return where + f"datagrams through {first['provider']} on {first['domain']} (rank 0)"
    shared = sorted({f["shared_memory_peers"] for f in ranks})
    counts = "/".join(map(str, shared))
    return where + f"{counts} of {len(ranks) - 1} peers through shared memory, " \
        "the rest through MPI_Rget"


def parser() -> argparse.ArgumentParser:
    d = Config()
    ap = argparse.ArgumentParser(prog="python -m mpilossy.examples.lm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduce", choices=("mpilossy", "mpi"), default=d.reduce,
                    help="gradient all-reduce: mpilossy (lossy) or mpi (reliable MPI_Allreduce baseline)")
    ap.add_argument("--loss", default="0", help="injected loss: a probability (Bernoulli) or an "
                    "MPILOSSY_LOSS spec such as gilbert-elliott:p_good_to_bad=0.02,p_bad_to_good=0.2,loss_bad=1")
    ap.add_argument("--timeout", type=to_timeout, default=d.timeout,
                    help="deadline of each lossy call: seconds, 'auto' (learned from the "
                    "calls and agreed by the ranks, keeping at least --delivered-target: "
                    "docs/deadlines.md) or 'none' (wait for everything)")
    ap.add_argument("--delivered-target", type=float, default=d.delivered_target,
                    help="with --timeout auto: the share of the gradients the learned "
                    "deadline keeps at least (default: the library's, 0.99)")
    ap.add_argument("--block-bytes", type=int, default=d.block_bytes, help="loss unit (bytes)")
    ap.add_argument("--algorithm", choices=("auto", "ring", "tree", "direct", "hierarchical"),
                    default=d.algorithm,
                    help="of the lossy all-reduce (auto: hierarchical across nodes of several "
                         "ranks: docs/hierarchy.md)")
    ap.add_argument("--channel", choices=("auto", "rma", "ud"), default=d.channel,
                    help="of the lossy all-reduce: MPI one-sided windows or datagrams (ud)")
    ap.add_argument("--mode", choices=("replicated", "sharded", "fsdp"), default=d.mode,
                    help="replicated: every rank applies the lossy all-reduce's average; "
                    "sharded: owners update their shard, parameters travel by lossy all-gather; "
                    "fsdp: FSDP2 over the torch.distributed backend 'mpilossy' (reduce mpi: "
                    "over Gloo), docs/backend.md")
    ap.add_argument("--fsdp", dest="mode", action="store_const", const="fsdp",
                    help="the same as --mode fsdp")
    ap.add_argument("--error-feedback", action=argparse.BooleanOptionalAction,
                    default=d.error_feedback,
                    help="re-send next step what a step's gradients lost (plain average)")
    ap.add_argument("--missed", choices=("keep", "extrapolate"), default=d.missed,
                    help="sharded mode: a parameter block the all-gather missed keeps its "
                    "previous value, or is extrapolated by the owner's recent update")
    ap.add_argument("--zero-fill", action="store_true", help="ablation: no rescaling")
    ap.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=None,
                    help="move each chunk's reducer with every call (default: pinned to the "
                    "owner, one hop, in the sharded mode; rotating otherwise)")
    ap.add_argument("--resync", choices=("broadcast", "average"), default=d.resync,
                    help="replicated mode's re-synchronisation: rank 0's parameters, or the "
                    "average of parameters and optimizer state")
    ap.add_argument("--resync-every", "--broadcast-every", dest="resync_every", type=int,
                    default=d.resync_every, help="reliable re-synchronisation every K steps")
    ap.add_argument("--no-drift-correction", action="store_true",
                    help="ablation: no re-synchronisation")
    ap.add_argument("--align", choices=ALIGN, default=d.align,
                    help="the barrier before each lossy reduction: over every rank (world), "
                    "over each node's ranks (node: shared memory), none (compute skew between "
                    "ranks then counts as straggler loss), or auto (world before a lossy "
                    "reduction, none before MPI_Allreduce)")
    ap.add_argument("--no-align", dest="align", action="store_const", const="none",
                    help="the same as --align none")
    ap.add_argument("--phase-aware", action="store_true",
                    help="phase-aware loss tolerance: reliable during the critical phase")
    ap.add_argument("--critical-fraction", type=float, default=d.critical_fraction,
                    help="share of the steps that is the critical phase")
    ap.add_argument("--micro-batches", type=int, default=d.micro_batches,
                    help="compute each rank's batch in this many micro-batches (accumulated)")
    ap.add_argument("--compute-deadline", default=d.compute_deadline,
                    help="DropCompute: 'auto', seconds per step, or 'off': a rank stops "
                    "after the micro-batches its budget allows (at least one) and its "
                    "gradient weighs by the count")
    ap.add_argument("--compression", default=d.compression,
                    help="gradient compression: none, int8, int4 (quantised in groups, "
                    "stochastic rounding) or topk:D (the D share of blocks, the same on every "
                    "rank)")
    ap.add_argument("--compression-feedback", action=argparse.BooleanOptionalAction,
                    default=d.compression_feedback,
                    help="error feedback of what compression leaves out")
    ap.add_argument("--redundancy", default=d.redundancy,
                    help="none, K,M (M parity blocks with every K blocks of each stream, "
                    "from which lost blocks are rebuilt) or auto (M from the measured loss "
                    "rate; docs/redundancy.md)")
    ap.add_argument("--straggle", default=d.straggle,
                    help="straggler scenario 'P:F': each rank, each step, with probability P "
                    "computes F times slower (e.g. 0.1:2)")
    for name in ("steps", "batch", "context", "width", "layers", "heads", "warmup", "seed",
                 "val_windows", "measure_every", "threads", "eval_every"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default=d.optimizer,
                    help="AdamW, or SGD with momentum 0.9 (give it its own --lr)")
    ap.add_argument("--progress", choices=MODES, default="auto",
                    help="progress on rank 0's stderr: a bar, a line every 5%% of the steps "
                    "(for job logs), none, or auto: a bar where the output reaches a "
                    "terminal (also through mpiexec), lines elsewhere")
    ap.add_argument("--no-progress", dest="progress", action="store_const", const="none",
                    help="the same as --progress none")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=d.device,
                    help="where the model trains: cpu, or cuda (each rank takes its node's "
                    "GPU number node-local rank mod GPUs; gradients are staged through "
                    "pinned host memory: docs/gpu.md)")
    ap.add_argument("--elastic", action="store_true",
                    help="go on without a rank that exits or hangs (Communicator(elastic=True); "
                    "launch with mpiexec -disable-auto-cleanup: docs/elastic.md)")
    ap.add_argument("--kill-rank", type=int, default=None, metavar="R",
                    help="rank R exits before step --at-step (implies --elastic)")
    ap.add_argument("--at-step", type=int, default=d.kill_at, metavar="S",
                    help="the step before which --kill-rank exits")
    ap.add_argument("--spares", type=int, default=d.spares, metavar="K",
                    help="the last K ranks wait as hot spares; after a rank is lost one takes "
                    "its place, with the others' model and optimizer state (implies "
                    "--elastic; --mode replicated: docs/elastic.md, 'Growing back')")
    ap.add_argument("--elastic-wait", type=float, default=d.elastic_wait, metavar="SECONDS",
                    help="elastic: how long a reliable wait waits for a silent rank (default: "
                    "the library's, 10 s)")
    ap.add_argument("--soak", type=int, default=d.soak_every, metavar="EVERY",
                    help="a working rank fails before every EVERY-th step, in turn: it stops "
                    "for --soak-hang seconds and comes back as a spare, or exits "
                    "(--soak-exits of the failures); needs --spares >= 1: docs/elastic.md")
    ap.add_argument("--soak-hang", type=float, default=d.soak_hang, metavar="SECONDS")
    ap.add_argument("--soak-exits", type=int, default=d.soak_exits, metavar="N")
    ap.add_argument("--forget", type=int, default=d.forget_every, metavar="EVERY",
                    help="the soak's control arm (--mode sharded): no rank fails; before every "
                    "EVERY-th step the rank whose turn it is zeroes its chunk of the optimizer's "
                    "state (AdamW's moments), as a failure did without copies (--copy-state-every 0)")
    ap.add_argument("--copy-state-every", type=int, default=d.copy_state_every, metavar="K",
                    help="elastic, --mode sharded: every K steps each rank's chunk of the "
                    "optimizer's state is copied to the next rank, which restores it if the "
                    "rank is lost (0: no copies, a lost chunk restarts from zeros; default: "
                    "the library's, 10)")
    ap.add_argument("--json", help="write the results to this file (rank 0)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    cfg = Config(reduce=args.reduce, loss=loss_spec(args.loss), timeout=args.timeout,
                 delivered_target=args.delivered_target,
                 block_bytes=args.block_bytes, algorithm=args.algorithm, channel=args.channel,
                 mode=args.mode, error_feedback=args.error_feedback, missed=args.missed,
                 zero_fill=args.zero_fill, rotate=args.rotate,
                 resync=args.resync,
                 resync_every=None if args.no_drift_correction else args.resync_every,
                 align=args.align, phase_aware=args.phase_aware,
                 micro_batches=args.micro_batches, compute_deadline=args.compute_deadline,
                 straggle=args.straggle, eval_every=args.eval_every,
                 compression=args.compression, optimizer=args.optimizer,
                 compression_feedback=args.compression_feedback, redundancy=args.redundancy,
                 critical_fraction=args.critical_fraction,
                 steps=args.steps, batch=args.batch, context=args.context, width=args.width,
                 layers=args.layers, heads=args.heads, lr=args.lr, warmup=args.warmup,
                 seed=args.seed, val_windows=args.val_windows,
                 measure_every=args.measure_every, threads=args.threads, device=args.device,
                 elastic=args.elastic, kill_rank=args.kill_rank, kill_at=args.at_step,
                 spares=args.spares, elastic_wait=args.elastic_wait, soak_every=args.soak,
                 soak_hang=args.soak_hang, soak_exits=args.soak_exits,
                 forget_every=args.forget, copy_state_every=args.copy_state_every)
    comm = MPI.COMM_WORLD
    result = train(cfg, comm, progress=args.progress)
    if result.get("released"):      # (a spare nobody needed; a lost rank may hang Finalize)
        sys.stdout.flush()
        os._exit(0)
    working = comm.size - cfg.spares
    excluded = sorted(set(range(working)) - set(result["members"]))
    joined = [r for r in result["members"] if r >= working]
    if comm.rank == result["members"][0]:
        r = result
        how = cfg.reduce if cfg.reduce == "mpi" else (
            f"mpilossy {cfg.mode}{' + error feedback' if cfg.error_feedback else ''}"
            f"{'' if cfg.compression == 'none' else ', compression ' + cfg.compression}"
            f"{'' if cfg.compression == 'none' or cfg.compression_feedback else ' without EF'}"
            f"{'' if cfg.redundancy == 'none' else ', redundancy ' + cfg.redundancy}")
        print(f"ranks {r['ranks']}  reduce {how}  loss {cfg.loss or 'none'}  "
              f"{'' if cfg.reduce == 'mpi' else 'deadline ' + str(r.get('timeout')) + '  '}"
              f"params {r['parameters']}  steps {cfg.steps}"
              f"{'  on ' + r['device'] if r['device'] != 'cpu' else ''}")
        print(f"train loss      {r['train_loss_first']:.3f} -> {r['train_loss_last']:.3f}")
        print(f"val perplexity  {r['val_perplexity']:.4f}  (rank 0's model; ranks "
              f"{min(r['val_perplexity_ranks']):.4f}..{max(r['val_perplexity_ranks']):.4f})")
        print(f"drift           {r['final_drift']:.2e} at the end, {r['max_drift']:.2e} at most")
        print(f"delivered       {r['delivered']:.4f}")
        if r.get("auto_deadlines"):
            print("deadline        learned: " + ", ".join(
                f"{kind} {1e3 * seconds:.1f} ms" for kind, seconds in r["auto_deadlines"].items()))
        if "fabric" in r:
            print(f"channel         {fabric_line(r['fabric'])}")
        print(f"time            {r['wall_seconds']:.1f} s ({r['comm_seconds']:.1f} s in gradient "
              f"communication, {1e3 * r['step_seconds']:.1f} ms per training step)")
        print("phases          " + ", ".join(
            f"{name} {p['mean']:.1f} s" for name, p in r["phase_seconds"].items())
            + " (mean over the ranks)")
        if cfg.micro_batches > 1:
            print(f"micro-batches   {r['micro_batches']:.2f} of {cfg.micro_batches} per step "
                  f"(compute deadline {cfg.compute_deadline})")
        if "phase_aware" in r:
            print(f"phase-aware     {r['phase_aware']}")
        if "soak" in r:
            soak, costs = r["soak"], r["soak"]["costs"]
            print(f"soak            {soak['failures']} failures ({soak['exits']} exits), "
                  f"arrivals per rank {soak['arrivals']}; a failure cost "
                  f"{', '.join(f'{x:.2f}' for x in costs['extra_seconds_p50_p90_max'])} s "
                  f"(p50, p90, max) over {costs['measured']} measured; steps to full size "
                  f"{costs['steps_to_full_size_p50_p90_max']}")
        if "forgotten" in r:
            print(f"forgotten       the optimizer state of a rank's chunk zeroed "
                  f"{r['forgotten']['times']} times ({r['forgotten']['elements']} elements)")
        if excluded:
            print(f"elastic         ranks {excluded} excluded; {len(result['members'])} went on"
                  f"{f', spares {joined} among them' if joined else ''}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if excluded or cfg.spares:      # (MPI_Finalize hangs after a rank is gone: docs/elastic.md)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
