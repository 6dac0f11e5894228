"""One scenario on a simulated platform: mpilossy's calls and MPI's
all-reduce, alternating as in `python -m mpilossy.bench allreduce
--scenario link`, every rank an S4U actor on its node's host.

Model (docs/scale.md says what each choice leaves out):
- a stream (what one rank sends another in one deadline stage) is cut in
  `pieces` messages sent in order, so a stage pipelines into the next at
  that granularity; bytes on the wire include the datagram, UDP/IP and
  Ethernet headers (ud) or TCP/IP and Ethernet (MPI);
- each rank paces its datagrams at 0.95 x port rate / ranks on the node
  (MPILOSSY_UD_RATE, as the emulated cluster's `--pace port` sets it); MPI's
  TCP is not paced; flows share links as SimGrid's network model shares
  them (max-min fairness, CM02 by default: no packets, no queues), and a
  datagram flow served slower than its pace loses the difference instead
  of slowing;
- on the emulated cluster (`cores`) every datagram, to a peer on the node
  too, also costs the sender CPU (`core_rate`), and the hierarchy's node
  stages copy at `copy_rate` a core: each rank at a fixed share of the
  cores, or (`sharing`) mpilossy's work on one host of `cores` cores that
  serves whoever has work, a message in once its bytes and its sender's
  CPU are both done (MPI keeps the fixed share: its waits poll without
  yielding); the time a rank's CPU work takes varies as a gamma process
  of variance `jitter` x its mean (the scheduler, drawn per rank from the
  seed: longer work averages out more);
- a datagram sent before its reader asks for it waits in the reader's
  socket (the rank's actor is its mailbox's permanent receiver); MPI's
  messages wait for their receive;
- a message not in by its stage deadline is late; the stage deadlines are
  the core's (anchor + 0.4 x budget x stage end, at most start + budget);
- random datagram drops (`drop`) enter as expected values: a block crossing
  one hop arrives with probability 1 - drop;
- redundancy=(k, m) (`Scenario.redundancy`): a stream's wire bytes grow by
  (k + m) / k, and a block is kept with the probability that its group lost
  at most m of its k + m records or, failing that, that the block itself
  arrived, every record arriving on its own (_World.kept); loss that comes
  in bursts (a congested port) rebuilds less than that;
- MPI_Allreduce is MPICH's for large buffers (SMP-aware with several ranks
  per node, reduce_scatter_allgather among the leaders); under random drops
  a share of its messages between nodes waits for TCP's retransmission
  timer (mpich.tcp_recovery), drawn per message; the rest of TCP's recovery
  is free.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Callable, List, Sequence, Tuple

from . import _simgrid
from .flows import _Pacer, _wait
from .mpich import mpi_allreduce
from .scenario import Outcome, Scenario
from .traffic import Background, start_background
from .world import _World, _clock

__all__ = ["Background", "Scenario", "Outcome", "simulate", "ALGORITHMS"]

ALGORITHMS = ("direct", "ring", "tree", "hierarchical")
HIER_SHARES = (0.15, 0.25, 0.0375, 0.075)   # hierarchy stage floors (mpilossy/hierarchy/stages.py)


class _Call:
    """One lossy call of every rank: its clock, deadlines and what arrived."""

    def __init__(self, world: _World, number: int, start: float, budget: float) -> None:
        self.w = world
        self.n = number
        self.start = start
        self.budget = budget
        # every rank enters at `start` (the bench lines them up), so the
        # anchor is the start plus the time to see one message from each peer
        self.anchor = start + 2 * world.s.latency

    def stage_deadline(self, lo: float, share_end: float, budget: float) -> float:
        """The core's stage deadline: anchor + 0.4 x budget x stage end, at
        most the budget's end."""
        anchor = max(self.anchor, lo)
        return min(lo + budget, anchor + 0.4 * budget * share_end) if budget > 0 else math.inf

    def key(self, *parts: Any) -> str:
        return ":".join(str(p) for p in (self.n,) + parts)


def _among(call: _Call, me: int, members: Sequence[int]) -> Tuple[Any, Any, int, int, int,
                                                                   Callable[[], float]]:
    """(world, simgrid, group size, my index, pieces per stream, clock)."""
    return call.w, call.w.sg, len(members), members.index(me), call.w.s.pieces, _clock(call.w.sg)


