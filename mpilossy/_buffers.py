"""Buffer intake: one place that turns what a user passes into a host NumPy
array viewing the same memory, or says clearly why it cannot."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core

DTYPE_CODES = {
    np.dtype(np.float16): _core.DTYPE_F16,
    np.dtype(np.float32): _core.DTYPE_F32,
    np.dtype(np.float64): _core.DTYPE_F64,
    np.dtype(np.int32): _core.DTYPE_I32,
    np.dtype(np.int64): _core.DTYPE_I64,
}
SUPPORTED = "float16, float32, float64, int32, int64"


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
            return np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise BufferError(f"{name} cannot be viewed through DLPack on the host: {exc}") from None
    try:
        memoryview(obj).release()
    except TypeError:
        raise TypeError(f"{name} must be a NumPy array or expose the buffer protocol or "
                        f"__dlpack__, not {type(obj).__name__}") from None
    return np.asarray(obj)


def dtype_code(arr: np.ndarray, name: str) -> int:
    code = DTYPE_CODES.get(arr.dtype)
    if code is None:
        raise TypeError(f"{name} has dtype {arr.dtype}; supported: {SUPPORTED} "
                        f"(native byte order)")
    return code


def check_contiguous(arr: np.ndarray, name: str) -> None:
    if not arr.flags.c_contiguous:
        raise BufferError(f"{name} is not C-contiguous; pass np.ascontiguousarray({name})")


def check_writable(arr: np.ndarray, name: str) -> None:
    if not arr.flags.writeable:
        raise BufferError(f"{name} is read-only; the result is written into it")


address = _core.buffer_address
