"""The element types the compiled core reduces, and their codes."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core import DTYPE_F16, DTYPE_F32, DTYPE_F64, DTYPE_I32, DTYPE_I64

__all__ = ["DTYPE_CODES", "SUPPORTED", "dtype_code"]

DTYPE_CODES = {
    np.dtype(np.float16): DTYPE_F16,
    np.dtype(np.float32): DTYPE_F32,
    np.dtype(np.float64): DTYPE_F64,
    np.dtype(np.int32): DTYPE_I32,
    np.dtype(np.int64): DTYPE_I64,
}
SUPPORTED = "float16, float32, float64, int32, int64"


def dtype_code(arr: Any, name: str) -> int:
    """The core's code for `arr`'s dtype; TypeError for one it does not reduce."""
    code = DTYPE_CODES.get(arr.dtype)
    if code is None:
        raise TypeError(f"{name} has dtype {arr.dtype}; supported: {SUPPORTED} "
                        f"(native byte order)")
    return code
