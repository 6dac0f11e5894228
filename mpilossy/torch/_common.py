"""What every part of mpilossy.torch shares: tensor intake, the collective
check that ranks hold the same parameters, the communicator for reliable
traffic, and packing many tensors into a few flat buffers."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from mpi4py import MPI

from .. import Communicator, default_communicator
from ..call.device import CUPY_HINT
from ..errors import MismatchError

# What the lossy collectives reduce (the core's float dtypes).
REDUCIBLE = (torch.float16, torch.float32, torch.float64)
NamedTensors = List[Tuple[str, torch.Tensor]]
CommLike = Union[None, MPI.Intracomm, Communicator]


def lossy_communicator(communicator: Optional[Communicator]) -> Communicator:
    if communicator is None:
        return default_communicator()
    if not isinstance(communicator, Communicator):
        raise TypeError(f"communicator must be an mpilossy.Communicator, "
                        f"not {type(communicator).__name__}")
    return communicator


_world: Optional[MPI.Intracomm] = None


def reliable_comm(comm: CommLike) -> MPI.Intracomm:
    """The MPI communicator for reliable traffic (validation, broadcasts, the
    drift meter).  Default: a private duplicate of COMM_WORLD, made on first
    use (collectively), so that our messages never mix with the caller's.  A
    Communicator lends its own duplicate: the lossy and reliable calls of one
    training loop then run in program order on one communicator."""
    global _world
    if comm is None:
        if _world is None:
            _world = MPI.COMM_WORLD.Dup()
        return _world
    if isinstance(comm, Communicator):
        lent = comm.comm
        if isinstance(lent, MPI.Intracomm):     # (always: it duplicates one)
            return lent
    if isinstance(comm, MPI.Intracomm) and comm != MPI.COMM_NULL:
        return comm
    raise TypeError(f"comm must be an mpi4py intracommunicator or an mpilossy.Communicator, "
                    f"not {type(comm).__name__}")


# -- tensor intake -------------------------------------------------------------
def named_tensors(tensors: Any, what: str = "parameter") -> NamedTensors:
    """(name, tensor) pairs from a module, a mapping (state_dict), an iterable
    of pairs (named_parameters()) or an iterable of tensors."""
    if isinstance(tensors, torch.nn.Module):
        tensors = tensors.state_dict(keep_vars=True)
    if isinstance(tensors, torch.Tensor):
        raise TypeError("pass a list of tensors, not a single tensor")
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    out: NamedTensors = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            out.append((f"{what}[{i}]", item))
        elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], torch.Tensor)):
            out.append(item)
        else:
            raise TypeError(f"expected tensors or (name, tensor) pairs, got "
                            f"{type(item).__name__} at position {i}")
    return out


def optimizer_parameters(optimizer: torch.optim.Optimizer,
                         named_parameters: Any = None) -> NamedTensors:
    """The optimizer's parameters in group order, named after
    `named_parameters` where it names them."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, not "
                        f"{type(optimizer).__name__}")
    names: Dict[int, str] = {}
    if named_parameters is not None:
        for name, p in named_tensors(named_parameters):
            names.setdefault(id(p), name)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is not None:
        unnamed = [i for i, p in enumerate(params) if id(p) not in names]
        if unnamed:
            raise ValueError(f"named_parameters does not name {len(unnamed)} of the "
                             f"optimizer's parameters (positions {unnamed[:5]})")
    return [(names.get(id(p), f"parameter[{i}]"), p) for i, p in enumerate(params)]


def host_problem(name: str, tensor: torch.Tensor, reducible: bool,
                 cuda: bool = False) -> Optional[Exception]:
    """Why `tensor` cannot go through this build (None if it can).  `cuda`:
    the caller hands CUDA tensors to the communicator as they are (staged
    through pinned host memory, call/device.py), which needs CuPy."""
    # The one place that decides by device.
    if tensor.device.type == "cuda" and cuda:
        try:
            import cupy  # noqa: F401
        except ImportError:
            return BufferError(f"{name} is a CUDA tensor; mpilossy reads GPU memory through "
                               f"CuPy, which is not installed ({CUPY_HINT})")
    elif tensor.device.type != "cpu":
        return BufferError(f"{name} is on device {tensor.device}; this part of mpilossy.torch "
                           f"works on CPU tensors only (the DDP hook without compression takes "
                           f"CUDA tensors)")
    if tensor.layout != torch.strided:
        return TypeError(f"{name} has layout {tensor.layout}; only dense tensors are supported")
    if reducible and tensor.dtype not in REDUCIBLE:
        return TypeError(f"{name} has dtype {tensor.dtype}; the lossy collectives reduce "
                         f"{', '.join(str(d) for d in REDUCIBLE)}")
    return None


def signature(named: NamedTensors) -> List[Tuple[Any, ...]]:
    return [(name, tuple(t.shape), str(t.dtype), t.device.type) for name, t in named]


