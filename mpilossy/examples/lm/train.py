"""Data-parallel training of TinyGPT with mpilossy (or MPI_Allreduce, the
reliable baseline): every rank samples its own windows of the training text.
Replicated mode: gradients are averaged by the lossy all-reduce and every
rank updates its whole model; sharded mode: each rank updates its shard from
the lossy reduce-scatter and the parameters travel by lossy all-gather.
Either way a periodic reliable re-synchronisation bounds the drift."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from mpi4py import MPI

import mpilossy
import mpilossy.torch as mt
from mpilossy.reliable import again

from . import corpus as corpus_mod
from .model import TinyGPT
from .progress import MODES as PROGRESS_MODES
from .progress import progress as progress_display
from .soak import Soak, failure_costs, forget_state

__all__ = ["Config", "train"]


@dataclass
class Config:
    reduce: str = "mpilossy"          # "mpilossy" or "mpi" (reliable MPI_Allreduce)
    loss: str = ""                    # mpilossy.loss spec ("" = none)
    timeout: Union[float, str, None] = "auto"  # deadline of every lossy call: seconds,
                                      # "auto" (learned and agreed, docs/deadlines.md) or None
    delivered_target: Optional[float] = None  # timeout "auto": the share it keeps (None:
                                      # the library's default, 0.99)
    block_bytes: int = 4096           # loss unit: about one packet
    algorithm: str = "auto"           # of the lossy all-reduce
    channel: str = "auto"             # of the lossy all-reduce: rma, ud or auto
    mode: str = "sharded"             # "sharded" (ShardedOptimizer) or "replicated"
    error_feedback: bool = False      # re-send what was lost (plain average)
    missed: str = "extrapolate"       # sharded: a missed parameter block is extrapolated or kept
    zero_fill: bool = False           # ablation: no rescaling
    rotate: Optional[bool] = None     # move the direct reducers with every call; None:
                                      # pinned to the owners in the sharded mode
    resync: str = "broadcast"         # replicated re-synchronisation: "broadcast" or "average"
    resync_every: Optional[int] = 50  # drift correction (None = off)
    align: str = "auto"               # barrier before each reduction: "world", "node",
                                      # "none" or "auto" (align_over, below)
    phase_aware: bool = False         # phase-aware loss tolerance
    micro_batches: int = 1            # the batch is computed in this many micro-batches
    compute_deadline: str = "off"     # "off", "auto" or seconds: DropCompute's budget per step
    compression: str = "none"         # gradients: "none", "int8", "int4" or "topk:D" (density D)
    compression_feedback: bool = True  # the compressor's error feedback
    redundancy: str = "auto"          # "none", "K,M": M parity blocks with every K, or "auto":
                                      # M from the measured loss rate (docs/redundancy.md)
    optimizer: str = "adamw"          # "adamw", or "sgd" (momentum 0.9; give it its own --lr)
    straggle: str = ""                # "P:F": each rank, each step, with probability P
                                      # computes F times slower (straggler scenario)
    eval_every: int = 0               # validation perplexity every K steps (0: at the end only)
    critical_fraction: float = 0.2    # its critical phase: this share of the steps
    steps: int = 300
    batch: int = 16                   # windows per rank per step
    context: int = 64
    width: int = 96
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    val_windows: int = 1024
    measure_every: int = 25
    threads: int = 1
    device: str = "cpu"               # "cpu" or "cuda" (each rank takes its node's GPU
                                      # number local rank mod GPUs; they may share one)
    elastic: bool = False             # go on without a rank that exits or hangs
                                      # (Communicator(elastic=True); docs/elastic.md)
    kill_rank: Optional[int] = None   # this rank exits (os._exit) before step kill_at:
    kill_at: int = 0                  # the scenario of --kill-rank R --at-step S (elastic)
    spares: int = 0                   # the last `spares` ranks wait as hot spares and take
                                      # lost ranks' places (elastic, replicated mode)
    elastic_wait: Optional[float] = None  # seconds a reliable wait waits for a silent rank
                                      # (None: the library's default)
    soak_every: int = 0               # a working rank fails before every soak_every-th step
    soak_hang: float = 4.0            # (it stops for soak_hang seconds, comes back as a
    soak_exits: int = 0               # spare; soak_exits of the failures are exits: soak.py)
    forget_every: int = 0             # the soak's control arm: no failure, the victim zeroes
                                      # its chunk of the optimizer's state (sharded; soak.py)
    copy_state_every: Optional[int] = None    # sharded, elastic: copies of each chunk's
                                      # optimizer state (None: the library's default)


def pinned_reducers(cfg: Config) -> bool:
    """Whether each chunk's reducer is its owner: one hop for the sharded
    mode's gradients, and the owner's own contribution never lost.  The
    owner's data then weighs a little more than the others' in its shard
    (docs/training.md); every rank draws from the same data, so the
    expected gradient is unchanged."""
    if cfg.rotate is None:
        return cfg.mode in ("sharded", "fsdp")
    return not cfg.rotate


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    done = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def straggler(spec: str) -> tuple:
    """'P:F' -> (P, F): probability of a slow step, and how much slower."""
    if not spec:
        return 0.0, 1.0
    try:
        p, f = (float(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"straggle must be 'P:F' (e.g. 0.1:2), got {spec!r}") from None
    if not (0 <= p <= 1 and f >= 1):
        raise ValueError(f"straggle needs 0 <= P <= 1 and F >= 1, got {spec!r}")
    return p, f


def lossy_communicator(cfg: Config, comm: MPI.Intracomm, elastic: bool) -> mpilossy.Communicator:
    """The Communicator of cfg's lossy calls.  Collective."""
    # Each seed draws its own losses too.
    models = [dataclasses.replace(m, seed=m.seed + cfg.seed) if hasattr(m, "seed") else m
              for m in mpilossy.loss.parse(cfg.loss)] if cfg.loss else None
    # Error feedback re-sends what was lost, so it needs the plain average.
    plain = cfg.zero_fill or cfg.error_feedback
    target: Dict[str, Any] = {}       # (None: the library's default)
    if cfg.delivered_target is not None:
        target["delivered_target"] = cfg.delivered_target
    if cfg.elastic_wait is not None:
        target["elastic_wait"] = cfg.elastic_wait
    return mpilossy.Communicator(comm, timeout=cfg.timeout, loss=models,
                                 block_bytes=cfg.block_bytes, algorithm=cfg.algorithm,
                                 channel=cfg.channel,
                                 scaling="zero-fill" if plain else "unbiased",
                                 rotate=not pinned_reducers(cfg),
                                 redundancy=redundancy(cfg), elastic=elastic,
                                 spares=cfg.spares, **target)


