"""How the model's ranks move messages: waiting for them until a deadline
(_wait) and a rank's paced FIFO sender (_Pacer), over world.py's
primitives; used by engine.py and aggregate.py."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .world import _Arrival, _World, _clock

__all__ = ["_Pacer", "_wait"]


def _wait(comms: Sequence[Any], until: float, clock: Callable[[], float]) -> List[float]:
    """Wait for each comm (or _Arrival) until `until` (absolute) and cancel
    the rest.  Returns what arrived of each: 0 (late), else 1, or an
    arrival's share of its datagrams."""
    done: List[float] = []
    for item in comms:
        arrival = item if isinstance(item, _Arrival) else None
        c = item if arrival is None else arrival.comm
        got = 0.0
        try:
            if arrival is not None:
                got = arrival.share() if arrival.arrived_by(until, clock) else 0.0
            elif until - clock() > 0:
                c.wait_for(until - clock())
                got = 1.0
        except Exception:                        # timeout, or the peer cancelled
            got = 0.0
        if not got:
            try:
                c.cancel()
            except Exception:
                pass
        done.append(got)
    return done


class _Pacer:
    """A rank's datagram sender: rows of messages leave in the order they were
    queued (the core's token bucket is one FIFO), a row's messages to other
    nodes sharing the rank's pace; nothing leaves after the call's budget."""

    def __init__(self, world: _World, me: int, until: float, pace: float = -1.0,
                 local: Optional[Callable[[int], bool]] = None, sharers: int = 1) -> None:
        """`pace`: bytes/s (default: the rank's); `local(dest)`: whether a
        destination shares the sender's memory (default: the rank's node)."""
        self.w, self.me, self.until = world, me, until
        self.rows: Dict[int, List[Any]] = {}      # comms of the rows queued, by sending actor
        self.pace = world.pace if pace < 0 else pace
        self.local = local or (lambda dest: world.same_node(me, dest))
        # the ranks whose CPUs send this pacer's rows (a node's, at node level)
        self.sharers = sharers
        sg = world.sg
        self.queue = sg.Mailbox.by_name(f"pace:{me}:{id(self)}")
        self.actor = sg.Actor.create(f"pacer{me}", sg.this_actor.get_host(), self._run)
        self.queue.set_receiver(self.actor)

    def send(self, row: Optional[Sequence[Tuple[Any, ...]]]) -> None:
        """Queue one row: (key, destination rank, bytes[, streams]) each.  An actor
        that sends rows calls settle() before it ends."""
        # (not detached: a detached comm keeps its sender alive for good, and
        # with it the actor's stack, two memory maps: a reducer's rows took a
        # 256-node run past the kernel's 65,530 maps)
        me = self.w.sg.this_actor.get_pid()
        message = None if row is None else list(row)      # None: the end
        self.rows.setdefault(me, []).append(self.queue.put_async(message, 0))

    def settle(self) -> None:
        """Wait until the pacer has taken the rows this actor queued."""
        for comm in self.rows.pop(self.w.sg.this_actor.get_pid(), []):
            comm.wait()

    def close(self) -> None:
        self.send(None)
        self.actor.join()
        self.settle()
        # (the mailbox's receiver, and references to the actor, which its
        # code holds in turn through this object, would keep it alive too)
        self.queue.set_receiver(None)
        self.actor = None
        self.rows.clear()

    def _row_time(self, remote: Sequence[Tuple[float, int]], local: float = 0.0,
                  cpu_too: bool = True) -> float:
        """Seconds a row of messages takes to leave: the wire bytes to other
        nodes at the pace, every byte (`local`: those to this node) at the
        CPU's rate on the emulated cluster, or the datagrams to other nodes
        at `datagram_cost` each, whichever is longest (0: unpaced and free).
        Each remote message: (wire bytes, how many rank-level streams of
        equal size it stands for); `cpu_too` False: the CPU left out."""
        out = sum(nbytes for nbytes, _ in remote)
        cpu = self.w.cpu * self.sharers if cpu_too else 0.0
        at_cpu = self.w.cpu_time(self.me, (out + local) / cpu) if cpu else 0.0
        if not remote:
            return at_cpu
        at_pace = max(out / self.pace if self.pace else 0.0, at_cpu)
        cost = self.w.s.datagram_cost
        if not cost:
            return at_pace
        frame = self.w.s.payload * self.w.ud_frame
        datagrams = sum(n * math.ceil(nbytes / n / frame - 1e-9) for nbytes, n in remote)
        return max(at_pace, datagrams * cost / self.sharers)

    def _shared_row(self, sends: Sequence[Tuple[Any, int, float, int]],
                    remote: Sequence[Tuple[float, int]], local: float) -> List[Any]:
        """One row on shared cores (_World.machine): the bytes to other nodes
        leave at the pace while the CPU works at whatever share the cores
        give it, and each message is in once both are done (its tail)."""
        w, sg = self.w, self.w.sg
        began = sg.Engine.clock
        out = sum(nbytes for nbytes, _ in remote)
        at_pace = self._row_time(remote, cpu_too=False) if remote else 0.0
        cpu = w.compute(self.me, (out + local) / (w.cpu * self.sharers))
        comms = [w.put(key, nbytes, nbytes / at_pace if at_pace and not self.local(dest) else 0.0,
                       to=dest)
                 for key, dest, nbytes, _ in sends]
        cpu.join()
        for key, _, _, _ in sends:
            w.tail(key)
        rest = min(began + at_pace, self.until) - sg.Engine.clock
        if rest > 0:
            sg.this_actor.sleep_for(rest)
        return comms

    def _run(self) -> None:
        w, sg = self.w, self.w.sg
        clock = _clock(sg)
        flying: List[Any] = []
        while True:
            row = self.queue.get()
            if row is None:
                break
            if clock() >= self.until:
                continue                           # unsent: past the budget
            sends = [(m[0], m[1], m[2], m[3] if len(m) > 3 else 1) for m in row]
            remote = [(nbytes, streams) for _, dest, nbytes, streams in sends
                      if not self.local(dest)]
            local = sum(nbytes for _, dest, nbytes, _ in sends if self.local(dest))
            if w.machine is not None:
                flying += self._shared_row(sends, remote, local)
                continue
            took = self._row_time(remote, local)
            # the row's time split in proportion to the bytes, so that every
            # message of the row ends when the row does (one to this node
            # only where the CPU is charged: it crosses no port)
            flying += [w.put(key, nbytes, nbytes / took if took and (w.cpu or not self.local(dest))
                             else 0.0, to=dest)
                       for key, dest, nbytes, _ in sends]
            if took:
                # the token bucket lets the row out at the pace, whether or
                # not the network keeps up (the switch queues the rest)
                sg.this_actor.sleep_for(min(took, max(0.0, self.until - clock())))
        _wait(flying, self.until, clock)
