"""Averages of parameters and optimizer state: reliable over every rank
(MPI_Allreduce), or lossy over a group of ranks that changes every round
(mpilossy.GroupAverager, Moshpit SGD) for local SGD."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List, Sequence, Tuple

import torch
from mpi4py import MPI

from .broadcast import bcast_tensors, overlap_problem
from .checks import check_tensors
from .communicators import CommLike, reliable_comm
from .tensors import Flat, as_numpy, named_tensors

if TYPE_CHECKING:
    from .. import GroupAverager

__all__ = ["average_optimizer_state", "average_parameters", "group_average_parameters"]


def average_tensors(comm: MPI.Intracomm, tensors: Sequence[torch.Tensor], root: int) -> None:
    """Replace floating-point `tensors` by their average over ranks (one
    MPI_Allreduce per dtype, float16 and bfloat16 through float32); the
    others (integer buffers, counters) get root's values."""
    floats = [t for t in tensors if t.is_floating_point()]
    if floats:
        flat = Flat(floats)
        flat.pack(floats)
        for buf in flat.buffers.values():
            wide = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
            comm.Allreduce(MPI.IN_PLACE, as_numpy(wide), op=MPI.SUM)
            wide /= comm.size
            if wide is not buf:
                buf.copy_(wide)
        flat.unpack(floats)
    others = [t for t in tensors if not t.is_floating_point()]
    if others:
        bcast_tensors(comm, others, root)


def average_parameters(parameters: Any, *, comm: CommLike = None) -> float:
    """Collective: replace `parameters` (as for broadcast_parameters) by their
    average over ranks, in place (integer buffers get rank 0's values).
    Reliable (MPI_Allreduce).  Returns the seconds spent."""
    began = time.perf_counter()
    comm = reliable_comm(comm)
    named = named_tensors(parameters)
    problem = next((p for p in (overlap_problem(f"tensor {n!r}", t) for n, t in named) if p),
                   None)
    check_tensors(comm, named, reducible=False, what="tensors", problem=problem, copied=True)
    with torch.no_grad():
        average_tensors(comm, [t for _, t in named], 0)
    return time.perf_counter() - began


def group_average_parameters(parameters: Any, averager: "GroupAverager",
                             **call_arguments: Any) -> float:
    """One round of group averaging (mpilossy.GroupAverager, Moshpit SGD)
    of `parameters`' floating-point tensors, in place and lossy: each becomes
    the average over this round's group of ranks, for local SGD or a
    decentralised mode (average every few steps, no global collective).
    Without loss, `averager.rounds_to_mix` rounds in a row give the global
    average.  The tensors travel in one buffer of the widest dtype among
    them (float64 if any is, else float32: float16 exactly, and without its
    range's overflow), so none loses precision.  Returns the fraction of
    elements delivered."""
    named = [(n, t) for n, t in named_tensors(parameters) if t.is_floating_point()]
    check_tensors(averager.comm, named, reducible=True, copied=True)
    wide = (torch.float64 if any(t.dtype == torch.float64 for _, t in named)
            else torch.float32)
    with torch.no_grad():
        # (a new host tensor, whatever the tensors' device)
        flat = torch.cat([t.detach().reshape(-1).to("cpu", wide) for _, t in named])
        stats = averager.average(flat.numpy(), **call_arguments)
        at = 0
        for _, tensor in named:
            n = tensor.numel()
            tensor.copy_(flat[at:at + n].view_as(tensor))
            at += n
    return 1.0 if stats is None else stats.delivered


def _state_tensors(optimizer: torch.optim.Optimizer) -> List[Tuple[str, torch.Tensor]]:
    """Every tensor of the optimizer's state, named by parameter position and key."""
    out = []
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, value in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
            if isinstance(value, torch.Tensor):
                out.append((f"{i}.{key}", value))
    return out


def average_optimizer_state(optimizer: torch.optim.Optimizer, *, comm: CommLike = None) -> float:
    """Collective: replace the floating-point tensors of the optimizer's state
    (momentum, Adam's moments) by their average over ranks, in place; step
    counters are left as they are.  Every rank must hold the same state
    structure (same parameters, same keys, shapes and dtypes), checked first.
    Returns the seconds spent."""
    began = time.perf_counter()
    comm = reliable_comm(comm)
    problem = None
    if not isinstance(optimizer, torch.optim.Optimizer):
        problem = TypeError(f"optimizer must be a torch.optim.Optimizer, not "
                            f"{type(optimizer).__name__}")
    elif getattr(optimizer, "per_rank_state", False):
        problem = ValueError("a ShardedOptimizer's state covers this rank's chunk only: "
                             "there is no common state to average")
    named = [] if problem else _state_tensors(optimizer)
    averaged = [(n, t) for n, t in named if t.is_floating_point() and not n.endswith(".step")]
    check_tensors(comm, averaged, reducible=False, problem=problem, what="optimizer states",
                  copied=True)
    with torch.no_grad():
        average_tensors(comm, [t for _, t in averaged], 0)
    return time.perf_counter() - began
