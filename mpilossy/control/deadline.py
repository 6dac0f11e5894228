"""timeout="auto": a deadline learned from earlier calls and agreed by all ranks.

The rule, per kind of call (collective, algorithm, message size rounded to a
power of two):

- each rank keeps the durations of its last ``WINDOW`` calls of that kind
  that ended before their deadline with every block that was not dropped
  on purpose (injected loss), measured from the anchor (every peer seen in
  the call) to the end, which is the part the stages of a call must fit in.
  (A rank far behind its peers finds their blocks of the call rewritten,
  "gone", and ends quickly but not fast: counted, it took the learned
  deadline of a straggler run from 2 ms to 20 ms);
- every ``PERIOD`` calls on the communicator (every call counts, whatever
  its kind and whether it failed validation, so the schedule is the same on
  every rank) the ranks agree, with one nonblocking ``MPI_Iallreduce`` of a
  fixed-size vector on a private communicator, on the maximum of their 95th
  percentiles of every kind and on each rank's *cut*: the share of the
  blocks it reads that its timeout="auto" calls gave up at the deadline
  (late, not lost), over the calls since the last agreement in which every
  peer was seen within the first ``EARLY_ANCHOR`` of the deadline; ``LAG``
  calls later the deadline of each kind becomes ``FACTOR * scale`` times
  that maximum, clamped between ``floor`` and ``cap``;
- ``scale`` holds the delivered target (``delivered_target``, default
  0.99): where the ranks' mean cut exceeds ``1 - target`` it grows by
  sqrt(cut / allowed), at most ``STEP_UP`` per agreement; where the cut is
  below half of what is allowed it shrinks by ``STEP_DOWN``; it never goes
  below 1 (the deadline never cuts below what calls that finished in time
  needed) nor above what reaches ``cap``; every rank computes it from the
  same agreed numbers, so it is the same everywhere;
- the agreed percentile of a kind is at least what the patience (PATIENCE
  of the deadline) needs to cover the lateness of peers that most calls
  see (late_peers): a rank late into every call is waited for, a rare
  straggler is cut; in a hierarchy the stages within a node cover the
  delivered target's share of their late ranks, and the network stage a
  node's lateness as long as that (within_node, follow);
- a rank that starts an agreement while ``AHEAD`` are still pending (a
  peer is PERIOD + LAG calls or more behind it) waits for that peer, at
  most the cap, and asks for the cap for one period (_catch_up): outrun,
  a late peer would never catch up, and the agreements that should
  lengthen the deadline would complete later and later;
- until the first agreement, and for kinds never seen complete, the
  deadline is ``cap``.

Why the cut and not the percentile alone: under congestion from other
traffic the calls that the deadline cut are the long ones, and a percentile
of the calls that finished in time never sees them; it learns a deadline
too short for the network it is in (0.947 delivered on the emulated cluster
beside background traffic, docs/deadlines.md).  Calls in which a peer was
seen late or never (a straggler, a stopped rank, a rank catching up after
either) do not count: waiting longer for a rank that is not there buys
nothing, and the learned deadline is what bounds the wait for it.  Blocks
lost to injected loss or real drops that their producers reported do not
count either: no deadline brings them back.

The agreement is waited for at most SETTLE_SHARE of the shortest deadline
in use, and that wait comes out of the call's own deadline: ranks that are
on time all complete it at the due call and apply the result together; a
rank whose peer is far behind (asleep, not yet in the agreement) gives up
after that share, keeps its previous deadlines and looks again at its next
call, so a straggler cannot stretch the other ranks' calls.  The ranks then
use different deadlines for those few calls, which the straggler makes lossy
anyway.  Agreements apply in the order they started, each once, so the
scale is the same on every rank once they are applied.  Agreement k starts
at call k * PERIOD on every rank even while earlier ones are still pending
(they queue, each with its own buffers): the collectives match by order, so
skipping one on a rank that waits would put the ranks' schedules a period
apart for good.

A communicator freed while an agreement is still in flight waits for it at
most a second, then leaves it to control/agreement.py, which completes it
later.

Why these numbers: a call spends 40% of its deadline in its stages after the
anchor (docs/deadlines.md), so FACTOR = 4 gives a lossless call 1.6 times its
recent 95th percentile, and late peers 60% of the deadline.  The scale
climbs fast and comes down slowly: a deadline too short loses data at once,
one too long costs only while data is late (a call ends when everything
has arrived).  The agreement
matters: ranks that used different deadlines would give up at different
stages, and losses that hit some ranks more than others bias the result.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Deque, Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .._core import PATIENCE     # of a deadline, the wait for peers not yet in the call
from .agreement import LAG, PERIOD, Agreement, _lingering, finish, reap, wait  # noqa: F401

WINDOW = 64
FACTOR = 4.0
PERCENTILE = 95

# np.percentile's first use imports numpy.ma (20-60 ms on a loaded machine):
# paid here, at import, not inside the call that starts the first agreement
# (it made every rank's 16th call the slowest of a run).
np.percentile(np.zeros(1), PERCENTILE)
SKEW_PERCENTILE = 90    # lateness of peers that the deadline's patience covers (flat,
                        # across nodes; within a node the delivered target's: within_node)...
SKEW_MARGIN = 1.25      # ...with this margin
ABSENT_SHARE = 0.5      # a peer missing more of the calls than this is behind, not straggling
SETTLE_SHARE = 0.25     # of a deadline, at most, spent completing an agreement
STEP_UP = 2.0           # largest growth of the scale per agreement
STEP_DOWN = 0.75        # its shrinking per agreement while the cut is well below target
EARLY_ANCHOR = 0.25     # a call's cut counts if every peer was seen within this share of it
AHEAD = 2               # agreements pending when a rank waits for the peer behind (_catch_up)

Key = Tuple[int, int, int]

# Kinds have a fixed place in the agreed vector: collective x algorithm x
# size bucket (bit length of the byte count, < 64).
_COLLECTIVES, _ALGORITHMS, _BUCKETS = 3, 3, 64
_SLOTS = _COLLECTIVES * _ALGORITHMS * _BUCKETS


def size_bucket(nbytes: int) -> int:
    return max(nbytes, 1).bit_length()


def _slot(key: Key) -> int:
    coll, algo, bucket = key
    return (coll * _ALGORITHMS + algo) * _BUCKETS + min(bucket, _BUCKETS - 1)


def _key(slot: int) -> Key:
    return (slot // (_ALGORITHMS * _BUCKETS), slot // _BUCKETS % _ALGORITHMS, slot % _BUCKETS)


def next_scale(scale: float, cut: float, allowed: float, largest: float) -> float:
    """The scale after an agreement whose ranks' mean cut is `cut`, for a
    target that allows `allowed` (1 - delivered target); `largest`: the
    scale beyond which every deadline is at the cap (no wind-up)."""
    if cut > allowed:
        scale *= min(STEP_UP, math.sqrt(cut / allowed))
    elif cut < allowed / 2:
        scale *= STEP_DOWN
    return max(1.0, min(scale, largest))


def late_peers(seen: Deque[float], absent: Tuple[int, int, float],
               percentile: float = SKEW_PERCENTILE) -> float:
    """The wait for late peers that a deadline's patience should cover: the
    `percentile` of how long recent calls waited for their last peer
    (`seen`), with a margin.  `absent`: (calls, calls with a peer never seen
    in them, the longest of those) since the last agreement.  A peer absent
    from most calls has fallen behind for good (every call loses it, and it
    falls further behind while the others do not wait for it): the wait
    covers the longest such call then, so that the patience grows (by about
    2x an agreement) until the peer is seen.  Rarer absences are a
    straggler's, or a rank catching up after one (a sleep past the deadline
    misses the next few calls too): not counted, so that a straggler is cut,
    not waited for.  0: nothing to cover."""
    calls, missed, longest = absent
    needed = float(np.percentile(list(seen), percentile)) if seen else 0.0
    if calls and missed > ABSENT_SHARE * calls:
        needed = max(needed, longest)
    return needed * SKEW_MARGIN


class AutoDeadline:
    """The learned, agreed deadline of each kind of call on one communicator."""

    def __init__(self, comm: MPI.Intracomm, floor: float = 1e-3, cap: float = 1.0,
                 target: float = 0.99) -> None:
        if not (0 < floor <= cap) or not math.isfinite(cap):
            raise ValueError(f"auto deadline needs 0 < floor <= cap < inf, got {floor}, {cap}")
        if not 0 < target < 1:
            raise ValueError(f"delivered target must be in (0, 1), got {target}")
        self.comm = comm            # private: the agreements never meet other traffic
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.floor = floor
        self.cap = cap
        self.allowed = 1.0 - target     # share of the blocks the deadline may cut
        self.skew_percentile: float = SKEW_PERCENTILE   # of late peers' lateness, covered
        self.absent_as_late = False     # a call that never saw a peer: within_node()
        self.upstream: Optional["AutoDeadline"] = None     # see follow()
        self.calls = 0
        self.durations: Dict[Key, deque] = {}
        self.skews: Dict[Key, deque] = {}    # how long calls waited for their last peer
        self.absent: Dict[Key, Tuple[int, int, float]] = {}   # this period's; see late_peers
        self.agreed: Dict[Key, float] = {}     # agreed 95th percentile per kind
        self.timeouts: Dict[Key, float] = {}
        self.scale = 1.0
        self.cut = 0.0              # this period's cut shares, summed over its calls
        self.cut_calls = 0
        self.auto_call = False      # whether the current call uses the auto deadline
        self.waited_behind = False  # the current call waited for a peer far behind (_catch_up)
        self.last_key: Any = None   # the kind of the latest call that asked its deadline
        self.pending: Deque[Agreement] = deque()
        self.started = 0            # agreements started (one per PERIOD calls)

    def within_node(self) -> None:
        """Learn as the stages within a node of a hierarchical call: a peer
        late into them is the node's cores busy elsewhere, milliseconds
        before a network stage of tens, and cut there it loses a whole
        rank's share of every slice of the node (0.96 delivered within the
        node at 2 x 2, docs/deadlines.md, "Late peers within a node").  So
        the patience covers the delivered target's share of that lateness,
        not the SKEW_PERCENTILE that lets a flat or network level cut a
        straggler.  A call that never saw a peer (it came later than the
        whole call) counts the call's length as its lateness, the least it
        was: unmeasured, a lateness past the deadline would never be
        covered."""
        self.skew_percentile = 100.0 * (1.0 - self.allowed)
        self.absent_as_late = True

    def follow(self, upstream: "AutoDeadline") -> None:
        """This level's stage runs after `upstream`'s (the network stage after
        the node's): a node whose stage waited for a late rank comes late
        into this one by as much, so this level waits for late peers at
        least as long as `upstream` does.  Otherwise the node's wait only
        moves the cut from the late rank to its whole node."""
        self.upstream = upstream

    def patience(self) -> float:
        """The longest wait for late peers that the agreed deadlines allow
        (the same on every rank of the communicator); 0 before the first."""
        return PATIENCE * max((self.timeouts[key] for key in self.agreed), default=0.0)

    def tick(self, auto: bool) -> float:
        """Count one call on the communicator: every rank, every call, before
        anything about the call is known (even one that fails validation).
        `auto`: the call asked for timeout="auto": only such a call waits
        for a due agreement (others look once and apply it when done).
        Agreements run every PERIOD calls whatever the calls ask for: a
        schedule that started at a rank's first "auto" call paired the
        agreements of a rank that had passed "auto" once with the next of
        the others for good.  Returns the seconds spent on the agreement,
        which the call takes out of its deadline."""
        self.calls += 1
        self.auto_call = auto
        self.waited_behind = False
        spent = 0.0
        for agreement in self.pending:
            agreement.request.Test()     # drive MPI progress: shared-memory calls make none
        if _lingering and self.calls % PERIOD == 0:
            reap()
        # Agreements complete in the order they were started; each applies
        # at its due call, or at the first call after it that finds it done.
        while self.pending and self.calls >= self.pending[0].due:
            waited, done = self._settle(self.pending[0], auto)
            spent += waited
            if not done:
                break
            self._apply(self.pending.popleft().recv)
        # Agreement k starts at call k * PERIOD on every rank, whatever is
        # still pending: the collectives match by order, so none is skipped.
        if self.calls % PERIOD == 0:
            behind = auto and len(self.pending) >= AHEAD
            if behind:
                spent += self._catch_up()
                self.waited_behind = True
            self._start(behind)
        return spent

    def _catch_up(self) -> float:
        """AHEAD agreements are still pending: some peer has not started
        the oldest, PERIOD + LAG calls or more behind this rank.  Racing on
        leaves it behind for good: every call loses it, and the agreements
        that would lengthen the deadline complete only as it gets to them,
        later and later.  So wait for it here, at most the cap, and apply
        what completed; the agreement started next asks for the cap (_start).
        The call that waited has the cap as its deadline (timeout()), the
        wait coming out of it like any agreement's: it ends within the
        deadline it reports."""
        waited = wait(self.pending[0], self.cap)
        while self.pending and self.pending[0].request.Test():
            self._apply(self.pending.popleft().recv)
        return waited

    def _start(self, behind: bool = False) -> None:
        """Start the next agreement.  `behind`: a peer is PERIOD + LAG calls
        or more behind this rank (_catch_up): the kinds that missed a peer
        since the last agreement ask for the cap, for one period, so that
        the ranks wait for it until it has caught up; the calls after that
        measure how late it comes (late_peers)."""
        # [percentile of every kind | 1 + each rank's mean cut, 0 if it had
        # no call to count]: MAX gives the largest percentiles and, in the
        # ranks' own places, everyone's cut.
        send = np.zeros(_SLOTS + self.size)
        for key, durations in self.durations.items():
            if durations:
                send[_slot(key)] = float(np.percentile(list(durations), PERCENTILE))
        # (the node's agreed patience, the same on its ranks: the late rank
        # itself measured no lateness, its node-mates did)
        carried = self.upstream.patience() if self.upstream is not None else 0.0
        for key in set(self.skews) | set(self.absent):
            absent = self.absent.pop(key, (0, 0, 0.0))
            needed = max(late_peers(self.skews.get(key, deque()), absent, self.skew_percentile),
                         carried)
            if behind and absent[1]:
                needed = math.inf
            if needed:
                # in the units of the stages' percentile (deadline = FACTOR * scale * it;
                # the cap at most, which a scale >= 1 keeps)
                send[_slot(key)] = max(send[_slot(key)], min(needed / (PATIENCE * FACTOR),
                                                             self.cap / FACTOR))
        if self.cut_calls:
            send[_SLOTS + self.rank] = 1.0 + self.cut / self.cut_calls
        self.cut, self.cut_calls = 0.0, 0
        recv = np.zeros_like(send)
        self.pending.append(Agreement(self.comm.Iallreduce(send, recv, op=MPI.MAX), send,
                                       recv, self.calls + LAG))
        self.started += 1

    def _settle(self, agreement: Agreement, wait: bool) -> Tuple[float, bool]:
        """Wait for an agreement at most SETTLE_SHARE of the shortest deadline
        in use (every rank that is on time gets there within it, so all apply
        the result at the same call); a straggler that has not joined costs
        no more than that.  Without `wait`, look once.  (seconds waited, done)."""
        began = time.monotonic()
        budget = SETTLE_SHARE * min(self.timeouts.values(), default=self.cap) if wait else 0.0
        while not agreement.request.Test():
            if time.monotonic() - began > budget:
                return time.monotonic() - began, False      # look again at the next call
        return time.monotonic() - began, True

    def _apply(self, recv: np.ndarray) -> None:
        # Every kind any rank reported, also those this rank has not used yet:
        # the deadlines must be the same everywhere when it does.
        for slot in np.flatnonzero(recv[:_SLOTS] > 0):
            self.agreed[_key(int(slot))] = float(recv[slot])
        cuts = recv[_SLOTS:]
        cuts = cuts[cuts > 0] - 1.0
        if cuts.size and self.agreed:
            largest = self.cap / (FACTOR * min(self.agreed.values()))
            self.scale = next_scale(self.scale, float(np.mean(cuts)), self.allowed, largest)
        self._set_timeouts()

    def _set_timeouts(self) -> None:
        for key, p in self.agreed.items():
            self.timeouts[key] = min(max(FACTOR * self.scale * p, self.floor), self.cap)

    def learned(self) -> Tuple[Dict[Key, float], float]:
        """What the agreements so far settled (the same on every rank once
        applied): the percentiles per kind and the scale."""
        return dict(self.agreed), self.scale

    def warm(self, learned: Tuple[Dict[Key, float], float]) -> None:
        """Start from another communicator's learned() (elastic: the
        survivors' after an exclusion, theirs for a spare called in)
        instead of the cap."""
        agreed, self.scale = learned
        self.agreed = dict(agreed)
        self._set_timeouts()

    def timeout(self, key: Key) -> float:
        """The deadline of this call, of this kind: the cap for a call that
        waited for a peer far behind (_catch_up), whose wait may have taken
        up to the cap."""
        self.last_key = key
        self.timeouts.setdefault(key, self.cap)
        return self._in_force(key)

    def _in_force(self, key: Key) -> float:
        """The deadline the current call had (timeout(), without side effects)."""
        return self.cap if self.waited_behind else self.timeouts.get(key, self.cap)

    def may_grow(self) -> bool:
        """The current call uses the learned deadline, and it is below the
        cap: a peer late into every call may yet be waited for (late_peers)."""
        return self.auto_call and self._in_force(self.last_key) < self.cap

    def observe(self, key: Key, result: Any) -> None:
        """Learn from a call that ended (the core's CallResult) in which every
        peer was seen: how long its stages took after the anchor, if it ended
        before its deadline with everything not dropped on purpose, and, if
        every peer was seen early in it, what share of the blocks it read
        the deadline cut.  (A single rank has nothing to learn: it only
        copies.)"""
        if self.size > 1 and not result.err_kind:
            start, anchor, end, seen = result.timing
            if anchor >= 0:
                _injected, late, gone, torn = result.lost_blocks
                self.record(key, end - anchor, not (result.deadline_hit or gone or torn))
                timeout = self._in_force(key)
                if self.auto_call:
                    self._skew(key, start, max(end, anchor), seen)
                early = anchor - start <= EARLY_ANCHOR * timeout
                # (a kind already at the cap cannot be lengthened: its cut
                # would lengthen every other kind's deadline, to no avail)
                if self.auto_call and early and result.read_blocks and timeout < self.cap:
                    self.cut += min(1.0, late / result.read_blocks)
                    self.cut_calls += 1

    def _skew(self, key: Key, start: float, end: float, seen: float) -> None:
        """Learn how late the last peer came into a call (late_peers)."""
        calls, missed, longest = self.absent.get(key, (0, 0, 0.0))
        if seen >= 0:
            self.skews.setdefault(key, deque(maxlen=WINDOW)).append(seen - start)
            self.absent[key] = (calls + 1, missed, longest)
        else:
            if self.absent_as_late:
                self.skews.setdefault(key, deque(maxlen=WINDOW)).append(end - start)
            self.absent[key] = (calls + 1, missed + 1, max(longest, end - start))

    def record(self, key: Key, duration: float, in_time: bool) -> None:
        """Report how long the stages of a call took, and whether it ended
        before its deadline."""
        if in_time and duration > 0:
            self.durations.setdefault(key, deque(maxlen=WINDOW)).append(duration)

    def close(self, limit: float = 1.0) -> None:
        """Finish the agreements in flight (finish())."""
        finish(self.pending, limit)

    def snapshot(self) -> dict:
        """Current deadline per kind, for logs and tests."""
        return dict(self.timeouts)