def _direct(call: _Call, me: int, members: Sequence[int], nbytes: float, begin: float,
            budget: float, tag: str, drop: float) -> Tuple[float, float]:
    """The direct all-reduce among `members` (ranks), from time `begin` with
    `budget` seconds: (expected contributors summed over my result's pieces,
    in member units; the number of pieces)."""
    w, sg, P, k, K, clock = _among(call, me, members)
    if P == 1:
        return 1.0, 1.0
    wire = nbytes / P / K * w.ud_frame * w.parity
    others = [members[(k - j) % P] for j in range(1, P)]
    end0 = call.stage_deadline(begin, 0.5, budget)
    end1 = call.stage_deadline(begin, 1.0, budget)
    gets0 = [[w.get(call.key(tag, 0, o, me, i)) for o in others] for i in range(K)]
    gets1 = [[w.get(call.key(tag, 1, o, me, i)) for o in others] for i in range(K)]
    pacer = _Pacer(w, me, begin + budget)
    for i in range(K):              # every contribution row first, as the core queues them
        pacer.send([(call.key(tag, 0, me, o, i), o, wire) for o in others])
    counts: List[float] = []

    def reduce_and_send() -> None:
        for i in range(K):
            arrived = _wait(gets0[i], end0, clock)
            counts.append(1.0 + sum(w.kept((1 - drop) * got) for got in arrived))
            pacer.send([(call.key(tag, 1, me, o, i), o, wire) for o in others])
        pacer.settle()

    reducer = sg.Actor.create(f"r{me}", sg.this_actor.get_host(), reduce_and_send)
    total = 0.0
    # a reducer's count in expectation: each contribution arrives with 1 - drop
    mean_count = 1.0 + w.kept(1 - drop) * (P - 1)
    for i in range(K):
        for got in _wait(gets1[i], end1, clock):
            p = w.kept((1 - drop) * got)
            total += p * mean_count + (1 - p) * 1.0
    reducer.join()
    pacer.close()
    return total + sum(counts), float(P * K)


def _ring(call: _Call, me: int, members: Sequence[int], nbytes: float, begin: float,
          budget: float, tag: str, drop: float) -> Tuple[float, float]:
    """mpilossy's ring: a chain per chunk through every rank (reduce-scatter,
    pipelined by pieces), then the reducer's fan-out to every other rank."""
    w, sg, P, k, K, clock = _among(call, me, members)
    if P == 1:
        return 1.0, 1.0
    left, right = members[(k - 1) % P], members[(k + 1) % P]
    wire = nbytes / P / K * w.ud_frame * w.parity
    hop = 1 - w.kept(1 - drop)      # a hop's block lost for good
    # (partial sums travel in the accumulation type: float32 data, same bytes)
    ends = [call.stage_deadline(begin, (j + 1) / (2.0 * (P - 1)), budget) for j in range(P - 1)]
    end_g = call.stage_deadline(begin, 1.0, budget)
    pacer = _Pacer(w, me, begin + budget)
    reduced = [1.0] * K
    gets_rs = [[w.get(call.key(tag, "rs", j - 1, left, me, i)) for i in range(K)]
               for j in range(1, P)]
    for i in range(K):              # position 0: my chunk starts its chain
        pacer.send([(call.key(tag, "rs", 0, me, right, i), right, wire)])

    def position(j: int) -> None:
        for i in range(K):
            got = _wait([gets_rs[j - 1][i]], ends[j - 1], clock)[0]
            if j < P - 1:
                pacer.send([(call.key(tag, "rs", j, me, right, i), right, wire)])
            else:
                reduced[i] = 1.0 + w.kept((1 - drop) * got) * _chain_mean(j - 1, hop)
                pacer.send([(call.key(tag, "ag", me, o, i), o, wire) for o in members if o != me])
        pacer.settle()

    host = sg.this_actor.get_host()
    helpers = [sg.Actor.create(f"p{me}.{j}", host, position, j) for j in range(1, P)]
    reducer_mean = _chain_mean(P - 1, hop)
    total = 0.0
    gets = [[w.get(call.key(tag, "ag", members[(k - j) % P], me, i)) for j in range(1, P)]
            for i in range(K)]
    for i in range(K):
        for j, got in enumerate(_wait(gets[i], end_g, clock), start=1):
            p = w.kept((1 - drop) * got)
            # my fallback: my own partial of that chunk, at my position in its chain
            total += p * reducer_mean + (1 - p) * _chain_mean(P - 1 - j, hop)
    for h in helpers:
        h.join()
    pacer.close()
    return total + sum(reduced), float(P * K)


