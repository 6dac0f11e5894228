"""GPU buffers: intake of device arrays and their staging through pinned
host memory (the GPU side of call/buffers.py).

A device buffer is recognised by ``__cuda_array_interface__`` (CuPy, Numba,
PyTorch CUDA tensors) or by ``__dlpack_device__`` naming a CUDA device
(imported through CuPy).  The channels move host memory (CPU loads from
shared windows, libfabric datagrams from host buffers), so a device buffer
is staged: copied into a pinned host buffer that the Communicator owns and
reuses, reduced there, and copied back.

Stream semantics: the copies are ordered on the array's stream (the
``stream`` entry of the CUDA array interface, version 3; else the current
CuPy stream), so work queued on that stream before the call is seen by it.
The call synchronises that stream before it returns: like an MPI call, it
is complete when it returns and the result may be used on any stream.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple, Union

import sys

import numpy as np

from . import pipeline
from .dtypes import BFLOAT16, DTYPE_CODES, SUPPORTED

__all__ = ["DeviceBuffer", "PipelinedBuffers", "StagedBuffers", "Staging", "backend", "describe", "is_device",
           "mpi_cuda_aware"]

KDL_CUDA, KDL_CUDA_MANAGED = 2, 13
# The extras name CuPy's wheels by CUDA major version (pyproject.toml).
CUPY_HINT = "pip install 'mpilossy[cuda12]', or 'mpilossy[cuda13]' for CUDA 13"


class DeviceBuffer(NamedTuple):
    """What the staging needs to know of a device array."""

    ptr: int
    shape: Tuple[int, ...]
    dtype: np.dtype
    readonly: bool
    contiguous: bool
    stream: Optional[int]
    obj: Any                  # keeps the exporter alive during the call

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def segment(self, first: int, stop: int) -> "DeviceBuffer":
        """Elements [first, stop) of the flattened array."""
        return self._replace(ptr=self.ptr + first * self.dtype.itemsize, shape=(stop - first,))


def _torch_cuda_bfloat16(obj: Any) -> Optional[DeviceBuffer]:
    """A CUDA bfloat16 tensor of PyTorch, described from the tensor itself:
    its __cuda_array_interface__ raises (no typestr names bfloat16), and
    CuPy's DLPack import has no bfloat16.  None for anything else."""
    torch = sys.modules.get("torch")            # (never imported here)
    if (torch is None or not isinstance(obj, torch.Tensor) or obj.dtype != torch.bfloat16
            or not obj.is_cuda):
        return None
    # The copies go on the tensor's device's current stream, as PyTorch's
    # interface would name it for any other dtype.
    stream = int(torch.cuda.current_stream(obj.device).cuda_stream)
    return DeviceBuffer(int(obj.data_ptr()), tuple(obj.shape), BFLOAT16, False,
                        obj.is_contiguous(), stream, obj)


def is_device(obj: Any) -> bool:
    if type(obj) is np.ndarray:        # the common case, checked first: it is per call
        return False
    if _torch_cuda_bfloat16(obj) is not None:
        return True
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        kind = device()[0]
    except Exception:           # an exporter that cannot say is not a GPU one
        return False
    return int(kind) in (KDL_CUDA, KDL_CUDA_MANAGED)


