"""A rank that no longer takes part in its peers' calls says so.

A rank that finds every peer already past its call (only its own data in
the result, blocks `gone`, none late) catches up by itself: such calls
return at once while the peers wait for it.  One that stays behind for
MPILOSSY_MAX_BEHIND calls in a row has dropped out of the others' calls:
LagWatch raises LaggingError instead of staying silent.
"""

from __future__ import annotations

from typing import Any

from ..errors import LaggingError

__all__ = ["LagWatch"]


class LagWatch:
    """Counts the calls in a row in which every peer had already moved on."""

    def __init__(self, rank: int, size: int, max_behind: int) -> None:
        self.rank, self.size, self.max_behind = rank, size, max_behind
        self.behind = 0

    def watch(self, result: Any) -> None:
        """After each successful call (the core's CallResult)."""
        delivered, lost = result.delivered, result.lost_blocks
        behind = (self.size > 1 and lost[2] > 0 and lost[1] == 0
                  and delivered <= 1.0 / self.size + 1e-9)
        self.behind = self.behind + 1 if behind else 0
        if self.behind >= self.max_behind:
            calls, self.behind = self.behind, 0
            raise LaggingError(
                f"rank {self.rank}: every peer had already finished this rank's call on "
                f"{calls} calls in a row (call {result.seq}): this rank no longer takes part in "
                f"the others' calls. Do all ranks make the same calls? (MPILOSSY_MAX_BEHIND="
                f"{self.max_behind} sets how many calls in a row are tolerated)")
