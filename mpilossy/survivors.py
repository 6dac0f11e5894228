"""What elastic=True adds to a Communicator: after each call the
membership's heartbeat (control/elastic.py); after an agreement that ranks
are out, the switch to a state built whole on the survivors (no
hierarchy, as an elastic communicator promises), the old one abandoned
with its agreements handed over; and the calls this rank then owes the
survivors that reached the agreement after more calls, answered alone
(call/alone.py) on the old state; the waits of reliable collectives,
which a rank that hangs cannot block (wait(): docs/elastic.md); and with
spares, the growth back at Communicator.grow(), where the user's program
(or the torch wrapper's step) says a newcomer can follow: an agreement,
and the switch to a state built on the survivors and the spares called
in (control/spares.py); while a place is free and no spare is left, the
offers of excluded ranks that woke, agreed at grow() (one nonblocking
MPI_Iallreduce on a duplicate of the survivors' communicator, started at
one grow() and read at the next) before they are called in.  With a
rendezvous instead of spares, the newcomers are processes started after
the loss: while a place is free, each grow() agrees on whether one is
waiting (one small MPI_Iallreduce), and the growth accepts it through MPI's
ports (control/rendezvous.py); newcomers are numbered from the size of the
user's communicator on, in order of arrival."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import fields
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import numpy as np
from mpi4py import MPI

from .call import environment
from .call.request import Request
from .call.stats import CollectiveStats
from .call.config import Config
from .call.environment import Settings
from .control.agreement import Agreement, linger
from .control.elastic import POLL, Membership, check_elastic
from .control.failures import failed_ranks, survivors
from .control.rendezvous import Refused, Rendezvous, directory_problem
from .control.spares import Spares
from .dispatch import alone
from .state import State

__all__ = ["Elastic", "SpareSeat", "Callback", "SPARE_ANSWER", "arrive", "shared_settings"]

SPARE_ANSWER = 1.0      # seconds a spare about to be called in has to answer a ping

Callback = Callable[[Tuple[int, ...], Tuple[int, ...]], None]


class Elastic:
    """The membership of one elastic Communicator and what follows from it."""

    def __init__(self, state: State, spares: Optional[Spares] = None,
                 joining: Optional[Dict[str, Any]] = None,
                 offers: Optional[MPI.Intracomm] = None,
                 rendezvous: Optional[Rendezvous] = None) -> None:
        """Collective over the state's communicator (the deadline is checked
        on every rank first; the other settings were agreed in Config).
        `joining`: on a spare called in, its call-in (control/spares.py),
        or on a newcomer through `rendezvous`, what the ranks in sent it;
        and `offers`, the duplicate of the grown communicator that agrees
        on offers and knocks (made by every rank in at the growth)."""
        if joining is None:             # (a spare's settings were checked with everyone's)
            problem = check_elastic(state.config.timeout)
            if problem is None and rendezvous is not None:
                where = directory_problem(rendezvous.directory)
                problem = None if where is None else ValueError(where)
            if problem is None and rendezvous is not None and state.channel != "ud":
                # (tried: 6 of 22 newcomers stayed in; a survivor waited in a reliable
                # collective the others had left until elastic_wait: docs/elastic.md)
                problem = ValueError(f"rendezvous= needs channel='ud' (this one is "
                                     f"{state.channel!r}): one-sided calls with a process "
                                     f"started outside the job stall")
            errors = [(r, e) for r, e in enumerate(
                state.comm.allgather(None if problem is None else str(problem))) if e]
            if errors:
                raise ValueError(f"rank {errors[0][0]}: {errors[0][1]}")
        layout, config = state.layout, state.config
        across = (joining["across_nodes"] if joining is not None
                  else layout is not None and layout.nodes > 1)
        self.membership = Membership(state.comm, list(range(state.size)) if joining is None
                                     else joining["members"], config.evict_after,
                                     config.elastic_wait, across_nodes=across,
                                     span=config.heartbeat_span)
        self.callbacks: List[Callback] = []
        self.growth_callbacks: List[Callback] = []
        self.owed: List[int] = []           # call numbers still to answer alone, last first
        self.before: Optional[State] = None     # the state they belong to
        self.spares = spares
        self.places = 0                     # ranks excluded and not replaced yet
        # (a rendezvous: the knock the lowest rank found, the processes agreed to
        # come at this grow(), and the number the next newcomer gets as a member)
        self.rendezvous = rendezvous
        self.knock: Optional[str] = None
        self.arriving = 0
        self.next_id = state.size
        # (spares: agreeing on the offers of excluded ranks that woke; the agreement
        # in flight, started at one grow() and read at the next)
        self.offer_comm = offers
        self.offering: Optional[Agreement] = None
        if joining is not None:
            self.membership.epoch = joining["epoch"]
            self.membership.reliable_done = joining["reliable_done"]
            self.places = joining["places"]
            self.next_id = joining.get("next_id", self.next_id)

    @property
    def evicted(self) -> Optional[str]:
        return self.membership.evicted

    def owes(self) -> bool:
        return bool(self.owed)

    def answer_alone(self, request: Request) -> CollectiveStats:
        """The next call owed to the survivors that went ahead."""
        assert self.before is not None
        return alone(self.before, request, self.owed.pop())

    def after_call(self, state: State, stats: CollectiveStats) -> Tuple[State, CollectiveStats]:
        """Heartbeat; if a rank is suspected (or another rank started an
        agreement), agree on who is out and return the survivors' state
        (else `state`).  The stats say whom this call excluded (then
        notify() them, once the survivors' state is in use)."""
        self.membership.note_deadline(stats.timeout)
        suspects = self.membership.after_call(stats.deadline_hit, state.auto.may_grow())
        if suspects is None:
            return state, stats
        fresh, excluded, _ = self._exclude(state, suspects, grow=False)
        return fresh, stats._replace(excluded=excluded) if excluded else stats

    @property
    def grows(self) -> bool:
        """Whether exclusions leave places that newcomers can fill."""
        return self.spares is not None or self.rendezvous is not None

    def _may_grow(self) -> bool:
        """Places to fill and spares (or an agreed newcomer) to fill them:
        the same on every rank still in (they follow from agreed
        exclusions and agreements)."""
        return bool(self.places and ((self.spares is not None and self.spares.left)
                                     or self.arriving))

    def grow(self, state: State) -> Tuple[State, Tuple[int, ...], Tuple[int, ...]]:
        """Communicator.grow(): where places are free and spares left, the
        agreement (every rank still in gets there after the same calls:
        one that owes calls has not yet) and the growth.  (the state, the
        ranks excluded, the spares joined)"""
        if self.owes():
            return state, (), ()
        if self.places and self.spares is not None and not self.spares.left:
            state, excluded = self._take_offers(state)
            if excluded:
                return state, excluded, ()
        if self.places and self.rendezvous is not None:
            state, excluded = self._hear_knocks(state)
            if excluded:
                return state, excluded, ()
        if self._may_grow() and self.spares is not None:
            state, excluded = self._drop_lost_spares(state)
            if excluded:
                return state, excluded, ()
        if not self._may_grow():
            return state, (), ()
        return self._exclude(state, frozenset(), grow=True)

    def _take_offers(self, state: State) -> Tuple[State, Tuple[int, ...]]:
        """A place is free and no spare left: read the agreement on offers
        started at the last grow() (the offers every rank in had heard
        then, the same result everywhere) and take them as spares, or
        start one.  (the state, the ranks excluded meanwhile: the
        agreement abandoned with the old state)"""
        assert self.spares is not None and self.offer_comm is not None
        pending = self.offering
        if pending is not None:
            outcome = self.wait(state, pending.request, closing=False)
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
        ranks in agree on it (one small MPI_Iallreduce, waited for here,
        the heartbeat going on).  (the state, the ranks excluded meanwhile:
        the agreement abandoned)"""
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
        MPI_Iallreduce on the duplicate for offers, waited for here, the
        heartbeat going on): (it, None), or (_, (the survivors' state, the
        ranks excluded)) if ranks were excluded meanwhile (the agreement
        abandoned)."""
        assert self.offer_comm is not None
        recv = np.zeros_like(send)
        request = self.offer_comm.Iallreduce(send, recv, op=MPI.MAX)
        outcome = self.wait(state, request, closing=False)
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
        a round, waited for here.  (the state, the ranks excluded
        meanwhile: the agreement abandoned)"""
        assert self.spares is not None and self.offer_comm is not None
        while self._may_grow():
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
        answer a ping within SPARE_ANSWER seconds (half of elastic_wait at
        most), the heartbeat going on meanwhile."""
        assert self.spares is not None
        began = time.monotonic()

        def between() -> None:
            self.membership.waiting(began)      # (suspects: the agreement's wait sees them)
            time.sleep(POLL)

        return self.spares.silent(spares, min(SPARE_ANSWER, self.membership.wait / 2), between)

    def _drop_offers(self) -> None:
        """At a switch: the agreement on offers in flight belongs to the old
        communicator (a peer may still complete it: kept until it does)."""
        if self.offering is not None:
            linger(*self.offering[:3])
            self.offering = None

    def wait(self, state: State, request: MPI.Request, closing: bool
             ) -> Optional[Tuple[State, Tuple[int, ...], bool]]:
        """Wait for `request`, a reliable collective on `state.exact`, with
        the membership's heartbeat going on: None once it completed, or
        (the survivors' state, the ranks excluded, done) if ranks were
        excluded meanwhile: the caller abandons the request
        (control/agreement.py's linger) and, unless `done`, makes its
        reliable collective again from the start over the survivors.  A
        neighbour silent for `elastic_wait` seconds is suspected
        (Membership.waiting), so the wait is bounded by that and one
        agreement.  `closing`: the barrier that closes a reliable
        collective; done when a survivor had left it (Membership.reliable_done),
        so it completed everywhere but here."""
        membership = self.membership
        began = time.monotonic()
        silent = began - membership.last_beat > membership.wait
        while True:
            done = request.Test()
            # (also once it completed: a woken excluded rank completes the others'
            # abandoned collective, and must learn it is out rather than return)
            suspects = membership.waiting(began)
            if done:
                if silent:
                    membership.after_silence()
                membership.reliable_done += closing
                return None
            if suspects is None:
                time.sleep(POLL)
                continue
            fresh, excluded, _ = self._exclude(state, suspects, grow=False)
            if excluded:
                ahead = closing and membership.others_ahead
                membership.reliable_done += ahead
                return fresh, excluded, ahead
            began = time.monotonic()        # (nobody out: another `elastic_wait`)

    def _exclude(self, state: State, suspects: FrozenSet[int], grow: bool
                 ) -> Tuple[State, Tuple[int, ...], Tuple[int, ...]]:
        """The agreement; if it put ranks out, or `grow` and spares can fill
        places, the switch to the survivors' state (with the spares called
        in).  (that state or `state`, the ranks excluded, the spares joined)"""
        membership = self.membership
        began = time.perf_counter()
        calls = membership.calls
        out, failed, behind, grow = membership.agree(suspects, grow and self._may_grow())
        excluded = tuple(membership.members[r] for r in sorted(out))
        reported = [membership.members[r] for r in sorted(failed)]
        if self.grows:
            self.places += len(out)
        joined: Tuple[int, ...] = ()
        # (the newcomer's knock is on the lowest rank: if that rank is out, it waits
        # for the next growth)
        if grow and self.arriving and 0 not in out:
            fresh, joined = self._admit(state, out)
        elif grow and self._may_grow() and not self.arriving:  # (agreed: every rank going on can)
            fresh, joined = self._grow(state, out)
        elif out:
            fresh = self._switch(state, out)
        else:
            self.arriving = 0
            return state, (), ()
        self.arriving = 0
        self.owed = [calls + k for k in range(behind, 0, -1)]
        self.before = state                 # (calls owed are the old layout's)
        if out:
            environment.log.warning(
                "excluded ranks %s (MPI reported %s failed) after call %d in %.3f s; "
                "%d ranks go on%s", list(excluded), reported, calls,
                time.perf_counter() - began, fresh.size,
                f"; this rank answers its next {behind} call(s) alone to line up with "
                f"the others" if behind else "")
        if joined:
            environment.log.warning("%s %s %s after call %d: %d ranks go on",
                                    "spares" if self.spares else "newcomers", list(joined),
                                    "called in" if self.spares else "joined", calls, fresh.size)
        return fresh, excluded, joined

    def notify(self, excluded: Tuple[int, ...], joined: Tuple[int, ...] = ()) -> None:
        """The callbacks, once the Communicator goes on over the new state
        (they may use it: a re-shard's reliable broadcasts): on_exclusion's
        for `excluded`, then on_growth's for `joined`."""
        members = tuple(self.membership.members)
        if excluded:
            for callback in self.callbacks:
                callback(excluded, members)
        if joined:
            for callback in self.growth_callbacks:
                callback(joined, members)

    def _grow(self, state: State, out: FrozenSet[int]) -> Tuple[State, Tuple[int, ...]]:
        """Collective over the survivors and the spares they call in (as
        many as places are free, while spares last): the state built on
        them all, as _switch builds it.  (the state, the spares joined)"""
        assert self.spares is not None
        membership = self.membership
        kept = [m for r, m in enumerate(membership.members) if r not in out]
        places = min(self.places, len(self.spares.left))
        self.places -= places
        info: Dict[str, Any] = dict(epoch=membership.epoch, reliable_done=membership.reliable_done,
                    across_nodes=not membership.signals.reliable, places=self.places)
        grown, joined = self.spares.grown(
            kept, places, kept.index(membership.members[membership.rank]), info)
        self._drop_offers()
        try:
            learned = grown.bcast(state.learned(), root=0)     # (to the spares: rank 0's)
            fresh = State.open(grown, state.config, state.serial, layout=True)
            self.offer_comm = grown.Dup()       # (the spares make theirs: SpareSeat.stand_by)
        finally:
            grown.Free()
        fresh.warm(learned)
        state.abandon()
        membership.rebind(fresh.comm, out, joined)
        return fresh, joined

    def _admit(self, state: State, out: FrozenSet[int]) -> Tuple[State, Tuple[int, ...]]:
        """Collective over the survivors and the newcomer agreed on
        (_hear_knocks): accepted through the rendezvous and merged, the
        state built on them all, as _grow builds it.  (the state, the
        newcomer's members)"""
        assert self.rendezvous is not None
        membership = self.membership
        size, self.arriving = self.arriving, 0
        knock, self.knock = self.knock, None
        joined = tuple(range(self.next_id, self.next_id + size))
        self.next_id += size
        self.places -= size
        kept = [m for r, m in enumerate(membership.members) if r not in out]
        info: Dict[str, Any] = dict(epoch=membership.epoch, reliable_done=membership.reliable_done,
                    across_nodes=not membership.signals.reliable, places=self.places,
                    members=kept + list(joined), next_id=self.next_id,
                    learned=state.learned(), settings=shared_settings(state.config))
        self._drop_offers()
        rest = survivors(state.comm, out)
        try:
            grown = self.rendezvous.admit(rest, knock if rest.Get_rank() == 0 else None, info)
        except Refused as exc:
            environment.log.warning("the newcomer at %s could not be taken in: %s",
                                    knock or "the rendezvous", exc)
            self.next_id -= size
            self.places += size
            return (self._switch(state, out) if out else state), ()
        finally:
            rest.Free()
        try:
            fresh = State.open(grown, state.config, state.serial, layout=True)
            self.offer_comm = grown.Dup()
        finally:
            grown.Free()
        fresh.warm(info["learned"])
        state.abandon()
        membership.rebind(fresh.comm, out, joined)
        return fresh, joined

    def _switch(self, state: State, out: frozenset) -> State:
        """Collective over the survivors: a state built whole on their
        communicator, without hierarchy (its levels, states of their own,
        would go on apart from this one).  The old state is abandoned, not
        freed (freeing is collective over ranks that are gone): its
        agreements in flight are handed over to complete later."""
        rest = survivors(state.comm, out)
        self._drop_offers()
        try:
            fresh = State.open(rest, state.config, state.serial, layout=True)
            if self.grows:
                self.offer_comm = rest.Dup()
        finally:
            rest.Free()
        fresh.warm(state.learned())         # (agreed: the same on every survivor)
        state.abandon()
        self.membership.rebind(fresh.comm, out)
        return fresh

    def close(self) -> None:
        self.membership.close()


class SpareSeat:
    """spares=k, on one rank: set aside at construction (the last k ranks of
    the communicator are spares), then on a spare the wait to be called in
    (control/spares.py's Spares), with the callbacks registered meanwhile."""

    def __init__(self, comm: MPI.Intracomm, config: Config) -> None:
        """Collective over `comm`; `workers` is the working ranks'
        communicator (COMM_NULL on a spare), for the caller to free."""
        size = comm.Get_size()
        if not config.elastic or check_elastic(config.timeout) is not None:
            raise ValueError("spares= needs elastic=True and a deadline: spares replace ranks "
                             "that an elastic communicator excluded")
        if config.spares >= size:
            raise ValueError(f"spares={config.spares} leaves no working rank of {size}")
        self.config = config        # (a spare's, until stand_by() opens its state)
        self.spares = Spares(comm.Dup(), config.spares)
        self.standing = comm.Get_rank() >= size - config.spares   # not called in yet
        self.newcomer = False                                       # called in
        self.arrivals = 0                                           # times called in
        # (on_exclusion's and on_growth's callbacks, until it is called in)
        self.early: Tuple[List[Callback], List[Callback]] = ([], [])
        self.workers = comm.Split(MPI.UNDEFINED if self.standing else 0, comm.Get_rank())

    def stand_by(self, serial: int, timeout: Optional[float]) -> Optional[Tuple[State, Elastic]]:
        """Wait until the survivors call this spare in (Communicator.stand_by):
        its state on the grown communicator, warmed with what the survivors
        learned, and its membership; None if it was not needed."""
        message = self.spares.stand_by(timeout)
        self.standing = False
        if message is None:
            return None
        grown = message["comm"]
        try:
            learned = grown.bcast(None, root=0)     # (the survivors' learned deadline, ...)
            state = State.open(grown, self.config, serial, layout=True)
            offers = grown.Dup()                    # (as the survivors: Elastic._grow)
        finally:
            grown.Free()
        state.warm(learned)
        elastic = Elastic(state, self.spares, joining=message, offers=offers)
        elastic.callbacks, elastic.growth_callbacks = self.early
        self.early = ([], [])
        self.newcomer = True
        self.arrivals += 1
        return state, elastic

    def come_back(self, members: List[int]) -> None:
        """On a rank the others excluded (it hung) that woke: stand by as
        a spare again, offered to `members`, the ranks (of the parent) in
        with it when it was excluded."""
        me = self.spares.parent.Get_rank()
        self.spares.offer([m for m in members if m != me])
        self.standing, self.newcomer = True, False


def shared_settings(config: Config) -> Dict[str, Any]:
    """What a newcomer through a rendezvous takes from the ranks in: every
    Communicator argument and every setting that must agree (the rest,
    such as the datagram domain, is its host's own)."""
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.metadata["argument"] or f.metadata["agreed"]}


def arrive(own: Config, env: Settings, comm: MPI.Intracomm, bound: float, serial: int
           ) -> Optional[Tuple[State, Elastic]]:
    """Communicator.join on a newcomer's processes (collective over
    `comm`): knock at the rendezvous of `own` (this process's settings,
    built and checked before it knocks: once it is taken in, the ranks in
    wait for it), and once the ranks in accepted it, its state on the
    merged communicator with their settings, warmed with what they
    learned, and its membership; None if the job ended or nobody took it
    in within `bound` seconds."""
    assert own.rendezvous is not None
    rendezvous = Rendezvous(own.rendezvous)
    admitted = rendezvous.knock_and_connect(comm, bound)
    if admitted is None:
        return None
    grown, info = admitted
    try:
        config = dataclasses.replace(own, **info["settings"])
        environment.configure_logging(env, grown.Get_rank())
        state = State.open(grown, config, serial, layout=True)
        offers = grown.Dup()                    # (as the ranks in: Elastic._admit)
    finally:
        grown.Free()
    state.warm(info["learned"])
    return state, Elastic(state, None, joining=info, offers=offers, rendezvous=rendezvous)