def _c_contiguous(shape: Tuple[int, ...], strides: Optional[Tuple[int, ...]],
                  itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def describe(obj: Any, name: str) -> DeviceBuffer:
    """Describe a device array (is_device(obj) is true).  DLPack-only
    exporters go through CuPy.  Raises TypeError or BufferError."""
    bfloat16 = _torch_cuda_bfloat16(obj)
    if bfloat16 is not None:
        return bfloat16
    if not hasattr(obj, "__cuda_array_interface__"):
        try:
            import cupy
        except ImportError:
            raise BufferError(f"{name} lives on a GPU (DLPack); reading it needs CuPy, which "
                              f"is not installed ({CUPY_HINT})") from None
        obj = cupy.from_dlpack(obj)
    try:
        cai = obj.__cuda_array_interface__
        ptr, readonly = cai["data"]
        shape = tuple(int(n) for n in cai["shape"])
        dtype = np.dtype(cai["typestr"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BufferError(f"{name} has a malformed __cuda_array_interface__: {exc}") from None
    if cai.get("mask") is not None:
        raise TypeError(f"{name} is a masked device array; pass its data")
    strides = cai.get("strides")
    contiguous = _c_contiguous(shape, tuple(strides) if strides is not None else None,
                               dtype.itemsize)
    if ptr == 0 and int(np.prod(shape, dtype=np.int64)) > 0:
        raise BufferError(f"{name} has a null device pointer")
    return DeviceBuffer(int(ptr), shape, dtype, bool(readonly), contiguous,
                        cai.get("stream"), obj)


class CupyBackend:
    """Copies and pinned memory through CuPy's CUDA runtime bindings."""

    def __init__(self) -> None:
        import cupy
        self.cupy = cupy
        self.runtime = cupy.cuda.runtime

    def pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def stream_of(self, buf: DeviceBuffer) -> int:
        # CAI v3: None = no synchronisation required; 1 and 2 are the legacy
        # and per-thread default streams.
        if buf.stream is not None:
            return int(buf.stream)
        return int(self.cupy.cuda.get_current_stream().ptr)

    def to_host(self, host: np.ndarray, buf: DeviceBuffer, stream: int) -> None:
        self.runtime.memcpyAsync(host.ctypes.data, buf.ptr, buf.nbytes,
                                 self.runtime.memcpyDeviceToHost, stream)

    def to_device(self, buf: DeviceBuffer, host: np.ndarray, stream: int) -> None:
        self.runtime.memcpyAsync(buf.ptr, host.ctypes.data, buf.nbytes,
                                 self.runtime.memcpyHostToDevice, stream)

    def synchronize(self, stream: int) -> None:
        self.runtime.streamSynchronize(stream)

    def event(self) -> int:
        return int(self.runtime.eventCreateWithFlags(self.runtime.eventDisableTiming))

    def record(self, event: int, stream: int) -> None:
        self.runtime.eventRecord(event, stream)

    def wait_event(self, event: int) -> None:
        self.runtime.eventSynchronize(event)


def backend() -> Any:
    """The copy backend (CuPy).  Raises BufferError where there is none."""
    try:
        return CupyBackend()
    except ImportError:
        raise BufferError("a GPU buffer was given, but CuPy is not installed "
                          f"({CUPY_HINT}); pass host arrays instead") from None


def mpi_cuda_aware() -> Optional[bool]:
    """Does the MPI library say it is CUDA-aware?  (None: it does not say.)
    Reported for information: the channels read peers' data with CPU loads
    and libfabric host buffers, so device data is staged either way."""
    try:
        from mpi4py import MPI
        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query is not None else None
    except Exception:
        return None


class StagedBuffers:
    """A call on GPU memory: `send` and `recv` are pinned host copies, and
    finish() copies the result back to the device."""

    __slots__ = ("send", "recv", "_backend", "_device_recv", "_stream")
    segments = None                             # (not pipelined: call/pipeline.py)

    def __init__(self, send: np.ndarray, recv: np.ndarray, backend: Any,
                 device_recv: DeviceBuffer, stream: int) -> None:
        self.send, self.recv = send, recv
        self._backend, self._device_recv, self._stream = backend, device_recv, stream

    def finish(self, ok: bool) -> None:
        """Copy the result to the device and wait for it (not after a failed
        call: the user's buffer keeps what it held)."""
        if ok:
            self._backend.to_device(self._device_recv, self.recv, self._stream)
            self._backend.synchronize(self._stream)


class PipelinedBuffers:
    """An all-reduce staged in segments (mpilossy/call/pipeline.py): `send`
    and `recv` are the whole pinned host vectors; segment k may be read
    once ready(k) returned, and deliver(k) queues its result's copy back."""

    __slots__ = ("send", "recv", "segments", "_backend", "_device_send", "_device_recv",
                 "_in_place", "_events", "_in_stream", "_out_stream", "_delivered")

    def __init__(self, send: np.ndarray, recv: np.ndarray, backend: Any,
                 device_send: DeviceBuffer, device_recv: DeviceBuffer, in_place: bool,
                 segments: List[Tuple[int, int]], events: List[Any], in_stream: int,
                 out_stream: int) -> None:
        self.send, self.recv, self.segments = send, recv, segments
        self._backend, self._device_send, self._device_recv = backend, device_send, device_recv
        self._in_place, self._events = in_place, events
        self._in_stream, self._out_stream = in_stream, out_stream
        self._delivered = 0

    def ready(self, k: int) -> None:
        """Wait until segment k's send data is on the host."""
        self._backend.wait_event(self._events[k])

    def deliver(self, k: int) -> None:
        """Queue the copy of segment k's result to the device (not waited
        for: it runs while the next segment travels)."""
        first, stop = self.segments[k]
        self._backend.to_device(self._device_recv.segment(first, stop), self.recv[first:stop],
                                self._out_stream)
        self._delivered = k + 1

    def finish(self, ok: bool) -> None:
        """Wait for every copy.  After a failure, an in-place call gets its
        delivered segments' data back from slot 0 (the user's data is never
        lost); an out-of-place recvbuf keeps what was delivered."""
        back = self._backend
        if not ok and self._in_place and self._delivered:
            stop = self.segments[self._delivered - 1][1]
            back.to_device(self._device_recv.segment(0, stop), self.send[:stop],
                           self._out_stream)
        back.synchronize(self._in_stream)
        if self._out_stream != self._in_stream:
            back.synchronize(self._out_stream)


class Staging:
    """Pinned host buffers owned by a Communicator: allocated on first use,
    grown by doubling, reused by every later call."""

    def __init__(self) -> None:
        self._backend: Any = None
        self._buffers: List[Optional[np.ndarray]] = [None, None]
        self._events: List[Any] = []          # one per segment of a pipelined call, reused

    @property
    def backend(self) -> Any:
        if self._backend is None:
            self._backend = backend()
        return self._backend

    def host(self, slot: int, buf: DeviceBuffer) -> np.ndarray:
        """A pinned host array shaped like `buf` (slot 0 or 1)."""
        have = self._buffers[slot]
        if have is None or have.nbytes < buf.nbytes:
            size = max(buf.nbytes, 2 * (have.nbytes if have is not None else 0), 4096)
            self._buffers[slot] = have = self.backend.pinned(size)
        return have[:buf.nbytes].view(buf.dtype).reshape(buf.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers if b is not None)

    def take(self, sendbuf: Any, recvbuf: Any, rules: Any,
             segment_bytes: int = 0) -> Union[StagedBuffers, "PipelinedBuffers"]:
        """GPU buffers of one call: validate them, stage what the call reads
        into pinned host memory (copies on the arrays' streams, waited for),
        and return the host views.  `rules`: call/buffers.py's Rules.  An
        all-reduce of at least two segments of `segment_bytes` is staged in
        segments instead (PipelinedBuffers; 0: never)."""
        back, send, recv = self._validate(sendbuf, recvbuf, rules)
        if rules.same_ok and not rules.overlap_ok and recv.nbytes == send.nbytes:
            same = send.ptr == recv.ptr
            apart = send.ptr + send.nbytes <= recv.ptr or recv.ptr + recv.nbytes <= send.ptr
            segments = pipeline.plan(send.size, send.dtype.itemsize, segment_bytes)
            if segments is not None and (same or apart):
                return self._pipelined(back, send, recv, same, segments)
        return self._staged(back, send, recv, recvbuf, rules)

    def _validate(self, sendbuf: Any, recvbuf: Any,
                  rules: Any) -> Tuple[Any, DeviceBuffer, DeviceBuffer]:
        """(backend, send, recv) of a call's GPU buffers, checked."""
        if recvbuf is None and rules.recv_required:
            raise TypeError("recvbuf is required")
        back = self.backend                             # raises without CuPy
        for obj, name in ((sendbuf, "sendbuf"), (recvbuf, "recvbuf")):
            if obj is not None and not is_device(obj):
                raise BufferError(f"{name} is in host memory and the other buffer on a GPU; "
                                  f"pass both on the same side")
        send = describe(sendbuf, "sendbuf")
        recv = send if recvbuf is None else describe(recvbuf, "recvbuf")
        for buf, name in ((send, "sendbuf"), (recv, "recvbuf")):
            if buf.dtype not in DTYPE_CODES:
                raise TypeError(f"{name} has dtype {buf.dtype}; supported: {SUPPORTED}")
            if not buf.contiguous:
                raise BufferError(f"{name} is not C-contiguous; pass a contiguous copy")
        if recv.readonly:
            raise BufferError("recvbuf is read-only; the result is written into it"
                              if recvbuf is not None else
                              "sendbuf (in place, no recvbuf) is read-only")
        if recv.dtype != send.dtype:
            raise TypeError(f"recvbuf has dtype {recv.dtype}, sendbuf {send.dtype}")
        return back, send, recv

    def _staged(self, back: Any, send: DeviceBuffer, recv: DeviceBuffer, recvbuf: Any,
                rules: Any) -> StagedBuffers:
        """Stage the whole call: copies queued and waited for."""
        in_stream, out_stream = back.stream_of(send), back.stream_of(recv)
        same = send.ptr == recv.ptr and send.nbytes == recv.nbytes
        s_lo, s_hi, r_lo, r_hi = send.ptr, send.ptr + send.nbytes, recv.ptr, recv.ptr + recv.nbytes
        if same:
            if recvbuf is not None and not rules.same_ok:
                raise ValueError("sendbuf and recvbuf must be different buffers")
            host_send = host_recv = self.host(1, recv)
            back.to_host(host_recv, recv, out_stream)
        elif s_lo < r_hi and r_lo < s_hi:
            offset = s_lo - r_lo
            if not (rules.overlap_ok and offset >= 0 and s_hi <= r_hi
                    and offset % recv.dtype.itemsize == 0):
                raise ValueError("sendbuf and recvbuf overlap without being the same buffer")
            host_recv = self.host(1, recv)
            back.to_host(host_recv, recv, out_stream)
            first = offset // recv.dtype.itemsize
            host_send = host_recv.reshape(-1)[first:first + send.size]     # a chunk of recv
        elif rules.same_ok and not rules.overlap_ok:
            # allreduce out of place: reduce the staged send data in place,
            # then copy it to recvbuf (recvbuf's old contents are not needed).
            if recv.nbytes != send.nbytes:
                raise ValueError(f"recvbuf has {recv.size} elements, sendbuf {send.size}")
            host_send = host_recv = self.host(1, send)
            back.to_host(host_send, send, in_stream)
        else:
            # reduce_scatter, allgather: recvbuf's old contents stay where
            # nothing arrives (allgather keeps a missing chunk's previous values)
            host_recv = self.host(1, recv)
            back.to_host(host_recv, recv, out_stream)
            host_send = self.host(0, send)
            back.to_host(host_send, send, in_stream)
        back.synchronize(in_stream)
        if out_stream != in_stream:
            back.synchronize(out_stream)
        return StagedBuffers(host_send.reshape(-1), host_recv.reshape(-1), back, recv, out_stream)

    def _pipelined(self, back: Any, send: DeviceBuffer, recv: DeviceBuffer, in_place: bool,
                   segments: List[Tuple[int, int]]) -> "PipelinedBuffers":
        """Stage an all-reduce segment by segment: every copy to the host is
        queued now, each followed by an event; the call waits for segment
        k's event only when it reduces segment k.  The send data goes to
        slot 0 and the result to slot 1, so that slot 0 still holds the
        user's data if the call fails half way (in place, it is put back)."""
        in_stream, out_stream = back.stream_of(send), back.stream_of(recv)
        host_send = self.host(0, send).reshape(-1)
        host_recv = self.host(1, recv).reshape(-1)
        while len(self._events) < len(segments):
            self._events.append(back.event())
        events = self._events[:len(segments)]
        for (first, stop), event in zip(segments, events):
            back.to_host(host_send[first:stop], send.segment(first, stop), in_stream)
            back.record(event, in_stream)
        return PipelinedBuffers(host_send, host_recv, back, send, recv, in_place, segments,
                                events, in_stream, out_stream)
