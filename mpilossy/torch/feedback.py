"""Error feedback: what a rank's gradient lost in one step is sent again in
the next, so that loss delays gradient information instead of discarding it.

A rank sends v_t = g_t + e_{t-1} and keeps e_t, the part of v_t that is in
no applied result.  Summed over steps, the contributions that were applied
equal the sum of the true gradients minus the residual still held.  The
result must then be the plain average (sum / size, ``scaling="zero-fill"``):
dividing by the contributions that arrived would count the lost part twice,
once rescaled now and once re-sent later.

Who contributed to each block is known exactly by at least one rank: the
direct algorithm's reducer (all-reduce) or the chunk's owner (reduce-scatter).
Under the plain average a block that a rank did not receive is zeros with an
empty bitmap, so the bitwise OR of every rank's bitmaps is the truth.  It
travels as one small reliable MPI_Allreduce (N bits per block) after the
lossy calls.  (A non-blocking one would not overlap anything without an
asynchronous progress thread, and would leave a request open at exit.)
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .. import CollectiveStats, Communicator
from ..errors import MembershipChanged
from ..reliable import again
from .communicators import reliable_comm
from .tensors import Flat, REDUCIBLE

__all__ = ["ErrorFeedback"]


def feedback_problem(lc: Communicator, error_feedback: object) -> Optional[Exception]:
    """Why these settings cannot run error feedback (None if they can)."""
    if not isinstance(error_feedback, bool):
        return TypeError(f"error_feedback must be a bool, not {type(error_feedback).__name__}")
    if error_feedback and lc.scaling != "zero-fill":
        return ValueError("error_feedback=True needs the plain average: build the Communicator "
                          "with scaling='zero-fill' (rescaling by the contributions that "
                          "arrived would count the lost part twice: docs/training.md)")
    return None


class ErrorFeedback:
    """The residual of one flat set of gradients (one buffer per dtype).

    Per step: ``add_to(flat)`` before the lossy calls (adds the residual and
    keeps a copy of what is sent), ``record(calls)`` after them.  Collective:
    every rank calls both in the same order.  If a call fails in between,
    nothing was applied and the residual stays as it was.
    """

    def __init__(self, lc: Communicator, flat: Flat) -> None:
        self.rank, self.size = lc.rank, lc.size
        self.comm = reliable_comm(lc)       # in program order with the lossy calls
        self.residuals = {d: torch.zeros_like(b) for d, b in flat.buffers.items() if d in REDUCIBLE}
        self.sent = {d: torch.zeros_like(b) for d, b in self.residuals.items()}

    def rebind(self, comm: MPI.Intracomm) -> None:
        """Go on over `comm` (after an elastic exclusion)."""
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    def add_to(self, flat: Flat) -> None:
        """Add the residual to the packed gradients; remember what is sent."""
        with torch.no_grad():
            for dtype, residual in self.residuals.items():
                buf = flat.buffers[dtype]
                buf.add_(residual)
                self.sent[dtype].copy_(buf)

    def record(self, calls: List[Tuple[torch.dtype, int, CollectiveStats]]) -> None:
        """The step's lossy calls: (dtype, first element in the flat buffer,
        stats).  The residual becomes what the sent values lost."""
        rank = self.rank             # (the calls' rank: an exclusion below rebinds)
        records = []
        for dtype, first, stats in calls:
            record = stats.contributors
            if record is None:
                raise RuntimeError("error feedback needs the direct algorithm's contributor "
                                   f"record; the {stats.algorithm} {stats.collective} has none")
            records.append((dtype, first, record, record.layout_bits()))
        if self.size == 1:
            return                      # nothing is ever lost
        everything = np.concatenate([bits.reshape(-1) for *_, bits in records]) \
            if records else np.zeros(0, np.uint64)
        # Elastic: made again over the survivors if ranks are excluded during
        # it (a bounded wait writes nothing until it completes).  A gone
        # owner's bits are missing: its chunk counts as lost for every
        # survivor, and it was (its update never reached them).
        again(lambda: self.comm.Allreduce(MPI.IN_PLACE, everything, op=MPI.BOR),
              MembershipChanged)
        at = 0
        with torch.no_grad():
            for dtype, first, record, bits in records:
                truth = record.of_every_chunk(everything[at:at + bits.size].reshape(bits.shape))
                at += bits.size
                lost = torch.from_numpy(~truth.mask(rank))
                end = first + lost.numel()
                torch.mul(self.sent[dtype][first:end], lost,
                          out=self.residuals[dtype][first:end])

    def residual(self) -> Dict[torch.dtype, torch.Tensor]:
        """The residual now held, per dtype (flat, in the wrappers' order)."""
        return self.residuals
