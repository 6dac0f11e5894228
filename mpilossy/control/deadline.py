"""timeout="auto": a deadline learned from earlier calls and agreed by all ranks.

The rule, per kind of call (collective, algorithm, message size rounded to a
power of two):

- each rank keeps the durations of its last ``WINDOW`` *complete* calls of
  that kind (every contribution arrived, no deadline hit), measured from the
  anchor (every peer seen in the call) to the end, which is the part the
  stages of a call must fit in;
- every ``PERIOD`` calls on the communicator (every call counts, whatever
  its kind and whether it failed validation, so the schedule is the same on
  every rank) the ranks take the maximum of their 95th percentiles of every
  kind with one nonblocking ``MPI_Iallreduce`` of a fixed-size vector on a
  private communicator; ``LAG`` calls later the deadline of each kind becomes
  ``FACTOR`` times that maximum, clamped between ``floor`` and ``cap``;
- until the first agreement, and for kinds never seen complete, the
  deadline is ``cap``.

The agreement is waited for at most SETTLE_SHARE of the shortest deadline
in use, and that wait comes out of the call's own deadline: ranks that are
on time all complete it at the due call and apply the result together; a
rank whose peer is far behind (asleep, not yet in the agreement) gives up
after that share, keeps its previous deadlines and looks again at its next
call, so a straggler cannot stretch the other ranks' calls.  The ranks then
use different deadlines for those few calls, which the straggler makes lossy
anyway.  Agreement k starts at call k * PERIOD on every rank even while
earlier ones are still pending (they queue, each with its own buffers): the
collectives match by order, so skipping one on a rank that waits would put
the ranks' schedules a period apart for good.

A communicator freed while an agreement is still in flight waits for it at
most a second, then leaves it to control/agreement.py, which completes it
later.

Why these numbers: a call spends 40% of its deadline in its stages after the
anchor (docs/deadlines.md), so FACTOR = 4 gives a lossless call 1.6 times its
recent 95th percentile, and late peers 60% of the deadline.  The agreement
matters: ranks that used different deadlines would give up at different
stages, and losses that hit some ranks more than others bias the result.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Deque, Dict, Tuple

import numpy as np
from mpi4py import MPI

from .agreement import LAG, PERIOD, Agreement, _lingering, finish, reap  # noqa: F401

WINDOW = 64
FACTOR = 4.0
PERCENTILE = 95
SETTLE_SHARE = 0.25     # of a deadline, at most, spent completing an agreement

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


class AutoDeadline:
    """The learned, agreed deadline of each kind of call on one communicator."""

    def __init__(self, comm: MPI.Intracomm, floor: float = 1e-3, cap: float = 1.0) -> None:
        if not (0 < floor <= cap) or not math.isfinite(cap):
            raise ValueError(f"auto deadline needs 0 < floor <= cap < inf, got {floor}, {cap}")
        self.comm = comm            # private: the agreements never meet other traffic
        self.size = comm.Get_size()
        self.floor = floor
        self.cap = cap
        self.calls = 0
        self.durations: Dict[Key, deque] = {}
        self.timeouts: Dict[Key, float] = {}
        self.pending: Deque[Agreement] = deque()
        self.started = 0            # agreements started (one per PERIOD calls once active)
        self.active = False

    def tick(self, auto: bool) -> float:
        """Count one call on the communicator: every rank, every call, before
        anything about the call is known (even one that fails validation).
        `auto`: the call asked for timeout="auto" (from then on the ranks
        agree every PERIOD calls).  Returns the seconds spent on the
        agreement, which the call takes out of its deadline."""
        self.calls += 1
        self.active = self.active or auto
        spent = 0.0
        for agreement in self.pending:
            agreement.request.Test()     # drive MPI progress: shared-memory calls make none
        if _lingering and self.calls % PERIOD == 0:
            reap()
        # Agreements complete in the order they were started; each applies
        # at its due call, or at the first call after it that finds it done.
        while self.pending and self.calls >= self.pending[0].due:
            waited, done = self._settle(self.pending[0])
            spent += waited
            if not done:
                break
            self._apply(self.pending.popleft().recv)
        # Agreement k starts at call k * PERIOD on every rank, whatever is
        # still pending: the collectives match by order, so none is skipped.
        if self.active and self.calls % PERIOD == 0:
            send = np.zeros(_SLOTS)
            for key, durations in self.durations.items():
                if durations:
                    send[_slot(key)] = float(np.percentile(list(durations), PERCENTILE))
            recv = np.zeros(_SLOTS)
            self.pending.append(Agreement(self.comm.Iallreduce(send, recv, op=MPI.MAX), send,
                                           recv, self.calls + LAG))
            self.started += 1
        return spent

    def _settle(self, agreement: Agreement) -> Tuple[float, bool]:
        """Wait for an agreement at most SETTLE_SHARE of the shortest deadline
        in use (every rank that is on time gets there within it, so all apply
        the result at the same call); a straggler that has not joined costs
        no more than that.  (seconds waited, done)."""
        began = time.monotonic()
        budget = SETTLE_SHARE * min(self.timeouts.values(), default=self.cap)
        while not agreement.request.Test():
            if time.monotonic() - began > budget:
                return time.monotonic() - began, False      # look again at the next call
        return time.monotonic() - began, True

    def _apply(self, recv: np.ndarray) -> None:
        # Every kind any rank reported, also those this rank has not used yet:
        # the deadlines must be the same everywhere when it does.
        for slot in np.flatnonzero(recv > 0):
            self.timeouts[_key(int(slot))] = min(max(FACTOR * float(recv[slot]), self.floor),
                                                 self.cap)

    def timeout(self, key: Key) -> float:
        """The deadline of this call, of this kind."""
        return self.timeouts.setdefault(key, self.cap)

    def observe(self, key: Key, result: Any) -> None:
        """Learn from a call that ended (the core's CallResult): how long its
        stages took after the anchor, if every contribution arrived.  (A
        single rank has nothing to learn: it only copies.)"""
        if self.size > 1 and not result.err_kind:
            _start, anchor, end = result.timing
            if anchor >= 0:
                self.record(key, end - anchor, result.delivered >= 1.0 and not result.deadline_hit)

    def record(self, key: Key, duration: float, complete: bool) -> None:
        """Report how long the stages of a call took, and whether it lost anything."""
        if complete and duration > 0:
            self.durations.setdefault(key, deque(maxlen=WINDOW)).append(duration)

    def close(self, limit: float = 1.0) -> None:
        """Finish the agreements in flight (finish())."""
        finish(self.pending, limit)

    def snapshot(self) -> dict:
        """Current deadline per kind, for logs and tests."""
        return dict(self.timeouts)
