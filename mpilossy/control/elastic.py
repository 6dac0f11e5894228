"""Who is still in (Communicator(elastic=True); docs/elastic.md).

A rank is out when MPI reports it failed (it exited: control/failures.py),
or when it has fallen `evict_after` calls behind this rank's (hung, stopped,
cut off).  Ranks tell their neighbours how far they are with a heartbeat:
after each call one small message to each of the `span` ranks on either
side of it on the ring of ranks (every peer when there are at most
2 span + 1 ranks), so that a call costs each rank at most 2 span messages
at any size (control/signals.py: UDP datagrams across nodes, where MPI
sends to a rank that is gone crash or hang on some netmods; MPI through
shared memory on one node).  A rank is watched by the same neighbours it
watches: they suspect it and start the agreement, which every other rank
joins when the agreement's first message reaches it.  Nothing ever waits
for a heartbeat without a deadline, and a round's datagram is sent again
until every peer it goes to has confirmed it (ACK) or is out.

The ranks that still run agree on who is out in two rounds of messages,
each waiting at most `wait` seconds for a peer that says nothing:

1. every rank sends the ranks it suspects to every rank it does not, and
   collects theirs: the union, with the ranks it did not hear from in time
   and those MPI reports failed, is its first set;
2. every rank sends its first set (and the ranks MPI reports failed) the
   same way: the union of the first sets it hears is the decision.

Two ranks that noticed at different calls meet in round 1 (the one that
noticed later enters when it finds the other's message after its own
call); the rounds carry each rank's call count, and a rank behind the
furthest answers the calls it lacks alone (Communicator.behind).  A rank
heard by some and not by others in round 1 (it stopped or died during it)
is in some first sets, so in every decision.  The
decisions differ only if a rank dies or stops during round 2, or between
its messages and the survivors' new communicator (MPI_Comm_create_group,
which cannot survive a member that is gone): not survived, documented.

The ranks not out go on only if they are a majority of those not reported
failed (half, with the lowest of them): a rank cut off from the others
decides that they are all out, and must not go on alone.  The others and
any rank the decision names get EvictedError.
"""

from __future__ import annotations

import time
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from mpi4py import MPI

from ..errors import EvictedError
from .failures import failed_ranks
from .signals import signals_for

__all__ = ["Membership", "check_elastic", "neighbours"]

BEAT, ROUND_1, ROUND_2, OUT, ACK = 1, 2, 3, 4, 5   # datagram tags (control/signals.py)
POLL = 0.001                                  # seconds between looks while waiting
RESEND = 0.02                                 # seconds between a round's sends (datagrams)
WAIT_BEAT = 0.05                # seconds between heartbeats while in a reliable wait
# Seconds a rank that was silent for longer than `wait` (it computed, or it
# was stopped and the others excluded it meanwhile) looks for an OUT message
# before it trusts a reliable collective that completed at once: a woken
# excluded rank completes the collective the others abandoned, and their
# OUT, sent long before, reached its MPI probe a few milliseconds after it
# woke (tried: 4 ranks on one node).
AFTER_SILENCE = 0.05
# Datagrams: seconds a round goes on sending, once this rank heard everyone, to
# peers that have not confirmed its message (at most `wait`): 25 more sendings.
CONFIRM = 0.5
# Heartbeats a peer has not confirmed reading, at most, over MPI.  Each
# unread one holds a shared-memory cell of the sender's (MPICH: 64 by
# default); with them all held, MPI postponed every send of the sender, to
# every peer, and a rank stopped for more calls than that made all the
# others miss each other's heartbeats and evict themselves (tried:
# evict_after=70).  Only the latest heartbeat matters to its receiver.
UNREAD_BEATS = 4
# Seconds more than `wait` a spare just called in may stay silent: after
# stand_by() it builds its model and optimizer (PyTorch's first optimizer
# took 3.5 s on a loaded core here), then makes the reliable calls the
# others wait in for it.
JOIN_GRACE = 30.0