def _chain_mean(position: int, drop: float) -> float:
    """Expected contributors at a chain position when each hop arrives with
    1 - drop (a lost hop restarts the chain)."""
    size = 1.0
    for _ in range(position):
        size = 1.0 + (1 - drop) * size
    return size


def _tree(call: _Call, me: int, members: Sequence[int], nbytes: float, begin: float,
          budget: float, tag: str, drop: float, radix: int = 4) -> Tuple[float, float]:
    """The k-ary tree: partial sums up, the result down, piece by piece:
    (expected contributors summed over my result's pieces; the pieces)."""
    from .patterns import tree_depth, tree_levels, tree_shape
    w, sg, P, k, K, clock = _among(call, me, members)
    if P == 1:
        return 1.0, 1.0
    root = call.n % P
    children, levels, parent = tree_shape(k, P, root, radix)
    H = tree_levels(P, radix)
    nst = max(1, 2 * H)
    depth = tree_depth((k - root) % P, radix)
    wire = nbytes / K * w.ud_frame * w.parity
    up = [[w.get(call.key(tag, "up", members[c], me, i)) for c in children] for i in range(K)]
    down = [w.get(call.key(tag, "dn", members[parent], me, i)) for i in range(K)] \
        if parent >= 0 else []
    pacer = _Pacer(w, me, begin + budget)
    subtree = [1.0] * K

    def upward() -> None:
        for i in range(K):
            for c, lv, g in zip(children, levels, up[i]):
                ok = _wait([g], call.stage_deadline(begin, (lv + 1) / nst, budget), clock)[0]
                # (a child's partial sum carries its subtree's contributors)
                subtree[i] += w.kept((1 - drop) * ok) * w.partials.pop(
                    call.key(tag, members[c], i), 1.0)
            if parent >= 0:
                w.partials[call.key(tag, me, i)] = subtree[i]
                pacer.send([(call.key(tag, "up", me, members[parent], i), members[parent], wire)])
            else:
                w.partials[call.key(tag, "root", i)] = subtree[i]
                pacer.send([(call.key(tag, "dn", me, members[c], i), members[c], wire)
                            for c in children])
        pacer.settle()

    climber = sg.Actor.create(f"u{me}", sg.this_actor.get_host(), upward)
    total = 0.0
    for i in range(K):
        if parent >= 0:
            got = _wait([down[i]], call.stage_deadline(begin, (H + depth) / nst, budget), clock)[0]
            if children:
                pacer.send([(call.key(tag, "dn", me, members[c], i), members[c], wire)
                            for c in children])
            # the root's result if every hop above me kept it (in expectation),
            # else my subtree's partial sum
            kept = w.kept(1 - drop) ** depth
            got = w.kept(got)
            whole = w.partials[call.key(tag, "root", i)] if got else 0.0
            total += got * (kept * whole + (1 - kept) * subtree[i]) + (1 - got) * subtree[i]
    climber.join()
    if parent < 0:
        total = sum(subtree)
    pacer.close()
    # (every piece is the whole vector: K results of up to P contributors)
    return total, float(K)


