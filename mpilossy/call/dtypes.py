"""The element types the compiled core reduces, and their codes.

bfloat16 is ml_dtypes' NumPy dtype (NumPy has none of its own; JAX,
TensorFlow and ONNX use the same one, and ml_dtypes depends on NumPy only).
Its kind is "V", not "f": ask `is_float`, not ``dtype.kind``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._core import DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_F64, DTYPE_I32, DTYPE_I64

__all__ = ["BFLOAT16", "DTYPE_CODES", "SUPPORTED", "dtype_code", "is_float"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

DTYPE_CODES = {
    np.dtype(np.float16): DTYPE_F16,
    BFLOAT16: DTYPE_BF16,
    np.dtype(np.float32): DTYPE_F32,
    np.dtype(np.float64): DTYPE_F64,
    np.dtype(np.int32): DTYPE_I32,
    np.dtype(np.int64): DTYPE_I64,
}
SUPPORTED = "float16, bfloat16 (ml_dtypes), float32, float64, int32, int64"
FLOATS = frozenset([np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)])


def is_float(dtype: Any) -> bool:
    """Whether the core reduces `dtype` as floating point (averages,
    weights, unbiased rescaling without rounding to integers)."""
    return np.dtype(dtype) in FLOATS


def dtype_code(arr: Any, name: str) -> int:
    """The core's code for `arr`'s dtype; TypeError for one it does not reduce."""
    code = DTYPE_CODES.get(arr.dtype)
    if code is None:
        raise TypeError(f"{name} has dtype {arr.dtype}; supported: {SUPPORTED} "
                        f"(native byte order)")
    return code
