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

from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np

from .dtypes import DTYPE_CODES, SUPPORTED

__all__ = ["DeviceBuffer", "StagedBuffers", "Staging", "backend", "describe", "is_device",
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


def is_device(obj: Any) -> bool:
    if type(obj) is np.ndarray:        # the common case, checked first: it is per call
        return False
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


class Staging:
    """Pinned host buffers owned by a Communicator: allocated on first use,
    grown by doubling, reused by every later call."""

    def __init__(self) -> None:
        self._backend: Any = None
        self._buffers: List[Optional[np.ndarray]] = [None, None]

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

    def take(self, sendbuf: Any, recvbuf: Any, rules: Any) -> StagedBuffers:
        """GPU buffers of one call: validate them, stage what the call reads
        into pinned host memory (copies on the arrays' streams, waited for),
        and return the host views.  `rules`: call/buffers.py's Rules."""
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
