"""Compressed all-reduce with error feedback, on NumPy float32 vectors:
fewer bytes per call, and what compression leaves out is sent later instead
of never.  The optimizers and the DDP hook of mpilossy.torch take these
(``compression=``); the benchmark measures them.

- ``LowBit("int8" | "int4")``: the values travel quantised (the core's
  groups with a scale each and stochastic rounding, Communicator's
  ``compression=``).  With error feedback each rank adds to its next
  vector what quantisation took from its contribution this call (the
  core's ``residual=``).
- ``TopK(density)``: every rank sends the same blocks of the vector, the
  ``density`` share of them with the most energy, and nothing else.  The
  ranks agree on the blocks without exchanging indices: each computes the
  energy (sum of squares, in float64, where float32 squares cannot
  overflow) of every block of its vector plus residual, and one small
  reliable ``MPI_Allreduce`` takes the maximum per block.  The maximum,
  unlike a sum, is exact and the same on every rank whatever the MPI's
  order of reduction, provided no operand is NaN (``MPI_MAX`` with a NaN
  depends on that order: MPICH gives NaN on some ranks, a number on
  others), so a NaN energy becomes +inf before the reduction: a block with
  a NaN or an infinity is among the first chosen (sent, not hidden).  Every
  rank then ranks the blocks by energy, ties by block index (a stable
  sort: one answer for identical input, whatever the NumPy build), and
  takes the first ``ceil(density * blocks)``.  The selected values go
  through one lossy all-reduce; the rest stays in the residual (error
  feedback) or is dropped (without it).

Both keep the lossy call's own rules: a lost block of the compressed
payload is rescaled by the contributions that arrived, as without
compression.  What loss takes is not re-sent (mpilossy.torch's
``error_feedback=True``, which does that, is not combined with
compression).

A compressor keeps a residual per key (one per vector it reduces: per
dtype, per bucket).  float32 only; other dtypes go through uncompressed.
"""

from __future__ import annotations

import math
from typing import Dict, Hashable, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .call.config import COMPRESSIONS
from .call.stats import CollectiveStats
from .communicator import Communicator
from .errors import MembershipChanged
from .reliable import again

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

    def refusal(self, lc: Communicator) -> Optional[str]:
        """Why this compressor cannot work over `lc` (None if it can); the
        same on every rank, from settings the ranks agreed on."""
        return None

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
        if bits not in COMPRESSIONS:
            raise ValueError(f"bits must be 'int8' or 'int4', got {bits!r}")
        self.bits = bits

    def __repr__(self) -> str:
        return f"LowBit({self.bits!r}, error_feedback={self.error_feedback})"

    def allreduce(self, lc: Communicator, key: Hashable, data: np.ndarray, *, op: str,
                  weight: Optional[float] = None) -> CollectiveStats:
        if data.dtype != np.float32:
            return lc.allreduce(data, op=op, weight=weight, algorithm="direct")
        residual = self._with_residual(key, data)
        return lc.allreduce(data, op=op, weight=weight, algorithm="direct",
                            compression=self.bits, residual=residual)

    def reduce_scatter(self, lc: Communicator, key: Hashable, send: np.ndarray,
                       recv: np.ndarray, *, op: str,
                       weight: Optional[float] = None) -> CollectiveStats:
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

    def _blocks(self, data: np.ndarray) -> np.ndarray:
        """`data` as (blocks, block): a view, or a zero-padded copy when the
        last block is short."""
        nblocks = -(-data.size // self.block)
        if data.size == nblocks * self.block:
            return data.reshape(nblocks, self.block)
        padded = np.zeros(nblocks * self.block, data.dtype)
        padded[:data.size] = data
        return padded.reshape(nblocks, self.block)

    def _put(self, out: np.ndarray, chosen: np.ndarray, values: np.ndarray) -> None:
        """Write `values` (one row per chosen block) into those blocks of the
        flat `out`; the short last block takes what fits."""
        full = out.size // self.block
        inside = chosen < full
        out[:full * self.block].reshape(full, self.block)[chosen[inside]] = values[inside]
        if not inside.all():        # (sorted: the short block is the last chosen)
            out[full * self.block:] = values[-1, :out.size - full * self.block]

    def _select(self, lc: Communicator, blocks: np.ndarray) -> np.ndarray:
        """Indices of the chosen blocks, sorted, identical on every rank.
        elastic=True: the choice is a bounded wait (Communicator.bounded_comm),
        made again over the survivors if ranks are excluded during it (its
        buffers fit any number of ranks; a reduce-scatter keeps the chunk it
        was called for: reduce_scatter)."""
        energy = np.einsum("ij,ij->i", blocks, blocks, dtype=np.float64)
        # Every operand of the maximum a number (see the module docs): a
        # NaN gradient is sent, not hidden, and chosen alike everywhere.
        energy[np.isnan(energy)] = np.inf
        if lc.elastic:
            again(lambda: lc.bounded_comm().Allreduce(MPI.IN_PLACE, energy, op=MPI.MAX),
                  MembershipChanged)
        else:
            lc.comm.Allreduce(MPI.IN_PLACE, energy, op=MPI.MAX)
        k = min(energy.size, max(1, math.ceil(self.density * energy.size)))
        # Most energy first, ties to the lower index: a stable sort has one
        # answer (argpartition's choice among ties is the build's).
        return np.sort(np.argsort(-energy, kind="stable")[:k])

    def _reduce(self, lc: Communicator, key: Hashable, data: np.ndarray, op: str,
                weight: Optional[float]) -> Tuple[np.ndarray, np.ndarray, CollectiveStats]:
        """(chosen blocks, their reduced values, stats); `data` (gradient
        plus residual) is left as it is, the residual set."""
        residual = self._with_residual(key, data)
        blocks = self._blocks(data)
        chosen = self._select(lc, blocks)
        values = blocks[chosen]
        stats = lc.allreduce(values.reshape(-1), op=op, weight=weight, algorithm="direct")
        if residual is not None:
            residual[...] = data
            self._put(residual, chosen, np.zeros_like(values))
        return chosen, values, stats

    def allreduce(self, lc: Communicator, key: Hashable, data: np.ndarray, *, op: str,
                  weight: Optional[float] = None) -> CollectiveStats:
        if data.dtype != np.float32:
            return lc.allreduce(data, op=op, weight=weight, algorithm="direct")
        chosen, values, stats = self._reduce(lc, key, data, op, weight)
        data[...] = 0
        self._put(data, chosen, values)
        return stats

    def reduce_scatter(self, lc: Communicator, key: Hashable, send: np.ndarray,
                       recv: np.ndarray, *, op: str,
                       weight: Optional[float] = None) -> CollectiveStats:
        if send.dtype != np.float32:
            return lc.reduce_scatter(send, recv, op=op, weight=weight, algorithm="direct")
        # The chunk `recv` was cut for: an elastic exclusion during the
        # choice or the all-reduce leaves it this rank's of the old layout
        # (the survivors' reduction of it), as a lossy reduce-scatter would.
        lo, hi = lc.chunk_bounds(send.size)
        chosen, values, stats = self._reduce(lc, key, send, op, weight)
        dense = np.zeros_like(send)
        self._put(dense, chosen, values)
        recv[...] = dense[lo:hi]
        return stats
