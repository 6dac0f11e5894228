"""The elastic half of Communicator's API (elastic=True, spares=k): who is
in, exclusions, spares standing by and growth.  A thin front over
survivors.py (Elastic: the membership of the ranks in) and newcomers.py
(SpareSeat: a spare's or an excluded rank's wait to be called in)."""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

from .state import State
from .newcomers import SpareSeat
from .survivors import Callback, Elastic

__all__ = ["ElasticFront", "open_communicators"]

# communicators not freed yet (freed at exit, newest first: communicator.py)
open_communicators: "weakref.WeakSet[Any]" = weakref.WeakSet()


class ElasticFront:
    """Communicator's elastic methods; the Communicator holds the fields."""

    _state: Optional[State]
    _elastic: Optional[Elastic]
    _seat: Optional[SpareSeat]
    _serial: int
    _joined: int

    def _live(self) -> State:       # (Communicator's: the state, or why there is none)
        raise NotImplementedError

    @property
    def spare(self) -> bool:
        """spares=k: this rank is a spare that no exclusion has called in
        yet (stand_by() waits for that)."""
        return self._seat is not None and self._seat.standing

    @property
    def newcomer(self) -> bool:
        """spares=k: this rank was a spare and an exclusion called it in;
        rendezvous: it came in through Communicator.join (mpilossy.torch's
        DistributedOptimizer built on it then receives the survivors'
        parameters and optimizer state)."""
        return bool(self._joined) or (self._seat is not None and self._seat.newcomer)

    @property
    def grows(self) -> bool:
        """elastic=True with spares or a rendezvous: grow() may take
        newcomers in where exclusions freed places."""
        return self._elastic is not None and self._elastic.grows

    def stand_by(self, timeout: Optional[float] = None) -> bool:
        """On a spare (spares=k: the last k ranks of `comm`): wait until the
        survivors of an exclusion call this rank in at their grow() (True:
        it is a member from now on, the communicator's last rank(s); the
        reliable calls the survivors make after grow() to send it their
        state, this rank makes after stand_by returns), or
        until the job's working ranks free the communicator without
        needing it, MPI reports them all failed, or `timeout` seconds pass
        (False: nothing to do; free() is a no-op).

        On a rank that the others excluded (its calls raised EvictedError:
        it hung, then woke), the same after it offered itself to the ranks
        still in: they take it in as a spare, once they agreed on its offer,
        at a grow() where a place is free (docs/elastic.md, "Coming
        back")."""
        excluded = (self._seat is not None and self._elastic is not None
                    and self._elastic.evicted is not None)
        if self._seat is None or not (self._seat.standing or excluded):
            raise ValueError("stand_by() is for a spare rank not called in yet, or a rank "
                             "the others excluded (Communicator(..., spares=k))")
        if timeout is not None and not (isinstance(timeout, (int, float))
                                        and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"timeout must be None or seconds > 0, not {timeout!r}")
        if excluded:
            self._come_back()
        called = self._seat.stand_by(self._serial, timeout)
        if called is None:
            return False
        self._state, self._elastic = called
        open_communicators.add(self)
        return True

    def _come_back(self) -> None:
        """An excluded rank that woke: leave its old state (without a
        collective: the others went on without it) and stand by as a spare,
        offered to the ranks that were in with it."""
        assert self._seat is not None and self._elastic is not None
        members = list(self._elastic.membership.members)
        # (the callbacks stay: they belong to this Communicator, not to one membership)
        self._seat.early = (self._elastic.callbacks, self._elastic.growth_callbacks)
        state, self._state = self._state, None
        self._elastic.close()
        self._elastic = None
        open_communicators.discard(self)
        if state is not None:
            state.abandon()
        self._seat.come_back(members)

    @property
    def arrivals(self) -> int:
        """spares=k: how many times exclusions called this rank in (a spare,
        or a rank that came back after it was excluded); 0 on a rank in from
        the start that never left."""
        return self._joined + (0 if self._seat is None else self._seat.arrivals)

    def grow(self) -> Tuple[int, ...]:
        """elastic=True with spares or a rendezvous: collective over the
        ranks in, at a point of the program where a newcomer can follow
        (the end of a step: right after this, the survivors send it what it
        needs, with reliable calls it makes after stand_by() or join()).
        Where exclusions freed places and spares are left, the ranks agree
        and call spares in; with a rendezvous, while a place is free, they
        agree on whether a process started since waits there (one small
        all-reduce each grow()) and accept it (the on_growth callbacks
        run); returns the members that joined (spares: ranks of the
        communicator this one was built on; through the rendezvous:
        numbers from its size on, in order of arrival), () almost always,
        at no cost while no place is free.  Every rank in must call it
        after the same lossy calls, within elastic_wait seconds of the
        first."""
        state = self._live()
        if self._elastic is None:
            return ()
        self._state, excluded, joined = self._elastic.grow(state)
        if excluded or joined:
            self._elastic.notify(excluded, joined)
        return joined

    def on_growth(self, callback: Callback) -> None:
        """elastic=True with spares: call `callback(joined, members)` (ranks
        of the communicator this one was built on) on every rank that was
        in, right after spares joined, before grow() returns."""
        if not callable(callback):
            raise TypeError("callback must be callable")
        if self._seat is not None and self._seat.standing:
            self._seat.early[1].append(callback)
        elif self._elastic is None:
            raise ValueError("on_growth() needs a communicator built with elastic=True")
        else:
            self._elastic.growth_callbacks.append(callback)
    @property
    def elastic(self) -> bool:
        return self._elastic is not None

    @property
    def members(self) -> Tuple[int, ...]:
        """The ranks (in the communicator this Communicator was built on)
        still in: all of them unless elastic=True excluded some; newcomers
        through a rendezvous (Communicator.join) are numbered from that
        communicator's size on, in order of arrival."""
        if self.spare:
            return ()
        if self._elastic is None:
            return tuple(range(self._live().size))
        return tuple(self._elastic.membership.members)

    @property
    def behind(self) -> int:
        """elastic=True: how many of its next calls this rank answers alone
        (CollectiveStats.alone), because other survivors reached the last
        agreement after more calls than it had made; 0 almost always.
        These calls belong to the communicator before the exclusion: its
        size, this rank's chunk in it."""
        return 0 if self._elastic is None else len(self._elastic.owed)

    def on_exclusion(self, callback: Callback) -> None:
        """elastic=True: call `callback(excluded, members)` (ranks of the
        communicator this one was built on) on every rank that goes on,
        right after an exclusion, before the call that led to it returns:
        to re-shard, log or checkpoint."""
        if not callable(callback):
            raise TypeError("callback must be callable")
        if self._seat is not None and self._seat.standing:
            self._seat.early[0].append(callback)
            return
        if self._elastic is None:
            raise ValueError("on_exclusion() needs a communicator built with elastic=True")
        self._elastic.callbacks.append(callback)
