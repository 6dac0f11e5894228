"""MPI_Allreduce in the scale model: MPICH's algorithms for large buffers,
the peer every mpilossy figure is a ratio against."""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

__all__ = ["mpi_allreduce", "tcp_recovery", "TCP_PAYLOAD", "TCP_FRAME", "RTO_MIN",
           "RTO_SHARE"]

TCP_PAYLOAD, TCP_FRAME = 1448, 1538     # TCP payload and Ethernet frame of a full segment
# TCP's recovery from random drops.  Most losses are repaired within a round
# trip (fast retransmit, tail loss probes); a message whose loss is not waits
# for the retransmission timer: Linux's minimum, 200 ms, doubled for each
# retransmission lost again.  RTO_SHARE: messages that wait for it, per unit
# of drop probability; fitted on the emulated cluster (docs/scale.md,
# "Calibration"; `python -m mpilossy.sim calibrate` fits it again).
RTO_MIN = 0.2
RTO_SHARE = 0.46


def tcp_recovery(seed: int, key: str, drop: float, share: float) -> float:
    """Seconds one TCP message between nodes waits for retransmission timers
    under random drops `drop` (0.0: repaired in a round trip, or no loss),
    drawn from the message's own key (the same on every run of a seed)."""
    if drop <= 0 or share <= 0:
        return 0.0
    rng = random.Random(f"{seed}:{key}")
    if rng.random() >= min(1.0, share * drop):
        return 0.0
    waited, timer = RTO_MIN, RTO_MIN
    while rng.random() < drop:          # the retransmission was dropped too
        timer *= 2
        waited += timer
    return waited


def mpi_allreduce(world: Any, n: int, me: int) -> None:
    """MPI_Allreduce for large messages as MPICH runs it: with several
    ranks per node (its SMP-aware collectives, on by default) the node's
    ranks reduce to a leader through shared memory, the leaders all-reduce,
    and each leader broadcasts to its node; among the leaders (or all ranks
    on one rank per node) reduce_scatter_allgather: ranks beyond the largest
    power of two fold into a partner, the rest halve the vector by recursive
    halving, then double it back.  TCP between nodes, with its
    retransmission timeouts under random drops (tcp_recovery)."""
    s = world.s

    def exchange(tag: str, peer: int, nbytes: float, send: bool = True, recv: bool = True) -> None:
        key = f"m{n}:{tag}:{peer}:{me}"
        # (MPI's CPU is its fixed share of the cores in either model: a
        # rank waiting in MPICH's progress engine polls without yielding)
        g = world.get(key, charged=False) if recv else None
        c = None
        if send:
            out = f"m{n}:{tag}:{me}:{peer}"
            if world.same_node(me, peer):
                c = world.put(out, nbytes, datagrams=False)
            else:
                wire = nbytes * TCP_FRAME / TCP_PAYLOAD
                took = world.cpu_time(me, wire / world.cpu) if world.cpu else 0.0
                c = world.put(out, wire, wire / took if took else 0.0, datagrams=False)
                world.tcp_messages += 1
        if g is not None:
            g.wait()
            if not world.same_node(me, peer):
                # (the bytes are in but for a loss the timer repairs)
                late = tcp_recovery(s.seed, key, s.drop, s.rto_share)
                if late:
                    world.sg.this_actor.sleep_for(late)
        if c is not None:
            c.wait()

    node, local = divmod(me, s.ppn)
    leader = node * s.ppn
    smp = s.ppn > 1 and s.nodes > 1
    if smp and local:
        exchange("node-reduce", leader, s.nbytes, recv=False)
        exchange("node-bcast", leader, s.nbytes, send=False)
        return
    if smp:
        for j in range(1, s.ppn):
            world.get(f"m{n}:node-reduce:{leader + j}:{me}", charged=False).wait()
        members = [k * s.ppn for k in range(s.nodes)]
    else:
        members = list(range(s.size))
    _reduce_scatter_allgather(exchange, members.index(me), members, s.nbytes)
    if smp:
        sends = [world.put(f"m{n}:node-bcast:{me}:{leader + j}", s.nbytes, datagrams=False)
                 for j in range(1, s.ppn)]
        for c in sends:
            c.wait()


def _reduce_scatter_allgather(exchange: Callable[..., None], me: int, members: Sequence[int],
                              nbytes: float) -> None:
    P = len(members)
    if P == 1:
        return
    pof2 = 1 << (P.bit_length() - 1)
    rem = P - pof2
    if me < 2 * rem:
        if me % 2 == 0:
            exchange("fold", members[me + 1], nbytes, recv=False)
            newrank = -1
        else:
            exchange("fold", members[me - 1], nbytes, send=False)
            newrank = me // 2
    else:
        newrank = me - rem

    def real(v: int) -> int:
        return members[v * 2 + 1 if v < rem else v + rem]

    if newrank >= 0:
        size = float(nbytes)
        mask = 1
        while mask < pof2:
            size /= 2
            exchange(f"rs{mask}", real(newrank ^ mask), size)
            mask <<= 1
        mask = pof2 >> 1
        while mask > 0:
            exchange(f"ag{mask}", real(newrank ^ mask), size)
            size *= 2
            mask >>= 1
    if me < 2 * rem:
        if me % 2:
            exchange("unfold", members[me - 1], nbytes, recv=False)
        else:
            exchange("unfold", members[me + 1], nbytes, send=False)
