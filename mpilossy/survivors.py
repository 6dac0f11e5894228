"""What elastic=True adds to a Communicator: after each call the
membership's heartbeat (control/elastic.py); after an agreement that ranks
are out, the switch to a state built whole on the survivors (no
hierarchy, as an elastic communicator promises), the old one abandoned
with its agreements handed over; and the calls this rank then owes the
survivors that reached the agreement after more calls, answered alone
(call/alone.py) on the old state; the waits of reliable collectives,
which a rank that hangs cannot block (wait(): docs/elastic.md); and with
spares or a rendezvous, the growth back at Communicator.grow(), where the
user's program (or the torch wrapper's step) says a newcomer can follow:
an agreement, and the switch to a state built on the ranks going on and
the newcomers (growth.py; newcomers.py is the newcomers' side)."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from mpi4py import MPI

from .call import environment
from .call.request import Request
from .call.stats import CollectiveStats
from .control.elastic import POLL, Membership, check_elastic
from .control.failures import survivors
from .control.rendezvous import Rendezvous
from .control.spares import Spares
from .dispatch import alone
from .growth import Growth, opened
from .state import State

__all__ = ["Elastic", "Callback"]

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
            reason = str(problem) if problem is not None else Growth.problem(state, rendezvous)
            errors = [(r, e) for r, e in enumerate(state.comm.allgather(reason)) if e]
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
        self.growth = (None if spares is None and rendezvous is None else
                       Growth(self.membership, self.wait, spares, rendezvous, offers, joining,
                              state.size))
        if joining is not None:
            self.membership.epoch = joining["epoch"]
            self.membership.reliable_done = joining["reliable_done"]

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
        return self.growth is not None

    def grow(self, state: State) -> Tuple[State, Tuple[int, ...], Tuple[int, ...]]:
        """Communicator.grow(): where places are free and newcomers can
        fill them, the agreement (every rank still in gets there after the
        same calls: one that owes calls has not yet) and the growth.  (the
        state, the ranks excluded, the newcomers joined)"""
        growth = self.growth
        if growth is None or self.owes():
            return state, (), ()
        state, excluded = growth.prepare(state)
        if excluded or not growth.can():
            return state, excluded, ()
        return self._exclude(state, frozenset(), grow=True)

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
        """The agreement; if it put ranks out, or `grow` and newcomers can
        fill places, the switch to the survivors' state (with the
        newcomers).  (that state or `state`, the ranks excluded, the
        newcomers joined)"""
        membership, growth = self.membership, self.growth
        began = time.perf_counter()
        calls = membership.calls
        out, failed, behind, grow = membership.agree(
            suspects, grow and growth is not None and growth.can())
        excluded = tuple(membership.members[r] for r in sorted(out))
        reported = [membership.members[r] for r in sorted(failed)]
        grown = None
        if growth is not None:
            growth.lost(len(out))
            grown = growth.fill(state, out, grow)
        joined: Tuple[int, ...] = ()
        if grown is not None:
            comm, learned, joined = grown
            fresh = self._open(state, comm, learned, out, joined)
        elif out:
            fresh = self._switch(state, out)
        else:
            return state, (), ()
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
            assert growth is not None
            environment.log.warning("%s %s %s after call %d: %d ranks go on",
                                    "spares" if growth.spares else "newcomers", list(joined),
                                    "called in" if growth.spares else "joined", calls,
                                    fresh.size)
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

    def _switch(self, state: State, out: frozenset) -> State:
        """Collective over the survivors: a state built whole on their
        communicator, without hierarchy (its levels, states of their own,
        would go on apart from this one)."""
        if self.growth is not None:
            self.growth.drop_offers()
        # (agreed: the same learned values on every survivor)
        return self._open(state, survivors(state.comm, out), state.learned(), out)

    def _open(self, state: State, comm: MPI.Intracomm, learned: Any, out: FrozenSet[int],
              joined: Tuple[int, ...] = ()) -> State:
        """The state built on `comm` (freed here) that replaces `state`; the
        old state is abandoned, not freed (freeing is collective over ranks
        that are gone): its agreements in flight are handed over to
        complete later."""
        fresh, offers = opened(comm, state.config, state.serial, learned,
                               offers=self.growth is not None)
        if self.growth is not None:
            self.growth.rebound(offers)
        state.abandon()
        self.membership.rebind(fresh.comm, out, joined)
        return fresh

    def close(self) -> None:
        self.membership.close()

