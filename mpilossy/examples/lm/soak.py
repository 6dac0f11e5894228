"""The soak scenario (``--soak EVERY``, docs/elastic.md "A soak"): before
every EVERY-th step one working rank fails, in turn: it stops itself
(SIGSTOP) and is woken ``hang`` seconds later by a process it started, or,
for ``exits`` of the failures spread over the run, it exits.  The others
exclude it and a spare takes its place; a rank that wakes is told it was
excluded, stands by again (Communicator.stand_by) and is the next spare.
Every rank knows the schedule (the step and the communicator's size are
agreed), so the victim is the rank of the current communicator whose turn
it is, and only it acts.

The soak's control arm (``--forget EVERY``) fails no rank: on the same
schedule the victim zeroes its chunk of the sharded optimizer's
elementwise state (AdamW's moments), which is what a failure cost the
sharded mode without copies of the state (``--copy-state-every 0``: the
lost owner's chunk of the state restarts from zeros, the step count goes
on); the rest of the run is undisturbed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["Soak", "failure_costs", "forget_state"]


@dataclass(frozen=True)
class Soak:
    every: int          # steps between failures (0: no soak)
    hang: float         # seconds a stopped rank stays stopped
    exits: int          # how many of the failures are exits (the others stop)
    steps: int          # the run's steps

    @property
    def failures(self) -> int:
        return 0 if self.every <= 0 else (self.steps - 1) // self.every

    def failure(self, step: int) -> Optional[int]:
        """The failure (1, 2, ...) due before `step`, or None."""
        if self.every <= 0 or step == 0 or step % self.every:
            return None
        return step // self.every

    def kind(self, failure: int) -> str:
        """"exit" for `exits` failures spread evenly over the run, else "stop"."""
        if self.exits <= 0:
            return "stop"
        spacing = max(1, self.failures // self.exits)
        return "exit" if failure % spacing == 0 and failure // spacing <= self.exits else "stop"

    def victim(self, failure: int, size: int) -> int:
        """The rank of the current communicator that fails."""
        return failure % size

    def fail(self, failure: int, rank: int) -> None:
        """On the victim (`rank` in the job): exit, or stop until a helper
        process wakes it."""
        print(f"soak: failure {failure} before step {failure * self.every}: rank {rank} "
              f"{'exits' if self.kind(failure) == 'exit' else 'stops'}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if self.kind(failure) == "exit":
            os._exit(0)
        # (in a session of its own: what signals the job's process groups at its end
        # must not take the waker with it and leave this rank stopped)
        subprocess.Popen(["sh", "-c", f"sleep {self.hang}; kill -CONT {os.getpid()}"],
                         start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def forget_state(optimizer: torch.optim.Optimizer) -> int:
    """Zero every elementwise state tensor (the parameter's shape) of
    `optimizer`'s parameters, keep its counters; returns the elements
    zeroed.  On a sharded optimizer's inner optimizer: this rank's chunk."""
    zeroed = 0
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                for value in optimizer.state.get(param, {}).values():
                    if torch.is_tensor(value) and value.shape == param.shape and value.numel() > 1:
                        value.zero_()
                        zeroed += value.numel()
    return zeroed


def failure_costs(soak: Soak, step_seconds: List[Dict[int, float]],
                  sizes: List[Dict[int, int]], working: int, window: int = 10) -> Dict[str, Any]:
    """What the failures cost, from every rank in's record of the steps it
    made (a rank out for a while has gaps): a step took as long as its
    slowest rank; for each failure at step f, the seconds steps
    f..f+window-1 took beyond window typical steps (the median step), and
    the steps until the communicator was back at `working` ranks."""
    took: Dict[int, float] = {}
    size: Dict[int, int] = {}
    for mine, seen in zip(step_seconds, sizes):
        for step, seconds in mine.items():
            took[step] = max(took.get(step, 0.0), seconds)
        for step, ranks in seen.items():
            size[step] = max(size.get(step, 0), ranks)
    typical = float(np.median(list(took.values()))) if took else 0.0
    extra: List[float] = []
    back: List[float] = []
    each: List[Tuple[int, Optional[float], Optional[int]]] = []
    for failure in range(1, soak.failures + 1):
        f = failure * soak.every
        window_took = [took[s] for s in range(f, f + window) if s in took]
        cost = sum(window_took) - window * typical if len(window_took) == window else None
        full = [s - f for s in range(f, soak.steps) if size.get(s) == working]
        each.append((f, cost, full[0] if full else None))
        if cost is not None:
            extra.append(cost)
        if full:
            back.append(float(full[0]))

    def quantiles(values: List[float]) -> List[float]:
        return [float(np.percentile(values, q)) for q in (50, 90, 100)] if values else []
    return {"typical_step_seconds": typical, "measured": len(extra),
            "extra_seconds_p50_p90_max": quantiles(extra),
            "steps_to_full_size_p50_p90_max": quantiles(back),
            "each": each}      # (step, extra seconds, steps to full size)
