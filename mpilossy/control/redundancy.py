"""redundancy="auto": the code (k, m) picked from the loss rate that the
ranks measured on recent calls, agreed by all of them.

Each rank counts, over its last ``WINDOW`` calls, the data blocks its
streams covered and those that did not arrive on their own (dropped, or
rebuilt from parity: what the wire lost, whether or not parity made up for
it).  Blocks still missing at the deadline do not count: they are late,
not lost, and the parity sent after them is as late; how much the deadline
may cut is the learned deadline's business (control/deadline.py).  Counted,
under congestion the cut raised the code, whose extra bytes made the calls
later still.  Every ``PERIOD`` calls the ranks take the largest of their
loss rates with one nonblocking ``MPI_Iallreduce`` (MAX) on a private
communicator; ``LAG`` calls later every rank applies it, and from then on
each call's code is the smallest m (groups of ``AUTO_K`` blocks) whose
residual loss, the chance that a data block is lost and its group cannot
rebuild it, is at most the target (``residual_loss``, losses taken as
independent).  Before the first agreement, calls carry no parity.

Which codes exist is agreed too: at construction the ranks take the
largest m that every rank's build has (``largest_m``, one ``MPI_Allreduce``
MIN): a build without Intel ISA-L has m = 1 only, and ranks that chose from
their own builds would use different codes from the first agreement on.

Why strict where the auto deadline is lenient: ranks that used different
codes in one call could not read each other's records (the call fails as a
mismatch), so every rank must switch at the same call.  A rank that reaches
the due call before the agreement completed (a peer is more than LAG calls
behind) waits for it, at most ``AGREE_WAIT`` seconds, then raises; a rank
that is itself behind finds it complete.  The largest rate, not the mean:
the code must cover the reader that loses most.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Deque, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .._core import fec_check
from ..errors import MPILossyError
from .agreement import LAG, PERIOD, Agreement, finish, wait

__all__ = ["AutoRedundancy", "residual_loss", "choose", "largest_m", "AUTO_K", "AUTO_MAX_M"]

WINDOW = 64             # calls per rank in the measured rate
AUTO_K = 8              # data blocks per group (the measured (8, 2) rows)
AUTO_MAX_M = 6          # at most 75% more bytes, as the (4, 3) rows at 30% loss
AGREE_WAIT = 30.0       # seconds a rank waits at the due call for a late peer

Code = Optional[Tuple[int, int]]


def residual_loss(p: float, k: int, m: int) -> float:
    """Chance that a data block is lost and not rebuilt, each of a group's
    k + m records lost independently with probability p: the block is lost
    and m or more of the other k + m - 1 records are too."""
    if m == 0:
        return p
    others = k + m - 1
    below = sum(math.comb(others, i) * p ** i * (1 - p) ** (others - i) for i in range(m))
    return p * (1.0 - below)


def largest_m(k: int = AUTO_K) -> int:
    """The largest m <= AUTO_MAX_M such that this build has every code (k, 1)
    to (k, m): 1 without ISA-L."""
    m = 0
    while m < AUTO_MAX_M and fec_check(k, m + 1) is None:
        m += 1
    return m


def choose(p: Optional[float], target: float, k: int = AUTO_K,
           max_m: Optional[int] = None) -> Code:
    """The code for loss rate `p` and residual-loss `target`: None when the
    rate is unknown or already within the target, else the smallest m up to
    `max_m` (default: what this build has) whose residual loss meets the
    target, or `max_m` when none does."""
    if p is None or p <= target:
        return None
    top = largest_m(k) if max_m is None else max_m
    best = None
    for m in range(1, top + 1):
        best = (k, m)
        if residual_loss(p, k, m) <= target:
            break
    return best


class AutoRedundancy:
    """The agreed loss rate of one communicator and the code it calls for."""

    def __init__(self, comm: MPI.Intracomm, target: float, k: int = AUTO_K) -> None:
        """Collective over `comm`: agrees the codes every rank's build has."""
        self.comm = comm            # private: the agreements never meet other traffic
        self.target = target
        self.k = k
        self.max_m: int = comm.allreduce(largest_m(k), op=MPI.MIN)
        """The largest m every rank's build has."""
        self.calls = 0
        self.recent: Deque[Tuple[int, int]] = deque(maxlen=WINDOW)   # (missed, read) per call
        self.pending: Deque[Agreement] = deque()
        self.loss_rate: Optional[float] = None
        """The largest loss rate of any rank, as last agreed (None before)."""

    def tick(self) -> float:
        """Count one call (every rank, every call, before anything about it
        is checked).  Returns the seconds spent waiting for an agreement;
        raises MPILossyError after AGREE_WAIT seconds of waiting."""
        self.calls += 1
        for agreement in self.pending:
            agreement.request.Test()     # drive MPI progress
        spent = 0.0
        while self.pending and self.calls >= self.pending[0].due:
            spent += self._wait(self.pending[0])
            recv = self.pending.popleft().recv
            if recv[1] > 0:             # some rank read something
                self.loss_rate = float(recv[0])
        if self.calls % PERIOD == 0:
            missed = sum(m for m, _ in self.recent)
            read = sum(r for _, r in self.recent)
            send = np.array([missed / read if read else 0.0, 1.0 if read else 0.0])
            recv = np.zeros(2)
            self.pending.append(Agreement(self.comm.Iallreduce(send, recv, op=MPI.MAX), send,
                                          recv, self.calls + LAG))
        return spent

    def _wait(self, agreement: Agreement) -> float:
        """Wait for the agreement (sleeping between tests: agreement.wait),
        at most AGREE_WAIT seconds, then raise."""
        waited = wait(agreement, AGREE_WAIT)
        if not agreement.request.Test():
            raise MPILossyError(
                f"redundancy='auto': call {self.calls} needs the loss rate agreed at call "
                f"{agreement.due - LAG}, and some rank has not reached that call after "
                f"{AGREE_WAIT:.0f} s (it is more than {LAG} calls behind, or gone); the "
                f"ranks cannot pick the same code without it")
        return waited

    def observe(self, result: Any) -> None:
        """Learn from a call that ended (the core's CallResult)."""
        if not result.err_kind and result.read_blocks:
            injected, _late, gone, torn = result.lost_blocks
            self.recent.append((injected + gone + torn + result.rebuilt, result.read_blocks))

    def code(self, target: Optional[float] = None) -> Code:
        """The code in force for residual-loss `target` (default: the
        communicator's): the same on every rank between two agreements."""
        return choose(self.loss_rate, self.target if target is None else target, self.k,
                      self.max_m)

    def close(self, limit: float = 1.0) -> None:
        finish(self.pending, limit)
