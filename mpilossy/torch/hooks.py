"""DDP communication hook: each gradient bucket goes through the lossy
all-reduce instead of the process group's, zero-copy through DLPack."""

# (no `from __future__ import annotations`: DDP checks the hook's annotations
# against the real dist.GradBucket and torch.futures.Future[torch.Tensor])
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Dict, Hashable, List, Optional, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import CollectiveStats, Communicator
from ._common import as_numpy, check_tensors, lossy_communicator, named_tensors, reliable_comm
from .compression import Compression, compression_problem
from .optimizer import check_settings
from .stats import Recorder, StepStats

__all__ = ["AllreduceHookState", "allreduce_hook", "init_process_group",
           "destroy_process_group"]


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
        feedback; CPU gradients (without compression, CUDA gradients are
        staged through pinned host memory: docs/gpu.md).  The residuals
        follow the parameters, not the bucket index: DDP rebuilds its
        buckets after the first iteration (other parameters under the same
        index), and each new bucket's residual is assembled from its
        parameters' old ones.

    ``stats`` is the StepStats of the last complete backward pass,
    ``bucket_stats`` the CollectiveStats of each bucket's last call.
    Construction is collective (one small allgather).
    """

    def __init__(self, communicator: Optional[Communicator] = None, *, op: str = "avg",
                 background: bool = False, model: Optional[torch.nn.Module] = None,
                 compression: Optional[Compression] = None) -> None:
        self.communicator = lossy_communicator(communicator)
        comm = reliable_comm(self.communicator)
        problem = check_settings(op) or compression_problem(compression, False)
        if not isinstance(background, bool):
            problem = problem or TypeError("background must be a bool")
        named = [] if model is None else named_tensors(model.named_parameters())
        check_tensors(comm, named, reducible=True, problem=problem,
                      extra=(op, repr(compression)), cuda=compression is None)
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

    def _reduce(self, tensor: torch.Tensor, index: int, last: bool,
                future: torch.futures.Future[torch.Tensor],
                layout: Optional[List[Tuple[int, int, int]]] = None) -> None:
        try:
            if self.compression is not None:
                if tensor.device.type != "cpu":
                    raise BufferError("compression needs CPU gradients")
                key: Hashable = index
                if layout is not None and tensor.dtype == torch.float32:
                    key = self._residual_key(layout, tensor.numel())
                stats = self.compression.allreduce(self.communicator, key, as_numpy(tensor),
                                                   op=self.op)
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


def init_process_group(backend: str = "gloo", *, comm: Optional[MPI.Intracomm] = None,
                       timeout: Optional[timedelta] = None) -> None:
    """Start torch.distributed under mpiexec: rank and world size from MPI,
    MASTER_ADDR/MASTER_PORT from rank 0's environment if it sets them, else
    127.0.0.1 (when all ranks share rank 0's host; rank 0's host name
    otherwise) and a port rank 0's store was given by the kernel.
    Collective; does nothing if a process group already exists."""
    reliable = reliable_comm(comm)
    if dist.is_initialized():
        return
    host = MPI.Get_processor_name()
    hosts = reliable.allgather(host)
    wait = timeout if timeout is not None else timedelta(minutes=5)
    store = None
    choice = None
    if reliable.rank == 0:
        same_host = all(h == host for h in hosts)
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if same_host
                                                 else socket.gethostname())
        # Rank 0's store listens first, on MASTER_PORT or on a port the
        # kernel picks (choosing a free port and binding it later lost the
        # port to another process now and then, and the peers then waited).
        store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT") or 0), reliable.size,
                              is_master=True, timeout=wait, wait_for_workers=False)
        choice = (addr, str(store.port))
    addr, port = reliable.bcast(choice, 0)
    if store is None:
        store = dist.TCPStore(addr, int(port), reliable.size, is_master=False, timeout=wait)
    for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        if os.environ.get(name) != value:       # (a value the user set stays theirs)
            os.environ[name] = _exported[name] = value
    # (only when given: torch's own default otherwise)
    kwargs: Dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, store=store, rank=reliable.rank,
                            world_size=reliable.size, **kwargs)


# What init_process_group wrote into os.environ: taken back on destroy, so
# that a later init does not read its predecessor's port as the user's
# MASTER_PORT (that port may still be held: EADDRINUSE).
_exported: Dict[str, str] = {}


def destroy_process_group() -> None:
    """Barrier, then destroy the process group (without the barrier, about
    one run in three aborted at exit on the development machine)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    for name, value in _exported.items():
        if os.environ.get(name) == value:
            del os.environ[name]
    _exported.clear()
