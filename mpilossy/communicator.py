"""The lossy communicator: a front of public methods over its state
(state.py: core, config, buffers, control loops, layout, hierarchy), each
collective one request (call/request.py) through its plan (dispatch.py,
call/plan.py); elastic=True adds the membership (survivors.py), whose
methods live in elasticity.py."""

from __future__ import annotations

import atexit
import itertools
import os
from typing import Any, Callable, Dict, Optional, Tuple, Union, cast

import numpy as np
from mpi4py import MPI

from ._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from .call import environment
from .call.buffers import chunk_bounds
from .call.config import DEFAULTS, UNSET, Config, agree, check_fraction
from .call.request import Request
from .call.stats import ALGORITHM_NAMES, COLLECTIVE_NAMES, AllreduceStats, CollectiveStats
from . import reliable
from .control.agreement import linger
from .dispatch import run
from .errors import EvictedError, MPILossyError
from .hierarchy import NodeLayout
from .state import State
from .elasticity import ElasticFront, open_communicators as _live
from .control.rendezvous import Rendezvous, directory_problem
from .newcomers import SpareSeat, arrive
from .survivors import Elastic

__all__ = ["Communicator", "CollectiveStats", "AllreduceStats"]

_serials = itertools.count()


def _setting(name: str, doc: str, convert: Callable[[Any], Any] = lambda v: v) -> Any:
    """A read-only property of the Communicator: one field of its Config."""
    return property(lambda self: convert(getattr(self.config, name)), doc=doc)


