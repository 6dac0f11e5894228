"""Horovod-style optimizer wrapper: gradients go through the lossy all-reduce
before every step, with no torch.distributed process group."""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type, TypeVar, cast

import numpy as np
import torch
from mpi4py import MPI

from .. import Communicator
from ..call.config import UNSET
from ..errors import MembershipChanged
from ..reliable import again
from .broadcast import bcast_tensors, broadcast_optimizer_state
from .checks import check_tensors
from .communicators import lossy_communicator, reliable_comm
from .compression import Compression, compression_problem
from .compute import ComputeDeadline, deadline_problem, fill_in, weigh
from .drift import DriftController, every_problem, resync_problem
from .feedback import ErrorFeedback, feedback_problem
from .stats import Recorder, StepStats
from .tensors import Flat, optimizer_parameters
from .tolerance import PhaseAwareTolerance

__all__ = ["DistributedOptimizer", "WrappedOptimizer"]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024    # the Communicator's default capacity

if TYPE_CHECKING:
    # A wrapped optimizer is an instance of a subclass of (wrapper class,
    # the optimizer's own class), made by wrap(): to a type checker the
    # wrapper classes are optimizers.  At run time they derive from object.
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object


class WrappedOptimizer(_OptimizerBase):
    """Base of every wrapper class: what DistributedOptimizer and
    ShardedOptimizer add to the wrapped optimizer's own class.  What they
    return is a torch.optim.Optimizer (an instance of the optimizer's own
    class) and a WrappedOptimizer."""

    _mpilossy: Engine

    @property
    def stats(self) -> Optional[StepStats]:
        """Statistics of the last step (None before the first)."""
        return self._mpilossy.recorder.last

    @property
    def steps(self) -> int:
        """Steps taken so far (a spare called in: the survivors' count when
        it joined, from which it goes on)."""
        return self._mpilossy.recorder.steps

    @property
    def drift_control(self) -> Optional[DriftController]:
        """The DriftController (if broadcast_every or measure_every was given)."""
        return self._mpilossy.drift

    @property
    def communicator(self) -> Communicator:
        return self._mpilossy.lc

    @property
    def error_feedback(self) -> Optional[ErrorFeedback]:
        """The residual keeper (if error_feedback=True), else None."""
        return self._mpilossy.feedback


_classes: Dict[Tuple[type, type], type] = {}
# newcomers (Communicator.newcomer): the arrival whose first wrapper (DistributedOptimizer,
# ShardedOptimizer) took the survivors' state (a rank that comes back after an exclusion arrives again)
welcomed: "weakref.WeakKeyDictionary[Communicator, int]" = weakref.WeakKeyDictionary()
_W = TypeVar("_W", bound=WrappedOptimizer)


def wrap(optimizer: torch.optim.Optimizer, mixin: Type[_W], engine: Engine) -> _W:
    """An object of a subclass of (mixin, type(optimizer)) that shares the
    optimizer's __dict__: it *is* the same optimizer (param_groups, state,
    hooks, state_dict) and stays an instance of its class (LR schedulers),
    with the mixin's step()."""
    cls = type(optimizer)
    sub = _classes.get((mixin, cls))
    if sub is None:
        sub = type(cls.__name__, (mixin, cls), {"__module__": mixin.__module__})
        _classes[(mixin, cls)] = sub
    wrapped = cast(_W, object.__new__(sub))
    wrapped.__dict__ = optimizer.__dict__
    # An LR scheduler made before wrapping put the original's step() into
    # the instance dict, which would hide ours (the scheduler warns once).
    optimizer.__dict__.pop("step", None)
    optimizer.__dict__["_mpilossy"] = engine
    return wrapped


