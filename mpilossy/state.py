"""What one Communicator holds, as one object: its duplicate communicator,
config, compiled core, buffer intake, the control loops that steer its calls
(learned deadline, auto redundancy, lag watch), trace, node layout and
hierarchy.  Built collectively by `State.open`, freed by `free()`, or, when
an elastic communicator goes on over its survivors, left whole by
`abandon()` (its agreements in flight handed over to finish later) and
replaced by a new one.  The hierarchy's levels are States too
(hierarchy/levels.py's Level: the methods below), whose calls the
hierarchy makes through dispatch.run, handed to it here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from mpi4py import MPI

from ._core import Core
from .call.buffers import BufferIntake
from .call.channel import open_core, pace
from .call.config import Config
from .call.failure import failure_bound, refuse
from .call.plan import Routing
from .call.request import Request
from .call.spec import CallResolver
from .call.trace import Trace
from .control.deadline import AutoDeadline
from .control.lag import LagWatch
from .control.redundancy import AutoRedundancy
from .errors import MPILossyError
from .hierarchy import Hierarchy, NodeLayout
from .hierarchy.levels import Run

__all__ = ["State"]

WHOLE_SLICE = 1 << 30       # block bytes within a node: the channel's largest block


class State:
    """One communicator's state (module documentation).  `calls` counts the
    public calls made on it, whatever their route."""

    def __init__(self, comm: MPI.Intracomm, config: Config, core: Core, channel: str,
                 serial: int, layout: Optional[NodeLayout],
                 trace_as: Optional[Tuple[int, str]] = None) -> None:
        self.comm, self.config, self.core, self.channel = comm, config, core, channel
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.serial = serial
        self.calls = 0
        # (one rank: a call is a copy, nothing travels that copies could overlap)
        self.buffers = BufferIntake(self.rank, self.size,
                                    config.pipeline_bytes if self.size > 1 else 0)
        self.auto = AutoDeadline(comm.Dup(), floor=config.auto_floor, cap=config.auto_cap,
                                 target=config.delivered_target)
        self.codes = (AutoRedundancy(comm.Dup(), config.redundancy_target)
                      if config.redundancy == "auto" else None)
        self.resolver = CallResolver(config, self.size, self.auto, self.codes)
        self.lag = LagWatch(self.rank, self.size, config.max_behind)
        # reliable collectives (Communicator.barrier, bcast): elastic, on a duplicate
        # of their own, abandoned whole with a request in flight when ranks are lost
        self.exact = comm.Dup() if config.elastic else comm
        # a level of a hierarchy traces under its parent's rank and its own
        # name: every level's rank 0 would share one file otherwise
        rank, level = trace_as if trace_as is not None else (self.rank, "")
        self.trace = Trace.open(config.trace, serial, rank, level)
        self.layout = layout
        self.hierarchy: Optional[Hierarchy] = None
        self.closed = False

    @classmethod
    def open(cls, comm: MPI.Intracomm, config: Config, serial: int, *, layout: bool,
             two_levels: Optional[Run] = None,
             trace_as: Optional[Tuple[int, str]] = None) -> "State":
        """Collective over `comm` (duplicated here; the caller keeps its
        own): the whole state.  layout: detect the node layout; two_levels:
        where it has two levels, build the hierarchy's levels, whose calls
        this runs (dispatch.run)."""
        own = comm.Dup()
        try:
            core, channel = open_core(own, config)
        except BaseException:
            own.Free()
            raise
        nodes: Optional[NodeLayout] = None
        node: Optional[MPI.Comm] = None
        state: Optional[State] = None
        try:
            if layout:
                nodes, node = NodeLayout.detect(own)
            state = cls(own, config, core, channel, serial, nodes, trace_as)
            if two_levels and node is not None and nodes is not None and nodes.hierarchical:
                state.hierarchy = Hierarchy.build(own, nodes, node, state._level,
                                                  config.block_bytes, two_levels)
        except BaseException:
            if state is not None:
                state.free()
            else:
                core.close()
                own.Free()
            raise
        finally:
            if node is not None:
                node.Free()
        return state

    def _level(self, comm: MPI.Intracomm, within_node: bool) -> "State":
        """A level of this state's hierarchy: the node's ranks (shared
        memory: exact, no injected loss) or the owners of one slice across
        nodes (this state's channel and settings)."""
        assert self.layout is not None
        config = dataclasses.replace(self.config, algorithm="auto", elastic=False)
        if within_node:
            # rotate=False: each rank reduces its own slice, so it knows the
            # weights that reached it; one block per rank and slice: a rank's
            # data reaches a slice whole or not at all, so a node's partial is
            # the mean over the ranks it names in every block of the slice
            # (hierarchy/allreduce.py)
            config = dataclasses.replace(config, channel="rma", loss=(), compression=None,
                                         redundancy=None, rotate=False,
                                         block_bytes=WHOLE_SLICE)
        level = State.open(comm, config, self.serial, layout=False,
                           trace_as=(self.rank, "node" if within_node else "nodes"))
        if not within_node and level.channel == "ud":
            # the owners of a node's slices share its port
            pace(level.comm, level.core, config.ud_rate, senders=min(self.layout.sizes))
        return level

    # -- what the call path asks of it -------------------------------------------
    @property
    def routing(self) -> Routing:
        """What the plan of a call needs to know of this communicator."""
        h = self.hierarchy
        return Routing(self.config.algorithm, h is not None,
                       h is None or h.layout.uniform, self.config.scaling)

    @property
    def max_block(self) -> int:
        """Largest record payload the channel moves as one unit (bytes)."""
        return self.core.max_block

    @property
    def scaling(self) -> str:
        return self.config.scaling

    def count_call(self, request: Request, waits: bool = True) -> float:
        """Count one call on every control loop: every rank, every call,
        before anything about it is checked.  Returns the seconds spent
        on agreements (they come out of the call's deadline).  `waits`:
        the call may wait for a due agreement of the learned deadline
        (False: one whose stages use other communicators' deadlines looks
        once, like a call without the learned deadline)."""
        self.calls += 1
        spent = self.auto.tick(waits and self.resolver.asks_for_auto(request.timeout))
        if self.codes is not None:
            spent += self.codes.tick()
        return spent

    def refuse(self, collective: int, exc: BaseException) -> Optional[Exception]:
        """Fail the call being counted on every rank because of `exc`
        (call/failure.py's refuse): the exception to raise, or None to
        re-raise `exc` itself."""
        return refuse(self.core, collective, exc, self.rank,
                      failure_bound(self.config.core_timeout, self.auto.cap))

    def refuse_next(self, request: Request, exc: BaseException) -> None:
        """Take part in the next call only to fail it on every rank with
        `exc`: the hierarchy's stages after one that failed, so that their
        peers learn of it and every level counts the same calls."""
        try:
            self.count_call(request)
        except Exception:       # (an agreement that failed too: `exc` is what to report)
            pass
        self.refuse(request.collective, exc)

    # -- lifetime -----------------------------------------------------------------
    def alive(self) -> Core:
        if self.closed:
            raise MPILossyError("this mpilossy.Communicator was freed")
        return self.core

    def free(self) -> None:
        """Collective: release everything (agreements in flight are waited
        for a bounded time, then handed over: control/agreement.py)."""
        if self.closed:
            return
        self.closed = True
        if self.trace is not None:
            self.trace.close()
        self.core.close()
        if self.hierarchy is not None:
            self.hierarchy.free()
        for loop in (self.auto, self.codes):
            if loop is not None:
                loop.close()
                loop.comm.Free()
        if self.exact is not self.comm:
            self.exact.Free()
        self.comm.Free()

    def learned(self) -> Tuple[Any, Optional[float]]:
        """What its control loops learned and agreed: the learned deadline's
        state, the agreed loss rate (redundancy="auto")."""
        return self.auto.learned(), None if self.codes is None else self.codes.loss_rate

    def warm(self, learned: Tuple[Any, Optional[float]]) -> None:
        """Start the control loops from another state's learned()."""
        deadline, loss_rate = learned
        self.auto.warm(deadline)
        if self.codes is not None:
            self.codes.loss_rate = loss_rate

    def abandon(self) -> None:
        """Leave this state without a collective (elastic: some of its ranks
        are gone, and freeing is collective over them): agreements in flight
        are handed over to complete later, never dropped while MPI may
        still write into their buffers; the rest is left as it is."""
        if self.closed:
            return
        self.closed = True
        if self.trace is not None:
            self.trace.close()
        for loop in (self.auto, self.codes):
            if loop is not None:
                loop.close(limit=0.0)
