"""What elastic=True adds to a Communicator: after each call the
membership's heartbeat (control/elastic.py); after an agreement that ranks
are out, the switch to a state built whole on the survivors (no
hierarchy, as an elastic communicator promises), the old one abandoned
with its agreements handed over; and the calls this rank then owes the
survivors that reached the agreement after more calls, answered alone
(call/alone.py) on the old state; and the waits of reliable collectives,
which a rank that hangs cannot block (wait(): docs/elastic.md)."""

from __future__ import annotations

import time
from typing import Callable, FrozenSet, List, Optional, Tuple

from mpi4py import MPI

from .call import environment
from .call.request import Request
from .call.stats import CollectiveStats
from .control.elastic import POLL, Membership, check_elastic
from .control.failures import survivors
from .dispatch import alone
from .state import State

__all__ = ["Elastic", "Callback"]

Callback = Callable[[Tuple[int, ...], Tuple[int, ...]], None]


class Elastic:
    """The membership of one elastic Communicator and what follows from it."""

    def __init__(self, state: State) -> None:
        """Collective over the state's communicator (the deadline is checked
        on every rank first; the other settings were agreed in Config)."""
        problem = check_elastic(state.config.timeout)
        errors = [(r, e) for r, e in enumerate(
            state.comm.allgather(None if problem is None else str(problem))) if e]
        if errors:
            raise ValueError(f"rank {errors[0][0]}: {errors[0][1]}")
        layout = state.layout
        self.membership = Membership(state.comm, list(range(state.size)),
                                     state.config.evict_after, state.config.elastic_wait,
                                     across_nodes=layout is not None and layout.nodes > 1,
                                     span=state.config.heartbeat_span)
        self.callbacks: List[Callback] = []
        self.owed: List[int] = []           # call numbers still to answer alone, last first
        self.before: Optional[State] = None     # the state they belong to

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
        suspects = self.membership.after_call(stats.deadline_hit)
        if suspects is None:
            return state, stats
        fresh, excluded = self._exclude(state, suspects)
        return fresh, stats._replace(excluded=excluded) if excluded else stats

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
            fresh, excluded = self._exclude(state, suspects)
            if excluded:
                ahead = closing and membership.others_ahead
                membership.reliable_done += ahead
                return fresh, excluded, ahead
            began = time.monotonic()        # (nobody out: another `elastic_wait`)

    def _exclude(self, state: State, suspects: FrozenSet[int]
                 ) -> Tuple[State, Tuple[int, ...]]:
        """The agreement; if it put ranks out, the switch to the survivors'
        state.  (that state or `state`, the ranks excluded, if any)"""
        membership = self.membership
        began = time.perf_counter()
        calls = membership.calls
        out, failed, behind = membership.agree(suspects)
        if not out:
            return state, ()
        excluded = tuple(membership.members[r] for r in sorted(out))
        reported = [membership.members[r] for r in sorted(failed)]
        fresh = self._switch(state, out)
        self.owed = [calls + k for k in range(behind, 0, -1)]
        self.before = state                 # (calls owed are the old layout's)
        environment.log.warning("excluded ranks %s (MPI reported %s failed) after call %d "
                                "in %.3f s; %d ranks go on%s", list(excluded), reported,
                                calls, time.perf_counter() - began, fresh.size,
                                f"; this rank answers its next {behind} call(s) alone to "
                                f"line up with the others" if behind else "")
        return fresh, excluded

    def notify(self, excluded: Tuple[int, ...]) -> None:
        """The callbacks, once the Communicator goes on over the survivors'
        state (they may use it: a re-shard's reliable broadcasts)."""
        members = tuple(self.membership.members)
        for callback in self.callbacks:
            callback(excluded, members)

    def _switch(self, state: State, out: frozenset) -> State:
        """Collective over the survivors: a state built whole on their
        communicator, without hierarchy (its levels, states of their own,
        would go on apart from this one).  The old state is abandoned, not
        freed (freeing is collective over ranks that are gone): its
        agreements in flight are handed over to complete later."""
        rest = survivors(state.comm, out)
        try:
            fresh = State.open(rest, state.config, state.serial, layout=True)
        finally:
            rest.Free()
        state.abandon()
        self.membership.rebind(fresh.comm, out)
        return fresh

    def close(self) -> None:
        self.membership.close()

