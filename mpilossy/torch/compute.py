"""The compute deadline (DropCompute): a rank accumulates micro-batches until
its time budget for the step runs out (at least one), and its gradient then
counts with the number it did as its weight, so that the reduced gradient is
the mean over every micro-batch that was computed and arrived."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Deque, Iterable, Iterator, Optional, Union

import numpy as np
import torch
from mpi4py import MPI

from .. import Communicator
from ..errors import MembershipChanged
from ..reliable import again

__all__ = ["ComputeDeadline"]


class ComputeDeadline:
    """Time budget for the micro-batches of each step.

    Iterate over it to run a step's micro-batches::

        deadline = mpilossy.torch.ComputeDeadline("auto", max_micro_batches=4)
        opt = mpilossy.torch.ShardedOptimizer(inner, model.named_parameters(), lc,
                                              compute_deadline=deadline)
        for step in range(steps):
            opt.zero_grad()
            for _ in deadline:
                model.loss(next_micro_batch()).backward()   # not divided by the count
            opt.step()

    Each iteration starts one micro-batch.  The first always runs; another
    one starts only if the budget leaves room for it (at this step's mean
    time per micro-batch so far), and never more than `max_micro_batches`.
    The optimizer wrappers (``compute_deadline=``) divide the summed
    gradients by ``micro_batches`` and reduce with that count as the weight
    (``Communicator.allreduce(..., weight=)``); without them, do the same.

    budget:
        seconds per step for the micro-batches, or "auto": learnt from the
        recent time per micro-batch, agreed across ranks every `agree_every`
        steps (the median over ranks of each rank's median over the last
        `history` micro-batches), times `max_micro_batches`, times
        (1 + `slack`).  A rank of typical speed then does every micro-batch;
        one slower than 1 + slack times the typical stops early.  Until the
        first agreement (the first `agree_every` steps) nothing is cut.
    comm:
        where "auto" agrees (collective: every rank iterates the same number
        of steps); the optimizer wrappers fill it in with their
        communicator's.
    device:
        where the micro-batches run.  On a CUDA device each micro-batch is
        timed once the work it queued is done (``torch.cuda.synchronize``):
        kernels run asynchronously, and the time to queue them says nothing
        of the time they take.  The optimizer wrappers fill it in with
        their parameters' device.
    """

    def __init__(self, budget: Union[float, str] = "auto", *, max_micro_batches: int,
                 comm: Optional[MPI.Intracomm] = None, slack: float = 0.1,
                 agree_every: int = 10, history: int = 50,
                 device: Union[None, str, torch.device] = None) -> None:
        if isinstance(budget, str):
            if budget != "auto":
                raise ValueError(f"budget must be seconds > 0 or 'auto', got {budget!r}")
        elif isinstance(budget, bool) or not isinstance(budget, (int, float)) \
                or not (math.isfinite(budget) and budget > 0):
            raise ValueError(f"budget must be seconds > 0 or 'auto', got {budget!r}")
        for name, value, least in (("max_micro_batches", max_micro_batches, 1),
                                   ("agree_every", agree_every, 1), ("history", history, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) \
                or not (math.isfinite(slack) and slack >= 0):
            raise ValueError(f"slack must be a number >= 0, got {slack!r}")
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must name a torch device, got {device!r}: {exc}") from None
        self.auto = budget == "auto"
        self.budget: float = math.inf if self.auto else float(budget)
        self.max_micro_batches = max_micro_batches
        self.comm = comm
        self.slack = float(slack)
        self.agree_every = agree_every
        self.times: Deque[float] = deque(maxlen=history)   # seconds per micro-batch
        self.steps = 0
        self.micro_batches = 0          # done in the current (or last) step
        self.cut_steps = 0              # steps that stopped before max_micro_batches

    @property
    def weight(self) -> float:
        """This rank's weight for the step's reduction: its micro-batch count."""
        if self.micro_batches < 1:
            raise RuntimeError("no micro-batch ran: iterate over the ComputeDeadline first")
        return float(self.micro_batches)

    def __iter__(self) -> Iterator[int]:
        if self.auto and self.steps and self.steps % self.agree_every == 0:
            self._agree()
        self.steps += 1
        self.micro_batches = 0
        began = last = time.perf_counter()
        while True:
            yield self.micro_batches
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.times.append(now - last)
            last = now
            self.micro_batches += 1
            if self.micro_batches >= self.max_micro_batches:
                return
            per_batch = (now - began) / self.micro_batches
            if now - began + per_batch > self.budget:
                self.cut_steps += 1
                return

    def _agree(self) -> None:
        if self.comm is None:
            raise RuntimeError("ComputeDeadline('auto') needs a communicator to agree on "
                               "(comm=, or pass it to an optimizer wrapper)")
        mine = statistics.median(self.times) if self.times else math.nan
        comm = self.comm
        every = again(lambda: comm.allgather(mine), MembershipChanged)   # (elastic)
        medians = [m for m in every if not math.isnan(m)]
        if medians:
            self.budget = (statistics.median(medians) * self.max_micro_batches
                           * (1.0 + self.slack))

    def __repr__(self) -> str:
        budget = "auto" if self.auto else f"{self.budget:g} s"
        return (f"ComputeDeadline({budget}, max_micro_batches={self.max_micro_batches}, "
                f"current budget {self.budget:.4g} s, steps {self.steps}, "
                f"cut {self.cut_steps})")


def fill_in(deadline: ComputeDeadline, comm: MPI.Intracomm,
            params: Iterable[torch.Tensor]) -> None:
    """What an optimizer wrapper gives its compute deadline where it has
    none: the communicator to agree on, the device its parameters are on."""
    if deadline.comm is None:
        deadline.comm = comm
    if deadline.device is None:
        deadline.device = next((p.device for p in params if p.device.type == "cuda"), None)


def deadline_problem(lc: Communicator, op: str, deadline: object,
                     error_feedback: bool) -> Optional[Exception]:
    """Why an optimizer wrapper cannot use this compute deadline (None if it can)."""
    if deadline is None:
        return None
    if not isinstance(deadline, ComputeDeadline):
        return TypeError(f"compute_deadline must be a ComputeDeadline or None, "
                         f"not {type(deadline).__name__}")
    if op != "avg" or error_feedback or lc.scaling != "unbiased":
        return ValueError("compute_deadline needs op='avg' and a Communicator with "
                          "scaling='unbiased' (so not error_feedback): the gradients are a "
                          "weighted average")
    return None


NO_MICRO_BATCH = ("compute deadline: no micro-batch ran in this step, so its gradients have "
                  "no weight (iterate over the ComputeDeadline at least once before step(); "
                  "a data loader that ran dry?)")


class _NoWeight(float):
    """The weight of a rank that ran no micro-batch in its step.  Passed to
    the lossy call like any weight, it fails that call's check of weight=
    (which reads it with float()) with NO_MICRO_BATCH, and the call path
    refuses the call on every rank with that ValueError: every rank raises
    at the same call, each counted it, and the next step runs normally.
    Raising here instead, on this rank alone, would leave its peers waiting
    for its contribution (or a call ahead of it, with a deadline).  Read as
    a number without float() it is NaN, which no weight check accepts."""

    def __new__(cls) -> "_NoWeight":
        return super().__new__(cls, math.nan)

    def __float__(self) -> float:
        raise ValueError(NO_MICRO_BATCH)

    def __repr__(self) -> str:
        return f"<no weight: {NO_MICRO_BATCH}>"


def weigh(deadline: Optional[ComputeDeadline], arrays: Iterable[np.ndarray]) -> Optional[float]:
    """Turn the summed gradients of this step's micro-batches into their mean
    (in place) and return the weight to reduce them with (None without a
    compute deadline).  A step without micro-batches gets a weight that
    fails the lossy call on every rank (_NoWeight); pass it to the call
    as it is."""
    if deadline is None:
        return None
    if deadline.micro_batches < 1:
        return _NoWeight()
    weight = deadline.weight
    if weight != 1.0:
        for arr in arrays:
            arr *= arr.dtype.type(1.0 / weight)
    return weight