def _hierarchical(call: _Call, me: int, nbytes: float, budget: float,
                  drop: float) -> Tuple[float, float]:
    """The two-level all-reduce: reduce-scatter within the node (shared
    memory, exact), direct across nodes among each slice's owners, then the
    node's all-gathers; the stages' budgets as mpilossy/hierarchy/stages.py."""
    w, sg = call.w, call.w.sg
    s = w.s
    node, local = divmod(me, s.ppn)
    clock = _clock(sg)
    peers = [node * s.ppn + j for j in range(s.ppn) if j != local]
    T = budget
    slice_bytes = nbytes / s.ppn
    def copying(stage: str) -> List[Any]:
        """My slices to every local peer: memory copies, at my share of the
        copy rate on the emulated cluster (a shared window takes what a
        peer writes before its owner reads it)."""
        if w.machine is not None:         # (the rank copies, then reads)
            sends = [w.put(call.key(stage, me, p), slice_bytes, datagrams=False, to=p)
                     for p in peers]
            if w.copy:
                w.compute(me, slice_bytes * len(peers) / w.copy).join()
            for p in peers:
                w.tail(call.key(stage, me, p))
            return sends
        took = w.cpu_time(me, slice_bytes * len(peers) / w.copy) if w.copy else 0.0
        return [w.put(call.key(stage, me, p), slice_bytes, slice_bytes / took if took else 0.0,
                      datagrams=False, to=p) for p in peers]

    # stage 1: my slice from every local peer
    gets = [w.get(call.key("h1", p, me)) for p in peers]
    sends = copying("h1")
    end1 = call.start + HIER_SHARES[0] * T
    local_count = 1 + sum(_wait(gets, end1, clock))
    _wait(sends, end1, clock)
    # stage 2: across nodes, among the owners of my slice
    left = T - (clock() - call.start)
    b2 = max(left - HIER_SHARES[0] * T, HIER_SHARES[1] * T)
    owners = [n * s.ppn + local for n in range(s.nodes)]
    total, pieces = _direct(call, me, owners, slice_bytes, clock(), b2, "h2", drop)
    cross = total / pieces                 # nodes' contributions in my slice
    # stages 3-4: the slices to every local peer
    left = T - (clock() - call.start)
    until = clock() + max(left, HIER_SHARES[3] * T)
    gets = [w.get(call.key("h4", p, me)) for p in peers]
    sends = copying("h4")
    arrived = _wait(gets, until, clock)
    _wait(sends, until, clock)
    # contributors (ranks): my slice holds every node's ranks that made stage 1
    mine = cross * local_count
    others = sum(got * cross * s.ppn + (1 - got) for got in arrived)
    return mine + others, float(s.ppn)


def simulate(scenario: Scenario) -> Outcome:
    """Run one scenario (one SimGrid engine: call in a fresh process)."""
    s = scenario
    if s.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {s.algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if s.algorithm == "hierarchical" and (s.ppn < 2 or s.nodes < 2):
        raise ValueError("the hierarchy needs several nodes of several ranks")
    if s.cores and s.core_rate <= 0:
        raise ValueError(f"cores={s.cores} needs the rate a core sends at (core_rate > 0)")
    sg = _simgrid.load()
    engine = sg.Engine(["mpilossy-sim", "--log=root.thr:critical", "--log=xbt_cfg.thr:critical",
                        f"--cfg=network/model:{scenario.network}"])
    world = _World(sg, s)
    out = Outcome(asdict(s))
    barrier = sg.Barrier(s.size)
    P = s.size

    def rank(me: int) -> None:
        for n in range(s.calls):
            barrier.wait()
            start = sg.Engine.clock
            call = _Call(world, n, start, s.deadline)
            if s.algorithm == "hierarchical":
                total, blocks = _hierarchical(call, me, s.nbytes, s.deadline, s.drop)
                delivered = total / (blocks * P)
            else:
                members = list(range(P))
                fn = {"direct": _direct, "ring": _ring, "tree": _tree}[s.algorithm]
                total, blocks = fn(call, me, members, s.nbytes, start, s.deadline, "f", s.drop)
                delivered = total / (blocks * P)
            out.lossy.append(sg.Engine.clock - start)
            out.delivered.append(min(1.0, delivered))
            if s.mpi:
                barrier.wait()
                began = sg.Engine.clock
                mpi_allreduce(world, n, me)
                out.mpi.append(sg.Engine.clock - began)
        world.done = True

    if s.background:
        start_background(world)
    for r in range(P):
        world.receivers[r] = sg.Actor.create(f"rank{r}", world.host_of(r), rank, r)
    engine.run()
    out.events = world.events
    out.tcp_messages = world.tcp_messages
    return out