# -- collective validation -------------------------------------------------------
_ERROR_TYPES = {"TypeError": TypeError, "ValueError": ValueError, "BufferError": BufferError,
                "MismatchError": MismatchError}


def check_everywhere(comm: MPI.Intracomm, local_error: Optional[Exception],
                     entries: Sequence[Any] = (), what: str = "parameters") -> None:
    """Collective: raise the same exception on every rank if any rank has a
    local error, or if `entries` differ between ranks (MismatchError naming
    the first difference).  One small allgather; one more on mismatch."""
    digest = hashlib.sha256(repr(list(entries)).encode()).hexdigest()
    error = None if local_error is None else (type(local_error).__name__, str(local_error))
    outcomes = comm.allgather((error, digest))
    failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if failed:
        rank, (kind, message) = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise _ERROR_TYPES.get(kind, ValueError)(f"rank {rank}{others}: {message}")
    if len({d for _, d in outcomes}) > 1:
        every = comm.allgather(list(entries))
        raise MismatchError(f"{what} differ across ranks: {_first_difference(every)}")


def _first_difference(every: List[List[Any]]) -> str:
    ref = every[0]
    for rank, entries in enumerate(every[1:], 1):
        if entries == ref:
            continue
        for i, (a, b) in enumerate(zip(ref, entries)):
            if a != b:
                return f"entry {i} is {a} on rank 0 but {b} on rank {rank}"
        return f"rank 0 has {len(ref)} entries, rank {rank} has {len(entries)}"
    return "(no difference found)"


def check_tensors(comm: MPI.Intracomm, named: NamedTensors, *, reducible: bool,
                  extra: Any = None, what: str = "parameters",
                  problem: Optional[Exception] = None, cuda: bool = False) -> None:
    """Collective: no `problem` (a local error) on any rank, every tensor
    usable on this rank, and the same names, shapes, dtypes and devices
    (plus `extra`: settings that must agree) on every rank."""
    for name, t in named:
        if problem is not None:
            break
        problem = host_problem(f"{what[:-1]} {name!r}", t, reducible, cuda)
    devices = sorted({str(t.device) for _, t in named})
    if problem is not None and len(devices) > 1:
        problem = type(problem)(f"{problem} (the {what} are on several devices: "
                                f"{', '.join(devices)})")
    check_everywhere(comm, problem, signature(named) + [("extra", repr(extra))], what)


# -- flat buffers ------------------------------------------------------------------
class Flat:
    """Copies of a list of tensors, held in one contiguous 1-D buffer per
    dtype (or in one buffer of `dtype`, cast), so that few collective calls
    move them all.  Slot i holds tensor i."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None):
        sizes: Dict[torch.dtype, int] = {}
        self.slots: List[Tuple[torch.dtype, int, int]] = []
        for t in tensors:
            key = dtype or t.dtype
            offset = sizes.setdefault(key, 0)
            self.slots.append((key, offset, t.numel()))
            sizes[key] = offset + t.numel()
        # dtypes in order of first appearance: the same on every rank
        self.buffers: Dict[torch.dtype, torch.Tensor] = {
            key: torch.zeros(n, dtype=key) for key, n in sizes.items()}
        # NumPy views for the lossy collectives (dtypes that NumPy knows)
        self.arrays: Dict[torch.dtype, np.ndarray] = {
            key: as_numpy(buf) for key, buf in self.buffers.items() if key in REDUCIBLE}

    def view(self, i: int, like: torch.Tensor) -> torch.Tensor:
        key, offset, n = self.slots[i]
        return self.buffers[key][offset:offset + n].view(like.shape)

    def pack(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        """Copy tensors in (any strides; None packs zeros)."""
        with torch.no_grad():
            for i, t in enumerate(tensors):
                key, offset, n = self.slots[i]
                part = self.buffers[key][offset:offset + n]
                if t is None:
                    part.zero_()
                else:
                    part.view(t.shape).copy_(t)

    def unpack(self, tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, t in enumerate(tensors):
                t.copy_(self.view(i, t))

    def pieces(self, max_bytes: int) -> List[Tuple[torch.dtype, int, np.ndarray]]:
        """(dtype, first element, NumPy view) of the buffers, cut into pieces
        of at most max_bytes."""
        out: List[Tuple[torch.dtype, int, np.ndarray]] = []
        for dtype, arr in self.arrays.items():
            step = max(1, max_bytes // arr.itemsize)
            out.extend((dtype, i, arr[i:i + step]) for i in range(0, arr.size, step))
        return out


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a CPU tensor, through DLPack."""
    return np.from_dlpack(tensor.detach())


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """Zero-copy uint8 view of a contiguous CPU tensor of any dtype."""
    return np.from_dlpack(tensor.detach().reshape(-1).view(torch.uint8))
