"""Drift control: ranks that lost different blocks end a step with slightly
different parameters.  A reliable broadcast every K steps puts them back on
one model, and a meter measures the gap every M steps."""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .. import Communicator
from ..errors import MembershipChanged
from ..reliable import again
from .averaging import average_optimizer_state, average_tensors
from .broadcast import bcast_tensors, broadcast_optimizer_state
from .checks import check_tensors
from .communicators import CommLike, reliable_comm
from .tensors import Flat, named_tensors

__all__ = ["DriftController", "DriftStep", "measure_drift"]

log = logging.getLogger("mpilossy.torch")


class DriftStep(NamedTuple):
    """What DriftController.step() did."""

    drift: Optional[float]
    """Relative drift measured this step (before any broadcast), else None."""
    broadcast: bool
    """True if the parameters were re-synchronised."""
    seconds: float
    """Seconds spent (reliable traffic)."""


def every_problem(**periods: Any) -> Optional[Exception]:
    for name, value in periods.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            return ValueError(f"{name} must be a positive int or None, got {value!r}")
    return None


RESYNCS = ("broadcast", "average")


def resync_problem(resync: Any) -> Optional[Exception]:
    if resync not in RESYNCS:
        return ValueError(f"resync must be one of {RESYNCS}, got {resync!r}")
    return None


class _Meter:
    """Relative L2 distance of each rank's parameters from the rank average,
    with one reliable MPI_Allreduce (float64, into a preallocated buffer)."""

    def __init__(self, comm: MPI.Intracomm, tensors: List[torch.Tensor]) -> None:
        self.comm = comm
        self.tensors = [t for t in tensors if t.is_floating_point()]
        self.flat = Flat(self.tensors, dtype=torch.float64)
        self.mine = self.flat.arrays.get(torch.float64, np.zeros(0))
        self.total = np.empty_like(self.mine)

    def __call__(self) -> Tuple[float, ...]:
        self.flat.pack(self.tensors)
        self.comm.Allreduce(self.mine, self.total, op=MPI.SUM)
        # |x_r - S/N| / |S/N| = |N x_r - S| / |S|.  Float32 (and narrower)
        # values are exact in float64, and so are N x_r and the sum S of equal
        # values: ranks that hold the same parameters measure exactly 0.
        gap = float(np.linalg.norm(self.comm.size * self.mine - self.total))
        norm = float(np.linalg.norm(self.total))
        mine = gap / norm if norm > 0 else (0.0 if gap == 0 else math.inf)
        return tuple(self.comm.allgather(mine))


def measure_drift(parameters: Any, *, comm: CommLike = None) -> float:
    """Collective: the largest, over ranks, relative L2 distance
    |theta_r - mean_r theta_r| / |mean_r theta_r| of the parameters (0.0 when
    every rank holds the same values).  Reliable (MPI_Allreduce)."""
    comm = reliable_comm(comm)
    named = named_tensors(parameters)
    check_tensors(comm, named, reducible=False, copied=True)
    return max(_Meter(comm, [t for _, t in named])())


