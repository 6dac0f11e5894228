"""timeout="auto": a deadline learned from earlier calls and agreed by all ranks.

The rule, per kind of call (collective, algorithm, message size rounded to a
power of two):

- each rank keeps the durations of its last ``WINDOW`` *complete* calls of
  that kind (every contribution arrived, no deadline hit), measured from the
  anchor (every peer seen in the call) to the end, which is the part the
  stages of a call must fit in;
- every ``PERIOD`` calls of that kind the ranks take the maximum of their
  95th percentiles with a nonblocking ``MPI_Iallreduce`` on a private
  communicator; ``LAG`` calls later — the same call on every rank — the
  deadline becomes ``FACTOR`` times that maximum, clamped between ``floor``
  and ``cap``;
- until the first agreement, and for kinds never seen complete, the
  deadline is ``cap``.

Why these numbers: a call spends 40% of its deadline in its stages after the
anchor (docs/deadlines.md), so FACTOR = 4 gives a lossless call 1.6 times its
recent 95th percentile, and late peers 60% of the deadline.  The agreement
matters: ranks that used different deadlines would give up at different
stages, and losses that hit some ranks more than others bias the result.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

WINDOW = 64
PERIOD = 16
LAG = 4
FACTOR = 4.0
PERCENTILE = 95

Key = Tuple[int, int, int]


def size_bucket(nbytes: int) -> int:
    return max(nbytes, 1).bit_length()


class _Kind:
    __slots__ = ("durations", "calls", "timeout", "pending", "due", "send", "recv")

    def __init__(self, cap: float) -> None:
        self.durations: deque = deque(maxlen=WINDOW)
        self.calls = 0
        self.timeout = cap
        self.pending: Optional[MPI.Request] = None
        self.due = 0
        self.send = np.zeros(1)
        self.recv = np.zeros(1)


class AutoDeadline:
    """The learned, agreed deadline of each kind of call on one communicator."""

    def __init__(self, comm: MPI.Intracomm, floor: float = 1e-3, cap: float = 1.0) -> None:
        if not (0 < floor <= cap) or not math.isfinite(cap):
            raise ValueError(f"auto deadline needs 0 < floor <= cap < inf, got {floor}, {cap}")
        self.comm = comm            # private: the agreements never meet other traffic
        self.floor = floor
        self.cap = cap
        self.kinds: Dict[Key, _Kind] = {}

    def timeout(self, key: Key) -> float:
        """The deadline of the next call of this kind (advances the schedule)."""
        kind = self.kinds.get(key)
        if kind is None:
            kind = self.kinds[key] = _Kind(self.cap)
        kind.calls += 1
        if kind.pending is not None:
            kind.pending.Test()     # drive MPI progress: shared-memory calls make none
        if kind.pending is not None and kind.calls >= kind.due:
            kind.pending.Wait()
            kind.pending = None
            estimate = float(kind.recv[0])
            if estimate > 0:
                kind.timeout = min(max(FACTOR * estimate, self.floor), self.cap)
        if kind.calls % PERIOD == 0 and kind.pending is None:
            complete = list(kind.durations)
            kind.send[0] = float(np.percentile(complete, PERCENTILE)) if complete else 0.0
            kind.pending = self.comm.Iallreduce(kind.send, kind.recv, op=MPI.MAX)
            kind.due = kind.calls + LAG
        return kind.timeout

    def record(self, key: Key, duration: float, complete: bool) -> None:
        """Report how long the stages of a call took, and whether it lost anything."""
        if complete and duration > 0:
            kind = self.kinds.get(key)
            if kind is None:
                kind = self.kinds[key] = _Kind(self.cap)
            kind.durations.append(duration)

    def close(self) -> None:
        for kind in self.kinds.values():
            if kind.pending is not None:
                kind.pending.Wait()
                kind.pending = None

    def snapshot(self) -> dict:
        """Current deadline per kind, for logs and tests."""
        return {key: kind.timeout for key, kind in self.kinds.items()}
