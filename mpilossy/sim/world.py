"""The platform a scenario runs on and the primitives its ranks use: hosts
on a fat tree (the ranks of a node sharing a memory link), the emulated
cluster's shared cores, mailboxes, and a message's send (_World.put, its
CPU's tail) and arrival (_Arrival); used by every engine of the package."""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Dict, List

from .scenario import Scenario, fat_tree

__all__ = ["_World", "_Arrival", "_clock", "UD_HEADERS"]

UD_HEADERS = 64 + 28 + 38          # mpilossy's datagram header, UDP/IP, Ethernet framing


def _clock(sg: Any) -> Callable[[], float]:
    return lambda: sg.Engine.clock


class _Arrival:
    """A datagram stream's piece on its way in.  Datagrams are not slowed
    down by a congested port, they are dropped there: a piece whose flow the
    network served slower than its sender's pace arrives with only the share
    the network carried (ideal / actual duration)."""

    __slots__ = ("comm", "key", "world", "tail")

    def __init__(self, comm: Any, key: str, world: _World, tail: Any = None) -> None:
        # `tail`: the semaphore its sender's CPU releases (_World.tail), or None
        self.comm, self.key, self.world, self.tail = comm, key, world, tail

    def wait(self) -> None:
        self.comm.wait()
        if self.tail is not None:
            self.tail.acquire()

    def arrived_by(self, until: float, clock: Callable[[], float]) -> bool:
        """Whether the piece is in by `until` (raises if the peer cancelled)."""
        left = until - clock()
        if left <= 0:
            return False
        self.comm.wait_for(left)                # (raises past `left`)
        if self.tail is None:
            return True
        left = until - clock()
        return left > 0 and not self.tail.acquire_timeout(left)

    def share(self) -> float:
        ideal = self.world.ideal.pop(self.key, 0.0)
        took = self.comm.finish_time - self.comm.start_time
        # (plus the route's latency: a flow at its pace takes that too)
        slack = self.world.route_latency
        return min(1.0, (ideal + slack) / took) if ideal > 0 and took > 0 else 1.0


