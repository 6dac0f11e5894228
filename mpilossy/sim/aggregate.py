"""The scale model at node granularity: one actor per node and its ranks'
flows merged, so that 1,024 nodes of 8 ranks run in minutes on 2 cores
where the per-rank engine (engine.py) needs about 70 million messages a call.

What is merged, and why the figures survive it (tests/sim/test_aggregate.py
runs both engines on the same scenarios and compares them):

- the hierarchy's node stages are shared-memory copies: a node's ranks move
  (ppn - 1) x nbytes through its memory link in each, one flow here;
- stage 2 (each slice's owners run the direct all-reduce across nodes): a
  node's ppn owners send every other node nbytes / nodes in all, each at its
  rank's pace, so the node sends at ppn times that pace.  The node's peers,
  by offset, are cut in `fanout` contiguous ranges; one flow per range goes
  to the range's middle peer with the whole range's bytes (every peer its
  own flow where nodes - 1 <= fanout).  On a full-bisection fat tree the
  node's port is what the flows share; the range's peer only decides
  whether a flow crosses the spines, which all but a node's 7 leaf
  neighbours do;
- a reducer's count is what actually reached it (the per-rank engine uses
  its expectation under random drops), sent along with its results;
- MPI's side runs at node level too: the node reduce and broadcast through
  shared memory as one flow each, the leaders' reduce_scatter_allgather as
  MPICH runs it (mpich.py), or a ring among the leaders (what NCCL and Gloo
  run) in `ring_steps` super-steps, each carrying the bytes of
  2 (nodes - 1) / ring_steps ring steps and waiting out their latencies.

The learned deadline (`auto=True`): stage 2 runs under its level's learned
deadline as mpilossy/control/deadline.py sets it (its constants and its
scale rule imported, not restated): every PERIOD calls the nodes agree on
the largest 95th percentile of their in-time stage-2 calls and on their
mean cut (share of the blocks a deadline below the cap gave up), applied
LAG calls later as FACTOR x scale x percentile within [floor, cap]; the cap
until the first agreement.  Every node enters each call together (the
bench's barrier), so there are no late peers to wait for.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List, Tuple

import numpy as np

from . import _simgrid
from .engine import HIER_SHARES, _Call
from .flows import _Pacer, _wait
from .world import _World, _clock
from .mpich import TCP_FRAME, TCP_PAYLOAD, _reduce_scatter_allgather
from .scenario import Outcome, Scenario
from .traffic import start_background

__all__ = ["simulate_nodes", "peer_ranges"]

# A flow that the network served at least this close to its pace lost
# nothing: the switch's queue absorbs that much (paced rows overlap by a
# route's latency, a 0.1% overload on a quiet network).
QUEUED = 0.01


def peer_ranges(nodes: int, fanout: int) -> List[Tuple[int, int]]:
    """(offset of the flow's peer, how many peers it stands for): offsets
    1 .. nodes - 1 cut in at most `fanout` contiguous ranges."""
    others = nodes - 1
    parts = max(1, min(fanout, others))
    edges = [1 + (others * j) // parts for j in range(parts + 1)]
    return [((lo + hi - 1) // 2, hi - lo) for lo, hi in zip(edges, edges[1:]) if hi > lo]


class _Learned:
    """Stage 2's learned deadline, shared by every node (they agree on it)."""

    def __init__(self, cap: float, floor: float, target: float) -> None:
        from ..control import deadline as rule
        self.rule = rule
        self.cap, self.floor, self.allowed = cap, floor, 1.0 - target
        self.scale = 1.0
        self.timeout = cap
        self.durations: Dict[int, List[float]] = {}     # node -> in-time stage-2 times
        self.cuts: List[float] = []                     # this period's, every node's calls
        self.due: Dict[int, float] = {}                 # call number -> timeout from then on

    def at(self, call: int) -> float:
        """Stage 2's deadline in call number `call`."""
        if call in self.due:
            self.timeout = self.due.pop(call)
        return self.timeout

    def observe(self, node: int, took: float, cut: float, gone: float, timeout: float) -> None:
        """A node's stage-2 call: its time counts if nothing was late or gone
        (control/deadline.py's observe), its late share is the cut."""
        if cut == 0.0 and gone == 0.0:
            window = self.durations.setdefault(node, [])
            window.append(took)
            del window[:-self.rule.WINDOW]
        if timeout < self.cap:
            self.cuts.append(cut)

    def agree(self, call: int) -> None:
        """After every node ended call `call`: an agreement every PERIOD calls,
        applied LAG calls later."""
        rule = self.rule
        if (call + 1) % rule.PERIOD or not self.durations:
            return
        p95 = max(float(np.percentile(d, rule.PERCENTILE)) for d in self.durations.values() if d)
        cut = float(np.mean(self.cuts)) if self.cuts else 0.0
        self.cuts = []
        largest = max(1.0, self.cap / (rule.FACTOR * p95)) if p95 > 0 else 1.0
        self.scale = rule.next_scale(self.scale, cut, self.allowed, largest)
        new = min(self.cap, max(self.floor, rule.FACTOR * self.scale * p95))
        self.due[call + 1 + rule.LAG] = new


class _Nodes:
    """The world at node level: per-call shared records beside _World's."""

    def __init__(self, world: _World, s: Scenario) -> None:
        self.w = world
        self.s = s
        self.ranges = peer_ranges(s.nodes, s.fanout)
        # what one node sends: ppn ranks at their pace
        self.pace = world.pace * s.ppn
        self.counts: Dict[Tuple[int, int, int], float] = {}

    def local(self, node: int) -> Any:
        return lambda dest: dest == node


def _memory(call: _Call, node: int, tag: str, nbytes: float, until: float) -> bool:
    """A node's shared-memory stage: its ranks' copies as one flow through
    its memory link.  Whether it ended by `until`."""
    w = call.w
    got = w.get(call.key(tag, node))
    sent = w.put(call.key(tag, node), nbytes)
    ok = _wait([got], until, _clock(w.sg))[0]
    _wait([sent], until, _clock(w.sg))
    return ok > 0


def _given_up(arrived: List[float], froms: List[Tuple[int, int]]) -> Tuple[float, float]:
    """What a rank gave up, in peers' worth: (blocks not in by the deadline,
    late; blocks the network dropped datagrams of, gone).  A rank stops
    waiting for a dropped block once its sender's END marks the stream done
    (early close, docs/deadlines.md), so only late blocks hold it to the
    deadline; gone ones do not count as the deadline's cut.  (Both END
    copies dropped, which makes the rank wait for the END's repeat 2 ms
    later, is left out.)  Rounds `arrived` in place: a share within QUEUED
    of whole arrived whole."""
    for j, a in enumerate(arrived):
        if a >= 1.0 - QUEUED:
            arrived[j] = 1.0
    late = sum(c for (_, c), a in zip(froms, arrived) if a == 0.0)
    gone = sum(c * (1.0 - a) for (_, c), a in zip(froms, arrived) if a > 0.0)
    return late, gone


def _stage2(call: _Call, nd: _Nodes, node: int, begin: float, budget: float,
            drop: float) -> Tuple[float, float, float, float]:
    """Stage 2 of one node's ranks: (contributing nodes per block of the
    node's slices, averaged; shares of the blocks it read that were late
    and gone; when it ended)."""
    w, s = nd.w, nd.s
    sg, N, K = w.sg, s.nodes, s.pieces
    clock = _clock(sg)
    if N == 1:
        return 1.0, 0.0, 0.0, clock()
    block = s.nbytes / N / K * w.ud_frame        # the node's bytes for one peer, one piece
    sends = [((node + off) % N, count) for off, count in nd.ranges]
    froms = [((node - off) % N, count) for off, count in nd.ranges]
    end0 = call.stage_deadline(begin, 0.5, budget)
    end1 = call.stage_deadline(begin, 1.0, budget)
    gets0 = [[w.get(call.key("c", src, node, d, i)) for d, (src, _) in enumerate(froms)]
             for i in range(K)]
    gets1 = [[w.get(call.key("r", src, node, d, i)) for d, (src, _) in enumerate(froms)]
             for i in range(K)]
    # (a flow stands for `count` peers' streams from each of the node's owners)
    L = s.ppn
    pacer = _Pacer(w, node, begin + budget, nd.pace, nd.local(node), sharers=L)
    for i in range(K):
        pacer.send([(call.key("c", node, dest, d, i), dest, count * block, count * L)
                    for d, (dest, count) in enumerate(sends)])
    own: List[float] = []
    lost = [0.0, 0.0]                           # late, gone

    def reduce_and_send() -> None:
        for i in range(K):
            arrived = _wait(gets0[i], end0, clock)
            for j, part in enumerate(_given_up(arrived, froms)):
                lost[j] += part
            count = 1.0 + (1 - drop) * sum(c * a for (_, c), a in zip(froms, arrived))
            nd.counts[(call.n, node, i)] = count
            own.append(count)
            pacer.send([(call.key("r", node, dest, d, i), dest, count_d * block, count_d * L)
                        for d, (dest, count_d) in enumerate(sends)])
        pacer.settle()

    reducer = sg.Actor.create(f"r{node}", sg.this_actor.get_host(), reduce_and_send)
    total = 0.0
    for i in range(K):
        arrived = _wait(gets1[i], end1, clock)
        for j, part in enumerate(_given_up(arrived, froms)):
            lost[j] += part
        for (src, c), got in zip(froms, arrived):
            p = (1 - drop) * got
            remote = nd.counts.get((call.n, src, i), 1.0)
            total += c * (p * remote + (1 - p) * 1.0)
    ended = clock()
    reducer.join()
    pacer.close()
    blocks = float(N * K)
    read = 2 * (N - 1) * K
    return (total + sum(own)) / blocks, lost[0] / read, lost[1] / read, ended


def _hierarchical(call: _Call, nd: _Nodes, node: int, T: float, T2: float,
                  drop: float) -> Tuple[float, float, float, float]:
    """One node's hierarchical call: (delivered; stage 2's late and gone
    shares, and its time).  `T`: the call's budget (the node stages' bounds); `T2`: stage
    2's (with the learned deadline its own, else what is left of T)."""
    w, s = nd.w, nd.s
    clock = _clock(w.sg)
    L, P = s.ppn, s.size
    copies = (L - 1) * s.nbytes
    whole = _memory(call, node, "h1", copies, call.start + HIER_SHARES[0] * T)
    local = float(L) if whole else 1.0
    begin = clock()
    if T2 <= 0:
        left = T - (begin - call.start)
        T2 = max(left - HIER_SHARES[0] * T, HIER_SHARES[1] * T)
    cross, late, gone, ended = _stage2(call, nd, node, begin, T2, drop)
    left = T - (clock() - call.start)
    back = _memory(call, node, "h4", copies, clock() + max(left, HIER_SHARES[3] * T))
    mine = cross * local
    others = (L - 1) * (cross * L if back else 1.0)
    # (contributors summed over the node's ppn slices, of P ranks each)
    return (mine + others) / (L * P), late, gone, ended - begin


def _mpi(world: _World, n: int, node: int, ring: bool) -> None:
    """MPI's all-reduce at node level: the node reduce and broadcast in
    shared memory, and among the leaders reduce_scatter_allgather (MPICH's
    MPI_Allreduce) or a ring (`ring`: NCCL's and Gloo's choice)."""
    s = world.s
    tag = f"{'ring' if ring else 'mpi'}{n}"

    def exchange(step: str, peer: int, nbytes: float, send: bool = True, recv: bool = True,
                 frame: float = TCP_FRAME / TCP_PAYLOAD) -> None:
        g = world.get(f"{tag}:{step}:{peer}:{node}") if recv else None
        c = world.put(f"{tag}:{step}:{node}:{peer}", nbytes * frame, datagrams=False) \
            if send else None
        if g is not None:
            g.comm.wait()
        if c is not None:
            c.wait()

    copies = (s.ppn - 1) * s.nbytes
    if copies:
        exchange("reduce", node, copies, frame=1.0)
    N = s.nodes
    if ring and N > 1:
        real = 2 * (N - 1)                  # reduce-scatter, then all-gather
        steps = min(s.ring_steps, real)
        for j in range(steps):
            share = real * (j + 1) // steps - real * j // steps
            g = world.get(f"{tag}:{j}:{(node - 1) % N}:{node}")
            c = world.put(f"{tag}:{j}:{node}:{(node + 1) % N}",
                          share * s.nbytes / N * TCP_FRAME / TCP_PAYLOAD, datagrams=False)
            g.comm.wait()
            c.wait()
            # the latencies of the ring steps this one stands for, after its first
            world.sg.this_actor.sleep_for(world.route_latency * (share - 1))
    else:
        _reduce_scatter_allgather(exchange, node, list(range(N)), s.nbytes)
    if copies:
        exchange("bcast", node, copies, frame=1.0)


def simulate_nodes(scenario: Scenario) -> Outcome:
    """Run one hierarchical (or flat direct) scenario at node level (one SimGrid engine: call
    in a fresh process).  Outcome.lossy, .mpi and .ring hold one time per
    node and call (a node's ranks end together in this model); .timeouts
    stage 2's deadline per call (0: what the fixed deadline leaves it)."""
    s = scenario
    # (at one rank per node the hierarchy's memory stages are empty and its
    # stage 2 is the flat direct all-reduce among all ranks)
    if not (s.algorithm == "hierarchical" or (s.algorithm == "direct" and s.ppn == 1)):
        raise ValueError("the node-level engine models the hierarchy, and direct at one "
                         "rank per node")
    if s.fanout < 1:
        raise ValueError("the node-level engine needs fanout >= 1")
    if scenario.redundancy:
        raise ValueError("the node-level engine does not model parity: redundancy runs on "
                         "the per-rank engine (fanout=0)")
    if s.sharing:
        raise ValueError("the node-level engine does not model shared cores (a node's "
                         "ranks are one actor): sharing runs on the per-rank engine (fanout=0)")
    sg = _simgrid.load()
    engine = sg.Engine(["mpilossy-sim", "--log=root.thr:critical", "--log=xbt_cfg.thr:critical",
                        f"--cfg=network/model:{s.network}"])
    world = _World(sg, s)
    nd = _Nodes(world, s)
    out = Outcome(asdict(s))
    barrier = sg.Barrier(s.nodes)
    learned = _Learned(s.deadline, s.floor, s.target) if s.auto else None
    ended = [0]

    def node_actor(node: int) -> None:
        for n in range(s.calls):
            barrier.wait()
            start = sg.Engine.clock
            call = _Call(world, n, start, s.deadline)
            T2 = learned.at(n) if learned else 0.0
            delivered, cut, gone, took = _hierarchical(call, nd, node, s.deadline, T2, s.drop)
            out.lossy.append(sg.Engine.clock - start)
            out.delivered.append(min(1.0, delivered))
            if learned:
                learned.observe(node, took, cut, gone, T2)
            barrier.wait()
            if node == 0:
                out.timeouts.append(T2)
                if learned:
                    learned.agree(n)
                nd.counts = {k: v for k, v in nd.counts.items() if k[0] > n}
            for ring, times in ((False, out.mpi), (True, out.ring)):
                if s.mpi and (not ring or s.ring_steps):
                    barrier.wait()
                    began = sg.Engine.clock
                    _mpi(world, n, node, ring)
                    times.append(sg.Engine.clock - began)
        ended[0] += 1
        world.done = ended[0] == s.nodes

    if s.background:
        start_background(world)
    for node in range(s.nodes):
        sg.Actor.create(f"node{node}", world.hosts[node], node_actor, node)
    engine.run()
    out.events = world.events
    return out
