"""The lossy communicator: lifetime and the three collectives, over the call
path (call/: config, spec, buffers, statistics) and the control loops
(control/: learned deadline, lag watch)."""

from __future__ import annotations

import atexit
import itertools
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
from mpi4py import MPI

from ._core import ALLGATHER, ALLREDUCE, PART_WHOLE, REDUCE_SCATTER, Core
from .call.alone import answer_alone
from .call.buffers import BufferIntake, chunk_bounds
from .call.channel import open_core, pace
from .call import environment, pipeline
from .call.config import DEFAULTS, UNSET, Config, check_fraction, check_timeout, agree
from .call.failure import call_error, failure_bound, refuse
from .call.spec import CallResolver, asks_for_auto, check_residual
from .call.stats import ALGORITHM_NAMES, COLLECTIVE_NAMES, AllreduceStats, CollectiveStats, stats_of
from .call.trace import Trace
from .control.deadline import AutoDeadline
from .control.elastic import Membership, check_elastic
from .control.failures import survivors
from .control.lag import LagWatch
from .control.redundancy import AutoRedundancy
from .errors import EvictedError, MPILossyError
from .hierarchy import Hierarchy, NodeLayout
from .hierarchy.allreduce import allreduce as hierarchical_allreduce
from .hierarchy.scatter import reduce_scatter as hierarchical_reduce_scatter
from .hierarchy.stages import refuse as refuse_hierarchical

__all__ = ["Communicator", "CollectiveStats", "AllreduceStats", "allreduce",
           "reduce_scatter", "allgather", "default_communicator"]

_serials = itertools.count()