def check_fsdp(cfg: Config) -> None:
    """What the fsdp mode leaves to FSDP2 and the backend, refused by name."""
    refused = [name for name, on in (
        ("error_feedback", cfg.error_feedback), ("zero_fill", cfg.zero_fill),
        ("phase_aware", cfg.phase_aware), ("micro_batches", cfg.micro_batches != 1),
        ("compute_deadline", cfg.compute_deadline != "off"),
        ("compression", cfg.compression != "none"), ("elastic", cfg.elastic),
        ("kill_rank", cfg.kill_rank is not None), ("device", cfg.device != "cpu"),
        ("algorithm", cfg.algorithm not in ("auto", "direct"))) if on]
    if refused:
        raise ValueError(f"the fsdp mode (FSDP2 over a torch.distributed backend, CPU) "
                         f"does not take: {', '.join(refused)}")


def compute_deadline(cfg: Config) -> Optional[mt.ComputeDeadline]:
    if cfg.compute_deadline == "off":
        return None
    budget: Any = cfg.compute_deadline
    if budget != "auto":
        budget = float(budget)
    return mt.ComputeDeadline(budget, max_micro_batches=cfg.micro_batches)


def compression(cfg: Config) -> Optional[Any]:
    """The gradient compressor of `cfg` (None: full float32 gradients)."""
    if cfg.compression == "none":
        return None
    if cfg.compression in ("int8", "int4"):
        return mt.LowBit(cfg.compression, error_feedback=cfg.compression_feedback)
    kind, _, density = cfg.compression.partition(":")
    if kind != "topk" or not density:
        raise ValueError(f"compression must be none, int8, int4 or topk:D, got {cfg.compression!r}")
    return mt.TopK(float(density), error_feedback=cfg.compression_feedback)


def redundancy(cfg: Config) -> Union[None, str, Tuple[int, int]]:
    """The communicator's redundancy of `cfg`: None, "auto" or (k, m)."""
    if cfg.redundancy in ("none", "auto"):
        return None if cfg.redundancy == "none" else "auto"
    try:
        k, m = (int(v) for v in cfg.redundancy.split(","))
    except ValueError:
        raise ValueError(f"redundancy must be none, auto or K,M, got {cfg.redundancy!r}") from None
    return (k, m)


