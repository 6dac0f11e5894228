"""Buffers of one call: what the user passed, checked and turned into host
arrays that view the same memory, and what to do once the call is over.

`BufferIntake.take` is the one entry: host memory (NumPy arrays, the buffer
protocol, CPU ``__dlpack__``) is viewed in place (`HostBuffers`: nothing to
do afterwards); GPU memory goes to the staging of ``call/device.py``, whose
`StagedBuffers` copy the result back.  Either way the call sees ``send`` and
``recv`` as contiguous host arrays of one dtype, with the shapes its
collective needs, and calls ``finish(ok)`` when it is done.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Tuple, Union

import numpy as np

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER, buffer_address
from . import device as _device
from .dtypes import BFLOAT16, dtype_code

__all__ = ["BufferIntake", "HostBuffers", "chunk_bounds"]

address = buffer_address


class Rules(NamedTuple):
    """What a collective accepts as (sendbuf, recvbuf)."""

    recv_required: bool
    same_ok: bool          # recvbuf may be sendbuf
    overlap_ok: bool       # sendbuf may be a part of recvbuf (the all-gather in place)


RULES = {
    ALLREDUCE: Rules(recv_required=False, same_ok=True, overlap_ok=False),
    REDUCE_SCATTER: Rules(recv_required=True, same_ok=False, overlap_ok=False),
    ALLGATHER: Rules(recv_required=True, same_ok=True, overlap_ok=True),
}


def chunk_bounds(count: int, size: int, rank: int) -> Tuple[int, int]:
    """(first, end) of `rank`'s chunk of a vector of `count` elements, as
    reduce_scatter and allgather cut it: the first count % size ranks get
    one element more."""
    base, extra = divmod(count, size)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0)


class HostBuffers:
    """User memory in place: the call reads `send` and writes `recv`."""

    __slots__ = ("send", "recv")
    segments = None                             # (not pipelined: call/pipeline.py)

    def __init__(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.send, self.recv = send, recv

    def finish(self, ok: bool) -> None:
        """Nothing to copy: the result is already where the user wants it."""


class WidenedBuffers:
    """16-bit floats (float16, bfloat16) of a compressed call, widened to
    float32 around it: the quantiser reads float32 values, and what travels
    is its codes either way.  The user's recvbuf is written (rounded to its
    dtype) only when the call succeeded."""

    __slots__ = ("inner", "send", "recv")
    segments = None

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.send = inner.send.astype(np.float32)
        same = address(inner.recv) == address(inner.send) and inner.recv.size == inner.send.size
        self.recv = self.send if same else np.empty(inner.recv.shape, np.float32)

    def finish(self, ok: bool) -> None:
        if ok:
            self.inner.recv[...] = self.recv
        self.inner.finish(ok)


def widen_for_compression(bufs: Any) -> Any:
    """`bufs` as float32 where they hold 16-bit floats on the host."""
    if isinstance(bufs, HostBuffers) and bufs.send.dtype in (np.dtype(np.float16), BFLOAT16):
        return WidenedBuffers(bufs)
    return bufs


Buffers = Union[HostBuffers, WidenedBuffers, _device.StagedBuffers, _device.PipelinedBuffers]


class BufferIntake:
    """Turns one call's (sendbuf, recvbuf) into host arrays; owns the pinned
    staging of GPU buffers, reused by every call of a communicator."""

    def __init__(self, rank: int, size: int, segment_bytes: int = 0) -> None:
        self.rank, self.size = rank, size
        self.staging = _device.Staging()
        self.segment_bytes = segment_bytes      # GPU all-reduces: pipelined staging (0: off)

    def take(self, collective: int, sendbuf: Any, recvbuf: Any) -> Buffers:
        """HostBuffers, StagedBuffers or PipelinedBuffers for this call.
        Raises TypeError, ValueError or BufferError that say what is wrong."""
        rules = RULES[collective]
        bufs: Buffers
        if ((type(sendbuf) is np.ndarray or not _device.is_device(sendbuf))
                and (recvbuf is None or type(recvbuf) is np.ndarray
                     or not _device.is_device(recvbuf))):
            bufs = HostBuffers(*_host(sendbuf, recvbuf, rules))
        else:
            bufs = self.staging.take(sendbuf, recvbuf, rules, self.segment_bytes)
        check_shapes(collective, bufs.send, bufs.recv, self.size, self.rank)
        return bufs


def _host(sendbuf: Any, recvbuf: Any, rules: Rules) -> Tuple[np.ndarray, np.ndarray]:
    send = as_array(sendbuf, "sendbuf")
    dtype_code(send, "sendbuf")
    check_contiguous(send, "sendbuf")
    if recvbuf is None:
        if rules.recv_required:
            raise TypeError("recvbuf is required")
        check_writable(send, "sendbuf (in place, no recvbuf)")
        return send, send
    recv = as_array(recvbuf, "recvbuf")
    if recv.dtype != send.dtype:
        raise TypeError(f"recvbuf has dtype {recv.dtype}, sendbuf {send.dtype}")
    check_contiguous(recv, "recvbuf")
    check_writable(recv, "recvbuf")
    same = address(recv) == address(send) and recv.size == send.size
    if same and not rules.same_ok:
        raise ValueError("sendbuf and recvbuf must be different buffers")
    if not same and not rules.overlap_ok and np.may_share_memory(send, recv):
        raise ValueError("sendbuf and recvbuf overlap without being the same buffer")
    return send, recv


def check_shapes(collective: int, send: np.ndarray, recv: np.ndarray, size: int,
                 rank: int) -> None:
    """The sizes a collective needs: equal (all-reduce), recvbuf this rank's
    chunk of sendbuf (reduce-scatter), sendbuf this rank's chunk of recvbuf
    (all-gather, which may also be in place)."""
    if collective == ALLREDUCE:
        if recv.size != send.size:
            raise ValueError(f"recvbuf has {recv.size} elements, sendbuf {send.size}")
    elif collective == REDUCE_SCATTER:
        lo, hi = chunk_bounds(send.size, size, rank)
        if recv.size != hi - lo:
            raise ValueError(f"recvbuf has {recv.size} elements; this rank's chunk of "
                             f"{send.size} has {hi - lo} (Communicator.chunk_bounds)")
    else:
        lo, hi = chunk_bounds(recv.size, size, rank)
        if send.size != hi - lo:
            raise ValueError(f"sendbuf has {send.size} elements; this rank's chunk of "
                             f"{recv.size} has {hi - lo} (Communicator.chunk_bounds)")
        if (address(send) != address(recv) + lo * recv.itemsize
                and np.may_share_memory(send, recv)):
            raise ValueError("sendbuf overlaps recvbuf without being this rank's chunk of it")


def as_array(obj: Any, name: str) -> np.ndarray:
    """A NumPy view of `obj` (no copy), accepting ndarrays, the buffer
    protocol and CPU `__dlpack__`.  Raises TypeError or BufferError."""
    if type(obj) is np.ndarray:
        return obj
    if isinstance(obj, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array; pass its .data (the mask would be ignored)")
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        try:
            bf16 = torch_bfloat16(obj)
            return np.from_dlpack(obj) if bf16 is None else bf16
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise BufferError(f"{name} cannot be viewed through DLPack on the host: {exc}") from None
    try:
        memoryview(obj).release()
    except TypeError:
        raise TypeError(f"{name} must be a NumPy array or expose the buffer protocol or "
                        f"__dlpack__, not {type(obj).__name__}") from None
    return np.asarray(obj)


def torch_bfloat16(obj: Any) -> Optional[np.ndarray]:
    """A CPU bfloat16 tensor of PyTorch as ml_dtypes' bfloat16 (NumPy's DLPack
    import has no bfloat16: its bits go through as int16), else None."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(obj, torch.Tensor) or obj.dtype != torch.bfloat16
            or obj.device.type != "cpu"):
        return None
    return np.from_dlpack(obj.detach().view(torch.int16)).view(BFLOAT16)


def check_contiguous(arr: np.ndarray, name: str) -> None:
    if not arr.flags.c_contiguous:
        raise BufferError(f"{name} is not C-contiguous; pass np.ascontiguousarray({name})")


def check_writable(arr: np.ndarray, name: str) -> None:
    if not arr.flags.writeable:
        raise BufferError(f"{name} is read-only; the result is written into it")
