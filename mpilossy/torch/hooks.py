"""DDP communication hook: each gradient bucket goes through the lossy
all-reduce instead of the process group's, zero-copy through DLPack."""

# (no `from __future__ import annotations`: DDP checks the hook's annotations
# against the real dist.GradBucket and torch.futures.Future[torch.Tensor])
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Hashable, List, Optional, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import CollectiveStats, Communicator
from .checks import check_tensors
from .communicators import lossy_communicator, reliable_comm, spares_problem
from .compression import Compression, compression_problem
from .optimizer import check_settings
from .stats import Recorder, StepStats
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

    On a Communicator built with elastic=True the hook goes on after an
    exclusion; DDP must then never touch its own process group again
    (no buffers to broadcast) and a DriftController given the same
    Communicator brings the survivors back on one model (docs/elastic.md).

    ``stats`` is the StepStats of the last complete backward pass,
    ``bucket_stats`` the CollectiveStats of each bucket's last call.
    Construction is collective (one small allgather).
    """

    def __init__(self, communicator: Optional[Communicator] = None, *, op: str = "avg",
                 background: bool = False, model: Optional[torch.nn.Module] = None,
                 compression: Optional[Compression] = None) -> None:
        self.communicator = lossy_communicator(communicator)
        comm = reliable_comm(self.communicator)
        problem = (check_settings(op)
                   or compression_problem(compression, False, self.communicator)
                   or spares_problem(self.communicator, "The DDP hook"))
        if not isinstance(background, bool):
            problem = problem or TypeError("background must be a bool")
        named = [] if model is None else named_tensors(model.named_parameters())
        check_tensors(comm, named, reducible=True, problem=problem,
                      extra=(op, repr(compression)), cuda=compression is None,
                      copied=compression is not None)
        self.op = op
        self.compression = compression
        self.bucket_stats: Dict[int, CollectiveStats] = {}
        self._recorder = Recorder()
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


def allreduce_hook(state: AllreduceHookState,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: lossy all-reduce of the bucket, in place.

    ``ddp_model.register_comm_hook(state, mpilossy.torch.allreduce_hook)``.
    Returns a Future whose value is the bucket's tensor, holding the average
    (op="avg") of what arrived by the deadline."""
    tensor = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    layout = None
    if state.compression is not None and state.compression.error_feedback:
        # Where each parameter's gradient sits in the bucket: its residual
        # follows it when DDP rebuilds the buckets.
        base, itemsize = tensor.data_ptr(), tensor.element_size()
        layout = [(id(p), (g.data_ptr() - base) // itemsize, g.numel())
                  for p, g in zip(bucket.parameters(), bucket.gradients())]
        if any(not 0 <= at <= tensor.numel() - n for _, at, n in layout):
            # (not views of the bucket: DDP packs them in order, back to back)
            offsets = np.cumsum([0] + [n for _, _, n in layout[:-1]])
            layout = [(pid, int(at), n) for (pid, _, n), at in zip(layout, offsets)]
    args = (tensor, bucket.index(), bucket.is_last(), future, layout)
    if state._worker is None:
        state._reduce(*args)
    else:
        state._worker.submit(state._reduce, *args)
    return future