class DriftController:
    """Bounds and measures the drift between ranks' parameters.

    Call ``step()`` once per training step, after ``optimizer.step()``
    (DistributedOptimizer and ShardedOptimizer do it for you when given
    ``broadcast_every`` / ``measure_every``).  Every `measure_every` steps it
    measures the drift (``.drift``, logged on the root rank to the
    "mpilossy.torch" logger at INFO); every `broadcast_every` steps it
    re-synchronises the parameters (of a module: parameters and buffers) and,
    if `optimizer` is given, its state: `resync="broadcast"` (default) gives
    every rank `root_rank`'s copy (MPI_Bcast), `resync="average"` the average
    over ranks (MPI_Allreduce; integer buffers as they are on `root_rank`,
    optimizer step counters as each rank has them).

    Given a Communicator built with elastic=True, it follows its exclusions
    (the survivors' communicator, whose rank 0 is the root) and, if it
    re-synchronises at all, does so at the end of the step in which ranks
    were excluded: that step's lost chunks left each survivor its own
    partial sums (the DDP hook's way to go on after an exclusion;
    docs/elastic.md).

    Construction and every method are collective over `comm`.
    """

    def __init__(self, parameters: Any, *, comm: CommLike = None,
                 broadcast_every: Optional[int] = None, measure_every: Optional[int] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, root_rank: int = 0,
                 resync: str = "broadcast",
                 synchronize: Optional[Callable[[], None]] = None) -> None:
        self.comm = reliable_comm(comm)
        problem = (every_problem(broadcast_every=broadcast_every, measure_every=measure_every)
                   or resync_problem(resync))
        if not (isinstance(root_rank, int) and 0 <= root_rank < self.comm.size):
            problem = ValueError(f"root_rank must be a rank of the communicator, got {root_rank!r}")
        try:
            named = named_tensors(parameters)   # of a module: parameters and buffers
        except TypeError as exc:
            problem, named = exc, []
        measured: List[torch.Tensor] = ([t for _, t in parameters.named_parameters()]
                                         if isinstance(parameters, torch.nn.Module)
                                         else [t for _, t in named])
        # (collective: a bad argument on one rank raises on every rank)
        self._agreed = (named, (broadcast_every, measure_every, root_rank,
                                optimizer is not None, resync, synchronize is not None))
        check_tensors(self.comm, named, reducible=False, problem=problem, copied=True,
                      extra=self._agreed[1])
        self.broadcast_every = broadcast_every
        self.measure_every = measure_every
        self.root_rank = root_rank
        self.resync = resync
        self.optimizer = optimizer
        self._tensors = [t for _, t in named]
        self._synchronize = synchronize
        self._meter = _Meter(self.comm, measured)
        self.steps = 0
        self.drift: Optional[float] = None
        """Last measured drift (largest over ranks)."""
        self.drift_per_rank: Tuple[float, ...] = ()
        self.history: List[Tuple[int, float]] = []
        """(step, drift) of every measurement."""
        self.broadcasts = 0
        self.broadcast_seconds = 0.0
        """Total seconds spent re-synchronising."""
        self._excluded = False          # (an elastic exclusion since the last step)
        _follow_exclusions(self, comm)
        self.measure_seconds = 0.0
        """Total seconds spent measuring."""

    def check_again(self) -> None:
        """Collective: the check its construction made (spares called in:
        the newcomers' controllers make it at their construction)."""
        named, extra = self._agreed
        check_tensors(self.comm, named, reducible=False, copied=True, extra=extra)

    @property
    def tensors(self) -> List[torch.Tensor]:
        """What it re-synchronises (a module's parameters and buffers)."""
        return self._tensors

    def rebind(self, comm: MPI.Intracomm, resync: bool = True) -> None:
        """Go on over `comm` (an elastic communicator's survivors, after an
        exclusion; `resync`: at the end of this step); its rank 0 is the
        root from now on."""
        self.comm = self._meter.comm = comm
        self.root_rank = 0
        self._excluded = self._excluded or resync

    def step(self) -> DriftStep:
        """Count a training step; measure and re-synchronise when due."""
        self.steps += 1
        began = time.perf_counter()
        drift = None
        if self.measure_every and self.steps % self.measure_every == 0:
            drift = self.measure()
        due = bool(self.broadcast_every and (self.steps % self.broadcast_every == 0
                                             or self._excluded))
        self._excluded = False
        if due:
            # (elastic: ranks excluded during it made rank 0 of the survivors the
            # root (rebind): again from the start, over them)
            again(self.synchronize, MembershipChanged)
            self._excluded = False
        return DriftStep(drift, due, time.perf_counter() - began)

    def measure(self) -> float:
        """Measure the drift now (collective); also stored in ``.drift``."""
        began = time.perf_counter()
        self.drift_per_rank = again(self._meter, MembershipChanged)   # (elastic: survivors)
        self.drift = max(self.drift_per_rank)
        self.history.append((self.steps, self.drift))
        took = time.perf_counter() - began
        self.measure_seconds += took
        if self.comm.rank == self.root_rank:
            log.info("step %d: drift %.3e (largest over %d ranks), measured in %.2f ms",
                     self.steps, self.drift, self.comm.size, took * 1e3)
        return self.drift

    def synchronize(self) -> float:
        """Re-synchronise now (collective); returns the seconds spent."""
        began = time.perf_counter()
        if self._synchronize is not None:
            self._synchronize()
        elif self.resync == "average":
            with torch.no_grad():
                average_tensors(self.comm, self._tensors, self.root_rank)
            if self.optimizer is not None:
                average_optimizer_state(self.optimizer, comm=self.comm)
        else:
            with torch.no_grad():
                bcast_tensors(self.comm, self._tensors, self.root_rank)
            if self.optimizer is not None:
                broadcast_optimizer_state(self.optimizer, self.root_rank, comm=self.comm)
        took = time.perf_counter() - began
        self.broadcasts += 1
        self.broadcast_seconds += took
        if self.comm.rank == self.root_rank:
            log.info("step %d: parameters re-synchronised in %.2f ms", self.steps, took * 1e3)
        return took


def _follow_exclusions(controller: DriftController, comm: CommLike) -> None:
    """An elastic Communicator: rebind `controller` after each exclusion
    (weakly: the communicator does not keep it alive).  The optimizer
    wrappers rebind their own as well; twice is the same."""
    if not (isinstance(comm, Communicator) and comm.elastic):
        return
    ref = weakref.ref(controller)
    lc = comm

    def react(excluded: Tuple[int, ...], members: Tuple[int, ...]) -> None:
        alive = ref()
        if alive is not None:
            alive.rebind(reliable_comm(lc))

    lc.on_exclusion(react)
