"""How an elastic Communicator grows back (survivors.py's Elastic holds
one Growth when it was built with spares or a rendezvous): the places
that exclusions freed, and the newcomers that fill them at
Communicator.grow().  With spares (control/spares.py), the spares called
in, after the ranks in agreed to drop those that MPI reports failed or
that do not answer a ping; once no spare is left, the offers of excluded
ranks that woke, agreed at grow() (one nonblocking MPI_Iallreduce on a
duplicate of the ranks' communicator, started at one grow() and read at
the next) before they are taken as spares.  With a rendezvous
(control/rendezvous.py), processes started after the loss: each grow()
agrees on whether one is waiting (one small MPI_Iallreduce) and the
growth accepts it through MPI's ports; newcomers are numbered from the
size of the user's communicator on, in order of arrival.  Every
agreement here waits with the membership's heartbeat going on (Elastic's
wait), so a rank that hangs meanwhile is excluded, not waited for."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import numpy as np
from mpi4py import MPI

from .call import environment
from .call.config import Config
from .control.agreement import Agreement, linger
from .control.elastic import POLL, Membership
from .control.failures import failed_ranks, survivors
from .control.rendezvous import Refused, Rendezvous, directory_problem
from .control.spares import Spares
from .state import State

__all__ = ["Growth", "Grown", "opened", "shared_settings", "ANSWER"]

# seconds a newcomer about to come in has to answer (a spare, a ping; a
# process at the rendezvous, by taking its port), half of elastic_wait at most
ANSWER = 1.0

# Elastic.wait: None once the request completed, else (the survivors' state,
# the ranks excluded meanwhile, done)
Wait = Callable[[State, MPI.Request, bool], Optional[Tuple[State, Tuple[int, ...], bool]]]
# what a growth hands back to Elastic: (the grown communicator, to build the
# state on and free; what the ranks in learned; the newcomers' members)
Grown = Tuple[MPI.Intracomm, Any, Tuple[int, ...]]


def opened(comm: MPI.Intracomm, config: Config, serial: int, learned: Any, offers: bool
           ) -> Tuple[State, Optional[MPI.Intracomm]]:
    """Collective over `comm` (freed here): the state built whole on it,
    without hierarchy, warmed with `learned`, and if `offers` a duplicate
    of it for Growth's agreements.  The same steps on the ranks in and on
    the newcomers, so that their collectives match."""
    try:
        state = State.open(comm, config, serial, layout=True)
        duplicate = comm.Dup() if offers else None
    finally:
        comm.Free()
    state.warm(learned)
    return state, duplicate


def shared_settings(config: Config) -> Dict[str, Any]:
    """What a newcomer through a rendezvous takes from the ranks in: every
    Communicator argument and every setting that must agree (the rest,
    such as the datagram domain, is its host's own)."""
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.metadata["argument"] or f.metadata["agreed"]}


