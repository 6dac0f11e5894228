"""The stages within a node on device memory: reduce-scatter and all-gather
between the ranks of one node that share a GPU (or see each other's GPUs),
through CUDA IPC handles, with no copy to the host (docs/gpu.md, "The
node's stages on device memory").

Each rank allocates one device buffer (cudaMalloc, so that its IPC handle
names the buffer itself) and opens its node peers' buffers once.  A call:

1. each rank copies its data into its own buffer, on its stream;
2. node barrier; rank r sums slice r of every rank's buffer into slice r
   of its own (in rank order, CuPy kernels on its stream);
3. node barrier (every slice reduced, and no peer still reads this rank's
   data); each rank copies every slice from its owner's buffer into the
   result;
4. node barrier: no rank overwrites its buffer while a peer still reads.

Bad or mismatched arrays on any rank raise on every rank of the node, from
one small allgather before the first barrier.

Every barrier follows a synchronisation of the rank's stream, which makes
its writes visible to the other processes.  The stages are exact and have
no deadline: a node peer that stops holds the others at the next barrier
(the host stages' deadline share has no counterpart here).  This is the
measured building block of the device hierarchy, not yet wired into
Communicator's hierarchical all-reduce.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..call.buffers import chunk_bounds

__all__ = ["DeviceNodeStages"]


class DeviceNodeStages:
    """Reduce-scatter, all-gather and all-reduce (sum) of CuPy arrays of up
    to `capacity` bytes between the ranks of `node` (collective: every rank
    of `node` constructs it with the same capacity).  Close with close()."""

    def __init__(self, node: MPI.Comm, capacity: int) -> None:
        import cupy
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if len(set(node.allgather(int(capacity)))) != 1:
            raise ValueError("DeviceNodeStages: the node's ranks passed different capacities")
        self.cupy, self.node, self.capacity = cupy, node, int(capacity)
        runtime = cupy.cuda.runtime
        self._device = cupy.cuda.Device().id
        self._own_ptr = runtime.malloc(self.capacity)
        handles = node.allgather(bytes(runtime.ipcGetMemHandle(self._own_ptr)))
        self._ptrs: List[int] = []
        self._opened: List[int] = []
        try:
            for rank, handle in enumerate(handles):
                if rank == node.rank:
                    self._ptrs.append(self._own_ptr)
                    continue
                ptr = runtime.ipcOpenMemHandle(handle)        # (peer access enabled lazily)
                self._opened.append(ptr)
                self._ptrs.append(ptr)
        except Exception:
            self._release()                     # (no barrier: a peer may have got further)
            raise

    # -- views -------------------------------------------------------------
    def _view(self, rank: int, count: int, dtype: np.dtype) -> Any:
        """Rank `rank`'s buffer as a CuPy array of `count` elements."""
        cupy = self.cupy
        if count == 0:
            return cupy.empty(0, dtype)
        mem = cupy.cuda.UnownedMemory(self._ptrs[rank], count * dtype.itemsize, self,
                                      self._device)
        return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(mem, 0))

    def _check(self, x: Any, out: Any = None) -> Tuple[int, np.dtype]:
        """(elements, dtype) of x (and of `out`, which must match), the same
        on every rank of the node, or the error of any rank raised on all of
        them (never a hang at a barrier)."""
        problem: Optional[Tuple[type, str]] = None
        shape = None
        if out is not None and (not isinstance(out, self.cupy.ndarray)
                                or getattr(x, "shape", None) != out.shape
                                or getattr(x, "dtype", None) != out.dtype):
            problem = (ValueError, "out must be a CuPy array of x's shape and dtype")
        elif not isinstance(x, self.cupy.ndarray):
            problem = (TypeError, f"DeviceNodeStages takes CuPy arrays, got {type(x).__name__}")
        elif not x.flags.c_contiguous:
            problem = (BufferError, "the array is not C-contiguous; pass a contiguous copy")
        elif x.nbytes > self.capacity:
            problem = (ValueError, f"{x.nbytes} bytes do not fit the stages' {self.capacity}")
        else:
            shape = (int(x.size), np.dtype(x.dtype).str)
        everyone = self.node.allgather((problem[0].__name__, problem[1]) if problem else shape)
        errors = {cls.__name__: cls for cls in (TypeError, BufferError, ValueError)}
        for rank, seen in enumerate(everyone):
            if seen[0] in errors:
                raise errors[seen[0]](f"node rank {rank}: {seen[1]}")
        if len(set(everyone)) != 1:
            raise ValueError(f"the node's ranks passed different arrays (elements, dtype): "
                             f"{everyone}")
        return x.size, np.dtype(x.dtype)

    def _sync_and_wait(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.node.Barrier()

    def slice_of(self, count: int, rank: int) -> Tuple[int, int]:
        return chunk_bounds(count, self.node.size, rank)

    # -- the stages ----------------------------------------------------------
    def reduce_scatter(self, x: Any) -> Any:
        """Stage 1: the sum over the node's ranks of this rank's slice of x,
        as a view of this rank's buffer (valid until the next call)."""
        count, dtype = self._check(x)
        return self._reduce_scatter(x, count, dtype)

    def _reduce_scatter(self, x: Any, count: int, dtype: np.dtype) -> Any:
        lo, hi = self.slice_of(count, self.node.rank)
        self._view(self.node.rank, count, dtype)[...] = x.ravel()
        self._sync_and_wait()
        views = [self._view(r, count, dtype)[lo:hi] for r in range(self.node.size)]
        acc = views[0].copy()
        for view in views[1:]:                  # (rank order, as every slice is summed)
            acc += view
        mine = views[self.node.rank]
        mine[...] = acc
        self._sync_and_wait()                   # every slice reduced, every read done
        return mine

    def all_gather(self, out: Any) -> Any:
        """Stage 2 (after reduce_scatter of an array shaped like `out`):
        every rank's reduced slice into `out`."""
        count, dtype = self._check(out)
        return self._all_gather(out, count, dtype)

    def _all_gather(self, out: Any, count: int, dtype: np.dtype) -> Any:
        flat = out.ravel()
        for r in range(self.node.size):
            lo, hi = self.slice_of(count, r)
            flat[lo:hi] = self._view(r, count, dtype)[lo:hi]
        self._sync_and_wait()                   # no buffer rewritten while read
        return out

    def allreduce(self, x: Any, out: Any) -> Any:
        """The sum over the node's ranks of x into out (x may be out)."""
        count, dtype = self._check(x, out)
        self._reduce_scatter(x, count, dtype)
        return self._all_gather(out, count, dtype)

    def close(self) -> None:
        """Collective: peers' buffers are closed everywhere before any rank
        frees its own."""
        if not self._own_ptr:
            return
        self._close_peers()
        self.node.Barrier()
        self._release()

    def _close_peers(self) -> None:
        for ptr in self._opened:
            self.cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        self._opened = []

    def _release(self) -> None:
        self._close_peers()
        if self._own_ptr:
            self.cupy.cuda.runtime.free(self._own_ptr)
            self._own_ptr = 0

    def __enter__(self) -> "DeviceNodeStages":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
