"""Gradient compression for the optimizers and the DDP hook: fewer bytes per
step, with error feedback so that what compression leaves out is sent later
instead of never.

- ``LowBit("int8" | "int4")``: the gradients travel quantised (the core's
  groups with a scale each and stochastic rounding, Communicator's
  ``compression=``).  With error feedback each rank adds to its next
  gradient what quantisation took from its contribution this step (the
  core's ``residual=``).
- ``TopK(density)``: every rank sends the same blocks of the gradient, the
  ``density`` share of them with the most energy, and nothing else.  The
  ranks agree on the blocks without exchanging indices: each computes the
  energy (sum of squares) of every block of its gradient plus residual, and
  one small reliable ``MPI_Allreduce`` takes the maximum per block.  The
  maximum, unlike a sum, is exact and the same on every rank whatever the
  MPI's order of reduction, so every rank selects the same blocks
  (``np.argpartition`` on identical input).  The selected values go through
  one lossy all-reduce; the rest stays in the residual (error feedback)
  or is dropped (without it).

Both keep the lossy call's own rules: a lost block of the compressed
payload is rescaled by the contributions that arrived, as without
compression.  What loss takes is not re-sent (the optimizers'
``error_feedback=True``, which does that, is not combined with
compression).

One compressor serves one optimizer or hook: it keeps a residual per
buffer it reduces (per dtype, per bucket).  CPU float32 gradients only;
other dtypes go through uncompressed.
"""

from __future__ import annotations

import math
from typing import Dict, Hashable, Optional

import numpy as np
from mpi4py import MPI

from ..communicator import COMPRESSIONS, CollectiveStats, Communicator
from ._common import reliable_comm

__all__ = ["Compression", "LowBit", "TopK"]


class Compression:
    """What the optimizers and the hook call instead of the plain lossy
    collective.  Collective: every rank calls with the same keys in the
    same order."""

    def __init__(self, error_feedback: bool) -> None:
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, not {type(error_feedback).__name__}")
        self.error_feedback = error_feedback
        self.residuals: Dict[Hashable, np.ndarray] = {}

    def allreduce(self, lc: Communicator, key: Hashable, data: np.ndarray, *, op: str,
                  weight: Optional[float] = None) -> CollectiveStats:
        """Reduce `data` in place (the whole vector on every rank)."""
        raise NotImplementedError

    def reduce_scatter(self, lc: Communicator, key: Hashable, send: np.ndarray,
                       recv: np.ndarray, *, op: str,
                       weight: Optional[float] = None) -> CollectiveStats:
        """`recv` = this rank's chunk (chunk_bounds) of the reduction of `send`."""
        raise NotImplementedError

    def _with_residual(self, key: Hashable, data: np.ndarray) -> Optional[np.ndarray]:
        """Add the residual kept under `key` to `data`; the residual (None
        without error feedback)."""
        if not self.error_feedback:
            return None
        residual = self.residuals.get(key)
        if residual is None or residual.shape != data.shape:
            residual = self.residuals[key] = np.zeros(data.shape, np.float32)
        data += residual
        return residual

    def residual(self, key: Hashable) -> Optional[np.ndarray]:
        """What is held back for `key` (None before its first call or without
        error feedback)."""
        return self.residuals.get(key)


class LowBit(Compression):
    """Quantised payloads ("int8" or "int4", the communicator's group size)."""

    def __init__(self, bits: str = "int8", *, error_feedback: bool = True) -> None:
        super().__init__(error_feedback)
        if bits not in COMPRESSIONS or COMPRESSIONS[bits] == 0:
            raise ValueError(f"bits must be 'int8' or 'int4', got {bits!r}")
        self.bits = bits

    def __repr__(self) -> str:
        return f"LowBit({self.bits!r}, error_feedback={self.error_feedback})"

    def allreduce(self, lc, key, data, *, op, weight=None):
        if data.dtype != np.float32:
            return lc.allreduce(data, op=op, weight=weight, algorithm="direct")
        residual = self._with_residual(key, data)
        return lc.allreduce(data, op=op, weight=weight, algorithm="direct",
                            compression=self.bits, residual=residual)

    def reduce_scatter(self, lc, key, send, recv, *, op, weight=None):
        if send.dtype != np.float32:
            return lc.reduce_scatter(send, recv, op=op, weight=weight, algorithm="direct")
        residual = self._with_residual(key, send)
        return lc.reduce_scatter(send, recv, op=op, weight=weight, algorithm="direct",
                                 compression=self.bits, residual=residual)


class TopK(Compression):
    """Aligned Top-K: the `density` share of `block`-element blocks with the
    most energy, the same blocks on every rank (see the module docs)."""

    def __init__(self, density: float, *, error_feedback: bool = True, block: int = 64) -> None:
        super().__init__(error_feedback)
        if isinstance(density, bool) or not isinstance(density, (int, float)) \
                or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.density, self.block = float(density), block

    def __repr__(self) -> str:
        return (f"TopK({self.density}, error_feedback={self.error_feedback}, "
                f"block={self.block})")

    def _select(self, lc: Communicator, data: np.ndarray) -> np.ndarray:
        """Indices of the chosen blocks, sorted, identical on every rank."""
        nblocks = -(-data.size // self.block)
        padded = np.zeros(nblocks * self.block, np.float64)
        padded[:data.size] = data
        energy = np.square(padded).reshape(nblocks, self.block).sum(axis=1)
        reliable_comm(lc).Allreduce(MPI.IN_PLACE, energy, op=MPI.MAX)
        energy[~np.isfinite(energy)] = np.inf        # a NaN gradient is sent, not hidden
        k = min(nblocks, max(1, math.ceil(self.density * nblocks)))
        return np.sort(np.argpartition(-energy, k - 1)[:k])

    def _reduce(self, lc: Communicator, key: Hashable, data: np.ndarray, op: str,
                weight: Optional[float]) -> tuple:
        """(dense reduced vector, stats); `data` holds gradient + residual."""
        residual = self._with_residual(key, data)
        chosen = self._select(lc, data)
        index = (chosen[:, None] * self.block + np.arange(self.block)).reshape(-1)
        index = index[index < data.size]
        values = data[index]
        stats = lc.allreduce(values, op=op, weight=weight, algorithm="direct")
        if residual is not None:
            residual[...] = data
            residual[index] = 0.0
        dense = np.zeros_like(data)
        dense[index] = values
        return dense, stats

    def allreduce(self, lc, key, data, *, op, weight=None):
        if data.dtype != np.float32:
            return lc.allreduce(data, op=op, weight=weight, algorithm="direct")
        dense, stats = self._reduce(lc, key, data, op, weight)
        data[...] = dense
        return stats

    def reduce_scatter(self, lc, key, send, recv, *, op, weight=None):
        if send.dtype != np.float32:
            return lc.reduce_scatter(send, recv, op=op, weight=weight, algorithm="direct")
        dense, stats = self._reduce(lc, key, send, op, weight)
        lo, hi = lc.chunk_bounds(send.size)
        recv[...] = dense[lo:hi]
        return stats


def compression_problem(compression: object, error_feedback: bool) -> Optional[Exception]:
    """Why the optimizers cannot take this compression (None if they can)."""
    if compression is None:
        return None
    if not isinstance(compression, Compression):
        return TypeError(f"compression must be mpilossy.torch.LowBit or TopK, got "
                         f"{type(compression).__name__}")
    if error_feedback:
        return ValueError("compression does not combine with error_feedback=True (re-sending "
                          "what loss took); the compressor's own error feedback carries what "
                          "compression leaves out")
    return None