def check_elastic(timeout: Any) -> Optional[Exception]:
    """Why an elastic communicator cannot work with this deadline (None if
    it can; its own settings are Config fields, checked there)."""
    if timeout is None:
        return ValueError("elastic=True needs a deadline (timeout seconds or 'auto'): "
                          "without one a call waits for a rank that is gone forever")
    return None


def neighbours(rank: int, size: int, span: int) -> List[int]:
    """The ranks that `rank` sends its heartbeat to and watches: `span` on
    each side of it on the ring of ranks, every other rank when there are
    at most 2 span + 1.  Symmetric (a watches b exactly when b watches a),
    so that every heartbeat over MPI has a reader that confirms it."""
    if size <= 2 * span + 1:
        return [r for r in range(size) if r != rank]
    return sorted({(rank + d) % size for d in range(-span, span + 1) if d != 0})


class Membership:
    """Heartbeats, suspicion and the agreement of one elastic communicator.
    Ranks here are the current communicator's; `members[r]` is rank r's
    rank in the communicator the user built the Communicator with."""

    def __init__(self, comm: MPI.Intracomm, members: List[int], evict_after: int,
                 wait: float, across_nodes: bool = True, span: int = 2) -> None:
        self.evict_after, self.wait, self.span = evict_after, float(wait), span
        self.members = list(members)
        self.epoch = 0                          # agreements so far
        self.evicted: Optional[str] = None      # why this rank is out, once it is
        self.signals = signals_for(comm, across_nodes)
        # the ranks excluded so far, by address: (the agreement's epoch, its OUT set),
        # told again whenever they send anything (a rank that wakes up)
        self.excluded: Dict[Tuple[str, int], Tuple[int, FrozenSet[int]]] = {}
        # Reliable collectives (Communicator.barrier, bcast, ...) this rank has seen
        # complete, each closed by a barrier: one can have completed on some ranks
        # (they left its barrier) and not on others (still in it, or in a wait
        # for it), never on one that did not enter that barrier, so the counts
        # of ranks still in differ by one at most and their parities say who
        # is ahead.  Set by the last agreement: whether a rank going on had.
        self.reliable_done = 0
        self.others_ahead = False
        # How long a peer may be inside a lossy call, where it reads no round
        # message: the larger of this rank's last two deadlines.  A round waits
        # that much longer than `wait` for a rank nobody suspects.
        self.in_call = 0.0
        self._last_deadline = 0.0
        self._bind(comm)

    def _bind(self, comm: MPI.Intracomm) -> None:
        self.comm = comm                        # (for failed_ranks: local)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.calls = 0                          # calls made on `comm`
        self.watched = neighbours(self.rank, self.size, self.span)
        self.seen = [0] * self.size             # the last call each neighbour finished
        self.moved = [0] * self.size            # this rank's call count when `seen` last grew
        self.heard = [0.0] * self.size          # when each neighbour's last heartbeat came
        self.next_beat = 0.0                    # (in a reliable wait: the next heartbeat's time)
        self.last_beat = time.monotonic()       # when this rank last sent its heartbeat
        # (reliable signals: the heartbeats sent to each peer that it has not
        # said it read, oldest first; a heartbeat says which of the
        # receiver's it has read)
        self.unread: List[List[int]] = [[] for _ in range(self.size)]
        self.inbox: Dict[int, Dict[int, Any]] = {ROUND_1: {}, ROUND_2: {}}
        # (datagrams: the peers that confirmed this rank's message of each round, and
        # the agreement just finished, whose messages are still confirmed: none after a
        # switch, which every survivor enters only once out of the rounds)
        self.acked: Dict[int, Set[int]] = {ROUND_1: set(), ROUND_2: set()}
        self.finished: Optional[int] = None
        self.gone: FrozenSet[int] = frozenset()     # reported failed: nothing is sent to them

    def close(self) -> None:
        self.signals.close()

    # -- messages ------------------------------------------------------------
    def _send(self, dest: int, tag: int, number: int = 0, first: Any = (),
              second: Any = ()) -> None:
        if dest not in self.gone:
            self.signals.send(dest, tag, self.epoch, number, first, second)

    def _drain(self) -> None:
        """Take every datagram that has arrived."""
        told, confirmed = set(), set()
        for signal in self.signals.receive():
            excluded = self.excluded.get(signal.address)
            if excluded is not None:            # (an excluded rank woke up: tell it again)
                if signal.address not in told:
                    told.add(signal.address)
                    self.signals.send_to(signal.address, OUT, excluded[0], 0, excluded[1])
                continue
            if signal.tag in self.inbox and not self.signals.reliable and (
                    signal.epoch in (self.epoch, self.finished)):
                # (a round's datagram, even of a round or agreement this rank has left:
                # confirmed every time it comes, so that its sender stops sending it;
                # a lost confirmation is answered at its next sending)
                if (signal.address, signal.tag, signal.epoch) not in confirmed:
                    confirmed.add((signal.address, signal.tag, signal.epoch))
                    self.signals.send_to(signal.address, ACK, signal.epoch, signal.tag)
            if signal.tag == OUT:
                if signal.epoch == self.epoch and self.rank in signal.first:
                    self.evicted = (f"the other ranks excluded this rank (it was behind or "
                                    f"silent; agreement {signal.epoch + 1})")
            elif signal.epoch != self.epoch or not 0 <= signal.sender < self.size:
                continue                        # (an earlier agreement's late message)
            elif signal.tag == BEAT:
                if signal.number > self.seen[signal.sender]:
                    self.seen[signal.sender] = signal.number
                    self.moved[signal.sender] = self.calls
                self.heard[signal.sender] = time.monotonic()
                read = max(signal.first, default=0)
                unread = self.unread[signal.sender]
                while unread and unread[0] <= read:
                    unread.pop(0)
            elif signal.tag == ACK:
                if signal.number in self.acked:
                    self.acked[signal.number].add(signal.sender)
            elif signal.tag in self.inbox:
                self.inbox[signal.tag][signal.sender] = (signal.first, signal.second,
                                                         signal.number)

    # -- after every call -----------------------------------------------------
    def note_deadline(self, seconds: Optional[float]) -> None:
        """The deadline of the call this rank just made (None: none)."""
        seconds = seconds or 0.0
        self.in_call, self._last_deadline = max(seconds, self._last_deadline), seconds

    def after_call(self, waited: bool, patient: bool = False) -> Optional[FrozenSet[int]]:
        """Count a call and send its heartbeat; then None (almost always), or the ranks
        this rank suspects, possibly none, when an agreement is to run
        (it suspects someone, or another rank started one).  Raises
        EvictedError if the others excluded this rank.

        `patient`: the learned deadline may still grow to wait for a rank
        late into every call (control/deadline.py: late_peers); a neighbour
        `evict_after` calls behind is then suspected only once it has
        finished no call in this rank's last `evict_after` (hung, stopped),
        not while it is merely slower and the deadline is catching up.

        `waited`: the call ended at its deadline.  A rank MPI reports failed
        counts only then: one that exited just after a call it took part in
        in full is seen by a quick peer at the end of that call and by the
        others only at the end of the next, the first call it misses, where
        every survivor waits for it; counting it there puts every survivor
        into the agreement after the same call."""
        self.calls += 1
        seq = self.calls
        if waited:      # (asking MPI costs ~90 us on MPICH: only when a call waited)
            self.gone = failed_ranks(self.comm)
        if self.signals.reliable:
            self._drain()       # (first: the heartbeats confirm what is read up to now)
        for peer in self.watched:
            self._beat(peer, seq)
        self.last_beat = time.monotonic()
        self._drain()
        if self.evicted:
            raise EvictedError(self.evicted)
        suspects = set(self.gone) if waited else set()
        suspects.update(r for r in self.watched if seq - self.seen[r] >= self.evict_after
                        and not (patient and seq - self.moved[r] < self.evict_after))
        if not suspects and not self._called():
            return None
        return frozenset(suspects)

    def _called(self) -> bool:
        """Another rank started an agreement that this rank joins now: any
        but a growth (Communicator.grow) that names nobody, which this rank
        joins at its own grow(), after the same calls."""
        return any(not number & 2 or first
                   for first, _, number in self.inbox[ROUND_1].values())

    def waiting(self, began: float) -> Optional[FrozenSet[int]]:
        """In a reliable wait that began at `began` (time.monotonic()), between
        two looks at its request: a heartbeat every WAIT_BEAT seconds (the
        call count unchanged), and as after_call, None or the ranks to
        suspect when an agreement is to run.  No call advances here, so a
        hung neighbour falls behind in time, not in calls: one not heard
        from for `wait` seconds since the wait began is suspected, with
        those MPI reports failed.  Raises EvictedError if the others
        excluded this rank."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.next_beat = now + WAIT_BEAT
            self.gone = failed_ranks(self.comm)
            if self.signals.reliable:
                self._drain()
            for peer in self.watched:
                self._beat(peer, self.calls)
            self.last_beat = now
        self._drain()
        if self.evicted:
            raise EvictedError(self.evicted)
        suspects = set(self.gone)
        suspects.update(r for r in self.watched if now - max(self.heard[r], began) > self.wait)
        if not suspects and not self._called():
            return None
        return frozenset(suspects)

    def after_silence(self) -> None:
        """A reliable collective completed for a rank that had been silent
        for more than `wait` seconds: look for an OUT message for
        AFTER_SILENCE seconds first (raises EvictedError if there is one)."""
        ends = time.monotonic() + AFTER_SILENCE
        while time.monotonic() < ends:
            self._drain()
            if self.evicted:
                raise EvictedError(self.evicted)
            time.sleep(POLL)

    def _beat(self, peer: int, seq: int) -> None:
        """Heartbeat `seq` to `peer`.  Over MPI it carries the latest of the
        peer's this rank has read, and none goes while UNREAD_BEATS are
        unread (a peer that stopped reading: when it reads again it
        confirms, and they go on).  (A datagram carries ranks in its sets,
        not call numbers: over 63 calls one would not fit.)"""
        if not self.signals.reliable:
            self._send(peer, BEAT, seq)
            return
        unread = self.unread[peer]
        if len(unread) >= UNREAD_BEATS:
            return
        unread.append(seq)
        self._send(peer, BEAT, seq, (self.seen[peer],))

    def agree(self, suspects: FrozenSet[int], grow: bool = False
              ) -> Tuple[FrozenSet[int], FrozenSet[int], int, bool]:
        """The two rounds (module documentation) after this rank's last
        call: (ranks out, ranks among them that MPI reports failed, calls
        this rank is behind, whether to grow), the first two and the last
        the same on every rank that goes on.  `grow`: this rank can take
        spares in here (after a lossy call, not in a reliable wait); they
        are taken in only if every rank that goes on can.  Raises EvictedError on a rank that is out or in a
        minority.  Ranks that came to the agreement after different calls
        learn each other's call numbers here; one that is d calls behind
        the furthest answers its next d calls alone (call/alone.py), so that
        every survivor's next call on the new communicator is the same."""
        seq = self.calls
        # (the rounds carry 4 calls + 2 grow + the parity of reliable_done)
        mine = 4 * seq + 2 * grow + (self.reliable_done & 1)
        first, failed, _ = self._round(ROUND_1, set(suspects), mine)
        decided, failed, numbers = self._round(ROUND_2, set(first), mine, failed)
        out = frozenset(decided)          # (never this rank: _round evicts it first)
        counted = [r for r in range(self.size) if r not in failed]
        kept = [r for r in counted if r not in out]
        if 2 * len(kept) < len(counted) or (2 * len(kept) == len(counted)
                                            and min(counted) not in kept):
            self._evict(out, f"this rank and {len(kept) - 1} other(s) are not a majority of "
                             f"the {len(counted)} ranks not reported failed: the others may "
                             f"go on without them")
        for r in out:               # (a rank that wakes up learns it is out)
            self._send(r, OUT, 0, out)
            self.excluded[self.signals.addresses[r]] = (self.epoch, out)
        # (the next agreement, if any, is another: its messages carry the next epoch)
        self.finished = self.epoch
        self.epoch += 1
        self.inbox = {ROUND_1: {}, ROUND_2: {}}
        self.acked = {ROUND_1: set(), ROUND_2: set()}
        furthest = max([seq] + [numbers[r] // 4 for r in kept if r in numbers])
        self.others_ahead = any(numbers[r] & 1 != mine & 1 for r in kept if r in numbers)
        grow = grow and all(numbers[r] & 2 for r in kept if r in numbers)
        return out, frozenset(failed & out), furthest - seq, grow

    def _round(self, tag: int, mine: Set[int], seq: int, failed: Optional[Set[int]] = None
               ) -> Tuple[Set[int], Set[int], Dict[int, int]]:
        """Send (mine, failed, seq) to every rank not in `mine`, collect
        theirs until each such rank was heard or `wait` passed (and the
        deadline of a call a peer may still be in: `in_call`).  Returns the
        union of the sets heard (and of those not heard), the ranks reported
        failed, and the call after which each rank heard came.

        Datagrams: the round also lasts until every rank not out has
        confirmed this rank's message (ACK), or CONFIRM seconds more.
        Ending it as soon as this rank had heard everyone could stop its
        sendings after the first: a peer that lost that one datagram
        excluded this rank (round 1), or waited for it alone while the
        others were in MPI_Comm_create_group (round 2).  A peer files
        every round message of the agreement it gets (in a round or
        between calls), so one that went on sending for CONFIRM reached
        it unless 25 datagrams in a row were lost; a lost confirmation
        costs at most CONFIRM seconds (its sender may be in
        MPI_Comm_create_group, where it reads nothing), never the decision."""
        failed = set(failed or ()) | set(failed_ranks(self.comm))
        self.gone = frozenset(failed)
        mine |= failed
        mine.discard(self.rank)
        union = set(mine)
        # (a rank nobody suspects may still be in its call, up to its deadline)
        ends = time.monotonic() + self.wait + self.in_call
        heard_all: Optional[float] = None     # (when nobody was left to hear from)
        acked = self.acked[tag]
        resend = 0.0
        while True:
            now = time.monotonic()
            if now >= resend:           # (datagrams: sent again until the round ends)
                resend = now + RESEND if not self.signals.reliable else float("inf")
                for peer in range(self.size):
                    if peer != self.rank and peer not in mine:
                        self._send(peer, tag, seq, mine, failed)
            self._drain()
            if self.evicted:
                raise EvictedError(self.evicted)
            heard = self.inbox[tag]
            for body in heard.values():
                union.update(body[0])
                failed.update(body[1])
            now_failed = failed_ranks(self.comm)
            failed |= now_failed
            union |= now_failed
            self.gone = frozenset(failed)
            if self.rank in union:          # another rank suspects this one
                self._evict(frozenset(union), "another rank found this rank behind or silent")
            waiting = [r for r in range(self.size)
                       if r != self.rank and r not in union and r not in heard]
            now = time.monotonic()
            if waiting and now >= ends:
                union.update(waiting)       # silent for `wait` seconds: out
                waiting = []
            if not waiting:
                heard_all = now if heard_all is None else heard_all
                if self.signals.reliable or now >= heard_all + min(CONFIRM, self.wait) or all(
                        r in acked or r in union for r in range(self.size) if r != self.rank):
                    break
            time.sleep(POLL)
        return union, failed, {r: body[2] for r, body in heard.items()}

    def _evict(self, out: FrozenSet[int], why: str) -> None:
        self.evicted = f"{why} (agreement {self.epoch + 1}: ranks {sorted(out)} out)"
        raise EvictedError(self.evicted)

    def rebind(self, comm: MPI.Intracomm, out: FrozenSet[int],
               joined: Tuple[int, ...] = ()) -> None:
        """After the switch to `comm`, the survivors' communicator, with the
        spares `joined` last (collective over it: everyone's addresses)."""
        self.members = [m for r, m in enumerate(self.members) if r not in out] + list(joined)
        self.signals.bind(comm)
        self._bind(comm)
        # (a newcomer sets up its model and optimizer before its first
        # reliable call, and says nothing meanwhile)
        for r in range(self.size - len(joined), self.size):
            self.heard[r] = time.monotonic() + JOIN_GRACE
