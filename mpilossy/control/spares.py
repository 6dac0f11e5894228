"""Hot spares (Communicator(elastic=True, spares=k); docs/elastic.md,
"Growing back"): the last k ranks of the user's communicator wait outside
the working communicator until the survivors of an exclusion call them in.

Why spares, not MPI_Comm_spawn: with the ``mpich`` wheel a spare called in
joins the survivors' MPI_Comm_create_group under mpiexec and under srun
(pmi2), where MPI_Comm_spawn hung (tests/programs/rank_replaced.py).

Before the call-in the lowest survivor pings the spares it is about to
call (a spare that hangs would hang the survivors' MPI_Comm_create_group);
one that does not answer within a bound is agreed gone with those MPI
reports failed (growth.py's Growth._drop_lost_spares), and the next is asked.  The
call-in is one message from the lowest survivor to each spare it
calls, on a duplicate of the user's communicator that every rank made at
construction; then the survivors and the spares called in build the grown
communicator (MPI_Comm_create_group over them only: ranks that are gone
take no part).  At the end the lowest rank still in releases the spares
nobody called.

A rank that the others excluded while it hung, and that woke, can come
back the same way (Communicator.stand_by on an excluded rank): it offers
itself to the ranks that were in with it (an ENLIST message), and the
ranks still in agree on the offers they heard (Elastic.grow: one
nonblocking MPI_Iallreduce per grow() while a place is free) before they
take offered ranks in as spares, in the order of their ranks.  Offers are
numbered by their sender (its first, second, ... time back): an offer
heard late, after the one it repeats was taken (a rank that was a spare
or out when it came reads it when it is in again), is older than what was
taken from that rank and never calls in a rank that has since left again.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from mpi4py import MPI

from .failures import failed_ranks

__all__ = ["Spares", "CALL_IN", "RELEASE", "ENLIST", "PING", "PONG"]

CALL_IN, RELEASE = 31, 32           # message tags on the parent duplicate
ENLIST = 34                         # an excluded rank that woke offers itself as a spare
GROW = 33                           # MPI_Comm_create_group's tag (+ the growth number)
PING, PONG = 35, 36                 # is a spare about to be called in still there?
POLL = 0.005                        # seconds between a waiting spare's looks


class Spares:
    """The parent duplicate and the spares not called yet (the same on
    every rank still in: they are taken in order, as agreed exclusions
    free places)."""

    def __init__(self, parent: MPI.Intracomm, count: int) -> None:
        self.parent = parent
        self.left: List[int] = list(range(parent.Get_size() - count, parent.Get_size()))
        self.growths = 0
        # offers heard and not taken yet: rank -> its number (the sender's count of offers)
        self.offers: Dict[int, int] = {}
        # the number of the last offer taken from each rank (the same on every rank in:
        # agreed, and sent to a spare with its call-in)
        self.taken: Dict[int, int] = {}
        self.offered = 0                # offers this rank made
        self.pings = 0                  # pings this rank sent (each round numbered)
        self._sends: List[MPI.Request] = []     # offers not yet sent through
        # the ranks whose end leaves nobody to call this rank in (a spare: the
        # working ranks; a rank that came back: those it offered itself to)
        self.callers: List[int] = list(range(parent.Get_size() - count))

    def grown(self, members: List[int], places: int, rank: int, info: Dict[str, Any]
              ) -> Tuple[MPI.Intracomm, Tuple[int, ...]]:
        """Collective over `members` (ranks of the parent, this rank's
        `rank` among them) and the spares called in: call in up to
        `places` spares (the lowest member sends each its call-in: the
        members it joins and `info`) and build the grown communicator,
        members first.  (it, the spares called in)"""
        called, self.left = self.left[:places], self.left[places:]
        everyone = list(members) + called
        message = dict(info, members=everyone, growth=self.growths, left=self.left,
                       taken=self.taken)
        if rank == 0:
            for spare in called:
                self.parent.send(message, dest=spare, tag=CALL_IN)
        return self._build(everyone), tuple(called)

    def _build(self, everyone: List[int]) -> MPI.Intracomm:
        group = self.parent.Get_group()
        try:
            chosen = group.Incl(everyone)
        finally:
            group.Free()
        try:
            comm = self.parent.Create_group(chosen, tag=GROW + self.growths)
        finally:
            chosen.Free()
        self.growths += 1
        return comm

    def release(self, members: Iterable[int]) -> None:
        """The lowest rank still in, at the end: every spare not called
        goes home (Communicator.stand_by returns False there), and so does
        every rank out of `members` that MPI does not report failed (one
        excluded while it hung may wake and offer itself later)."""
        gone = failed_ranks(self.parent)
        out = set(range(self.parent.Get_size())) - set(members)
        for rank in sorted((out | set(self.left)) - gone):
            self.parent.send(None, dest=rank, tag=RELEASE)
        self.left = []

    def drop(self, dead: Iterable[int]) -> None:
        """The spares the ranks in agreed are gone: never called in."""
        gone = set(dead)
        self.left = [r for r in self.left if r not in gone]

    def offer(self, to: Iterable[int]) -> None:
        """On an excluded rank that woke: offer itself as a spare to `to`
        (ranks of the parent that were in with it), without waiting."""
        gone = failed_ranks(self.parent)
        self.offered += 1
        self.callers = [r for r in to if r not in gone]
        # (a request to a rank that exited may never complete: keep only those)
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends += [self.parent.isend(self.offered, dest=r, tag=ENLIST)
                        for r in self.callers]

    def ping(self, spares: Iterable[int]) -> int:
        """Ask `spares` whether they are there, without waiting; returns the
        round's number, which their answers carry (answers() reads them)."""
        self.pings += 1
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends += [self.parent.isend(self.pings, dest=r, tag=PING) for r in spares]
        return self.pings

    def answers(self, number: int) -> Set[int]:
        """The spares whose answer to ping round `number` came so far (older
        rounds' answers are read and dropped)."""
        status = MPI.Status()
        came: Set[int] = set()
        while self.parent.iprobe(MPI.ANY_SOURCE, PONG, status):
            source = status.Get_source()
            if self.parent.recv(source=source, tag=PONG) == number:
                came.add(source)
        return came

    def silent(self, spares: List[int], bound: float,
               between: Callable[[], None]) -> Set[int]:
        """Ping `spares` and wait up to `bound` seconds for their answers,
        calling `between` between two looks (the caller's heartbeat and
        pause); the spares that did not answer.  A spare standing by
        answers within its own poll (POLL)."""
        if not spares:
            return set()
        number = self.ping(spares)
        began = time.monotonic()
        came: Set[int] = set()
        while True:
            came |= self.answers(number)
            if came >= set(spares) or time.monotonic() - began > bound:
                return set(spares) - came
            between()

    def _file(self, source: int, number: int) -> None:
        if number > self.taken.get(source, 0):
            self.offers[source] = max(number, self.offers.get(source, 0))

    def heard(self) -> Dict[int, int]:
        """The offers that reached this rank so far and were not taken:
        rank -> the offer's number."""
        status = MPI.Status()
        while self.parent.iprobe(MPI.ANY_SOURCE, ENLIST, status):
            source = status.Get_source()
            self._file(source, self.parent.recv(source=source, tag=ENLIST))
        return dict(self.offers)

    def enlist(self, agreed: Dict[int, int], members: Iterable[int]) -> List[int]:
        """Take the `agreed` offers (rank -> number, the same on every rank
        still in) newer than those taken before as spares, after those
        left, in the order of their ranks; returns them."""
        new = sorted(r for r, n in agreed.items() if n > self.taken.get(r, 0)
                     and r not in set(members) and r not in self.left)
        for r, n in agreed.items():
            self.taken[r] = max(n, self.taken.get(r, 0))
        self.offers = {r: n for r, n in self.offers.items() if n > self.taken.get(r, 0)}
        self.left += new
        return new

    def stand_by(self, bound: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """On a spare: wait for a call-in (its message, once the grown
        communicator is built: `message["comm"]`) or a release (None).
        Also None when MPI reports every one of `callers` failed, or after
        `bound` seconds."""
        began = time.monotonic()
        status = MPI.Status()
        while True:
            if self.parent.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                tag = status.Get_tag()
                message = self.parent.recv(source=status.Get_source(), tag=tag)
                if tag == ENLIST:           # (for when this rank is in again)
                    self._file(status.Get_source(), message)
                    continue
                if tag == PING:
                    self._sends = [r for r in self._sends if not r.Test()]
                    self._sends.append(self.parent.isend(message, dest=status.Get_source(),
                                                         tag=PONG))
                    continue
                if tag == RELEASE:
                    return None
                if tag == CALL_IN:
                    self.growths, self.left = message["growth"], message["left"]
                    self.taken = dict(message["taken"])
                    self.offers = {r: n for r, n in self.offers.items()
                                   if n > self.taken.get(r, 0)}
                    message["comm"] = self._build(message["members"])
                    return message
            if set(self.callers) <= failed_ranks(self.parent):
                return None
            if bound is not None and time.monotonic() - began > bound:
                return None
            time.sleep(POLL)
