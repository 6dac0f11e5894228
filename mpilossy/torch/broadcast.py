"""Reliable re-synchronisation of parameters and optimizer state by
broadcast from one rank (MPI_Bcast on NumPy views of the tensors' memory);
averaging.py averages instead."""

from __future__ import annotations

import time
from typing import Any, Iterator, List, Optional, Sequence

import torch
from mpi4py import MPI

from .checks import check_everywhere, check_tensors
from .communicators import CommLike, reliable_comm
from .tensors import Flat, as_bytes, host_problem, named_tensors

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "check_parameters"]

# Tensors smaller than this travel packed in one buffer per dtype: one
# MPI_Bcast instead of many small ones.  Larger ones are broadcast alone, in
# place when contiguous.  The choice depends on size alone (shape and dtype,
# the same on every rank), never on the layout, which may differ between
# ranks (a channels_last root, contiguous receivers): every rank must post
# the same messages.
FUSE_BELOW = 64 * 1024


def check_parameters(parameters: Any, comm: CommLike = None) -> None:
    """Collective: raise the same exception on every rank unless every rank
    holds the same parameters (names, shapes, dtypes), all on the CPU.

    Call it before ``DistributedDataParallel(model)``: DDP's own check raises
    only on the ranks that differ from rank 0, and the others wait forever.
    `parameters`: a module, a state_dict, named_parameters() or tensors.
    """
    check_tensors(reliable_comm(comm), named_tensors(parameters), reducible=False, copied=True)


def bcast_tensors(comm: MPI.Intracomm, tensors: Sequence[torch.Tensor], root: int) -> None:
    """Overwrite `tensors` with root's (same shapes and dtypes everywhere,
    and none that overlaps itself, checked by the caller).  Every message
    carries elements in logical (row-major) order, whatever each rank's
    layout: small tensors packed (FUSE_BELOW), large ones one by one, in
    place when contiguous on the CPU, else through a contiguous host copy
    (GPU tensors too)."""
    small = [t for t in tensors if t.numel() * t.element_size() < FUSE_BELOW]
    if small:
        flat = Flat(small)
        if comm.rank == root:
            flat.pack(small)
        for buf in flat.buffers.values():
            comm.Bcast(as_bytes(buf), root)
        if comm.rank != root:
            flat.unpack(small)
    fused = {id(t) for t in small}
    for t in tensors:
        if id(t) in fused:
            continue
        if t.is_contiguous() and t.device.type == "cpu":
            comm.Bcast(as_bytes(t), root)
            continue
        staged = (t.detach().to("cpu").contiguous() if comm.rank == root
                  else torch.empty(t.shape, dtype=t.dtype))
        comm.Bcast(as_bytes(staged), root)
        if comm.rank != root:
            with torch.no_grad():
                t.copy_(staged)


def overlap_problem(name: str, tensor: torch.Tensor) -> Optional[Exception]:
    """Why `tensor` cannot be overwritten element by element (None if it
    can): some of its elements share memory (an expanded tensor, stride 0),
    or its strides do not rule that out."""
    reach = 1
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride < reach:
            return BufferError(f"{name} overlaps itself in memory (strides "
                               f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}: an "
                               f"expanded view?); it cannot receive values: pass a tensor that "
                               f"owns its elements (.clone())")
        reach += (size - 1) * stride
    return None


def _check_root(comm: MPI.Intracomm, root_rank: Any) -> Optional[Exception]:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        return TypeError(f"root_rank must be an int, not {type(root_rank).__name__}")
    if not 0 <= root_rank < comm.size:
        return ValueError(f"root_rank {root_rank} is not a rank of a communicator of "
                          f"size {comm.size}")
    return None


def broadcast_parameters(parameters: Any, root_rank: int = 0, *, comm: CommLike = None) -> float:
    """Collective: give every rank `root_rank`'s values of `parameters` (a
    module — parameters and buffers —, a state_dict, named_parameters() or a
    list of tensors), in place.  Reliable (MPI_Bcast).  Checks first, on every
    rank, that all ranks hold the same tensors.  Returns the seconds spent."""
    began = time.perf_counter()
    comm = reliable_comm(comm)
    named = named_tensors(parameters)
    problem = _check_root(comm, root_rank)
    for name, t in named:
        problem = (problem or host_problem(f"tensor {name!r}", t, reducible=False, copied=True)
                   or overlap_problem(f"tensor {name!r}", t))
    check_everywhere(comm, problem, [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
                     + [("root", root_rank)], "tensors")
    bcast_tensors(comm, [t for _, t in named], root_rank)
    return time.perf_counter() - began


class _Spec:
    """Stands for a tensor in the pickled skeleton of a state_dict: its
    shape, dtype, and the strides of torch.empty_like(it) (the layout,
    channels_last say, that the receivers' copy keeps)."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = tuple(t.shape), t.dtype
        self.stride = torch.empty_like(t, device="meta").stride()   # (allocates nothing)

    def __repr__(self) -> str:
        return f"<tensor {self.shape} {self.dtype}>"


def _skeleton(value: Any, tensors: List[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by a _Spec (collected in order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Spec(value)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """The skeleton with its specs replaced by `tensors`, in order."""
    if isinstance(value, _Spec):
        return next(tensors)
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, *,
                              comm: CommLike = None) -> float:
    """Collective: give every rank `root_rank`'s optimizer state and
    hyperparameters (param_groups options such as lr).  State that the
    optimizer creates lazily works: a rank whose optimizer has not stepped
    yet receives the root's state, and state that only non-root ranks hold
    is dropped.  The structure travels pickled, the tensors by MPI_Bcast.
    Returns the seconds spent."""
    began = time.perf_counter()
    comm = reliable_comm(comm)
    problem = _check_root(comm, root_rank)
    if not isinstance(optimizer, torch.optim.Optimizer):
        problem = problem or TypeError(f"optimizer must be a torch.optim.Optimizer, not "
                                       f"{type(optimizer).__name__}")
    elif getattr(optimizer, "per_rank_state", False):
        problem = problem or ValueError("a ShardedOptimizer's state covers this rank's chunk "
                                        "only: there is no common state to broadcast")
    shapes = [] if problem else [
        (tuple(p.shape), str(p.dtype)) for g in optimizer.param_groups for p in g["params"]]
    check_everywhere(comm, problem, shapes + [("root", root_rank)], "optimizer parameters")
    tensors: List[torch.Tensor] = []
    skeleton = _skeleton(optimizer.state_dict(), tensors) if comm.rank == root_rank else None
    skeleton = comm.bcast(skeleton, root_rank)
    if comm.rank != root_rank:
        tensors = []
        _collect_specs(skeleton, tensors)
    problems = [host_problem("optimizer state", t, reducible=False, copied=True)
                for t in tensors]
    check_everywhere(comm, next((p for p in problems if p), None), (), "optimizer state")
    bcast_tensors(comm, tensors, root_rank)
    if comm.rank != root_rank:
        optimizer.load_state_dict(_fill(skeleton, iter(tensors)))
    return time.perf_counter() - began


def _collect_specs(value: Any, out: List[torch.Tensor]) -> None:
    """Fresh tensors for the specs of a skeleton, in order."""
    if isinstance(value, _Spec):
        out.append(torch.empty_strided(value.shape, value.stride, dtype=value.dtype))
    elif isinstance(value, dict):
        for v in value.values():
            _collect_specs(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_specs(v, out)