class _World:
    """The platform, the mailboxes and the send/receive primitives."""

    def __init__(self, sg: Any, scenario: Scenario) -> None:
        self.sg = sg
        self.s = scenario
        self.events = 0
        self.tcp_messages = 0
        self.holders: List[Any] = []
        self.receivers: Dict[int, Any] = {}        # rank -> its actor (the per-rank engine)
        self.ideal: Dict[str, float] = {}
        self.partials: Dict[str, float] = {}        # a partial sum's contributors, by sender
        self.done = False
        root = sg.NetZone.create_full_zone("world")
        self.hosts: Dict[int, Any] = {}

        def netpoint(zone: Any, coord: Any, ident: int) -> Any:
            host = zone.create_host(f"node-{ident}", 1e9)
            host.core_count = scenario.ppn
            host.seal()
            self.hosts[ident] = host
            return host.netpoint, None

        def loopback(zone: Any, coord: Any, ident: int) -> Any:
            link = zone.create_link(f"memory-{ident}", scenario.memory)
            link.set_latency(1e-6)
            return link.seal()

        def limiter(zone: Any, coord: Any, ident: int) -> Any:
            return zone.create_link(f"limit-{ident}", 1e15).seal()

        levels, down, up, count = fat_tree(scenario)
        zone = sg.NetZone.create_fatTree_zone(
            "fabric", root, sg.FatTreeParams(levels, down, up, count),
            sg.ClusterCallbacks(netpoint, loopback, limiter),
            scenario.rate / 8, scenario.latency, sg.Link.SharingPolicy.SPLITDUPLEX)
        zone.seal()
        # the emulated cluster's cores as one host that serves every rank's
        # CPU work at once (processor sharing, one core at most a piece of
        # work), when the cores are shared rather than split in fixed shares
        self.machine = None
        self.tails: Dict[str, Any] = {}             # message -> its sender's CPU done (shared cores)
        if scenario.cores and scenario.sharing:
            self.machine = root.create_host("cores", scenario.core_rate)
            self.machine.core_count = scenario.cores
            self.machine.seal()
        root.seal()
        if len(self.hosts) < scenario.nodes:
            raise ValueError(f"the fat tree {scenario.tree} has {len(self.hosts)} nodes, "
                             f"fewer than {scenario.nodes}")
        frame = (scenario.payload + UD_HEADERS) / scenario.payload
        self.ud_frame = frame
        # what one rank can push: its pace, and on an oversubscribed machine
        # (the emulated cluster: every rank on `cores` shared cores) its CPU
        share = min(1.0, scenario.cores / scenario.size) if scenario.cores else 0.0
        self.cpu = scenario.core_rate * share
        self.copy = scenario.copy_rate * share     # the node stages' copies; 0: the memory link's
        pace = 0.95 * scenario.rate / 8 / scenario.ppn if scenario.pace else 0.0
        caps = [r for r in (pace, scenario.seal_rate) if r > 0]
        # (the shared cores are charged apart, by the pacer: every byte, local too)
        self.pace = min(caps) if caps else 0.0
        self._rngs: Dict[int, random.Random] = {}
        k, m = scenario.redundancy or (1, 0)
        self.parity = (k + m) / k           # wire bytes per data byte
        self._groups = (k, m)

    def kept(self, q: float) -> float:
        """The share of a stream's data blocks the reader has when each
        record arrives with probability `q` on its own: every block of a
        group that lost at most m of its k + m records (rebuilt), else those
        that arrived.  `q` itself without redundancy."""
        k, m = self._groups
        if not m or q >= 1.0 or q <= 0.0:
            return q
        n = k + m
        return sum(math.comb(n, j) * q ** j * (1 - q) ** (n - j) * (1.0 if j >= k else j / n)
                   for j in range(n + 1))

    def cpu_time(self, rank: int, seconds: float) -> float:
        """How long CPU work of `seconds` (at the rank's mean share of the
        cores) takes this time: a gamma draw of that mean and variance
        jitter x seconds, so that a rank's work split in parts takes what
        it takes whole, in distribution."""
        theta = self.s.jitter
        if theta <= 0 or seconds <= 0:
            return seconds
        rng = self._rngs.setdefault(rank, random.Random(f"{self.s.seed}:cpu:{rank}"))
        return rng.gammavariate(seconds / theta, theta)

    def compute(self, rank: int, seconds: float) -> Any:
        """Start CPU work that takes `seconds` at the rank's mean share of
        the shared cores (jittered as cpu_time), served by the cores with
        every other rank's work of the moment; join() the actor returned."""
        work = self.cpu_time(rank, seconds) * self.cpu
        return self.sg.Actor.create(f"cpu{rank}", self.machine, self.sg.this_actor.execute, work)

    def tail(self, key: str) -> None:
        """Mark message `key` sent by its sender's CPU: with shared cores
        (`machine`) its bytes may cross the wire before the CPU that sends
        them is done, but are not in before.  (A semaphore, not a message:
        a message would take a share of the links its data flows use.)"""
        self._tail(key).release()

    def _tail(self, key: str) -> Any:
        sem = self.tails.get(key)
        if sem is None:
            sem = self.tails[key] = self.sg.Semaphore(0)
        return sem

    @property
    def route_latency(self) -> float:
        """One way between two nodes at the far ends of the tree (an upper
        bound for the nearer ones)."""
        return 2 * self.s.latency * (len(self.s.tree) // 3 + 1)

    def host_of(self, rank: int) -> Any:
        return self.hosts[rank // self.s.ppn]

    def same_node(self, a: int, b: int) -> bool:
        return a // self.s.ppn == b // self.s.ppn

    def put(self, key: str, nbytes: float, rate: float = 0.0, datagrams: bool = True,
            to: int = -1) -> Any:
        """Send `nbytes` on mailbox `key` (at most at `rate`).  `to`: the
        receiving rank, whose socket takes datagrams before it asks for them
        (without it a message waits for its get, as MPI's do)."""
        box = self.sg.Mailbox.by_name(key)
        if to in self.receivers:
            box.set_receiver(self.receivers[to])
        comm = box.put_init(None, max(1, int(nbytes)))
        if rate > 0:
            comm.set_rate(rate)
            if datagrams:
                self.ideal[key] = int(nbytes) / rate
        self.events += 1
        return comm.start()

    def get(self, key: str, charged: bool = True) -> "_Arrival":
        """Receive on mailbox `key`; `charged`: its sender's CPU sends it,
        so that with shared cores its tail() is waited for too."""
        comm, holder = self.sg.Mailbox.by_name(key).get_async()
        # (the holder receives the payload: it must outlive the comm)
        self.holders.append(holder)
        tail = self._tail(key) if charged and self.machine is not None else None
        return _Arrival(comm, key, self, tail)
