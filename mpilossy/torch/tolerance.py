"""Phase-aware loss tolerance: how much loss one training step may accept.

Early training is fragile (the "critical phase"): lost gradient data then
costs accuracy that later steps do not win back, while late training shrugs
it off.  A policy gives each step a tolerance: the largest fraction of
contributions the step may lose.  A step that loses more waits for the rest
instead — here, by re-sending its gradients reliably (MPI_Allreduce), which
is what a bounded-loss transport's retransmissions cost on a real network.
A tolerance of 0 goes reliable at once; a tolerance of 1 accepts whatever
arrived by the deadline (mpilossy's plain behaviour) and costs nothing extra.

The policy is collective state: every rank must reach the same decision, so
the signals it uses are agreed with one tiny reliable all-reduce (two
doubles, MAX) in the steps that need it, and never after the critical phase
ended when the late tolerance is 1.
"""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
from mpi4py import MPI

from ..call.config import check_fraction

__all__ = ["PhaseAwareTolerance"]


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class PhaseAwareTolerance:
    """Tight loss tolerance in the critical phase, loose afterwards.

    critical_steps:
        Length of the critical phase by schedule: steps 1..critical_steps
        accept at most `early` loss.
    ramp_steps:
        Then the tolerance grows linearly from `early` to `late` over this
        many steps (0: at once).
    early, late:
        Tolerances (fractions of contributions) of the two phases.
    grad_norm_threshold:
        Optional signal from training.  When given, the critical phase also
        lasts while the norm of the reduced gradient still changes fast: the
        relative change between the means of two consecutive windows of
        `window` steps exceeds the threshold on some rank.  The phase ends
        at the first window where no rank sees such a change (and never
        before `critical_steps`); it does not come back.
    window:
        Steps per window of the gradient-norm signal.
    redundancy_target:
        Optional residual-loss target of redundancy="auto" while the
        tolerance is below `late` (the critical phase and the ramp): lower
        than the communicator's redundancy_target, it buys more parity
        where loss costs most, so fewer steps exceed their tolerance and
        are re-sent.  Needs a Communicator(redundancy="auto").

    Pass it to ``DistributedOptimizer(..., tolerance=PhaseAwareTolerance())``.
    """

    def __init__(self, critical_steps: int = 100, *, ramp_steps: int = 0,
                 early: float = 0.0, late: float = 1.0,
                 grad_norm_threshold: Optional[float] = None, window: int = 10,
                 redundancy_target: Optional[float] = None) -> None:
        self.critical_steps = _count("critical_steps", critical_steps, 0)
        self.ramp_steps = _count("ramp_steps", ramp_steps, 0)
        self.early = _fraction("early", early)
        self.late = _fraction("late", late)
        if grad_norm_threshold is not None and (
                isinstance(grad_norm_threshold, bool)
                or not isinstance(grad_norm_threshold, (int, float))
                or not grad_norm_threshold > 0):
            raise ValueError(f"grad_norm_threshold must be a positive number or None, "
                             f"got {grad_norm_threshold!r}")
        self.grad_norm_threshold = grad_norm_threshold
        self.window = _count("window", window, 1)
        self.redundancy_target = None if redundancy_target is None else \
            check_fraction("redundancy_target", redundancy_target)
        self.step = 0
        """Steps begun so far."""
        self.critical_ended: Optional[int] = None if grad_norm_threshold is not None else \
            self.critical_steps
        """Last step of the critical phase: critical_steps by schedule; with the
        gradient-norm signal, None until the ranks agree that it ended."""
        self.repaired = 0
        """Steps whose loss exceeded their tolerance and were re-sent reliably."""
        self.reliable = 0
        """Steps reduced reliably from the start (tolerance 0)."""
        self._norms: List[float] = []
        self._previous_mean: Optional[float] = None
        self._vote = 0.0                 # this rank: the signal says "still critical"
        self._votes = np.zeros(2)        # (lost fraction, vote), agreed with MAX
        self._agreed = np.zeros(2)

    def __repr__(self) -> str:
        return (f"PhaseAwareTolerance(critical_steps={self.critical_steps}, "
                f"ramp_steps={self.ramp_steps}, early={self.early}, late={self.late}, "
                f"grad_norm_threshold={self.grad_norm_threshold}, window={self.window}, "
                f"redundancy_target={self.redundancy_target})")

    # -- the schedule ----------------------------------------------------------
    def tolerance(self, step: Optional[int] = None) -> float:
        """Tolerance of `step` (default: the step under way)."""
        step = self.step if step is None else step
        ended = self.critical_ended
        if ended is None or step <= max(ended, self.critical_steps):
            return self.early
        if self.ramp_steps == 0:
            return self.late
        done = min(1.0, (step - max(ended, self.critical_steps)) / self.ramp_steps)
        return self.early + (self.late - self.early) * done

    def begin(self) -> float:
        """Start a step; returns its tolerance."""
        self.step += 1
        return self.tolerance()

    def redundancy_target_now(self) -> Optional[float]:
        """The residual-loss target the step under way asks of
        redundancy="auto": `redundancy_target` while the tolerance is below
        `late`, else None (the communicator's own)."""
        if self.redundancy_target is None or self.tolerance() >= self.late:
            return None
        return self.redundancy_target

    @property
    def needs_agreement(self) -> bool:
        """Does the step under way end with the small reliable all-reduce?"""
        return self.tolerance() < 1.0 or self.critical_ended is None

    def agree(self, comm: MPI.Comm, lost: float) -> float:
        """Collective: the largest loss of any rank in this step; also
        settles the gradient-norm vote."""
        self._votes[0] = lost
        self._votes[1] = self._vote
        comm.Allreduce(self._votes, self._agreed, op=MPI.MAX)
        if self.critical_ended is None and self._vote_due() and self._agreed[1] == 0.0:
            self.critical_ended = self.step
        return float(self._agreed[0])

    def observe(self, grad_norm: float) -> None:
        """Feed the norm of this step's reduced gradient (signal mode)."""
        if self.critical_ended is not None or self.grad_norm_threshold is None:
            return
        self._norms.append(grad_norm)
        if len(self._norms) < self.window:
            return
        mean = sum(self._norms) / len(self._norms)
        self._norms.clear()
        previous, self._previous_mean = self._previous_mean, mean
        if previous is None or not math.isfinite(mean):
            self._vote = 1.0
            return
        change = abs(mean - previous) / max(abs(previous), 1e-30)
        self._vote = 1.0 if change > self.grad_norm_threshold else 0.0

    def _vote_due(self) -> bool:
        # A vote counts once a full window comparison exists and the
        # scheduled part of the critical phase is over.
        return (self._previous_mean is not None and not self._norms
                and self.step >= self.critical_steps and self.step >= 2 * self.window)
