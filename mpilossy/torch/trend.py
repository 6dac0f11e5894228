"""missed="extrapolate" of the sharded optimizer (sharded.py): a block of
parameters the all-gather did not bring is estimated from its owner's
recent updates."""

from __future__ import annotations

import numpy as np
import torch

from .. import CollectiveStats

__all__ = ["Trend"]


class Trend:
    """missed="extrapolate": per element, the last value received from its
    owner, the owner's mean update per step since the one before, and the
    steps since.  A block missed by the all-gather is set to the last value
    plus that rate times the steps since: with momentum optimizers a step's
    update is close to the last ones, so the estimate is nearer the owner's
    value than the stale one.  The owner's own chunk is always exact.

    Every pass works in place (one scratch buffer), and a step that missed
    nothing takes three passes: for the example's 25M parameters the
    out-of-place version cost 0.7 s a step on one core, this one 0.06 s
    (0.2 s at 10% loss).  It runs where the parameters are."""

    def __init__(self, values: torch.Tensor) -> None:
        self.last = values.clone()
        self.rate = torch.zeros_like(values)
        self.age = torch.ones_like(values)
        self.scratch = torch.empty_like(values)

    def update(self, values: torch.Tensor, stats: CollectiveStats) -> None:
        contributors = stats.contributors
        assert contributors is not None     # (the all-gather records them)
        got_blocks = contributors.members().any(axis=1)
        with torch.no_grad():
            if got_blocks.all():
                torch.sub(values, self.last, out=self.rate).div_(self.age)
                self.last.copy_(values)
                self.age.fill_(1)
                return
            _, lengths = contributors.blocks()
            got = torch.from_numpy(np.repeat(got_blocks, lengths)).to(values.device)
            torch.sub(values, self.last, out=self.scratch).div_(self.age)
            torch.where(got, self.scratch, self.rate, out=self.rate)
            torch.where(got, values, self.last, out=self.last)
            torch.addcmul(self.last, self.rate, self.age, out=self.scratch)
            torch.where(got, values, self.scratch, out=values)
            self.age.add_(1).masked_fill_(got, 1)

    def exact(self, values: torch.Tensor) -> None:
        """Every value is the owner's again (after a reliable re-synchronisation)."""
        with torch.no_grad():
            self.last.copy_(values)
            self.age.fill_(1)