def follow_exclusions(engine: Engine) -> None:
    """Communicator(elastic=True): rebind `engine` after each exclusion and
    growth (weakly: the communicator does not keep the optimizer alive)."""
    if not engine.lc.elastic:
        return
    ref = weakref.ref(engine)

    def react(excluded: Tuple[int, ...], members: Tuple[int, ...]) -> None:
        alive = ref()
        if alive is not None:
            alive.rebind()

    def grown(joined: Tuple[int, ...], members: Tuple[int, ...]) -> None:
        alive = ref()
        if alive is not None:       # (no re-synchronisation: Engine.grow sends the state)
            alive.rebind(resync=False)

    engine.lc.on_exclusion(react)
    engine.lc.on_growth(grown)


def already_wrapped(optimizer: Any) -> Optional[Exception]:
    if isinstance(optimizer, WrappedOptimizer) or "_mpilossy" in getattr(optimizer, "__dict__", {}):
        return ValueError("this optimizer is already wrapped by mpilossy.torch")
    return None


def check_settings(op: Any, bucket_bytes: Any = DEFAULT_BUCKET_BYTES) -> Optional[Exception]:
    if op not in ("avg", "sum"):
        return ValueError(f"op must be 'avg' or 'sum', got {op!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 64:
        return ValueError(f"bucket_bytes must be an int >= 64, got {bucket_bytes!r}")
    return None


def params_changed(engine: Engine, optimizer: torch.optim.Optimizer) -> None:
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    if ids != engine.ids:
        raise RuntimeError("the optimizer's parameters changed after it was wrapped "
                           "(add_param_group?): wrap it after adding every group")


class Engine:
    """What a wrapper keeps: communicator, parameters, statistics, drift control."""

    def __init__(self, lc: Communicator, params: List[torch.Tensor], op: str,
                 drift: Optional[DriftController]) -> None:
        self.lc, self.params, self.op, self.drift = lc, params, op, drift
        self.reliable = reliable_comm(lc)     # (what the wrappers' reliable calls use)
        self.ids: List[int] = [id(p) for p in params]      # the optimizer's parameters
        self.recorder = Recorder()
        self.feedback: Optional[ErrorFeedback] = None
        self.agreed: Tuple[Any, Any] = ([], None)   # (named, extra): the construction's check

    def rebind(self, resync: bool = True) -> None:
        """After an elastic exclusion (Communicator.on_exclusion) or growth
        (on_growth): the reliable collectives go over the new communicator;
        `resync`: drift control re-synchronises at the end of this step."""
        comm = reliable_comm(self.lc)
        if self.drift is not None:
            self.drift.rebind(comm, resync)
        if self.feedback is not None:
            self.feedback.rebind(comm)
        deadline = getattr(self, "compute_deadline", None)
        if deadline is not None and deadline.comm is self.reliable:
            deadline.comm = comm
        self.reliable = comm

    def grow(self, optimizer: torch.optim.Optimizer) -> None:
        """spares=k, at the end of a step: Communicator.grow(); if spares
        joined, the collectives a newcomer's construction makes (its
        checks, made again here), then the state it needs (share())."""
        if not self.lc.grows:
            return
        joined = self.lc.grow()
        if not joined:
            return
        assert self.recorder.last is not None
        self.recorder.last = dataclasses.replace(self.recorder.last, joined=joined)
        named, extra = self.agreed
        check_tensors(self.reliable, named, reducible=True, copied=True, extra=extra)
        if self.drift is not None:
            self.drift.check_again()
        self.share(optimizer)

    def share(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective over the ranks in and the newcomers: rank 0's step
        counts, parameters (with drift control, what it re-synchronises:
        a module's buffers too) and optimizer state.  A rank lost during
        it: made again from the start over the survivors (whose rank 0 is
        still one that was in: the grown communicator lists them first)."""
        def once() -> None:
            self.share_counts()
            with torch.no_grad():
                bcast_tensors(self.reliable, self.drift.tensors if self.drift else self.params, 0)
            broadcast_optimizer_state(optimizer, 0, comm=self.reliable)
        again(once, MembershipChanged)

    def share_counts(self) -> None:
        """Rank 0's step counts, the wrapper's and drift control's (whose
        schedule of measurements and re-synchronisations must match)."""
        counts = np.array([self.recorder.steps, self.drift.steps if self.drift else 0],
                          dtype=np.int64)
        self.reliable.Bcast(counts, 0)
        self.recorder.steps = int(counts[0])
        if self.drift is not None:
            self.drift.steps = int(counts[1])

    def finish(self) -> StepStats:
        """Close the step: drift control when due, then the statistics."""
        report = self.drift.step() if self.drift is not None else None
        if report is None:
            return self.recorder.finish()
        return self.recorder.finish(sync_seconds=report.seconds, drift=report.drift,
                                    broadcast=report.broadcast)


class _GradientAllreduce(Engine):
    """The engine behind DistributedOptimizer."""

    def __init__(self, lc: Communicator, params: List[torch.Tensor], op: str,
                 bucket_bytes: int, drift: Optional[DriftController],
                 tolerance: Optional[PhaseAwareTolerance], error_feedback: bool,
                 compute_deadline: Optional[ComputeDeadline] = None,
                 compression: Optional[Compression] = None) -> None:
        super().__init__(lc, params, op, drift)
        self.compute_deadline = compute_deadline
        self.compression = compression
        self.flat = Flat(params)
        self.pieces = self.flat.pieces(bucket_bytes)
        self.synchronized = False
        self.tolerance = tolerance
        self.feedback = ErrorFeedback(lc, self.flat) if error_feedback else None

    def reduce(self) -> None:
        """All-reduce every gradient (lossy, fused into few calls)."""
        grads = [p.grad for p in self.params]
        if any(g is not None and g.layout != torch.strided for g in grads):
            raise TypeError("sparse gradients are not supported; use dense ones "
                            "(e.g. nn.Embedding(sparse=False))")
        self.flat.pack(grads)
        policy = self.tolerance
        limit = policy.begin() if policy is not None else 1.0
        if limit <= 0.0:
            assert policy is not None       # (without a policy the limit is 1)
            self.reduce_reliably()
            policy.reliable += 1
            if policy.critical_ended is None:       # the signal still votes
                policy.agree(self.lc.comm, 0.0)
        else:
            feedback = self.feedback
            if feedback is not None:
                feedback.add_to(self.flat)
                calls = [(dtype, first, self.lc.allreduce(piece, op=self.op, algorithm="direct"))
                         for dtype, first, piece in self.pieces]
                feedback.record(calls)
                for _, _, stats in calls:
                    self.recorder.add(stats)
            else:
                weight = weigh(self.compute_deadline, self.flat.arrays.values())
                target = policy.redundancy_target_now() if policy is not None else None
                # (raised for this step: the same on every rank, from the agreed loss rate)
                code = UNSET if target is None else self.lc.auto_redundancy(target)
                for key, (_, _, piece) in enumerate(self.pieces):
                    if self.compression is not None:
                        stats = self.compression.allreduce(self.lc, key, piece, op=self.op,
                                                           weight=weight)
                    else:
                        stats = self.lc.allreduce(piece, op=self.op, weight=weight,
                                                  redundancy=code)
                    self.recorder.add(stats)
            if policy is not None and policy.needs_agreement:
                lost = 1.0 - self.recorder.pending_delivered()
                if policy.agree(self.lc.comm, lost) > limit:
                    # Too much lost for this phase: wait for the rest (re-send).
                    self.flat.pack(grads)
                    self.reduce_reliably()
                    policy.repaired += 1
        with torch.no_grad():
            for i, p in enumerate(self.params):
                reduced = self.flat.view(i, p)
                if p.grad is None:      # no gradient here: it counted as zeros
                    p.grad = reduced.to(p.device, copy=True)
                else:
                    p.grad.copy_(reduced)
        if policy is not None and policy.grad_norm_threshold is not None:
            policy.observe(math.sqrt(sum(
                float(torch.linalg.vector_norm(b, dtype=torch.float64)) ** 2
                for b in self.flat.buffers.values())))
        self.synchronized = True

    def reduce_reliably(self) -> None:
        """Exact reduction of the packed gradients (MPI_Allreduce)."""
        comm = self.lc.comm
        for arr in self.flat.arrays.values():
            # MPI has no 16-bit float types: float16 and bfloat16 go through float32.
            wide = arr.astype(np.float32) if arr.itemsize == 2 else arr
            comm.Allreduce(MPI.IN_PLACE, wide, op=MPI.SUM)
            if self.op == "avg":
                wide /= comm.size
            if wide is not arr:
                arr[...] = wide
        self.recorder.reliable = True


class _DistributedOptimizer(WrappedOptimizer):

    _mpilossy: _GradientAllreduce

    def synchronize(self) -> None:
        """All-reduce the gradients now (to clip them, say); the next
        step() uses them without reducing again."""
        params_changed(self._mpilossy, self)
        self._mpilossy.reduce()

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """All-reduce the gradients (unless synchronize() did), then step.
        A closure is evaluated once, before the reduction."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._mpilossy
        if not engine.synchronized:
            self.synchronize()
        engine.synchronized = False
        super().step(**kwargs)
        engine.finish()
        engine.grow(self)
        return loss


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         communicator: Optional[Communicator] = None, *, op: str = "avg",
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         broadcast_every: Optional[int] = None,
                         measure_every: Optional[int] = None,
                         broadcast_state: bool = False,
                         root_rank: int = 0,
                         tolerance: Optional[PhaseAwareTolerance] = None,
                         resync: str = "broadcast",
                         error_feedback: bool = False,
                         compute_deadline: Optional[ComputeDeadline] = None,
                         compression: Optional[Compression] = None
                         ) -> _DistributedOptimizer:
    """Wrap `optimizer` so that step() first all-reduces the gradients through
    mpilossy's lossy all-reduce (unbiased average, deadline-bound).

    The result is the same optimizer (it shares param_groups, state,
    state_dict, zero_grad) and stays an instance of its class (to a type
    checker: a torch.optim.Optimizer and a WrappedOptimizer).  Gradients
    are copied into one flat buffer per dtype and reduced in pieces of at most
    `bucket_bytes`.  A parameter without a gradient on a rank counts as zeros
    there, and has a gradient after the step on every rank.

    communicator:
        the mpilossy.Communicator (timeout, loss); default
        mpilossy.default_communicator() (settings from the environment).
    broadcast_every, measure_every, resync:
        drift control (DriftController): every K steps re-synchronise the
        parameters (and the optimizer state if `broadcast_state`): with
        resync="broadcast" to `root_rank`'s copy, with resync="average" to
        the average over ranks; every M steps measure the drift
        (``stats.drift``).
    error_feedback:
        re-send next step what this step's gradients lost (docs/training.md).
        Needs a Communicator with scaling="zero-fill" (the plain average;
        checked) and reduces with the direct algorithm, whose contributor
        record says what was lost.  Not with `tolerance`.
    tolerance:
        phase-aware loss tolerance (PhaseAwareTolerance): how much loss each
        step may accept; a step that loses more re-sends its gradients
        reliably.  Default None: accept whatever arrives by the deadline.
    compute_deadline:
        a ComputeDeadline (DropCompute) whose micro-batches fill the
        gradients: step() divides them by the rank's micro-batch count and
        reduces with that count as the weight (op="avg", scaling="unbiased";
        not with `tolerance` or `error_feedback`).
    compression:
        LowBit("int8" | "int4") or TopK(density) (mpilossy.torch.compression):
        fewer bytes per step, with the compressor's own error feedback.  Not
        with `tolerance` or `error_feedback`.

    Collective: checks on every rank that all ranks hold the same parameters
    (names, shapes, dtypes, CPU); a problem raises on every rank.  Extra
    attributes: ``stats`` (StepStats of the last step), ``steps``,
    ``drift_control``, ``communicator``, ``synchronize()``.

    On a Communicator with spares (elastic=True, spares=k), step() ends
    with Communicator.grow(): spares called in there (``stats.joined``)
    receive rank 0's step count, parameters (with drift control, what it
    re-synchronises) and optimizer state.  A spare builds its model and
    optimizer the same way after stand_by() returned True and wraps them:
    the wrapper takes that state over and ``steps`` says where to go on.
    Not yet with tolerance, error_feedback, compute_deadline or
    compression (refused).
    """
    lc = lossy_communicator(communicator)
    comm = reliable_comm(lc)
    problem = (already_wrapped(optimizer) or check_settings(op, bucket_bytes)
               or every_problem(broadcast_every=broadcast_every, measure_every=measure_every)
               or resync_problem(resync) or feedback_problem(lc, error_feedback)
               or deadline_problem(lc, op, compute_deadline, error_feedback)
               or compression_problem(compression, error_feedback, lc))
    if problem is None and tolerance is not None and compression is not None:
        problem = ValueError("compression and tolerance do not combine (a step re-sent "
                             "reliably would not be compressed)")
    if problem is None and tolerance is not None and compute_deadline is not None:
        problem = ValueError("compute_deadline and tolerance do not combine (a step re-sent "
                             "reliably would not be weighted)")
    if problem is None and tolerance is not None and not isinstance(tolerance, PhaseAwareTolerance):
        problem = TypeError(f"tolerance must be a PhaseAwareTolerance or None, "
                            f"not {type(tolerance).__name__}")
    if (problem is None and isinstance(tolerance, PhaseAwareTolerance)
            and tolerance.redundancy_target is not None and lc.config.redundancy != "auto"):
        problem = ValueError("tolerance's redundancy_target needs a communicator built with "
                             "redundancy='auto'")
    if problem is None and lc.grows and (tolerance is not None or error_feedback or
                                         compute_deadline is not None or compression):
        problem = ValueError("with spares or a rendezvous (Communicator(spares=k), "
                             "rendezvous=DIR), tolerance, error_feedback, "
                             "compute_deadline and compression do not take newcomers in yet "
                             "(docs/elastic.md, 'Growing back')")
    if problem is None and tolerance is not None and error_feedback:
        problem = ValueError("error_feedback and tolerance do not combine (a step re-sent "
                             "reliably would re-send without the residual)")
    try:
        named = optimizer_parameters(optimizer, named_parameters)
    except (TypeError, ValueError) as exc:
        problem, named = problem or exc, []
    extra = (op, bucket_bytes, broadcast_every, measure_every, broadcast_state,
             root_rank, repr(tolerance), resync, error_feedback,
             compute_deadline is not None, repr(compression))
    check_tensors(comm, named, reducible=True, problem=problem, copied=True, extra=extra)
    if compute_deadline is not None:
        fill_in(compute_deadline, comm, [p for _, p in named])
    drift = None
    if broadcast_every is not None or measure_every is not None:
        drift = DriftController(named, comm=comm, broadcast_every=broadcast_every,
                                measure_every=measure_every, root_rank=root_rank,
                                optimizer=optimizer if broadcast_state else None, resync=resync)
    engine = _GradientAllreduce(lc, [p for _, p in named], op, bucket_bytes, drift, tolerance,
                                error_feedback, compute_deadline, compression)
    engine.agreed = (named, extra)
    follow_exclusions(engine)
    if lc.newcomer and welcomed.get(lc, 0) < lc.arrivals:
        # a spare called in: the survivors' step() made the same checks
        # (Engine.welcome); now their state
        welcomed[lc] = lc.arrivals
        engine.share(optimizer)
    return wrap(optimizer, _DistributedOptimizer, engine)
