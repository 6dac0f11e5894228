"""One call through its plan: count it, take its buffers, plan its route
(call/plan.py), run the route, and fail it on every rank where this rank
cannot take part.

    run(state, request)        flat, pipelined or hierarchical
    alone(state, request, seq) a call this rank answers alone (elastic)

Every rank counts every call, whatever fails, so that the call numbers
(and the control loops' schedules) stay the same on every rank.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional

from ._core import ALLGATHER, REDUCE_SCATTER
from .call import pipeline
from .call.alone import answer_alone
from .call.buffers import widen_for_compression
from .call.config import UNSET, check_timeout
from .call.dtypes import is_float
from .call.failure import call_error
from .call.plan import Route, plan
from .call.request import Request
from .call.spec import check_residual
from .call.stats import CollectiveStats, stats_of
from .hierarchy.allreduce import allreduce as hierarchical_allreduce
from .hierarchy.gather import allgather as hierarchical_allgather
from .hierarchy.scatter import reduce_scatter as hierarchical_reduce_scatter
from .hierarchy.stages import refuse as refuse_hierarchical
from .state import State

__all__ = ["run", "alone"]


def run(state: State, request: Request) -> CollectiveStats:
    """One call on `state` (not answered alone)."""
    core = state.alive()
    collective = request.collective
    bufs: Any = None
    spec: Any = None
    route: Optional[Route] = None
    try:
        # (the hierarchy's stages wait for their own agreements: the
        # parent's learned deadline bounds no part of its calls.  The route
        # without a dtype, the same on every rank before intake; on uneven
        # nodes an integer call that then runs flat only looks once)
        spent = state.count_call(request, waits=plan(
            collective, request.algorithm, None, state.routing) is not Route.HIERARCHICAL)
        began = time.perf_counter()
        bufs = state.buffers.take(collective, request.sendbuf, request.recvbuf)
        compression = (state.config.compression if request.compression is UNSET
                       else request.compression)
        if compression is not None:
            bufs = widen_for_compression(bufs)
        route = plan(collective, request.algorithm, bufs.send.dtype, state.routing,
                     segmented=bufs.segments is not None)
        if route is Route.PIPELINED:
            spec = _segment_spec(state, request, bufs, 0, spent)
        else:
            spec = state.resolver.resolve(request, bufs.send, bufs.recv, spent)
    except BaseException as exc:
        if bufs is not None:
            bufs.finish(ok=False)       # (a pipelined call's copies are in flight)
        if route is None:               # (the route the peers take with valid buffers)
            route = plan(collective, request.algorithm, None, state.routing)
        if route is Route.HIERARCHICAL and state.hierarchy is not None:
            refuse_hierarchical(state.hierarchy, exc, request)     # (raises)
        error = state.refuse(collective, exc)
        if error is None:
            raise
        raise error from None
    if route is Route.HIERARCHICAL:
        return _hierarchical(state, request, bufs, spent)
    if route is Route.PIPELINED:
        return _pipelined(state, request, bufs, spec, spent, began)
    if spec.residual is not None:
        spec.residual[...] = 0       # (the core writes the blocks it quantised)
    result = core.collective(bufs.send, bufs.recv, spec)
    bufs.finish(ok=not result.err_kind)
    _settle(state, spec, result)
    return stats_of(result, spec, state.rank, state.size, spent)


def _settle(state: State, spec: Any, result: Any) -> None:
    """After a core call: the control loops learn from it, the trace
    records it, and its error, if any, is raised."""
    state.auto.observe(spec.kind, result)
    if state.codes is not None:
        state.codes.observe(result)
    if state.trace is not None:
        state.trace.write(result, spec)
    if result.err_kind:
        raise call_error(spec.collective, result)
    state.lag.watch(result)


def _segment_spec(state: State, request: Request, bufs: Any, k: int, spent: float) -> Any:
    """The spec of segment k of a pipelined call; `spent`: seconds of its
    deadline gone before the segment starts."""
    first, stop = bufs.segments[k]
    residual: Any = request.residual
    if residual is not None:
        residual = check_residual(residual, bufs.send, bufs.recv)
        residual = residual[first:stop]
    count = len(bufs.segments)
    return state.resolver.resolve(request.but(residual=residual), bufs.send[first:stop],
                                  bufs.recv[first:stop], spent, pipeline.part_of(k, count),
                                  segments=count)


def _pipelined(state: State, request: Request, bufs: Any, spec: Any, spent: float,
               began: float) -> CollectiveStats:
    """A GPU all-reduce staged in segments (call/pipeline.py), `spec`
    segment 0's: one core call per segment while the copies of the
    others run, each segment with what is left of the call's deadline.
    The first segment that fails ends the call."""
    core = state.alive()
    segments = bufs.segments
    done: List[CollectiveStats] = []
    ok = False
    try:
        for k, (first, stop) in enumerate(segments):
            if k:           # (what segment 0 accepted: only the sizes differ)
                spec = _segment_spec(state, request, bufs, k,
                                     spent + time.perf_counter() - began)
            if spec.residual is not None:
                spec.residual[...] = 0
            bufs.ready(k)
            result = core.collective(bufs.send[first:stop], bufs.recv[first:stop], spec)
            _settle(state, spec, result)
            bufs.deliver(k)
            done.append(stats_of(result, spec, state.rank, state.size))
        ok = True
    finally:
        bufs.finish(ok=ok)
    return pipeline.merge_stats(done, [stop - first for first, stop in segments],
                                spent + time.perf_counter() - began, state.rank, state.size)


def _hierarchical(state: State, request: Request, bufs: Any, spent: float) -> CollectiveStats:
    """The two-level stages (mpilossy/hierarchy/) on host arrays: the
    request checked against what the layout takes, on every rank; `spent`:
    seconds of the call gone before."""
    h = state.hierarchy
    assert h is not None
    collective = request.collective
    try:
        op = request.op
        if not isinstance(op, str) or op not in ("sum", "avg"):
            raise ValueError(f"op must be one of ['avg', 'sum'], got {op!r}")
        timeout = (state.config.timeout if request.timeout is UNSET
                   else check_timeout("timeout", request.timeout))
        if op == "avg" and not is_float(bufs.send.dtype):
            raise TypeError(f"op='avg' needs a floating-point dtype, got {bufs.send.dtype}")
        h.check(bufs.send, collective)
        weight = request.weight
        if weight is not None:
            weight = state.resolver.weight(weight, op, "direct")
        residual = request.residual
        if residual is not None:
            residual = check_residual(residual, bufs.send, bufs.recv)
        checked = request.but(timeout=timeout, weight=weight, residual=residual)
    except BaseException as exc:
        bufs.finish(ok=False)
        refuse_hierarchical(h, exc, request)        # (raises, on every rank)
    for k in range(len(bufs.segments or ())):   # (staged in segments: all of them here)
        bufs.ready(k)
    if residual is not None:
        residual[...] = 0        # (stage 2 writes what it quantised)
    ok = False
    try:
        if collective == REDUCE_SCATTER:
            stats = hierarchical_reduce_scatter(h, checked, bufs.send, bufs.recv, spent)
        elif collective == ALLGATHER:
            stats = hierarchical_allgather(h, checked, bufs.send, bufs.recv, spent)
        else:
            stats = hierarchical_allreduce(h, checked, bufs.send, bufs.recv, spent)
        for k in range(len(bufs.segments or ())):
            bufs.deliver(k)
        ok = True
    finally:
        bufs.finish(ok=ok)
    return stats


def alone(state: State, request: Request, seq: int) -> CollectiveStats:
    """elastic=True: a call made by survivors that reached the last
    agreement after more calls than this rank, answered with this rank's
    data alone (call/alone.py) on `state`, the communicator before the
    exclusion (abandoned: only its layout and intake are used); checked
    as any call is, not counted on it."""
    bufs: Any = None
    algorithm = "auto" if request.algorithm == "hierarchical" else request.algorithm
    try:
        bufs = state.buffers.take(request.collective, request.sendbuf, request.recvbuf)
        spec = state.resolver.resolve(request.but(algorithm=algorithm), bufs.send, bufs.recv)
    except BaseException:
        if bufs is not None:
            bufs.finish(ok=False)
        raise
    return answer_alone(bufs, spec, state.rank, state.size, state.config.scaling, seq)

