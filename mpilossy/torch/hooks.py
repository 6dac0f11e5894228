"""DDP communication hook: each gradient bucket goes through the lossy
all-reduce instead of the process group's, zero-copy through DLPack."""

# (no `from __future__ import annotations`: DDP checks the hook's annotations
# against the real dist.GradBucket and torch.futures.Future[torch.Tensor])
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Hashable, List, Optional, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import CollectiveStats, Communicator
from .checks import check_tensors
from .communicators import lossy_communicator, reliable_comm
from .compression import Compression, compression_problem
from .drift import DriftController
from .optimizer import Engine, check_settings, follow_exclusions, welcomed
from .stats import StepStats
from .tensors import as_numpy, named_tensors

__all__ = ["AllreduceHookState", "allreduce_hook"]


class AllreduceHookState:
    """State of allreduce_hook: the Communicator, options and statistics.

    communicator:
        the mpilossy.Communicator (timeout, loss); default
        mpilossy.default_communicator().  The hook owns it during backward:
        use it for nothing else at the same time.
    op:
        "avg" (DDP's default: the gradient average) or "sum".
    background:
        run the all-reduces on one worker thread, so that they overlap with
        the rest of the backward pass (the core releases the GIL).  Off by
        default: on the 2-core development machine it did not pay off
        (docs/training.md).
    model:
        if given (a module), check collectively that every rank holds the
        same parameters, as check_parameters() does.
    compression:
        LowBit or TopK (mpilossy.torch.compression), with its own error
        feedback.  CUDA buckets are staged through pinned host memory
        (docs/gpu.md): by the communicator without compression, by the
        hook's own host copy of each bucket with it.  The residuals
        follow the parameters, not the bucket index: DDP rebuilds its
        buckets after the first iteration (other parameters under the same
        index), and each new bucket's residual is assembled from its
        parameters' old ones.

    optimizer, drift:
        what a newcomer receives on a Communicator that grows (spares=k,
        rendezvous=DIR): the optimizer whose state it needs, and the
        DriftController (given this Communicator) whose step count and
        checks it shares.  Required there: `model` and `optimizer`.

    On a Communicator built with elastic=True the hook goes on after an
    exclusion; DDP must then never touch its own process group again
    (no buffers to broadcast) and a DriftController given the same
    Communicator brings the survivors back on one model (docs/elastic.md).
    On one that grows, build DDP on ``local_group()`` (a group of the
    process alone, so that a newcomer's DDP waits for nobody), call
    ``grow()`` after each ``optimizer.step()`` (and the DriftController's
    step()), and let a spare called in (``stand_by()`` returned True) build
    its model, DDP, optimizer, DriftController and this state the same
    way: its construction receives rank 0's parameters, buffers, optimizer
    state and step counts.  Not with compression (refused).

    ``stats`` is the StepStats of the last complete backward pass,
    ``bucket_stats`` the CollectiveStats of each bucket's last call.
    Construction is collective (one small allgather).
    """

    def __init__(self, communicator: Optional[Communicator] = None, *, op: str = "avg",
                 background: bool = False, model: Optional[torch.nn.Module] = None,
                 compression: Optional[Compression] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 drift: Optional[DriftController] = None) -> None:
        self.communicator = lc = lossy_communicator(communicator)
        comm = reliable_comm(lc)
        problem = (check_settings(op)
                   or compression_problem(compression, False, lc)
                   or _growth_problem(lc, model, optimizer, drift, compression))
        if not isinstance(background, bool):
            problem = problem or TypeError("background must be a bool")
        named = [] if model is None else named_tensors(model.named_parameters())
        extra = (op, repr(compression), optimizer is not None, drift is not None)
        check_tensors(comm, named, reducible=True, problem=problem, extra=extra,
                      cuda=compression is None, copied=compression is not None)
        self.op = op
        self.compression = compression
        self.optimizer = optimizer
        self.bucket_stats: Dict[int, CollectiveStats] = {}
        # What a growth needs (the construction's check, the tensors and
        # counts rank 0 sends a newcomer), and the statistics' recorder.
        held = [] if model is None else [t for _, t in named_tensors(model)]
        self._engine = Engine(lc, held, op, drift)
        self._engine.agreed = (named, extra)
        self._recorder = self._engine.recorder
        follow_exclusions(self._engine)
        self._whole = _WholeStep(model) if lc.grows and model is not None else None
        if lc.newcomer and optimizer is not None and welcomed.get(lc, 0) < lc.arrivals:
            # a spare called in: the others' grow() made the same checks; now their state
            welcomed[lc] = lc.arrivals
            self._engine.share(optimizer)
        # Error feedback by parameter: where each parameter's residual lives
        # (the key of its bucket's residual in the compressor, its offset),
        # and the keys this state made (a compressor may serve others too).
        self._residual_of: Dict[int, Tuple[Hashable, int]] = {}
        self._bucket_keys: Set[Hashable] = set()
        self._worker = ThreadPoolExecutor(1, "mpilossy-hook") if background else None
        # compression on CUDA buckets: a pinned host copy of each bucket
        self._host: Dict[int, torch.Tensor] = {}

    @property
    def stats(self) -> Optional[StepStats]:
        return self._recorder.last

    @property
    def steps(self) -> int:
        return self._recorder.steps

    def grow(self) -> Tuple[int, ...]:
        """Collective, after each ``optimizer.step()`` (and the
        DriftController's step()) on a Communicator that grows:
        Communicator.grow(); if spares joined, the checks their
        construction makes, then rank 0's parameters, buffers, optimizer
        state and step counts to them.  Returns the members that joined
        (also in ``stats.joined``); () elsewhere."""
        lc = self.communicator
        if not lc.grows:
            return ()
        joined = lc.grow()
        if not joined:
            return ()
        engine = self._engine
        if self._recorder.last is not None:
            self._recorder.last = dataclasses.replace(self._recorder.last, joined=joined)
        # (in the order of a newcomer's constructions: its DriftController first)
        if engine.drift is not None:
            engine.drift.check_again()
        named, extra = engine.agreed
        check_tensors(engine.reliable, named, reducible=True, extra=extra, cuda=True)
        assert self.optimizer is not None       # (_growth_problem)
        engine.share(self.optimizer)
        return joined

    def close(self) -> None:
        """Stop the worker thread (if any)."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def _residual_key(self, layout: List[Tuple[int, int, int]], size: int) -> Hashable:
        """The compressor's key for a bucket of these parameters ((id,
        offset, count) each, in the bucket's flat buffer of `size`
        elements).  A composition not seen before gets a residual made of
        its parameters' residuals from their previous buckets (zeros for a
        parameter never reduced), and residuals that no parameter uses any
        more are dropped."""
        key = ("ddp-bucket",) + tuple(pid for pid, _, _ in layout)
        assert self.compression is not None
        residuals = self.compression.residuals
        if key in residuals:
            return key
        fresh = np.zeros(size, np.float32)
        for pid, offset, count in layout:
            previous = self._residual_of.get(pid)
            if previous is not None and previous[0] in residuals:
                old_key, old_offset = previous
                fresh[offset:offset + count] = residuals[old_key][old_offset:old_offset + count]
            self._residual_of[pid] = (key, offset)
        residuals[key] = fresh
        self._bucket_keys.add(key)
        used = {k for k, _ in self._residual_of.values()}
        for stale in self._bucket_keys - used:
            residuals.pop(stale, None)
        self._bucket_keys &= used
        return key

    def _on_host(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` if it is in host memory, else a copy in this bucket's
        pinned host buffer (made again when DDP rebuilds its buckets)."""
        if tensor.device.type == "cpu":
            return tensor
        host = self._host.get(index)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = self._host[index] = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                   pin_memory=tensor.device.type == "cuda")
        host.copy_(tensor)
        return host

    def _reduce(self, tensor: torch.Tensor, index: int, last: bool,
                future: torch.futures.Future[torch.Tensor],
                layout: Optional[List[Tuple[int, int, int]]] = None) -> None:
        try:
            if self.compression is not None:
                key: Hashable = index
                if layout is not None and tensor.dtype == torch.float32:
                    key = self._residual_key(layout, tensor.numel())
                host = self._on_host(index, tensor)
                stats = self.compression.allreduce(self.communicator, key, as_numpy(host),
                                                   op=self.op)
                if host is not tensor:
                    tensor.copy_(host)
            else:
                stats = self.communicator.allreduce(tensor, op=self.op)
        except BufferError as exc:
            # Every rank gets this (the core spreads errors): say it in torch terms.
            # (torch's annotation of set_exception takes the Future's value type,
            # not the exception that it documents and checks for: hence the ignores)
            future.set_exception(BufferError(  # type: ignore[arg-type]
                f"gradient bucket {index} (shape {tuple(tensor.shape)}, device "
                f"{tensor.device}, contiguous={tensor.is_contiguous()}) cannot be reduced: "
                f"{exc}"))
            return
        except BaseException as exc:
            future.set_exception(exc)  # type: ignore[arg-type]
            return
        self.bucket_stats[index] = stats
        self._recorder.add(stats)
        if last:
            self._recorder.finish()
        future.set_result(tensor)


