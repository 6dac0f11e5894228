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
anyway.

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
from typing import Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

WINDOW = 64
PERIOD = 16
LAG = 8
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
        self.floor = floor
        self.cap = cap
        self.calls = 0
        self.durations: Dict[Key, deque] = {}
        self.timeouts: Dict[Key, float] = {}
        self.pending: Optional[MPI.Request] = None
        self.due = 0
        self.active = False
        self.send = np.zeros(_SLOTS)
        self.recv = np.zeros(_SLOTS)

    def tick(self, auto: bool) -> float:
        """Count one call on the communicator: every rank, every call, before
        anything about the call is known (even one that fails validation).
        `auto`: the call asked for timeout="auto" (from then on the ranks
        agree every PERIOD calls).  Returns the seconds spent on the
        agreement, which the call takes out of its deadline."""
        self.calls += 1
        self.active = self.active or auto
        spent = 0.0
        if self.pending is not None and self.calls >= self.due:
            spent = self._settle()
        elif self.pending is not None:
            self.pending.Test()          # drive MPI progress: shared-memory calls make none
        if self.active and self.calls % PERIOD == 0 and self.pending is None:
            self.send[:] = 0.0
            for key, durations in self.durations.items():
                if durations:
                    self.send[_slot(key)] = float(np.percentile(list(durations), PERCENTILE))
            self.pending = self.comm.Iallreduce(self.send, self.recv, op=MPI.MAX)
            self.due = self.calls + LAG
        return spent

    def _settle(self) -> float:
        """Complete the agreement if the peers have joined it: wait at most
        SETTLE_SHARE of the shortest deadline in use (every rank that is on
        time gets there within it, so all apply the result at the same call);
        a straggler that has not joined costs no more than that."""
        began = time.monotonic()
        budget = SETTLE_SHARE * min(self.timeouts.values(), default=self.cap)
        while not self.pending.Test():
            if time.monotonic() - began > budget:
                return time.monotonic() - began      # look again at the next call
        self.pending = None
        # Every kind any rank reported, also those this rank has not used yet:
        # the deadlines must be the same everywhere when it does.
        for slot in np.flatnonzero(self.recv > 0):
            self.timeouts[_key(int(slot))] = min(max(FACTOR * float(self.recv[slot]), self.floor),
                                                 self.cap)
        return time.monotonic() - began

    def timeout(self, key: Key) -> float:
        """The deadline of this call, of this kind."""
        return self.timeouts.setdefault(key, self.cap)

    def record(self, key: Key, duration: float, complete: bool) -> None:
        """Report how long the stages of a call took, and whether it lost anything."""
        if complete and duration > 0:
            self.durations.setdefault(key, deque(maxlen=WINDOW)).append(duration)

    def close(self, limit: float = 1.0) -> None:
        """Finish the agreement in flight; give up after `limit` seconds (a
        peer that never gets here) rather than hang."""
        if self.pending is None:
            return
        end = time.monotonic() + limit
        while not self.pending.Test() and time.monotonic() < end:
            time.sleep(1e-4)
        self.pending = None     # (MPI cannot cancel a collective: left to complete)

    def snapshot(self) -> dict:
        """Current deadline per kind, for logs and tests."""
        return dict(self.timeouts)
