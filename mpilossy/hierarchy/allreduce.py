"""The hierarchical all-reduce: an exact reduce-scatter within each node,
the lossy all-reduce of each slice across nodes among the ranks of the same
local index, an exact all-gather within each node (docs/hierarchy.md).

Slices: with S the fewest ranks of any node, the vector is cut into S
slices and local rank j < S of every node owns slice j; on nodes that hold
more ranks the others only take part within the node.  Where every node
holds S ranks the slices are the node communicator's own chunks and the
user's buffers are used in place; otherwise each rank lays its vector out
as S slices of M = ceil(count / S) elements followed by zeros for the local
ranks that own none (one copy in, one copy out).

Scaling: a node's slice holds all its ranks (the reduce-scatter within the
node is itself unbiased if a rank there missed its deadline), so across
nodes a slice that arrives counts its node's ranks: with equal nodes the
flat scaling over nodes is that; with unequal nodes the slices travel as
weighted averages, weighing each node by its number of ranks.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from ..call.buffers import chunk_bounds
from ..call.stats import CollectiveStats
from ..errors import MismatchError, MPILossyError
from .layout import NodeLayout
from .record import assemble, capacity, owner_record

__all__ = ["Hierarchy", "INTRA_SHARE"]

# With a deadline T, the stage within the node before the network gets
# INTRA_SHARE * T, the network what is left less INTRA_SHARE * T (at least
# NETWORK_FLOOR * T), the stage after it the rest: shared memory takes
# microseconds to milliseconds, so the shares matter only when a rank of
# the node is stopped or slow.
INTRA_SHARE = 0.15
NETWORK_FLOOR = 0.25


class Hierarchy:
    """The sub-communicators of one Communicator's two-level collectives.

    intra: this node's ranks (channel "rma": shared-memory windows, no
    injected loss).  inter: the ranks of the same local index on every node
    (the parent's channel and settings); None on local ranks past the
    fewest ranks of any node."""

    def __init__(self, layout: NodeLayout, intra: Any, inter: Optional[Any],
                 total: int, block_bytes: int, max_block: int) -> None:
        self.layout = layout
        self.intra, self.inter = intra, inter
        self.total = total                         # ranks of the parent communicator
        self.block_bytes = block_bytes             # the parent's setting
        self.max_block = max_block                 # of stage 2's channel
        self.leaders = min(layout.sizes)           # S: slices, owners per node
        self.calls = 0
        self._scratch: Dict[Tuple[str, Any, int], np.ndarray] = {}

    @classmethod
    def build(cls, comm: MPI.Intracomm, layout: NodeLayout, node: MPI.Comm,
              make: Callable[..., Any], block_bytes: int) -> "Hierarchy":
        """Collective over `comm`.  `make(comm, within_node)` builds a
        Communicator with the parent's settings on `comm` (within_node: the
        settings of the stage in shared memory)."""
        leaders = min(layout.sizes)
        color = layout.local_rank if layout.local_rank < leaders else MPI.UNDEFINED
        cross = comm.Split(color, key=layout.node)
        intra = inter = None
        try:
            intra = make(node, True)
            if cross != MPI.COMM_NULL:
                inter = make(cross, False)
        except BaseException:
            if intra is not None:
                intra.free()
            raise
        finally:
            if cross != MPI.COMM_NULL:
                cross.Free()
        # local rank 0 owns a slice on every node; its channel is every owner's
        max_block = node.bcast(inter._alive().max_block if inter is not None else 0, root=0)
        return cls(layout, intra, inter, comm.Get_size(), block_bytes, max_block)

    def free(self) -> None:
        if self.inter is not None:
            self.inter.free()
        self.intra.free()
        self._scratch.clear()

    def takes(self, dtype: Any) -> bool:
        """Can this layout reduce `dtype`?  (Nodes of different sizes:
        floating point only.)"""
        if self.layout.uniform:
            return True
        try:
            return np.dtype(dtype).kind == "f"
        except TypeError:
            return False

    # -- the call ------------------------------------------------------------------
    def check(self, send: np.ndarray) -> None:
        """What this layout cannot reduce (before the call's first stage)."""
        if not self.takes(send.dtype):
            raise TypeError(f"algorithm='hierarchical' on nodes of different sizes "
                            f"{list(self.layout.sizes)} needs floating-point data (the "
                            f"slices travel as weighted averages), got {send.dtype}")

    def refuse(self, exc: BaseException, timeout: Any) -> NoReturn:
        """This rank's input was refused (`exc`): take part in every stage of
        the call only to fail it, so that every rank raises (the same
        exception type, naming this rank) instead of waiting for it.
        Raises."""
        self.calls += 1
        failure = _Failure.own(exc, self.layout.rank)
        stages = _Stages(self, failure, _Deadline(timeout))
        stages.intra(lambda d: None, REDUCE_SCATTER)
        stages.inter(lambda d: None)
        stages.intra(lambda d: None, ALLGATHER)
        stages.intra(lambda d: None, ALLGATHER)
        failure.throw(self.calls)

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: str, timeout: Any,
                  compression: Any, redundancy: Any, weight: Optional[float] = None,
                  residual: Optional[np.ndarray] = None) -> CollectiveStats:
        """One hierarchical all-reduce of the host arrays `send` into `recv`
        (checked by the caller and check(); the same array in place).
        timeout: the call's deadline in seconds, None, or "auto" (each
        stage's learned one).  weight: this rank's (op="avg"), or None.
        residual: float32 as long as `send` (zeroed by the caller), for
        error feedback of stage 2's compression.  A stage that fails on this
        rank is refused in the stages after it, and the call raises on
        every rank."""
        began = time.perf_counter()
        layout, lead, j = self.layout, self.leaders, self.layout.local_rank
        self.calls += 1
        count = send.size
        deadline = _Deadline(timeout)
        weighted = weight is not None or not layout.uniform
        w = send.dtype.type(1.0 if weight is None else weight)
        if not weighted:
            # the node communicator's own chunks are the slices; this rank's
            # is kept in scratch until the last stage, so that a call failing
            # before leaves recv as it was (in place: the user's data)
            slices = [chunk_bounds(count, lead, s) for s in range(lead)]
            wide_send, wide_recv, region = send, recv, 0
            mine = self._buffer("mine", send.dtype, slices[j][1] - slices[j][0])
            slice_len = mine.size
        else:
            # each local rank's region: its slice times this rank's weight,
            # zeros to the width, then the weight; stage 1 sums them, so the
            # node's weighted mean and weight travel together (ranks past S
            # hold zeros and weigh nothing)
            width = -(-count // lead)
            region = width + 1
            slices = self._slices(count, width)
            wide_send = self._buffer("send", send.dtype, layout.local_size * region)
            wide_recv = self._buffer("recv", send.dtype, layout.local_size * region)
            wide_send[lead * region:] = 0
            for s, (lo, hi) in enumerate(slices):
                at = s * region
                np.multiply(send[lo:hi], w, out=wide_send[at:at + hi - lo])
                wide_send[at + hi - lo:at + width] = 0
                wide_send[at + width] = w
            mine = wide_recv[j * region:(j + 1) * region]
            slice_len = slices[j][1] - slices[j][0] if j < lead else 0
        first = slices[j][0] if j < lead else count
        inter: Any = self.inter            # (None: stages.inter does not call)
        records = self._buffer("records", np.int64, layout.local_size * self._record_words(
            -(-count // lead), send.dtype.itemsize)).view(np.uint64)
        own_record = records[j * records.size // layout.local_size:
                             (j + 1) * records.size // layout.local_size]
        stages = _Stages(self, None, deadline)

        # 1. within the node: this rank's slice, reduced over the node
        s1 = stages.intra(lambda d: self.intra.reduce_scatter(
            wide_send, mine, op="sum" if weighted else op, timeout=d.stage(INTRA_SHARE)),
            REDUCE_SCATTER)
        # 2. across nodes, among the owners of the same slice (every owner
        # calls, also with an empty slice: a size that differs across nodes
        # is then a mismatch every owner sees, not a call some never make)
        node_weight = 0.0
        if weighted and s1 is not None and inter is not None:
            node_weight = float(mine[region - 1])
            mine[:slice_len] /= mine.dtype.type(node_weight)
        feedback = residual[first:first + slice_len] if residual is not None else None
        s2 = stages.inter(lambda d: inter.allreduce(
            mine[:slice_len], op="avg" if weighted else op, timeout=d.network(),
            weight=node_weight if weighted else None, compression=compression,
            redundancy=redundancy, residual=feedback, algorithm="direct"))
        if feedback is not None and s2 is not None:
            # what quantisation took from the node's slice, in this rank's
            # units: adding it to this rank's next input restores it
            feedback *= np.float32(node_weight / float(w) if weighted
                                   else layout.local_size if op == "avg" else 1)
        # 3. within the node: the owners' records of who contributed
        if s2 is not None:
            owner_record(layout, slice_len, s1.contributors, s2.contributors, own_record)
        else:
            own_record[:] = 0
        s3 = stages.intra(lambda d: self.intra.allgather(
            own_record.view(np.int64), records.view(np.int64), timeout=d.record()), ALLGATHER)
        # 4. within the node: every slice to every rank of the node
        if not weighted and stages.failure is None:
            recv[first:first + slice_len] = mine
            mine = recv[first:first + slice_len]
        s4 = stages.intra(lambda d: self.intra.allgather(
            mine, wide_recv, timeout=d.rest()), ALLGATHER)
        if stages.failure is not None:
            stages.failure.throw(self.calls)
        assert s1 is not None and s3 is not None and s4 is not None
        arrived = s4.contributors.received()
        if weighted:
            arrived = np.concatenate([arrived[s * region:s * region + hi - lo]
                                      for s, (lo, hi) in enumerate(slices)])
        missed = ~arrived
        fallback = int(missed.sum())
        own = send[missed] if fallback else None    # (before recv, which may be send, changes)
        if weighted:
            for s, (lo, hi) in enumerate(slices):
                recv[lo:hi] = wide_recv[s * region:s * region + hi - lo]
            if op == "sum":
                recv *= recv.dtype.type(self.total)
        if own is not None:
            recv[missed] = self._stand_in(own, op)

        per_owner = records.size // layout.local_size
        came = s3.contributors.received().reshape(layout.local_size, per_owner).all(axis=1)
        record, delivered, agreed = assemble(
            layout, slices, records.reshape(layout.local_size, per_owner), came,
            missed if fallback else None, own=self.intra.scaling != "zero-fill")
        held = record.members().sum(axis=1)
        stats = [s for s in (s1, s2, s3, s4) if s is not None]
        return CollectiveStats(
            delivered=delivered, elapsed=time.perf_counter() - began,
            deadline_hit=any(s.deadline_hit for s in stats),
            fallback=fallback / max(count, 1),
            min_contributors=int(held.min()) if held.size else self.total,
            algorithm="hierarchical", nbytes=send.nbytes, seq=self.calls,
            lost_blocks=tuple(sum(s.lost_blocks[k] for s in stats) for k in range(4)),
            collective="allreduce", timeout=deadline.seconds, agreed=agreed,
            contributors=record, rebuilt=s2.rebuilt if s2 else 0,
            redundancy=s2.redundancy if s2 else None)

    def _record_words(self, longest: int, itemsize: int) -> int:
        """Words of one owner's record (stage 3) for slices of at most
        `longest` elements: the same on every rank of the node."""
        return capacity(longest, self.layout.nodes, self.total, itemsize, self.block_bytes,
                        self.max_block)

    def _stand_in(self, own: np.ndarray, op: str) -> np.ndarray:
        """Where a slice did not come back within the node, this rank's own
        contribution stands in for it (count 1), as in the flat algorithms."""
        if self.intra.scaling == "zero-fill":
            return np.zeros_like(own)
        return own * own.dtype.type(self.total) if op == "sum" else own

    def _slices(self, count: int, width: int) -> List[Tuple[int, int]]:
        """(first, end) in the user's vector of every slice (unequal nodes)."""
        return [(min(count, s * width), min(count, (s + 1) * width))
                for s in range(self.leaders)]

    def _buffer(self, role: str, dtype: Any, n: int) -> np.ndarray:
        """Scratch kept between calls (one per role, of the last size asked)."""
        key = (role, np.dtype(dtype), n)
        buf = self._scratch.get(key)
        if buf is None:
            self._scratch = {k: v for k, v in self._scratch.items() if k[0] != role}
            buf = self._scratch[key] = np.empty(n, dtype)
        return buf


class _Failure:
    """The first failure of a hierarchical call, as every rank raises it:
    the exception type and "rank R: what", R a rank of the parent
    communicator."""

    # what a stage passes on as itself; anything else travels as MPILossyError
    _PASSED = (MismatchError, TypeError, ValueError, BufferError, MPILossyError)

    def __init__(self, cls: type, text: str, original: Optional[BaseException]) -> None:
        self.cls, self.text, self.original = cls, text, original

    @classmethod
    def own(cls, exc: BaseException, rank: int) -> "_Failure":
        """This rank's own error."""
        kind = next((c for c in cls._PASSED if isinstance(exc, c)), MPILossyError)
        what = (str(exc) if isinstance(exc, cls._PASSED)
                else f"could not take part: {type(exc).__name__}: {exc}")
        return cls(kind, f"rank {rank}: {what}", exc)

    @classmethod
    def of_stage(cls, exc: BaseException, where: str, ranks: List[int],
                 rank: int) -> "_Failure":
        """An error a stage raised: passed on by a peer (its text names the
        rank it began at), found by the stage itself (its text numbers the
        stage's ranks: `ranks` are theirs in the parent), or this rank's own."""
        detail = getattr(exc, "detail", None)
        if not isinstance(exc, Exception) or detail is None:
            return cls.own(exc, rank)
        kind = next((c for c in cls._PASSED if isinstance(exc, c)), MPILossyError)
        if not _PASSED_ON.match(detail):
            detail = (f"rank {ranks[getattr(exc, 'origin')]}: in the stage {where}, "
                      f"whose ranks 0-{len(ranks) - 1} are ranks {ranks}: {detail}")
        return cls(kind, detail, None)

    def proxy(self) -> BaseException:
        """What a stage after this failure is refused with."""
        return self.cls(self.text)

    def throw(self, seq: int) -> NoReturn:
        if self.original is not None and not isinstance(self.original, Exception):
            raise self.original                       # Ctrl-C and the like, as they came
        raise self.cls(f"allreduce call {seq}: {self.text}") from None


_PASSED_ON = re.compile(r"rank \d+: ")


class _Stages:
    """Runs one call's stages on this rank; after the first failure, each
    later stage is refused instead (Communicator._refuse_next), so that the
    ranks of that stage fail too and every sub-communicator counts the
    same calls on every rank."""

    def __init__(self, hierarchy: Hierarchy, failure: Optional[_Failure],
                 deadline: "_Deadline") -> None:
        self.h, self.failure, self.deadline = hierarchy, failure, deadline

    def intra(self, run: Callable[["_Deadline"], Any], collective: int) -> Any:
        layout = self.h.layout
        return self._stage(self.h.intra, collective, run, f"within node {layout.node}",
                           layout.ranks_of(layout.node))

    def inter(self, run: Callable[["_Deadline"], Any]) -> Any:
        if self.h.inter is None:
            return None
        layout, j = self.h.layout, self.h.layout.local_rank
        return self._stage(self.h.inter, ALLREDUCE, run, f"across nodes of local rank {j}",
                           [layout.ranks_of(n)[j] for n in range(layout.nodes)])

    def _stage(self, lc: Any, collective: int, run: Callable[["_Deadline"], Any],
               where: str, ranks: List[int]) -> Any:
        if self.failure is not None:
            lc._refuse_next(collective, self.failure.proxy(), self.deadline.total)
            return None
        try:
            return run(self.deadline)
        except BaseException as exc:
            self.failure = _Failure.of_stage(exc, where, ranks, self.h.layout.rank)
            return None


class _Deadline:
    """Splits one call's deadline over its three stages (see INTRA_SHARE);
    None and "auto" go to every stage as they are."""

    def __init__(self, total: Any) -> None:
        self.total = total
        self.seconds: Optional[float] = total if isinstance(total, float) else None
        self.began = time.perf_counter()

    def _left(self) -> float:
        assert self.seconds is not None
        return self.seconds - (time.perf_counter() - self.began)

    def stage(self, share: float) -> Any:
        return self.total if self.seconds is None else share * self.seconds

    def network(self) -> Any:
        if self.seconds is None:
            return self.total
        return max(self._left() - INTRA_SHARE * self.seconds, NETWORK_FLOOR * self.seconds)

    def record(self) -> Any:
        """Stage 3's: half of what is left (the data's stage gets the rest)."""
        if self.seconds is None:
            return self.total
        return max(0.5 * self._left(), 0.25 * INTRA_SHARE * self.seconds)

    def rest(self) -> Any:
        if self.seconds is None:
            return self.total
        return max(self._left(), 0.5 * INTRA_SHARE * self.seconds)
