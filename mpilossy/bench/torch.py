"""Measurements behind docs/training.md (printed by rank 0).

    mpiexec -n 4 python -m mpilossy.bench torch drift     # drift: all-reduce + broadcast vs sharded
    mpiexec -n 4 python -m mpilossy.bench torch drift --steps 3000 --modes allreduce,sharded --plot d.png
    mpiexec -n 2 python -m mpilossy.bench torch overlap   # DDP hook: inline vs background thread

Both train a small MLP on a synthetic regression task (a fixed random
teacher), every rank on its own data.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from mpi4py import MPI

import mpilossy
from mpilossy.torch import (AllreduceHookState, DistributedOptimizer, ShardedOptimizer,
                            allreduce_hook, broadcast_parameters, destroy_process_group,
                            init_process_group)
from mpilossy.torch.optimizer import WrappedOptimizer

from .harness import figure, save_figure, say


def mlp(width: int, layers: int, inputs: int = 32, outputs: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = [inputs] + [width] * layers
    mods: List[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(sizes[-1], outputs))


def data(rank: int, step: int, batch: int, inputs: int = 32,
         outputs: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(inputs, outputs, generator=torch.Generator().manual_seed(99)) / 4
    x = torch.randn(batch, inputs, generator=torch.Generator().manual_seed(step * 1000 + rank))
    return x, torch.sin(x @ teacher)


class Mode(NamedTuple):
    wrapper: str                    # "replicated" (DistributedOptimizer) or "sharded"
    resync: Optional[str]           # re-synchronisation: "broadcast", "average", "resync"
    feedback: bool                  # error feedback
    missed: str = "keep"            # missed blocks (sharded)


MODES = {
    "allreduce": Mode("replicated", None, False),
    "allreduce+bcast": Mode("replicated", "broadcast", False),
    "allreduce+average": Mode("replicated", "average", False),
    "sharded": Mode("sharded", None, False),
    "sharded+resync": Mode("sharded", "resync", False),
    "sharded+extrapolate": Mode("sharded", None, False, "extrapolate"),
    "sharded+ef": Mode("sharded", None, True),
}


def drift(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    loss = mpilossy.loss.Bernoulli(args.loss, seed=1) if args.loss else None
    rows = []
    curves: Dict[str, List[Tuple[int, float]]] = {}
    for mode in args.modes:
        wrapper, resync, feedback, missed = MODES[mode]
        lc = mpilossy.Communicator(comm, timeout=args.timeout, loss=loss,
                                   block_bytes=args.block_bytes,
                                   scaling="zero-fill" if feedback else "unbiased")
        model = mlp(args.width, args.layers)
        broadcast_parameters(model)
        inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        opt: WrappedOptimizer
        if wrapper == "sharded":
            opt = ShardedOptimizer(inner, model.named_parameters(), lc,
                                   measure_every=args.measure_every, error_feedback=feedback,
                                   resync_every=args.broadcast_every if resync else None,
                                   missed=missed)
        else:
            opt = DistributedOptimizer(
                inner, model.named_parameters(), lc, measure_every=args.measure_every,
                broadcast_every=args.broadcast_every if resync else None,
                resync=resync or "broadcast", broadcast_state=resync == "average")
        drifts: List[float] = []
        delivered: List[float] = []
        losses: List[float] = []
        comm_s = 0.0
        began = time.perf_counter()
        for step in range(args.steps):
            opt.zero_grad()
            x, y = data(comm.rank, step, args.batch)
            value = torch.nn.functional.mse_loss(model(x), y)
            value.backward()
            opt.step()
            s = opt.stats
            assert s is not None                # a step has run
            delivered.append(s.delivered)
            comm_s += s.comm_seconds
            if s.drift is not None:
                drifts.append(s.drift)
            losses.append(value.item())
        wall = time.perf_counter() - began
        tail = losses[-max(1, args.steps // 10):]
        control = opt.drift_control
        assert control is not None              # measure_every is given
        per_bcast = control.broadcast_seconds / control.broadcasts if control.broadcasts else 0.0
        per_measure = control.measure_seconds / len(control.history)
        rows.append((mode, statistics.mean(drifts), max(drifts), drifts[-1],
                     comm.allreduce(statistics.mean(delivered)) / comm.size,
                     comm.allreduce(comm_s) / comm.size / args.steps * 1e3,
                     comm.allreduce(per_bcast) / comm.size * 1e3,
                     comm.allreduce(per_measure) / comm.size * 1e3,
                     wall / args.steps * 1e3,
                     comm.allreduce(statistics.mean(tail)) / comm.size))
        curves[mode] = list(control.history)
        lc.free()
    if comm.rank == 0 and args.plot:
        plot_drift(curves, args)
    n = sum(p.numel() for p in mlp(args.width, args.layers).parameters())
    say(comm,
        f"# {comm.size} ranks, {n} parameters, {args.steps} steps, loss {args.loss}, "
        f"timeout {args.timeout} s, block {args.block_bytes} B, drift every "
        f"{args.measure_every} steps, broadcast every {args.broadcast_every}",
        "# drift: relative L2 distance from the rank average (largest rank), measured\n"
        "# before any broadcast of the same step; comm ms: lossy calls per step; bcast ms:\n"
        "# per re-synchronisation; meter ms: per drift measurement; loss: mean of the last\n"
        "# tenth of the steps",
        f"# {'mode':<16} {'drift mean':>10} {'drift max':>10} {'drift end':>10} "
        f"{'delivered':>9} {'comm ms':>8} {'bcast ms':>8} {'meter ms':>8} {'step ms':>8} "
        f"{'loss':>8}",
        *(f"  {r[0]:<16} {r[1]:10.2e} {r[2]:10.2e} {r[3]:10.2e} {r[4]:9.4f} "
          f"{r[5]:8.2f} {r[6]:8.2f} {r[7]:8.2f} {r[8]:8.2f} {r[9]:8.5f}" for r in rows))


def plot_drift(curves: Dict[str, List[Tuple[int, float]]], args: argparse.Namespace) -> None:
    fig, (ax,) = figure(1, 7, 4)
    for mode, history in curves.items():
        steps = [s for s, _ in history]
        ax.plot(steps, [max(d, 1e-7) for _, d in history], lw=1, label=mode)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("drift (largest rank, relative L2)")
    ax.set_title(f"{MPI.COMM_WORLD.size} ranks, {args.loss:.0%} block loss, "
                 f"re-sync every {args.broadcast_every} where on", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, args.plot)


def overlap(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel
    comm = MPI.COMM_WORLD
    init_process_group()
    loss = mpilossy.loss.Bernoulli(args.loss, seed=1) if args.loss else None
    results: Dict[bool, List[float]] = {}
    for background in (False, True, False, True):      # twice each, interleaved
        lc = mpilossy.Communicator(comm, timeout=args.timeout, loss=loss,
                                   capacity=2 * args.bucket_mb * 2 ** 20)
        model = DistributedDataParallel(mlp(args.width, args.layers),
                                        bucket_cap_mb=args.bucket_mb)
        state = AllreduceHookState(lc, background=background)
        model.register_comm_hook(state, allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        times = []
        for step in range(args.steps + 3):
            x, y = data(comm.rank, step, args.batch)
            comm.Barrier()
            began = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step >= 3:                               # warm-up: bucket rebuild
                times.append(time.perf_counter() - began)
        buckets = len(state.bucket_stats)
        state.close()
        lc.free()
        results.setdefault(background, []).extend(times)
    destroy_process_group()
    n = sum(p.numel() for p in mlp(args.width, args.layers).parameters())
    say(comm,
        f"# {comm.size} ranks, {n} parameters, {buckets} buckets, batch {args.batch}, "
        f"{torch.get_num_threads()} torch threads, loss {args.loss}, timeout {args.timeout}",
        *(f"  background={background!s:<5} step median {statistics.median(times) * 1e3:7.2f} ms"
          f"  p90 {sorted(times)[int(0.9 * len(times))] * 1e3:7.2f} ms"
          for background, times in results.items()))


def parse_modes(text: str) -> List[str]:
    modes = text.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes: {', '.join(unknown)}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("drift")
    d.add_argument("--steps", type=int, default=400)
    d.add_argument("--loss", type=float, default=0.1)
    d.add_argument("--timeout", type=float, default=0.02)
    d.add_argument("--block-bytes", type=int, default=1024)
    d.add_argument("--width", type=int, default=64)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--lr", type=float, default=0.05)
    d.add_argument("--measure-every", type=int, default=10)
    d.add_argument("--broadcast-every", type=int, default=50,
                   help="re-synchronisation period of the modes that have one")
    d.add_argument("--modes", type=parse_modes,
                   default=["allreduce", "allreduce+bcast", "sharded"],
                   help=f"comma-separated, of {', '.join(MODES)}")
    d.add_argument("--plot", help="write drift against step to this image (rank 0)")
    o = sub.add_parser("overlap")
    o.add_argument("--steps", type=int, default=20)
    o.add_argument("--loss", type=float, default=0.0)
    o.add_argument("--timeout", type=float, default=None)
    o.add_argument("--width", type=int, default=1024)
    o.add_argument("--layers", type=int, default=4)
    o.add_argument("--batch", type=int, default=256)
    o.add_argument("--bucket-mb", type=int, default=4)
    o.add_argument("--lr", type=float, default=0.01)


def run(args: argparse.Namespace) -> int:
    if args.what == "drift":
        drift(args)
    else:
        overlap(args)
    return 0