def _growth_problem(lc: Communicator, model: Optional[torch.nn.Module],
                    optimizer: Optional[torch.optim.Optimizer],
                    drift: Optional[DriftController],
                    compression: Optional[Compression]) -> Optional[Exception]:
    """What the hook needs to take newcomers in, and the settings it refuses."""
    if drift is not None and not isinstance(drift, DriftController):
        return TypeError(f"drift must be a DriftController or None, not {type(drift).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        return TypeError(f"optimizer must be a torch.optim.Optimizer or None, "
                         f"not {type(optimizer).__name__}")
    if not lc.grows:
        return None
    if model is None or optimizer is None:
        return ValueError("on a Communicator that takes newcomers in (spares=k, rendezvous=DIR) "
                          "the DDP hook needs model= and optimizer=: what a newcomer receives")
    if compression is not None:
        return ValueError("the DDP hook's compression does not take newcomers in yet "
                          "(per-rank residuals; docs/elastic.md, 'Growing back')")
    if (isinstance(model, torch.nn.parallel.DistributedDataParallel)
            and model.process_group.size() != 1):
        return ValueError("DDP's own process group cannot take a newcomer in: build it with "
                          "process_group=mpilossy.torch.local_group()")
    return None


def allreduce_hook(state: AllreduceHookState,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: lossy all-reduce of the bucket, in place.

    ``ddp_model.register_comm_hook(state, mpilossy.torch.allreduce_hook)``.
    Returns a Future whose value is the bucket's tensor, holding the average
    (op="avg") of what arrived by the deadline."""
    tensor = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if state._whole is not None:
        state._whole.add(tensor, bucket.index(), future, _layout(bucket, tensor))
        if bucket.is_last():
            if state._worker is None:
                state._whole.reduce(state)
            else:
                state._worker.submit(state._whole.reduce, state)
        return future
    layout = None
    if state.compression is not None and state.compression.error_feedback:
        # Where each parameter's gradient sits in the bucket: its residual
        # follows it when DDP rebuilds the buckets.
        layout = [(id(p), at, n) for p, at, n in _layout(bucket, tensor)]
    args = (tensor, bucket.index(), bucket.is_last(), future, layout)
    if state._worker is None:
        state._reduce(*args)
    else:
        state._worker.submit(state._reduce, *args)
    return future


def _layout(bucket: dist.GradBucket,
            tensor: torch.Tensor) -> List[Tuple[torch.Tensor, int, int]]:
    """(parameter, offset, count) of each gradient in the bucket's buffer."""
    base, itemsize = tensor.data_ptr(), tensor.element_size()
    layout = [(p, (g.data_ptr() - base) // itemsize, g.numel())
              for p, g in zip(bucket.parameters(), bucket.gradients())]
    if any(not 0 <= at <= tensor.numel() - n for _, at, n in layout):
        # (not views of the bucket: DDP packs them in order, back to back)
        offsets = np.cumsum([0] + [n for _, _, n in layout[:-1]])
        layout = [(p, int(at), n) for (p, _, n), at in zip(layout, offsets)]
    return layout


class _WholeStep:
    """On a Communicator that grows: a step's buckets reduced together at
    the last one, in the model's parameter order.  DDP orders a bucket's
    gradients by when they became ready in its first step (it rebuilds its
    buckets then), so a newcomer's first step would pair other elements
    with the ranks in than theirs; the model's order is the same on every
    rank whatever the buckets."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.position = {id(p): i for i, p in enumerate(model.parameters())}
        # (bucket tensor, its index, its future, its layout) until the last bucket
        self.pending: List[Tuple[torch.Tensor, int, torch.futures.Future[torch.Tensor],
                                 List[Tuple[torch.Tensor, int, int]]]] = []

    def add(self, tensor: torch.Tensor, index: int, future: torch.futures.Future[torch.Tensor],
            layout: List[Tuple[torch.Tensor, int, int]]) -> None:
        self.pending.append((tensor, index, future, layout))

    def reduce(self, state: AllreduceHookState) -> None:
        pending, self.pending = self.pending, []
        try:        # (any failure ends in the futures: a worker thread would swallow it)
            pieces = sorted(((self.position[id(p)], tensor.view(-1)[at:at + n])
                             for tensor, _, _, layout in pending for p, at, n in layout),
                            key=lambda piece: piece[0])
            for dtype in sorted({str(view.dtype) for _, view in pieces}):
                views = [view for _, view in pieces if str(view.dtype) == dtype]
                flat = torch.cat(views)
                stats = state.communicator.allreduce(flat, op=state.op)
                for view, part in zip(views, torch.split(flat, [v.numel() for v in views])):
                    view.copy_(part)
                state._recorder.add(stats)
                for _, index, _, _ in pending:
                    state.bucket_stats[index] = stats
        except BaseException as exc:
            for _, _, future, _ in pending:
                future.set_exception(exc)  # type: ignore[arg-type]
            return
        state._recorder.finish()
        for tensor, _, future, _ in pending:
            future.set_result(tensor)
