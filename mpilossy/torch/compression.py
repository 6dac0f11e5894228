"""Gradient compression for the optimizers and the DDP hook: the
compressors of mpilossy.compression (LowBit, aligned TopK, each with error
feedback of what compression leaves out), and the settings they refuse."""

from __future__ import annotations

from typing import Optional

from ..communicator import Communicator
from ..compression import Compression, LowBit, TopK

__all__ = ["Compression", "LowBit", "TopK"]


def compression_problem(compression: object, error_feedback: bool,
                        lc: Communicator) -> Optional[Exception]:
    """Why the optimizers cannot take this compression over `lc` (None if
    they can)."""
    if compression is None:
        return None
    if not isinstance(compression, Compression):
        return TypeError(f"compression must be mpilossy.torch.LowBit or TopK, got "
                         f"{type(compression).__name__}")
    refused = compression.refusal(lc)
    if refused:
        return ValueError(refused)
    if error_feedback:
        return ValueError("compression does not combine with error_feedback=True (re-sending "
                          "what loss took); the compressor's own error feedback carries what "
                          "compression leaves out")
    return None
