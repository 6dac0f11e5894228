"""MPI_Allreduce in the scale model: MPICH's algorithms for large buffers,
the peer every mpilossy figure is a ratio against."""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["mpi_allreduce", "TCP_PAYLOAD", "TCP_FRAME"]

TCP_PAYLOAD, TCP_FRAME = 1448, 1538     # TCP payload and Ethernet frame of a full segment


def mpi_allreduce(world: Any, n: int, me: int) -> None:
    """MPI_Allreduce for large messages as MPICH runs it: with several
    ranks per node (its SMP-aware collectives, on by default) the node's
    ranks reduce to a leader through shared memory, the leaders all-reduce,
    and each leader broadcasts to its node; among the leaders (or all ranks
    on one rank per node) reduce_scatter_allgather: ranks beyond the largest
    power of two fold into a partner, the rest halve the vector by recursive
    halving, then double it back.  TCP between nodes."""
    s = world.s

    def exchange(tag: str, peer: int, nbytes: float, send: bool = True, recv: bool = True) -> None:
        g = world.get(f"m{n}:{tag}:{peer}:{me}") if recv else None
        c = None
        if send:
            if world.same_node(me, peer):
                c = world.put(f"m{n}:{tag}:{me}:{peer}", nbytes, datagrams=False)
            else:
                c = world.put(f"m{n}:{tag}:{me}:{peer}", nbytes * TCP_FRAME / TCP_PAYLOAD,
                              world.cpu, datagrams=False)
        if g is not None:
            g.comm.wait()
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
            world.get(f"m{n}:node-reduce:{leader + j}:{me}").comm.wait()
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