def inner_optimizer(cfg: Config, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    raise ValueError(f"optimizer must be adamw or sgd, got {cfg.optimizer!r}")


def warm_up(model: TinyGPT, cfg: Config, text: np.ndarray, device: torch.device) -> None:
    """On a spare, before it stands by: one training step of a copy of the
    model, so that the process's one-time costs (PyTorch's first forward,
    backward and optimizer step) are paid while it waits, not by the
    survivors in the steps after its call-in (docs/elastic.md, "A soak")."""
    scratch = copy.deepcopy(model)
    optimizer = inner_optimizer(cfg, list(scratch.parameters()))
    starts = np.random.default_rng(0).integers(0, text.size - cfg.context - 1,
                                               cfg.batch // cfg.micro_batches)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):   # (its draws are not the run's)
        scratch.loss(windows(text, starts, cfg.context + 1, device)).backward()
    optimizer.step()


def windows(text: np.ndarray, starts: np.ndarray, length: int,
            device: Optional[torch.device] = None) -> torch.Tensor:
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(text[idx].astype(np.int64)).to(device)


def pick_device(name: str, comm: MPI.Intracomm) -> torch.device:
    """The torch device of this rank: "cpu", or "cuda" (the node's GPU
    number node-local rank mod GPUs, so that ranks spread over a node's
    GPUs and share them when there are fewer)."""
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {name!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not all(comm.allgather(gpus)):
        raise ValueError("device 'cuda' needs a CUDA device on every rank; torch sees none "
                         "on some (torch.cuda.is_available())")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.rank
    node.Free()
    return torch.device("cuda", local % gpus)


@torch.no_grad()
def perplexity(model: TinyGPT, val: torch.Tensor, batch: int = 64) -> float:
    model.eval()
    total = 0.0
    for i in range(0, val.shape[0], batch):
        part = val[i:i + batch]
        total += float(model.loss(part)) * part.shape[0]
    model.train()
    return math.exp(total / val.shape[0])


class MPIAllreduce:
    """The reliable baseline: one MPI_Allreduce of all gradients per step
    (on a GPU, through a pinned host buffer, as mpilossy's)."""

    def __init__(self, comm: MPI.Intracomm, params: Sequence[torch.Tensor]) -> None:
        self.comm, self.params = comm, params
        self.flat = torch.zeros(sum(p.numel() for p in params),
                                pin_memory=any(p.is_cuda for p in params))

    def __call__(self) -> float:
        began = time.perf_counter()
        grads = [gradient(p) for p in self.params]
        self.flat.copy_(torch.cat([g.reshape(-1) for g in grads]))
        self.comm.Allreduce(MPI.IN_PLACE, self.flat.numpy(), op=MPI.SUM)
        self.flat /= self.comm.size
        offset = 0
        for p, g in zip(self.params, grads):
            g.copy_(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return time.perf_counter() - began


def gradient(p: torch.Tensor) -> torch.Tensor:
    """p's gradient (after backward, every parameter of TinyGPT has one)."""
    if p.grad is None:
        raise RuntimeError("a parameter has no gradient")
    return p.grad


def train(cfg: Config, comm: MPI.Intracomm = MPI.COMM_WORLD,
          progress: Union[bool, str] = True) -> Dict[str, Any]:
    """Train; collective.  Returns the results (the same dict on every rank).
    `progress` (rank 0, on stderr): "auto" or True (a bar on a terminal, a
    line every 5% elsewhere), "bar", "lines", or "none" or False."""
    if cfg.reduce not in ("mpilossy", "mpi"):
        raise ValueError(f"reduce must be 'mpilossy' or 'mpi', got {cfg.reduce!r}")
    if not isinstance(progress, bool) and progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be True, False or one of {', '.join(PROGRESS_MODES)}, "
                         f"got {progress!r}")
    if cfg.mode not in ("replicated", "sharded", "fsdp"):
        raise ValueError(f"mode must be 'replicated', 'sharded' or 'fsdp', got {cfg.mode!r}")
    if cfg.mode == "fsdp":
        check_fsdp(cfg)
    if cfg.mode == "sharded" and (cfg.phase_aware or cfg.algorithm not in ("auto", "direct")):
        raise ValueError("the sharded mode reduce-scatters with the direct algorithm and "
                         "has no phase-aware tolerance")
    if cfg.align not in ALIGN:
        raise ValueError(f"align must be one of {', '.join(ALIGN)}, got {cfg.align!r}")
    if cfg.micro_batches < 1 or cfg.batch % cfg.micro_batches:
        raise ValueError(f"micro_batches must divide batch ({cfg.batch}), got {cfg.micro_batches}")
    elastic = cfg.elastic or cfg.kill_rank is not None or cfg.spares > 0
    if elastic and cfg.reduce != "mpilossy":
        raise ValueError("elastic training (--kill-rank, --spares) needs reduce='mpilossy'")
    if cfg.soak_every and (cfg.soak_every < 2 or cfg.spares < 1 or cfg.soak_hang <= 0
                           or cfg.soak_exits < 0):
        raise ValueError("the soak needs soak_every >= 2, spares >= 1 (a stopped rank comes "
                         "back as a spare), soak_hang > 0 and soak_exits >= 0")
    if cfg.forget_every and (cfg.forget_every < 2 or cfg.mode != "sharded" or cfg.soak_every
                             or cfg.reduce != "mpilossy"):
        raise ValueError("forget_every (the soak's control arm) needs forget_every >= 2, "
                         "mode 'sharded', reduce 'mpilossy' and no soak")
    refused = [name for name, on in (
        ("mode " + cfg.mode, cfg.mode == "fsdp"), ("phase_aware", cfg.phase_aware),
        ("error_feedback", cfg.error_feedback), ("compression", cfg.compression != "none"),
        ("compute_deadline", cfg.compute_deadline != "off")) if on]
    if cfg.spares and refused:
        raise ValueError(f"spares (a newcomer takes the optimizer's state) do not "
                         f"take: {', '.join(refused)}")
    working = comm.size - max(cfg.spares, 0)
    if cfg.kill_rank is not None and not 0 <= cfg.kill_rank < working:
        raise ValueError(f"kill_rank must be a working rank (0..{working - 1}), "
                         f"got {cfg.kill_rank}")
    slow_p, slow_factor = straggler(cfg.straggle)
    deadline = compute_deadline(cfg)
    if deadline is not None and cfg.reduce != "mpilossy":
        raise ValueError("the compute deadline needs reduce='mpilossy' (a weighted average)")
    torch.set_num_threads(cfg.threads)
    rank, size = comm.rank, comm.size
    began = time.perf_counter()
    device = pick_device(cfg.device, comm)
    data = corpus_mod.load()
    picker = np.random.default_rng(12345)      # the same validation windows everywhere
    val = windows(data.val, picker.integers(0, data.val.size - cfg.context - 1, cfg.val_windows),
                  cfg.context + 1, device)
    sampler = np.random.default_rng([cfg.seed, rank])

    torch.manual_seed(cfg.seed)
    # (built on the CPU, then moved: the same initial values on any device)
    model = TinyGPT(corpus_mod.VOCAB, cfg.context, cfg.width, cfg.layers, cfg.heads).to(device)
    mt.broadcast_parameters(model, comm=comm)
    lc = lossy_communicator(cfg, comm, elastic) if cfg.reduce == "mpilossy" else None
    if lc is not None and lc.spare:
        warm_up(model, cfg, data.train, device)
        if not lc.stand_by():
            return {"released": True}       # (a spare nobody called in)
    align = align_over(cfg)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank) if align == "node" else None
    # fsdp: the parameters become shards (DTensors) before the optimizer sees them
    fsdp = None
    if cfg.mode == "fsdp":
        from .fsdp import Sharded   # torch.distributed.fsdp: 1.5 s of imports, only here
        fsdp = Sharded(model, comm, lc, align != "none")
    params = [p for p in model.parameters()]

    def make_inner() -> torch.optim.Optimizer:
        return inner_optimizer(cfg, params)

    def wrap(inner: torch.optim.Optimizer) -> mt.WrappedOptimizer:
        assert lc is not None
        if cfg.mode == "sharded":
            return mt.ShardedOptimizer(inner, model.named_parameters(), lc,
                                       resync_every=cfg.resync_every,
                                       measure_every=cfg.measure_every,
                                       error_feedback=cfg.error_feedback,
                                       missed=cfg.missed, compute_deadline=deadline,
                                       compression=compression(cfg),
                                       copy_state_every=(cfg.copy_state_every
                                                         if lc.elastic else None))
        return mt.DistributedOptimizer(inner, model.named_parameters(), lc,
                                       broadcast_every=cfg.resync_every,
                                       measure_every=cfg.measure_every,
                                       broadcast_state=cfg.resync == "average",
                                       resync=cfg.resync, tolerance=tolerance,
                                       error_feedback=cfg.error_feedback,
                                       compute_deadline=deadline,
                                       compression=compression(cfg))

    inner = make_inner()

    tolerance = None
    optimizer: torch.optim.Optimizer = inner
    wrapped: Optional[mt.WrappedOptimizer] = None      # (mpilossy's wrapper of `inner`)
    drift_control: Optional[mt.DriftController] = None  # (fsdp: none needed)
    if fsdp is not None:
        pass                            # (FSDP2 reduces inside backward, over its group)
    elif cfg.reduce == "mpi":
        reduce_mpi = MPIAllreduce(comm, params)
        drift_control = mt.DriftController(model, comm=comm, measure_every=cfg.measure_every)
    else:
        assert lc is not None
        if cfg.phase_aware:
            tolerance = mt.PhaseAwareTolerance(critical_steps=int(cfg.steps * cfg.critical_fraction))
        wrapped = optimizer = wrap(inner)
        drift_control = wrapped.drift_control

    mode = "none" if rank != 0 or progress is False else "auto" if progress is True else progress
    bar = progress_display(cfg.steps, "train", "step", mode)
    delivered: List[float] = []
    comm_seconds = 0.0
    # Where a step's time goes, this rank's sums: the forward and backward
    # passes, the barrier before a lossy reduction, the reductions
    # (comm_seconds), and the rest (the optimizer, drift control, Python).
    phases = {"compute": 0.0, "align": 0.0}
    losses: List[float] = []
    curve: List[tuple] = []           # (step, training seconds, rank 0's val perplexity)
    micro_done: List[int] = []
    paused = 0.0                      # seconds spent on the curve's evaluations
    slowness = np.random.default_rng([cfg.seed, rank, 7])
    per_micro = cfg.batch // cfg.micro_batches
    train_began = time.perf_counter()

    def reliable() -> Any:
        """Where the reliable calls go: elastic, the Communicator's bounded
        waits (over the survivors once a rank is lost; a rank that hangs or
        is gone cannot block them), else MPI."""
        return lc.bounded_comm() if lc is not None and lc.elastic else comm

    soak = Soak(cfg.soak_every, cfg.soak_hang, cfg.soak_exits, cfg.steps)
    forgetting = Soak(cfg.forget_every, 0.0, 0, cfg.steps)     # (the same schedule, no failure)
    forgotten = 0                                               # (elements zeroed here)
    full_size = size - cfg.spares           # (the working ranks at the start)
    step_seconds: Dict[int, float] = {}     # (the soak's costs: this rank's steps)
    sizes: Dict[int, int] = {}              # (and the ranks in after each)
    # (a spare called in goes on from the step the others had reached)
    step = wrapped.steps if wrapped is not None else 0
    while step < cfg.steps:
        stepping, evaluating = time.perf_counter(), 0.0     # (a step's time, but the curve's)
        failure = soak.failure(step)
        if failure is not None and lc is not None and lc.rank == soak.victim(failure, lc.size):
            soak.fail(failure, rank)
        forget = forgetting.failure(step)
        if forget is not None and lc is not None and lc.rank == forgetting.victim(forget, lc.size):
            forgotten += forget_state(inner)
        if step == cfg.kill_at and rank == cfg.kill_rank:
            bar.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)             # (a rank that is gone: the others go on)
        try:
            for group in inner.param_groups:
                group["lr"] = lr_at(cfg, step)
            optimizer.zero_grad(set_to_none=False)   # (the wrapper: sharded mode clears the model's)
            factor = slow_factor if slowness.random() < slow_p else 1.0
            # Without a compute deadline the micro-batches' mean is the step's
            # gradient; with one, the optimizer divides by the count it did.
            scale = 1.0 if deadline is not None else 1.0 / cfg.micro_batches
            parts = []
            for _ in (deadline if deadline is not None else range(cfg.micro_batches)):
                computing = time.perf_counter()
                starts = sampler.integers(0, data.train.size - cfg.context - 1, per_micro)
                part = model.loss(windows(data.train, starts, cfg.context + 1, device))
                (part * scale if scale != 1.0 else part).backward()
                parts.append(part.item())
                if factor > 1.0:    # a throttled or shared core: the same work, slower
                    time.sleep((factor - 1.0) * (time.perf_counter() - computing))
                phases["compute"] += time.perf_counter() - computing
            micro_done.append(len(parts))
            loss = torch.tensor(float(np.mean(parts)))
            if fsdp is None and align != "none":
                aligning = time.perf_counter()
                # Ranks that time-share cores finish their backward passes up
                # to ~100 ms apart, which a 50 ms deadline would count as
                # loss; lined up, the loss measured is the injected one.
                if align == "node":
                    assert node is not None
                    node.Barrier()      # (shared memory: no message on the network)
                elif lc is not None and lc.elastic:
                    lc.barrier()        # (a rank that is gone or hangs cannot block it)
                else:
                    reliable().Barrier()
                phases["align"] += time.perf_counter() - aligning
            if fsdp is not None:
                inner.step()
                got, seconds = fsdp.step_stats()
                if fsdp.lossy:
                    delivered.append(got)
                comm_seconds += seconds
            elif cfg.reduce == "mpi":
                comm_seconds += reduce_mpi()
                inner.step()
                assert drift_control is not None
                drift_control.step()
            else:
                assert wrapped is not None
                optimizer.step()
                stats = wrapped.stats
                assert stats is not None        # (after a step)
                delivered.append(stats.delivered)
                comm_seconds += stats.comm_seconds + stats.sync_seconds
            losses.append(loss.item())
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                pause = time.perf_counter()
                # (fsdp: every rank takes part in the forward pass's all-gathers)
                ppl_now = again(lambda: reliable().bcast(
                    perplexity(model, val) if reliable().rank == 0 or fsdp is not None else None),
                    mpilossy.MembershipChanged)
                curve.append((step + 1, pause - train_began - paused, ppl_now))
                evaluating = time.perf_counter() - pause
                paused += evaluating
            # the last 10 steps' mean training loss and delivered fraction
            bar.set_postfix(refresh=False, loss=f"{np.mean(losses[-10:]):.3f}",
                            delivered=f"{np.mean(delivered[-10:]) if delivered else 1.0:.3f}")
            bar.update(1)
        except mpilossy.EvictedError:
            if lc is None or not soak.every:
                raise
            # woken after the others excluded this rank: a spare again, called
            # in with their model and optimizer state (or released at the end)
            if not lc.stand_by():
                return {"released": True}
            inner = make_inner()
            wrapped = optimizer = wrap(inner)
            drift_control = wrapped.drift_control
            step = wrapped.steps
            continue
        step_seconds[step] = time.perf_counter() - stepping - evaluating
        if lc is not None:
            sizes[step] = lc.size
        step += 1
    train_seconds = time.perf_counter() - train_began - paused
    bar.close()
    def summary() -> Dict[str, Any]:
        """The run's results, agreed by reliable collectives (made again
        over the survivors if ranks are excluded during them)."""
        comm = reliable()
        size = comm.size

        # Drift of the models as trained: the measurement of the last step was
        # taken before that step's broadcast, if it had one.
        # (fsdp: one owner per shard, gathered exactly: no drift)
        history = drift_control.history if drift_control is not None else []
        final_drift = 0.0 if drift_control is None else history[-1][1] \
            if history and history[-1][0] == cfg.steps else drift_control.measure()
        ppl = comm.allgather(perplexity(model, val))
        mean_delivered = comm.allreduce(float(np.mean(delivered)) if delivered else 1.0) / size
        result = {
            "config": asdict(cfg),
            "ranks": size,
            "members": list(lc.members) if lc is not None else list(range(size)),
            "val_perplexity": ppl[0],                 # rank 0's model
            "val_perplexity_ranks": ppl,
            "final_drift": final_drift,
            "max_drift": max((d for _, d in history), default=0.0),
            "delivered": mean_delivered,
            "train_loss_first": float(np.mean(losses[:10])),
            "train_loss_last": float(np.mean(losses[-10:])),
            "train_seconds": comm.allreduce(train_seconds, op=MPI.MAX),
            "comm_seconds": comm.allreduce(comm_seconds, op=MPI.MAX),
            "wall_seconds": comm.allreduce(time.perf_counter() - began, op=MPI.MAX),
            "parameters": sum(p.numel() for p in params),
            "device": str(device),
            "train_tokens": int(data.train.size),
            "val_tokens": int(data.val.size),
            "broadcasts": drift_control.broadcasts if drift_control is not None else 0,
            "step_seconds": comm.allreduce(train_seconds, op=MPI.MAX) / cfg.steps,
            "micro_batches": comm.allreduce(float(np.mean(micro_done)), op=MPI.SUM) / size,
            "phase_seconds": phase_summary(comm, phases, comm_seconds, train_seconds),
            "curve": curve,
        }
        if soak.every:
            assert lc is not None
            result["soak"] = {
                "failures": soak.failures,
                "exits": sum(soak.kind(f) == "exit" for f in range(1, soak.failures + 1)),
                "arrivals": comm.allgather(lc.arrivals),
                "costs": failure_costs(soak, comm.allgather(step_seconds),
                                       comm.allgather(sizes), full_size)}
        if forgetting.every:
            result["forgotten"] = {"times": forgetting.failures,
                                   "elements": comm.allreduce(forgotten)}
        if tolerance is not None:
            result["phase_aware"] = {"reliable_steps": tolerance.reliable,
                                     "repaired_steps": tolerance.repaired,
                                     "critical_ended": tolerance.critical_ended}
        if lc is not None:
            result["fabric"] = comm.allgather(fabric(lc))
            result["timeout"] = lc.timeout          # the deadline asked for
            if lc.timeout == "auto":
                # the learned deadline of each level and kind of call at the end
                # (seconds; rank 0's: it owns a slice where the hierarchy runs)
                result["auto_deadlines"] = {
                    " ".join(map(str, (level, *kind))): seconds
                    for level, kinds in lc.auto_timeouts_by_level.items()
                    for kind, seconds in kinds.items()}
            if lc.config.redundancy == "auto":
                # what the agreed loss rate called for at the end of training
                result["redundancy_auto"] = {"loss_rate": lc.loss_rate,
                                             "code": lc.auto_redundancy()}
        return result

    result = again(summary, mpilossy.MembershipChanged)
    result["align"] = align
    if node is not None:
        node.Free()
    if fsdp is not None:
        fsdp.close()
    if lc is not None:
        lc.free()
    return result


ALIGN = ("auto", "world", "node", "none")


def align_over(cfg: Config) -> str:
    """Which barrier lines the ranks up before each reduction: "world" (all
    ranks), "node" (each node's ranks, through shared memory: no message on
    the network) or "none".  "auto": "world" before a lossy reduction,
    "none" before MPI_Allreduce, which lines the ranks up itself (asked
    for there, a barrier separates the compute skew from the reduction in
    the phases).  At 2 x 2 beside background traffic "node" was not
    faster than "world" and kept fewer contributions (docs/results.md)."""
    if cfg.mode == "fsdp" and cfg.align == "node":
        raise ValueError("the fsdp mode lines up all ranks or none (align 'world' or "
                         "'none'), not a node's")
    if cfg.align != "auto":
        return cfg.align
    return "none" if cfg.reduce == "mpi" and cfg.mode != "fsdp" else "world"


def phase_summary(comm: Any, phases: Dict[str, float], comm_seconds: float,
                  train_seconds: float) -> Dict[str, Dict[str, float]]:
    """Each phase's seconds over the run, the mean, the least and the
    largest over the ranks: compute, align (the barrier), comm (the reductions) and
    other (the rest of the training time: optimizer, drift control)."""
    mine = dict(phases, comm=comm_seconds)
    mine["other"] = train_seconds - sum(mine.values())
    every = comm.allgather(mine)
    return {name: {"mean": float(np.mean([r[name] for r in every])),
                   "min": min(r[name] for r in every),
                   "max": max(r[name] for r in every)} for name in mine}


def fabric(lc: mpilossy.Communicator) -> Dict[str, Any]:
    """What this rank's gradients travel through: its host, the channel,
    the peers it reads through shared memory, and for "ud" the datagram
    provider, interface or device, and address."""
    mine: Dict[str, Any] = {"host": MPI.Get_processor_name(), "channel": lc.channel,
                            "shared_memory_peers": lc.shared_memory_peers}
    if lc.channel == "ud":
        info = lc.channel_info()
        mine.update({k: info[k] for k in ("provider", "domain", "address")})
    return mine