class Growth:
    """The places free and the newcomers that fill them, on one rank in."""

    def __init__(self, membership: Membership, wait: Wait, spares: Optional[Spares],
                 rendezvous: Optional[Rendezvous], offers: Optional[MPI.Intracomm],
                 joining: Optional[Dict[str, Any]], size: int) -> None:
        """`offers`: the duplicate of the communicator that agrees on
        offers and knocks (None: made at the next rebound()); `joining`:
        on a newcomer, what the ranks in sent it; `size`: the ranks at the
        start (newcomers through a rendezvous are numbered from it)."""
        self.membership = membership
        self.wait = wait
        self.spares = spares
        self.rendezvous = rendezvous
        self.places = 0                     # ranks excluded and not replaced yet
        # (a rendezvous: the knock the lowest rank found, the processes agreed to
        # come at this grow(), and the number the next newcomer gets as a member)
        self.knock: Optional[str] = None
        self.arriving = 0
        self.next_id = size
        # (agreeing on offers and knocks; the agreement on offers in flight,
        # started at one grow() and read at the next)
        self.offer_comm = offers
        self.offering: Optional[Agreement] = None
        if joining is not None:
            self.places = joining["places"]
            self.next_id = joining.get("next_id", self.next_id)

    @staticmethod
    def problem(state: State, rendezvous: Optional[Rendezvous]) -> Optional[str]:
        """Why this rank cannot grow through `rendezvous` (checked on every
        rank before the communicator is built), or None."""
        if rendezvous is None:
            return None
        where = directory_problem(rendezvous.directory)
        if where is not None:
            return where
        if state.channel != "ud":
            # (tried: 6 of 22 newcomers stayed in; a survivor waited in a reliable
            # collective the others had left until elastic_wait: docs/elastic.md)
            return (f"rendezvous= needs channel='ud' (this one is {state.channel!r}): "
                    f"one-sided calls with a process started outside the job stall")
        return None

    def can(self) -> bool:
        """Places to fill and spares (or an agreed newcomer) to fill them:
        the same on every rank in (they follow from agreed exclusions and
        agreements)."""
        return bool(self.places and ((self.spares is not None and self.spares.left)
                                     or self.arriving))

    def prepare(self, state: State) -> Tuple[State, Tuple[int, ...]]:
        """At grow(), before the agreement: the offers, the knocks, and the
        spares lost while they stood by.  (the state, the ranks excluded
        meanwhile: the caller returns at once)"""
        steps = []
        if self.places and self.spares is not None and not self.spares.left:
            steps.append(self._take_offers)
        if self.places and self.rendezvous is not None:
            steps.append(self._hear_knocks)
        for step in steps:
            state, excluded = step(state)
            if excluded:
                return state, excluded
        if self.can() and self.spares is not None:
            return self._drop_lost_spares(state)
        return state, ()

    def _take_offers(self, state: State) -> Tuple[State, Tuple[int, ...]]:
        """A place is free and no spare left: read the agreement on offers
        started at the last grow() (the offers every rank in had heard
        then, the same result everywhere) and take them as spares, or
        start one."""
        assert self.spares is not None and self.offer_comm is not None
        pending = self.offering
        if pending is not None:
            outcome = self.wait(state, pending.request, False)
            if outcome is not None:
                fresh, excluded, _ = outcome
                return fresh, excluded
            self.offering = None
            agreed = {int(r): int(pending.recv[r]) for r in np.flatnonzero(pending.recv)}
            taken = self.spares.enlist(agreed, self.membership.members)
            if taken:
                environment.log.warning("ranks %s offered to come back: spares now %s",
                                        taken, self.spares.left)
                return state, ()
        send = np.zeros(self.spares.parent.Get_size(), dtype=np.int64)
        for rank, number in self.spares.heard().items():
            send[rank] = number
        recv = np.zeros_like(send)
        self.offering = Agreement(self.offer_comm.Iallreduce(send, recv, op=MPI.MAX),
                                  send, recv, 0)
        return state, ()

    def _hear_knocks(self, state: State) -> Tuple[State, Tuple[int, ...]]:
        """A place is free and a rendezvous set: the lowest rank in looks
        for a newcomer waiting whose processes fit the places, and the
        ranks in agree on it."""
        assert self.rendezvous is not None
        self.knock, self.arriving = None, 0
        send = np.zeros(1, dtype=np.int64)
        if self.membership.rank == 0:
            for knock, size in self.rendezvous.knocks():
                if size <= self.places:
                    self.knock, send[0] = knock, size
                    break
        recv, switched = self._agree_max(state, send)
        if switched is not None:
            return switched
        self.arriving = int(recv[0])
        return state, ()

    def _agree_max(self, state: State, send: np.ndarray
                   ) -> Tuple[np.ndarray, Optional[Tuple[State, Tuple[int, ...]]]]:
        """The elementwise MAX of `send` over the ranks in (one small
        MPI_Iallreduce on the duplicate for offers, waited for with the
        heartbeat going on): (it, None), or (_, (the survivors' state, the
        ranks excluded)) if ranks were excluded meanwhile (the agreement
        abandoned)."""
        assert self.offer_comm is not None
        recv = np.zeros_like(send)
        request = self.offer_comm.Iallreduce(send, recv, op=MPI.MAX)
        outcome = self.wait(state, request, False)
        if outcome is None:
            return recv, None
        linger(request, send, recv)
        fresh, excluded, _ = outcome
        return recv, (fresh, excluded)

    def _drop_lost_spares(self, state: State) -> Tuple[State, Tuple[int, ...]]:
        """Before spares are called in: the ranks in agree on the spares
        that any of them sees reported failed by MPI, or that did not
        answer the lowest rank's ping (one that hangs), and drop them (the
        survivors' MPI_Comm_create_group would wait for such a spare for
        ever); then the same for the spares next in line, until those to
        be called all answered or none is left.  One small MPI_Iallreduce
        a round."""
        assert self.spares is not None
        while self.can():
            left = list(self.spares.left)           # (the same on every rank in)
            gone = failed_ranks(self.spares.parent)
            silent: Set[int] = set()
            if self.membership.rank == 0:
                calling = [spare for spare in left if spare not in gone][:self.places]
                silent = self._silent(calling)
            send = np.array([spare in gone or spare in silent for spare in left],
                            dtype=np.int64)
            recv, switched = self._agree_max(state, send)
            if switched is not None:
                return switched
            dead = [spare for spare, lost in zip(left, recv) if lost]
            if not dead:
                break
            self.spares.drop(dead)
            environment.log.warning("spares %s are reported failed or did not answer: not "
                                    "called in; spares now %s", dead, self.spares.left)
        return state, ()

    def _silent(self, spares: List[int]) -> Set[int]:
        """On the lowest rank in: the spares among `spares` that did not
        answer a ping within the answer's bound, the heartbeat going on
        meanwhile."""
        assert self.spares is not None
        return self.spares.silent(spares, self._answer_bound(), self._beating())

    def _answer_bound(self) -> float:
        return min(ANSWER, self.membership.wait / 2)

    def _beating(self) -> Callable[[], None]:
        """What the lowest rank does between its looks for a newcomer's
        answer: the heartbeat (suspects: the agreement's wait sees them)."""
        began = time.monotonic()

        def between() -> None:
            self.membership.waiting(began)
            time.sleep(POLL)

        return between

    def lost(self, count: int) -> None:
        """An agreement put `count` ranks out: as many places free."""
        self.places += count

    def fill(self, state: State, out: FrozenSet[int], grow: bool) -> Optional[Grown]:
        """After an agreement (`grow`: it agreed to grow), collective over
        the ranks going on (those not in `out`) and the newcomers they
        agreed on: the newcomer knocking, accepted through the rendezvous,
        or as many spares as places are free.  None if there is none to
        take in, or the newcomer could not be (the caller switches to the
        survivors alone if ranks are out).  The newcomer's knock is on the
        lowest rank: if that rank is out, it waits for the next growth."""
        try:
            if grow and self.arriving and 0 not in out:
                return self._admit(state, out)
            if grow and self.can() and not self.arriving:   # (agreed: every rank going on can)
                return self._call_in(state, out)
            return None
        finally:
            self.arriving = 0

    def _call_in(self, state: State, out: FrozenSet[int]) -> Grown:
        """The spares called in (SpareSeat.stand_by is their side)."""
        assert self.spares is not None
        membership = self.membership
        kept = [m for r, m in enumerate(membership.members) if r not in out]
        places = min(self.places, len(self.spares.left))
        self.places -= places
        info = self._info(state)
        self.drop_offers()
        grown, joined = self.spares.grown(
            kept, places, kept.index(membership.members[membership.rank]), info)
        try:
            learned = grown.bcast(state.learned(), root=0)     # (to the spares: rank 0's)
        except BaseException:
            grown.Free()
            raise
        return grown, learned, joined

    def _admit(self, state: State, out: FrozenSet[int]) -> Optional[Grown]:
        """The newcomer agreed on (_hear_knocks), accepted through the
        rendezvous and merged (newcomers.arrive is its side)."""
        assert self.rendezvous is not None
        size = self.arriving
        knock, self.knock = self.knock, None
        joined = tuple(range(self.next_id, self.next_id + size))
        kept = [m for r, m in enumerate(self.membership.members) if r not in out]
        info = self._info(state, size)
        info.update(members=kept + list(joined), next_id=self.next_id + size,
                    learned=state.learned(), settings=shared_settings(state.config))
        self.drop_offers()
        rest = survivors(state.comm, out)
        try:
            grown = self.rendezvous.admit(rest, knock if rest.Get_rank() == 0 else None, info,
                                          self._answer_bound(), self._beating())
        except Refused as exc:
            environment.log.warning("the newcomer at %s could not be taken in: %s",
                                    knock or "the rendezvous", exc)
            return None
        finally:
            rest.Free()
        self.next_id += size
        self.places -= size
        return grown, info["learned"], joined

    def _info(self, state: State, coming: int = 0) -> Dict[str, Any]:
        """What every newcomer gets from the ranks in: the membership's
        agreed counts and the places still free once it is in."""
        membership = self.membership
        return dict(epoch=membership.epoch, reliable_done=membership.reliable_done,
                    across_nodes=not membership.signals.reliable,
                    places=self.places - coming)

    def rebound(self, offers: Optional[MPI.Intracomm]) -> None:
        """After a switch or a growth: the duplicate of the new
        communicator for the next agreements."""
        self.offer_comm = offers

    def drop_offers(self) -> None:
        """At a switch: the agreement on offers in flight belongs to the old
        communicator (a peer may still complete it: kept until it does)."""
        if self.offering is not None:
            linger(*self.offering[:3])
            self.offering = None

    def closed(self, rank: int) -> None:
        """At Communicator.free(), every rank in done: a newcomer still
        waiting is told the job ended (by the lowest rank)."""
        if self.rendezvous is not None and rank == 0:
            self.rendezvous.close()