class Communicator(ElasticFront):
    """Lossy collectives over a private duplicate of `comm`.

    comm: the MPI communicator whose ranks take part (default COMM_WORLD),
    duplicated so that mpilossy's traffic never mixes with the caller's.
    Every other argument is one field of mpilossy/call/config.py's Config,
    described there in full (and in README's table; docs/cluster.md for the
    environment): channel ("rma", "ud", "auto"); timeout (seconds, "auto":
    learned and agreed, docs/deadlines.md; None: exact); loss (injected);
    algorithm ("ring", "tree", "direct", "hierarchical": exact within each
    node, lossy between nodes, docs/hierarchy.md; "auto": hierarchical where
    the communicator spans several nodes and some node holds several ranks,
    else the tree for small messages and direct above); block_bytes,
    capacity (window allocated up front; a larger call grows it
    collectively, the one point not bound by the deadline), tree_radix;
    scaling="zero-fill" and rotate=False (docs/unbiasedness.md);
    compression ("int8", "int4"), compression_group; redundancy ((k, m)
    parity blocks per k blocks, or "auto", docs/redundancy.md),
    redundancy_target; delivered_target (timeout="auto"); pipeline_bytes
    (GPU all-reduces staged in segments, docs/gpu.md); elastic=True with
    evict_after, elastic_wait and heartbeat_span (ranks that exit or fall
    behind are excluded by agreement of the others, which go on without
    hierarchy; each rank's heartbeat goes to the heartbeat_span ranks on
    each side of it: docs/elastic.md); spares=k (with elastic=True: the
    last k ranks of `comm` wait outside as hot spares, stand_by(), until
    an exclusion frees a place; on_growth); rendezvous=DIR (with
    elastic=True, instead of spares: processes started after a loss join
    through that directory with Communicator.join(DIR)).

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
                 elastic_wait: float = DEFAULTS.elastic_wait,
                 heartbeat_span: int = DEFAULTS.heartbeat_span,
                 spares: int = DEFAULTS.spares,
                 rendezvous: Union[str, "os.PathLike[str]", None] = DEFAULTS.rendezvous
                 ) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError("comm must be an mpi4py intracommunicator")
        arguments = {name: value for name, value in locals().items()
                     if name in Config.arguments()}         # (the settings: every keyword)
        self._state: Optional[State] = None
        self._elastic: Optional[Elastic] = None
        self._bounded: Optional[reliable.BoundedComm] = None
        self._seat: Optional[SpareSeat] = None      # spares=k
        self._joined = 0                            # Communicator.join: 1
        self._serial = next(_serials)
        config, env = agree(comm, arguments)
        environment.configure_logging(env, comm.Get_rank())
        environment.warn_from_environment(env, MPI.COMM_WORLD.Get_rank(), tuple(
            name for name in ("loss", "timeout") if arguments[name] is UNSET))
        if config.rendezvous is not None and (not config.elastic or config.spares):
            raise ValueError("rendezvous= needs elastic=True and no spares: newcomers started "
                             "after a loss fill the places that exclusions free")
        if config.spares:
            self._seat = SpareSeat(comm, config)
            comm = cast(MPI.Intracomm, self._seat.workers)
            if comm == MPI.COMM_NULL:
                return
        # (an elastic communicator builds no hierarchy: docs/elastic.md)
        try:
            self._state = state = State.open(comm, config, self._serial, layout=True,
                                             two_levels=None if config.elastic else run)
        finally:
            if config.spares:
                comm.Free()
        if config.elastic:
            meeting = None if config.rendezvous is None else Rendezvous(config.rendezvous)
            try:
                self._elastic = Elastic(state, self._seat.spares if self._seat else None,
                                        rendezvous=meeting)
            except BaseException:
                self.free()
                raise
            if meeting is not None and state.rank == 0:
                meeting.opened()
        _live.add(self)
        environment.log.info("communicator of %d ranks: channel=%s timeout=%s loss=%s "
                             "block_bytes=%d", state.size, state.channel, config.timeout,
                             list(config.loss) or None, config.block_bytes)

    @classmethod
    def join(cls, rendezvous: Union[str, "os.PathLike[str]"], comm: Optional[MPI.Comm] = None,
             *, timeout: float = 60.0) -> Optional["Communicator"]:
        """On a process started after a loss, outside the job (a rank's
        process restarted by a wrapper script, an ``srun -n 1`` step): wait
        until the ranks of the running elastic Communicator built with the
        same `rendezvous` directory take it in at their grow(), where a
        place is free, and return its Communicator there (the last
        rank(s); every setting the ranks in agreed on is theirs; the
        reliable calls the survivors make after grow() to send it their
        state, this process makes after join returns).  None if the job
        freed its communicator meanwhile, or `timeout` seconds passed.
        Collective over `comm` (default COMM_SELF: one process): its
        processes come in together, where as many places are free."""
        if comm is None:
            comm = MPI.COMM_SELF
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError("comm must be an mpi4py intracommunicator")
        own, env = Config.build({"rendezvous": rendezvous})    # (the environment's too)
        directory = own.rendezvous
        assert directory is not None
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not timeout > 0:
            raise ValueError(f"timeout must be seconds > 0, not {timeout!r}")
        problem = directory_problem(directory)
        if problem is not None:
            raise ValueError(problem)
        lc = cls.__new__(cls)
        lc._state, lc._elastic, lc._bounded, lc._seat = None, None, None, None
        lc._serial = next(_serials)
        lc._joined = 0
        arrived = arrive(own, env, comm, float(timeout), lc._serial)
        if arrived is None:
            return None
        lc._state, lc._elastic = arrived
        lc._joined = 1
        _live.add(lc)
        environment.log.warning("joined through %s: rank %d of %d", directory,
                                lc._state.rank, lc._state.size)
        return lc

    # -- properties ----------------------------------------------------------
    @property
    def layout(self) -> NodeLayout:
        """Which node (MPI's COMM_TYPE_SHARED split) holds each rank."""
        layout = self._live().layout
        assert layout is not None
        return layout

    @property
    def comm(self) -> MPI.Intracomm:
        """The private duplicate that carries mpilossy's traffic."""
        return self._live().comm

    @property
    def rank(self) -> int:
        return self._live().rank

    @property
    def size(self) -> int:
        return self._live().size

    @property
    def config(self) -> Config:
        """Every setting in force (validated and agreed at construction)."""
        return self._live().config

    @property
    def channel(self) -> str:
        return self._live().channel

    timeout = _setting("timeout", 'Seconds, "auto", or None.')
    scaling = _setting("scaling", '"unbiased" (sum / contributions) or "zero-fill" (sum / size).')
    rotate = _setting("rotate", "Whether each chunk's reducer moves from call to call.")
    loss = _setting("loss", "The injected loss models.", list)

    @property
    def calls(self) -> int:
        """Calls made so far on this communicator, whatever their route
        (the sequence number of the last one)."""
        return self._live().calls

    @property
    def auto_timeouts(self) -> Dict[Tuple[str, str, int], float]:
        """timeout="auto": the deadline in force per kind of call
        (collective, algorithm, bit length of the byte count)."""
        return _named(self._live().auto.snapshot())

    @property
    def auto_timeouts_by_level(self) -> Dict[str, Dict[Tuple[str, str, int], float]]:
        """timeout="auto": the deadline in force per kind of call, for each
        level whose calls learn one.  "flat": this communicator's own (what
        auto_timeouts holds; for a hierarchical kind, the bound of the whole
        call: the cap).  Where the hierarchy runs, "node" (the stages within
        this rank's node) and "network" (the stage across nodes; only on the
        ranks that own a slice), each learned by its own level."""
        state = self._live()
        levels = {"flat": _named(state.auto.snapshot())}
        if state.hierarchy is not None:
            levels["node"] = _named(state.hierarchy.intra.auto.snapshot())
            if state.hierarchy.inter is not None:
                levels["network"] = _named(state.hierarchy.inter.auto.snapshot())
        return levels

    @property
    def loss_rate(self) -> Optional[float]:
        """redundancy="auto": the largest loss rate of any rank on recent
        calls, as last agreed (None before the first agreement, or without
        redundancy="auto")."""
        codes = self._live().codes
        return None if codes is None else codes.loss_rate

    def auto_redundancy(self, target: Optional[float] = None) -> Optional[Tuple[int, int]]:
        """redundancy="auto": the code in force for a residual-loss `target`
        (default: redundancy_target); the same on every rank between calls,
        so a per-call redundancy= computed from it agrees.  A lower target
        asks for more parity (docs/redundancy.md)."""
        codes = self._live().codes
        if codes is None:
            raise ValueError("auto_redundancy() needs a communicator built with "
                             "redundancy='auto'")
        if target is not None:
            check_fraction("target", target)
        return codes.code(target)

    def channel_info(self) -> Dict[str, Any]:
        """The channel and, for "ud", its provider, domain, datagram size and
        counters of datagrams dropped by cause (docs/ud.md)."""
        return self._live().core.channel_info()

    @property
    def shared_memory_peers(self) -> int:
        """Peers read through shared memory; the others through MPI_Rget."""
        return self._live().core.shared_peers

    def chunk_bounds(self, count: int, rank: Optional[int] = None) -> Tuple[int, int]:
        """(first, end) of `rank`'s chunk (default: this rank's) of a vector of
        `count` elements, as reduce_scatter and allgather cut it: the first
        count % size ranks get one element more."""
        return chunk_bounds(count, self.size, self.rank if rank is None else rank)

    # -- lifetime ------------------------------------------------------------
    def free(self) -> None:
        """Release windows and the duplicate communicator (collective; on a
        rank that elastic=True excluded, nothing: freeing is collective over
        ranks that are gone).  elastic=True: a barrier() first, so that a
        rank that hangs is excluded rather than waited for."""
        if self._elastic is not None and self._state is not None and not self._elastic.evicted:
            try:
                self.barrier()
                if self._seat is not None and self._state.rank == 0:
                    # (every rank still in is done)
                    self._seat.spares.release(self._elastic.membership.members)
                if self._elastic.growth is not None:
                    self._elastic.growth.closed(self._state.rank)
            except EvictedError:
                pass
        state, self._state = self._state, None
        _live.discard(self)
        if state is None:
            return
        if self._elastic is not None:
            self._elastic.close()
            if self._elastic.evicted:
                state.abandon()         # (its ranks include one that is gone)
                return
        state.free()

    def __enter__(self) -> "Communicator":
        self._live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        state = self._state
        if state is None:
            return "<mpilossy.Communicator freed>"
        return (f"<mpilossy.Communicator size={state.size} channel={state.channel!r} "
                f"timeout={state.config.timeout!r} loss={list(state.config.loss)!r}>")

    def _live(self) -> State:
        """The state; raises once the communicator was freed, or once
        elastic=True excluded this rank."""
        if self._elastic is not None and self._elastic.evicted:
            raise EvictedError(self._elastic.evicted)
        if self._state is None:
            if self.spare:
                raise MPILossyError("this rank is a spare standing by: stand_by() returns "
                                    "once the survivors of an exclusion call it in")
            raise MPILossyError("this mpilossy.Communicator was freed")
        return self._state

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
        return self._call(Request(ALLREDUCE, sendbuf, recvbuf, op, algorithm, timeout, weight,
                                  compression, residual, redundancy))

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
        sizes; hierarchical where allreduce would be, on nodes of equal size);
        unbiased like allreduce.  weight,
        compression, residual, redundancy: as in allreduce."""
        return self._call(Request(REDUCE_SCATTER, sendbuf, recvbuf, op, algorithm, timeout,
                                  weight, compression, residual, redundancy))

    def allgather(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                  timeout: Any = UNSET,
                  redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
        """Lossy all-gather: chunk r (chunk_bounds) of `recvbuf` receives rank
        r's `sendbuf`.  A chunk (block) that does not arrive in time keeps
        the previous contents of `recvbuf`.  `sendbuf` may be this rank's
        own chunk of `recvbuf` (in place).  algorithm: "direct" (every
        chunk to every rank), "hierarchical" (each chunk once across the
        network to each node, then within the node through shared memory;
        nodes of equal size: docs/hierarchy.md) or "auto" (hierarchical
        where the nodes are equal and hold several ranks, else direct).
        redundancy: as in allreduce."""
        return self._call(Request(ALLGATHER, sendbuf, recvbuf, algorithm=algorithm,
                                  timeout=timeout, redundancy=redundancy))

    # -- reliable collectives ----------------------------------------------------
    def barrier(self) -> None:
        """Collective: returns once every rank still in has entered it.
        elastic=True: never blocked by a rank that hangs or is gone: a
        neighbour silent for `elastic_wait` seconds meanwhile is excluded by
        agreement (on_exclusion runs) and the barrier is made again over
        the survivors (docs/elastic.md)."""
        reliable.barrier(self._reliable)

    def bcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Collective: reliable broadcast of `root`'s NumPy array `buf`
        (C-contiguous; writable except on the root) into every rank's, in
        place.  Byte counts, dtypes and roots are checked across ranks
        first: a mismatch raises on every rank.  elastic=True: bounded as
        barrier() is; made again over the survivors if ranks are excluded
        meanwhile, and if the root is, MPILossyError on every survivor."""
        reliable.bcast(self._reliable, buf, root, self.rank, lambda: self.members)

    def bounded_comm(self) -> reliable.BoundedComm:
        """elastic=True: the subset of an mpi4py communicator (Barrier,
        Bcast, bcast, Allreduce, allgather, Allgatherv) that mpilossy.torch's
        reliable calls use, each bounded as barrier() is; ranks excluded
        during one raise MembershipChanged (make the operation again)."""
        if self._elastic is None:
            raise ValueError("bounded_comm() needs a communicator built with elastic=True")
        if self._bounded is None:
            self._bounded = reliable.BoundedComm(self._reliable, lambda: self.comm)
        return self._bounded

    def _reliable(self, attempt: reliable.Attempt, closing: bool = False) -> np.ndarray:
        """Wait for the collective `attempt` starts: what it wrote.
        elastic=True: if ranks were excluded while it was in flight, it is
        abandoned whole, the communicator goes on over the survivors, and
        reliable.Switched is raised, unless `closing` (the barrier that
        closes a reliable collective: reliable.py) had completed on a
        survivor, so everywhere but here."""
        state = self._live()
        request, send, recv = attempt(state)
        if self._elastic is None:
            request.Wait()
            return recv
        switched = self._elastic.wait(state, request, closing)
        if switched is None:
            return recv
        linger(request, send, recv)         # (MPI cannot cancel a collective)
        self._state, excluded, done = switched
        self._elastic.notify(excluded)
        if done:
            return recv
        raise reliable.Switched()

    def _call(self, request: Request) -> CollectiveStats:
        state = self._live()
        elastic = self._elastic
        if elastic is None:
            return run(state, request)
        if elastic.owes():
            return elastic.answer_alone(request)
        self._state, stats = elastic.after_call(state, run(state, request))
        if stats.excluded:
            elastic.notify(stats.excluded)
        return stats


# -- module level -----------------------------------------------------------
@atexit.register
def _free_at_exit() -> None:
    """Free what the program left open before mpi4py finalizes MPI (every
    rank built the same communicators, so this is collective as it must be)."""
    for lc in sorted(_live, key=lambda c: -c._serial):
        lc.free()


def _named(snapshot: Dict[Tuple[int, int, int], float]) -> Dict[Tuple[str, str, int], float]:
    """A deadline snapshot's kinds with the collectives' and algorithms' names."""
    return {(COLLECTIVE_NAMES[c], ALGORITHM_NAMES[a], b): t for (c, a, b), t in snapshot.items()}