class Communicator:
    """Lossy collectives over a private duplicate of `comm`.

    comm: the MPI communicator whose ranks take part (default COMM_WORLD),
    duplicated so that mpilossy's traffic never mixes with the caller's.
    The settings (each one field of mpilossy/call/config.py's Config, where
    it is described in full; see also docs/cluster.md for the environment):

    - channel: "rma" (MPI one-sided windows), "ud" (unreliable datagrams:
      libfabric's verbs UD, efa or udp, or mpilossy's own UDP sockets) or
      "auto" (ud where the fabric does datagrams in hardware).
    - timeout: deadline of every call in seconds; "auto" (learned from
      earlier calls and agreed by all ranks, mpilossy/control/deadline.py;
      lengthened while it cuts more than 1 - delivered_target of the
      blocks, default 0.99, $MPILOSSY_DELIVERED_TARGET); None waits for
      everything (the result is then exact).  Default $MPILOSSY_TIMEOUT,
      else None.
    - loss: injected loss, models of mpilossy.loss or MPILOSSY_LOSS syntax.
    - algorithm: allreduce's default, "ring", "tree", "direct",
      "hierarchical" (exact within each node, lossy between nodes:
      docs/hierarchy.md) or "auto" (hierarchical where the communicator
      spans several nodes and some node holds several ranks; else the tree
      for small messages, direct above: docs/performance.md).
    - block_bytes (256 KiB), capacity (4 MiB of window allocated up front;
      a larger call grows the windows collectively, the one point not bound
      by the deadline), tree_radix (2..64, default 4).
    - scaling="zero-fill" (sum / size, for error feedback) and rotate=False
      (reducers pinned to the chunk owners, for the sharded mode); each
      biases a single call over arbitrary inputs (docs/unbiasedness.md).
    - compression ("int8", "int4": float32 on the direct algorithm travels
      quantised, one scale per compression_group values, rounded
      stochastically; a per-call compression= overrides it).
    - redundancy (None, or (k, m): with every k blocks of a stream m parity
      blocks, from which a reader rebuilds up to m lost blocks of the group
      without a round trip; m = 1 is XOR, m >= 2 Reed-Solomon through
      Intel ISA-L; docs/redundancy.md; a per-call redundancy= overrides it;
      "auto": the code whose residual loss at the loss rate the ranks
      measured and agreed is at most redundancy_target, default 2.5%).

    - pipeline_bytes: a GPU all-reduce of at least four times this many
      bytes (default 8 MiB, $MPILOSSY_PIPELINE_BYTES) is staged in segments of
      about this size, the copies of one overlapping the transport of
      another (docs/gpu.md); 0 stages every call in one piece.

    - elastic=True: a rank that exits (MPI reports it: launch with
      ``mpiexec -disable-auto-cleanup``) or that falls `evict_after` calls
      (default 20) behind is excluded by agreement of the others, which go
      on over a communicator of themselves (``members``, ``stats.excluded``,
      on_exclusion()); an excluded rank gets EvictedError; survivors that
      noticed after different calls line up (``behind``, ``stats.alone``).
      Needs a deadline; `elastic_wait` (10 s) bounds each of the
      agreement's two rounds; builds no hierarchy (its algorithms run flat)
      (mpilossy/control/elastic.py, docs/elastic.md).

    Construction and free() are collective over `comm`.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, *, channel: str = DEFAULTS.channel,
                 timeout: Union[float, str, None] = UNSET, loss: Any = UNSET,
                 algorithm: str = DEFAULTS.algorithm, block_bytes: Optional[int] = None,
                 capacity: int = DEFAULTS.capacity, tree_radix: Optional[int] = None,
                 scaling: str = DEFAULTS.scaling, rotate: bool = DEFAULTS.rotate,
                 compression: Optional[str] = DEFAULTS.compression,
                 compression_group: int = DEFAULTS.compression_group,
                 redundancy: Union[None, str, Tuple[int, int]] = DEFAULTS.redundancy,
                 redundancy_target: float = DEFAULTS.redundancy_target,
                 delivered_target: float = UNSET,
                 pipeline_bytes: Optional[int] = None, elastic: bool = DEFAULTS.elastic,
                 evict_after: int = DEFAULTS.evict_after,
                 elastic_wait: float = DEFAULTS.elastic_wait) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError("comm must be an mpi4py intracommunicator")
        self._core: Optional[Core] = None
        self._serial = next(_serials)
        self._comm = comm.Dup()
        arguments = dict(channel=channel, timeout=timeout, loss=loss, algorithm=algorithm,
                         block_bytes=block_bytes, capacity=capacity, tree_radix=tree_radix,
                         scaling=scaling, rotate=rotate, compression=compression,
                         compression_group=compression_group, redundancy=redundancy,
                         redundancy_target=redundancy_target, delivered_target=delivered_target,
                         pipeline_bytes=pipeline_bytes, elastic=elastic, evict_after=evict_after,
                         elastic_wait=elastic_wait)
        try:
            config, env = agree(self._comm, arguments)
            rank = self._comm.Get_rank()
            environment.configure_logging(env, rank)
            environment.warn_from_environment(env, MPI.COMM_WORLD.Get_rank(), tuple(
                name for name in ("loss", "timeout") if arguments[name] is UNSET))
            self._core, self._channel = open_core(self._comm, config)
        except BaseException:
            self._comm.Free()
            raise
        _live.add(self)
        self._arguments = arguments
        self._config = config
        self._membership: Optional[Membership] = None
        self._on_exclusion: List[Callable[[Tuple[int, ...], Tuple[int, ...]], None]] = []
        self._alone: List[int] = []     # (elastic: call numbers still to answer alone, last first)
        self._alone_layout: Any = None  # (and the communicator they belong to: rank, size, ...)
        self._rank, self._size = rank, self._comm.Get_size()
        # (one rank: a call is a copy, nothing travels that copies could overlap)
        self._buffers = BufferIntake(rank, self._size,
                                     config.pipeline_bytes if self._size > 1 else 0)
        self._auto = AutoDeadline(self._comm.Dup(), floor=config.auto_floor, cap=config.auto_cap,
                                  target=config.delivered_target)
        self._codes = (AutoRedundancy(self._comm.Dup(), config.redundancy_target)
                       if config.redundancy == "auto" else None)
        self._calls = CallResolver(config, self._size, self._auto, self._codes)
        self._lag = LagWatch(rank, self._size, config.max_behind)
        self._trace = Trace.open(config.trace, self._serial, rank)
        self._layout, self._hierarchy = self._two_levels(arguments)
        self._elastic()
        environment.log.info("communicator of %d ranks: channel=%s timeout=%s loss=%s "
                           "block_bytes=%d", self._size, self._channel, self.timeout,
                           list(config.loss) or None, config.block_bytes)

    def _two_levels(self, arguments: Dict[str, Any]) -> Tuple[NodeLayout, Optional[Hierarchy]]:
        """Collective: the node layout and, where it has two levels, the
        sub-communicators of the hierarchical all-reduce."""
        layout, node = NodeLayout.detect(self._comm)
        try:
            # (elastic: none.  Its stages are Communicators of their own, which
            # would notice a loss and switch apart from this one: wrong blocks,
            # seen on fake nodes; docs/elastic.md)
            if not layout.hierarchical or self._config.elastic:
                return layout, None
            config = self._config

            def make(comm: MPI.Intracomm, within_node: bool) -> "Communicator":
                given = dict(arguments, algorithm="auto", loss=config.loss,
                             timeout=config.timeout)
                if within_node:      # shared memory: exact, no injected loss
                    given.update(channel="rma", loss=None, compression=None,
                                 redundancy=None)
                sub = Communicator(comm, **given)
                if not within_node and sub.channel == "ud":
                    # the owners of a node's slices share its port
                    pace(comm, sub._core, config.ud_rate, senders=min(layout.sizes))
                return sub

            return layout, Hierarchy.build(self._comm, layout, node, make, config.block_bytes)
        finally:
            node.Free()

    def _elastic(self) -> None:
        """Collective: start the membership if elastic (its settings are
        checked and agreed with the others; here: a deadline on every rank)."""
        config = self._config
        if not config.elastic:
            return
        problem = check_elastic(config.timeout)
        errors = [(r, e) for r, e in enumerate(
            self._comm.allgather(None if problem is None else str(problem))) if e]
        if errors:
            self.free()
            raise ValueError(f"rank {errors[0][0]}: {errors[0][1]}")
        self._membership = Membership(self._comm, list(range(self._size)), config.evict_after,
                                      config.elastic_wait, across_nodes=self._layout.nodes > 1)

    @property
    def elastic(self) -> bool:
        return self._membership is not None

    @property
    def members(self) -> Tuple[int, ...]:
        """The ranks (in the communicator this Communicator was built on)
        still in: all of them unless elastic=True excluded some."""
        if self._membership is None:
            return tuple(range(self._size))
        return tuple(self._membership.members)

    @property
    def behind(self) -> int:
        """elastic=True: how many of its next calls this rank answers alone
        (CollectiveStats.alone), because other survivors reached the last
        agreement after more calls than it had made; 0 almost always.
        These calls belong to the communicator before the exclusion: its
        size, this rank's chunk in it."""
        return len(self._alone)

    def on_exclusion(self, callback: Callable[[Tuple[int, ...], Tuple[int, ...]], None]
                     ) -> None:
        """elastic=True: call `callback(excluded, members)` (ranks of the
        communicator this one was built on) on every rank that goes on,
        right after an exclusion, before the call that led to it returns:
        to re-shard, log or checkpoint."""
        if not callable(callback):
            raise TypeError("callback must be callable")
        if self._membership is None:
            raise ValueError("on_exclusion() needs a communicator built with elastic=True")
        self._on_exclusion.append(callback)

    def _after_call(self, stats: CollectiveStats) -> CollectiveStats:
        """elastic=True: heartbeat, and if a rank is suspected (or another
        rank started an agreement), agree on who is out and switch to the
        survivors' communicator.  The stats say whom this call excluded."""
        membership = self._membership
        if membership is None:
            return stats
        suspects = membership.after_call(stats.deadline_hit)
        if suspects is None:
            return stats
        began = time.perf_counter()
        calls = membership.calls
        out, failed, behind = membership.agree(suspects)
        if not out:
            return stats
        excluded = tuple(membership.members[r] for r in sorted(out))
        reported = [membership.members[r] for r in sorted(failed)]
        # (calls to answer alone are the old communicator's: its layout)
        before = (self._rank, self._size, self._buffers, self._calls)
        self._switch(out)
        self._alone = [calls + k for k in range(behind, 0, -1)]
        self._alone_layout = before
        environment.log.warning("excluded ranks %s (MPI reported %s failed) after call %d "
                                "in %.3f s; %d ranks go on%s", list(excluded), reported,
                                calls, time.perf_counter() - began, self._size,
                                f"; this rank answers its next {behind} call(s) alone to "
                                f"line up with the others" if behind else "")
        members = self.members
        for callback in self._on_exclusion:
            callback(excluded, members)
        return stats._replace(excluded=excluded)

    def _answer_alone(self, collective: int, sendbuf: Any, recvbuf: Any, op: Any,
                      algorithm: Any, timeout: Any, weight: Any, compression: Any,
                      residual: Any, redundancy: Any) -> CollectiveStats:
        """elastic=True, after an agreement that other survivors reached
        some calls later than this rank: one of the calls they made before
        it, answered with this rank's data alone (call/alone.py), checked
        as any call is.  Not counted on the survivors' communicator."""
        self._alive()
        seq = self._alone.pop()
        rank, size, buffers, calls = self._alone_layout
        bufs: Any = None
        try:
            bufs = buffers.take(collective, sendbuf, recvbuf)
            spec = calls.resolve(collective, bufs.send, bufs.recv, op,
                                       "auto" if algorithm == "hierarchical" else algorithm,
                                       timeout, weight, compression, residual, 0.0, redundancy)
        except BaseException:
            if bufs is not None:
                bufs.finish(ok=False)
            raise
        return answer_alone(bufs, spec, rank, size, self._config.scaling, seq)

    def _switch(self, out: Any) -> None:
        """Go on over the survivors: a new communicator of them and the
        Communicator's whole state built afresh on it (collective over the
        survivors).  What belonged to the old one (windows, duplicates,
        agreements in flight) is left as it is: freeing any of it is
        collective over ranks that are gone."""
        membership = self._membership
        assert membership is not None
        rest = survivors(self._comm, out)
        try:
            fresh = Communicator(rest, **dict(self._arguments, elastic=False))
        finally:
            rest.Free()
        _live.discard(fresh)
        for name in ("_core", "_comm", "_config", "_channel", "_rank", "_size", "_buffers",
                     "_auto", "_codes", "_calls", "_lag", "_trace", "_layout", "_hierarchy"):
            setattr(self, name, getattr(fresh, name))
        fresh._core = None              # (its state is this one's now)
        membership.rebind(self._comm, out)

    # -- properties ----------------------------------------------------------
    @property
    def layout(self) -> NodeLayout:
        """Which node holds each rank (MPI's COMM_TYPE_SHARED split)."""
        return self._layout

    @property
    def comm(self) -> MPI.Intracomm:
        """The private duplicate that carries mpilossy's traffic."""
        self._alive()
        return self._comm

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    @property
    def config(self) -> Config:
        """Every setting in force (validated and agreed at construction)."""
        return self._config

    @property
    def channel(self) -> str:
        return self._channel

    @property
    def timeout(self) -> Any:
        """Seconds, "auto", or None."""
        return self._config.timeout

    @property
    def auto_timeouts(self) -> Dict[Tuple[str, str, int], float]:
        """timeout="auto": the deadline in force per kind of call
        (collective, algorithm, bit length of the byte count)."""
        return {(COLLECTIVE_NAMES[c], ALGORITHM_NAMES[a], b): t
                for (c, a, b), t in self._auto.snapshot().items()}

    @property
    def loss_rate(self) -> Optional[float]:
        """redundancy="auto": the largest loss rate of any rank on recent
        calls, as last agreed (None before the first agreement, or without
        redundancy="auto")."""
        return None if self._codes is None else self._codes.loss_rate

    def auto_redundancy(self, target: Optional[float] = None) -> Optional[Tuple[int, int]]:
        """redundancy="auto": the code in force for a residual-loss `target`
        (default: redundancy_target); the same on every rank between calls,
        so a per-call redundancy= computed from it agrees.  A lower target
        asks for more parity (docs/redundancy.md)."""
        if self._codes is None:
            raise ValueError("auto_redundancy() needs a communicator built with "
                             "redundancy='auto'")
        if target is not None:
            check_fraction("target", target)
        return self._codes.code(target)

    @property
    def scaling(self) -> str:
        """"unbiased" (sum / contributions) or "zero-fill" (sum / size)."""
        return self._config.scaling

    @property
    def rotate(self) -> bool:
        return self._config.rotate

    @property
    def loss(self) -> List[Any]:
        return list(self._config.loss)

    @property
    def calls(self) -> int:
        """Calls made so far (the sequence number of the last one)."""
        return self._alive().seq

    def channel_info(self) -> Dict[str, Any]:
        """The channel and, for "ud", its provider, domain, datagram size and
        counters of datagrams dropped by cause (foreign, truncated, malformed,
        forged, stale, future, unexpected, duplicate, mismatch; docs/ud.md)."""
        return self._alive().channel_info()

    @property
    def shared_memory_peers(self) -> int:
        """Peers read through shared memory; the others through MPI_Rget."""
        return self._alive().shared_peers

    def chunk_bounds(self, count: int, rank: Optional[int] = None) -> Tuple[int, int]:
        """(first, end) of `rank`'s chunk (default: this rank's) of a vector of
        `count` elements, as reduce_scatter and allgather cut it: the first
        count % size ranks get one element more."""
        return chunk_bounds(count, self.size, self.rank if rank is None else rank)

    # -- lifetime ------------------------------------------------------------
    def free(self) -> None:
        """Release windows and the duplicate communicator (collective; on a
        rank that elastic=True excluded, nothing: freeing is collective over
        ranks that are gone)."""
        if self._core is None:
            return
        if self._membership is not None:
            self._membership.close()
            if self._membership.evicted:
                self._core = None       # (its ranks include one that is gone)
                _live.discard(self)
                return
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        core, self._core = self._core, None
        core.close()
        if self._hierarchy is not None:
            self._hierarchy.free()
            self._hierarchy = None
        self._auto.close()
        self._auto.comm.Free()
        if self._codes is not None:
            self._codes.close()
            self._codes.comm.Free()
        self._comm.Free()

    def __enter__(self) -> "Communicator":
        self._alive()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._core is None else f"size={self.size}"
        return (f"<mpilossy.Communicator {state} channel={self._channel!r} "
                f"timeout={self.timeout!r} loss={list(self._config.loss)!r}>")

    def _alive(self) -> Core:
        """The compiled core; raises once the communicator was freed, or
        once elastic=True excluded this rank."""
        if self._membership is not None and self._membership.evicted:
            raise EvictedError(self._membership.evicted)
        if self._core is None:
            raise MPILossyError("this mpilossy.Communicator was freed")
        return self._core

    # -- collectives -----------------------------------------------------------
    def allreduce(self, sendbuf: Any, recvbuf: Any = None, *, op: str = "sum",
                  algorithm: Optional[str] = None, timeout: Any = UNSET,
                  weight: Optional[float] = None,
                  compression: Optional[str] = UNSET,
                  residual: Optional[np.ndarray] = None,
                  redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
        """Lossy all-reduce of `sendbuf` into `recvbuf` (in place without recvbuf).

        With op="avg" the result is sum / count; with op="sum" it is
        sum * size / count, where count is the number of ranks whose data
        reached each block in time.  Returns this rank's statistics.

        weight: this rank's weight w > 0 in a weighted average (op="avg",
        the direct or hierarchical algorithm, scaling="unbiased"): each
        block of the result is sum(w_i x_i) / sum(w_i) over the ranks whose
        data reached it.  Every rank passes a weight, or none does.

        compression: None, "int8" or "int4" for this call (default: the
        communicator's); float32 on the direct algorithm only (hierarchical:
        the stage across nodes).

        residual: a float32 NumPy array as long as `sendbuf`, for error
        feedback: receives what quantisation took from this rank's
        contribution (sendbuf minus what travelled), zeros where nothing
        was quantised (this rank's own chunk, an uncompressed call).

        redundancy: None, (k, m) or "auto" (on a communicator built with
        "auto") for this call (default: the communicator's); every rank
        passes the same.
        """
        return self._call(ALLREDUCE, sendbuf, recvbuf, op, algorithm, timeout, weight,
                          compression, residual, redundancy)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, *, op: str = "sum",
                       algorithm: str = "auto", timeout: Any = UNSET,
                       weight: Optional[float] = None,
                       compression: Optional[str] = UNSET,
                       residual: Optional[np.ndarray] = None,
                       redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
        """Lossy reduce-scatter: `recvbuf` receives this rank's chunk
        (chunk_bounds) of the reduction of every rank's `sendbuf`, scaled as
        in allreduce.  algorithm: "ring", "direct", "hierarchical" (exact
        within each node, lossy between nodes; nodes of equal size:
        docs/hierarchy.md) or "auto" (as allreduce chooses above the tree's
        sizes; hierarchical where allreduce would be, on nodes of equal size,
        without weight or residual); unbiased like allreduce.  weight,
        compression, residual, redundancy: as in allreduce."""
        return self._call(REDUCE_SCATTER, sendbuf, recvbuf, op, algorithm, timeout, weight,
                          compression, residual, redundancy)

    def allgather(self, sendbuf: Any, recvbuf: Any, *, timeout: Any = UNSET,
                  redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
        """Lossy all-gather: chunk r (chunk_bounds) of `recvbuf` receives rank
        r's `sendbuf`.  A chunk (block) that does not arrive in time keeps
        the previous contents of `recvbuf`.  `sendbuf` may be this rank's
        own chunk of `recvbuf` (in place).  redundancy: as in allreduce."""
        return self._call(ALLGATHER, sendbuf, recvbuf, "sum", "auto", timeout, None, UNSET,
                          None, redundancy)

    def _call(self, collective: int, sendbuf: Any, recvbuf: Any, op: Any, algorithm: Any,
              timeout: Any, weight: Any, compression: Any, residual: Any,
              redundancy: Any) -> CollectiveStats:
        if self._alone:
            return self._answer_alone(collective, sendbuf, recvbuf, op, algorithm, timeout,
                                      weight, compression, residual, redundancy)
        return self._after_call(self._run(collective, sendbuf, recvbuf, op, algorithm, timeout,
                                          weight, compression, residual, redundancy))

    def _run(self, collective: int, sendbuf: Any, recvbuf: Any, op: Any, algorithm: Any,
             timeout: Any, weight: Any, compression: Any, residual: Any,
             redundancy: Any = UNSET) -> CollectiveStats:
        """One call: buffers, spec, core, statistics.  Every rank counts
        every call, whatever fails, so that the call numbers (and the auto
        deadline's schedule) stay the same on every rank."""
        core = self._alive()
        if collective != ALLGATHER and self._two_level(collective, algorithm, sendbuf, weight,
                                                       residual):
            return self._hierarchical(collective, sendbuf, recvbuf, op, weight, timeout,
                                      compression, residual, redundancy)
        bufs: Any = None
        try:
            spent = self._count_call(timeout)
            began = time.perf_counter()
            bufs = self._buffers.take(collective, sendbuf, recvbuf)
            send, recv, err, part = bufs.send, bufs.recv, residual, PART_WHOLE
            if bufs.segments is not None:       # a pipelined GPU all-reduce: its segment 0
                first, stop = bufs.segments[0]
                if residual is not None:
                    residual = check_residual(residual, send, recv)
                    err = residual[first:stop]
                send, recv = send[first:stop], recv[first:stop]
                part = pipeline.part_of(0, len(bufs.segments))
            spec = self._calls.resolve(collective, send, recv, op, algorithm, timeout, weight,
                                       compression, err, spent, redundancy, part)
        except BaseException as exc:
            if bufs is not None:
                bufs.finish(ok=False)       # (a pipelined call's copies are in flight)
            error = self._refuse(collective, exc)
            if error is None:
                raise
            raise error from None
        if bufs.segments is not None:
            return self._pipelined(bufs, spec, op, algorithm, timeout, weight, compression,
                                   residual, spent, redundancy, began)
        if spec.residual is not None:
            spec.residual[...] = 0       # (the core writes the blocks it quantised)
        result = core.collective(bufs.send, bufs.recv, spec)
        bufs.finish(ok=not result.err_kind)
        self._settle(collective, spec, result)
        return stats_of(result, spec, self._rank, self._size)

    def _settle(self, collective: int, spec: Any, result: Any) -> None:
        """After a core call: the control loops learn from it, the trace
        records it, and its error, if any, is raised."""
        self._auto.observe(spec.kind, result)
        if self._codes is not None:
            self._codes.observe(result)
        if self._trace is not None:
            self._trace.write(result, spec)
        if result.err_kind:
            raise call_error(collective, result)
        self._lag.watch(result)

    def _pipelined(self, bufs: Any, spec: Any, op: Any, algorithm: Any, timeout: Any,
                   weight: Any, compression: Any, residual: Any, spent: float, redundancy: Any,
                   began: float) -> CollectiveStats:
        """A GPU all-reduce staged in segments (call/pipeline.py), `spec`
        segment 0's: one core call per segment while the copies of the
        others run.  The first segment that fails ends the call."""
        core = self._alive()
        segments = bufs.segments
        done: List[CollectiveStats] = []
        ok = False
        try:
            for k, (first, stop) in enumerate(segments):
                send, recv = bufs.send[first:stop], bufs.recv[first:stop]
                if k:           # (what segment 0 accepted: only the sizes differ)
                    spec = self._calls.resolve(
                        ALLREDUCE, send, recv, op, algorithm, timeout, weight, compression,
                        None if residual is None else residual[first:stop],
                        spent + time.perf_counter() - began, redundancy,
                        pipeline.part_of(k, len(segments)))
                if spec.residual is not None:
                    spec.residual[...] = 0
                bufs.ready(k)
                result = core.collective(send, recv, spec)
                self._settle(ALLREDUCE, spec, result)
                bufs.deliver(k)
                done.append(stats_of(result, spec, self._rank, self._size))
            ok = True
        finally:
            bufs.finish(ok=ok)
        return pipeline.merge_stats(done, [stop - first for first, stop in segments],
                                    spent + time.perf_counter() - began, self._rank, self._size)

    def _count_call(self, timeout: Any) -> float:
        """Count one call: every rank, every call, before anything about it
        is checked.  Returns the seconds spent on agreements."""
        spent = self._auto.tick(asks_for_auto(timeout, self._config))
        if self._codes is not None:
            spent += self._codes.tick()
        return spent

    def _refuse(self, collective: int, exc: BaseException) -> Optional[Exception]:
        """Fail the call being counted on every rank because of `exc`
        (call/failure.py's refuse)."""
        return refuse(self._alive(), collective, exc, self._rank,
                      failure_bound(self._config.core_timeout, self._auto.cap))

    def _refuse_next(self, collective: int, exc: BaseException, timeout: Any) -> None:
        """Take part in the next call only to fail it on every rank with
        `exc`: the hierarchy's stages after one that failed, so that their
        peers learn of it and every rank counts the same calls."""
        try:
            self._count_call(timeout)
        except Exception:       # an agreement that failed too: `exc` is what to report
            pass
        self._refuse(collective, exc)

    def _two_level(self, collective: int, algorithm: Any, sendbuf: Any, weight: Any,
                   residual: Any) -> bool:
        """Does this call run the hierarchy?  "auto" picks it only for what
        it supports: on nodes of different sizes, floating-point data; the
        reduce-scatter, nodes of equal size and no weight or residual."""
        if self._hierarchy is None:
            return False
        chosen = self._config.algorithm if algorithm is None else algorithm
        if isinstance(chosen, str) and chosen == "hierarchical":
            return True
        if not (isinstance(chosen, str) and chosen == "auto"):
            return False
        if collective == REDUCE_SCATTER:
            return self._layout.uniform and weight is None and residual is None
        return self._hierarchy.takes(getattr(sendbuf, "dtype", None))

    def _hierarchical(self, collective: int, sendbuf: Any, recvbuf: Any, op: Any, weight: Any,
                      timeout: Any, compression: Any, residual: Any,
                      redundancy: Any) -> CollectiveStats:
        """algorithm="hierarchical" (mpilossy/hierarchy/)."""
        hierarchy = self._hierarchy
        assert hierarchy is not None
        asked = timeout           # (counted as given, also when refused: as the others count)
        try:
            if not isinstance(op, str) or op not in ("sum", "avg"):
                raise ValueError(f"op must be one of ['avg', 'sum'], got {op!r}")
            timeout = (self._config.timeout if timeout is UNSET
                       else check_timeout("timeout", timeout))
            bufs = self._buffers.take(collective, sendbuf, recvbuf)
            if op == "avg" and bufs.send.dtype.kind != "f":
                raise TypeError(f"op='avg' needs a floating-point dtype, got {bufs.send.dtype}")
            hierarchy.check(bufs.send, collective)
            if collective == REDUCE_SCATTER and (weight is not None or residual is not None):
                raise ValueError("the two-level reduce_scatter takes no weight= or residual= "
                                 "(yet): use algorithm='direct'")
            if weight is not None:
                weight = self._calls.weight(weight, op, "direct")
            if residual is not None:
                residual = check_residual(residual, bufs.send, bufs.recv)
        except BaseException as exc:
            # (raises, on every rank)
            refuse_hierarchical(hierarchy, exc, asked, collective)
        if residual is not None:
            residual[...] = 0        # (stage 2 writes what it quantised)
        ok = False
        try:
            if collective == REDUCE_SCATTER:
                stats = hierarchical_reduce_scatter(hierarchy, bufs.send, bufs.recv, op,
                                                    timeout, compression, redundancy)
            else:
                stats = hierarchical_allreduce(hierarchy, bufs.send, bufs.recv, op, timeout,
                                               compression, redundancy, weight=weight,
                                               residual=residual)
            ok = True
        finally:
            bufs.finish(ok=ok)
        return stats


# -- module level -----------------------------------------------------------
_default: Optional[Communicator] = None
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _free_at_exit() -> None:
    """Free what the program left open before mpi4py finalizes MPI (every
    rank built the same communicators, so this is collective as it must be)."""
    for lc in sorted(_live, key=lambda c: -c._serial):
        lc.free()


def default_communicator() -> Communicator:
    """The communicator behind mpilossy.allreduce(): COMM_WORLD, settings
    from the environment (MPILOSSY_TIMEOUT, MPILOSSY_LOSS, ...).  Created on
    first use, which is collective."""
    global _default
    if _default is None or _default._core is None:
        _default = Communicator(MPI.COMM_WORLD)
    return _default


def allreduce(sendbuf: Any, recvbuf: Any = None, *, op: str = "sum",
              algorithm: Optional[str] = None, timeout: Any = UNSET,
              weight: Optional[float] = None,
              compression: Optional[str] = UNSET,
              residual: Optional[np.ndarray] = None,
              redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
    """mpilossy.Communicator.allreduce on default_communicator()."""
    return default_communicator().allreduce(sendbuf, recvbuf, op=op, algorithm=algorithm,
                                            timeout=timeout, weight=weight,
                                            compression=compression, residual=residual,
                                            redundancy=redundancy)


def reduce_scatter(sendbuf: Any, recvbuf: Any, *, op: str = "sum",
                   algorithm: str = "auto", timeout: Any = UNSET,
                   weight: Optional[float] = None,
                   compression: Optional[str] = UNSET,
                   residual: Optional[np.ndarray] = None,
                   redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
    """mpilossy.Communicator.reduce_scatter on default_communicator()."""
    return default_communicator().reduce_scatter(sendbuf, recvbuf, op=op, algorithm=algorithm,
                                                 timeout=timeout, weight=weight,
                                                 compression=compression, residual=residual,
                                                 redundancy=redundancy)


def allgather(sendbuf: Any, recvbuf: Any, *, timeout: Any = UNSET,
              redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
    """mpilossy.Communicator.allgather on default_communicator()."""
    return default_communicator().allgather(sendbuf, recvbuf, timeout=timeout,
                                            redundancy=redundancy)
