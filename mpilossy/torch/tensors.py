"""Tensors in and out of mpilossy.torch: what may go through (host_problem,
the one place that decides by device), names for them, and many tensors
packed into a few flat buffers that few collective calls move."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..call.device import CUPY_HINT
from ..call.buffers import torch_bfloat16

# The parts of mpilossy.torch that take CUDA tensors (docs/gpu.md): all of them.
CUDA_TAKERS = ("DistributedOptimizer, ShardedOptimizer, the DDP hook, the broadcasts, drift "
               "control and the averaging functions")
# What the lossy collectives reduce (the core's float dtypes).
REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NamedTensors = List[Tuple[str, torch.Tensor]]


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
                 cuda: bool = False, copied: bool = False) -> Optional[Exception]:
    """Why `tensor` cannot go through this build (None if it can).  `cuda`:
    the caller hands CUDA tensors to the communicator as they are (staged
    through pinned host memory, call/device.py), which needs CuPy;
    `copied`: the caller copies tensors into host buffers of its own
    (Flat, torch's copies), so CUDA tensors need nothing more."""
    # The one place that decides by device.
    if tensor.device.type == "cuda" and copied:
        pass
    elif tensor.device.type == "cuda" and cuda:
        try:
            import cupy  # noqa: F401
        except ImportError:
            return BufferError(f"{name} is a CUDA tensor; mpilossy reads GPU memory through "
                               f"CuPy, which is not installed ({CUPY_HINT})")
    elif tensor.device.type != "cpu":
        return BufferError(f"{name} is on device {tensor.device}; this part of mpilossy.torch "
                           f"works on CPU tensors only ({CUDA_TAKERS} take CUDA tensors)")
    if tensor.layout != torch.strided:
        return TypeError(f"{name} has layout {tensor.layout}; only dense tensors are supported")
    if reducible and tensor.dtype not in REDUCIBLE:
        return TypeError(f"{name} has dtype {tensor.dtype}; the lossy collectives reduce "
                         f"{', '.join(str(d) for d in REDUCIBLE)}")
    return None


class Flat:
    """Copies of a list of tensors, held in one contiguous 1-D buffer per
    dtype (or in one buffer of `dtype`, cast), so that few collective calls
    move them all.  Slot i holds tensor i.  The buffers are in host memory
    unless `device` names another (then there are no NumPy `arrays`)."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None):
        device = torch.device("cpu") if device is None else device
        # Host buffers are pinned where some tensors are on a GPU, so that
        # pack() and unpack() copy at full speed.
        pinned = device.type == "cpu" and any(t.device.type == "cuda" for t in tensors)
        sizes: Dict[torch.dtype, int] = {}
        self.slots: List[Tuple[torch.dtype, int, int]] = []
        for t in tensors:
            key = dtype or t.dtype
            offset = sizes.setdefault(key, 0)
            self.slots.append((key, offset, t.numel()))
            sizes[key] = offset + t.numel()
        # dtypes in order of first appearance: the same on every rank
        self.buffers: Dict[torch.dtype, torch.Tensor] = {
            key: torch.zeros(n, dtype=key, device=device, pin_memory=pinned)
            for key, n in sizes.items()}
        # NumPy views for the lossy collectives (dtypes that NumPy knows)
        self.arrays: Dict[torch.dtype, np.ndarray] = {
            key: as_numpy(buf) for key, buf in self.buffers.items()
            if key in REDUCIBLE and device.type == "cpu"}

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
    """Zero-copy NumPy view of a CPU tensor, through DLPack (bfloat16, which
    NumPy lacks: its bits, viewed as ml_dtypes' bfloat16)."""
    bf16 = torch_bfloat16(tensor)
    return np.from_dlpack(tensor.detach()) if bf16 is None else bf16


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """Zero-copy uint8 view of a contiguous CPU tensor of any dtype."""
    return np.from_dlpack(tensor.detach().reshape(-1).view(torch.uint8))
