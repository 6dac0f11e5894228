"""The example's fsdp mode: FSDP2 (``fully_shard``) over a torch.distributed
process group, "mpilossy" (the gradients' reduce-scatter lossy, the
parameters' all-gather exact: docs/backend.md) or Gloo for the reliable
baseline (reduce="mpi").  Each shard has one owner, who alone updates it, and
every rank gathers the owners' shards exactly: the ranks' models cannot
drift apart, so this mode needs no periodic re-synchronisation."""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.fsdp import fully_shard

import mpilossy
import mpilossy.torch as mt

from .model import TinyGPT

__all__ = ["Sharded"]


class Sharded:
    """Shards `model` in place (each block, then the whole) over a process
    group made here; ``step_stats()`` says what the step's lossy calls
    delivered.  Collective; ``close()`` ends the process group."""

    def __init__(self, model: TinyGPT, comm: MPI.Intracomm,
                 lc: Optional[mpilossy.Communicator], line_up: bool) -> None:
        if dist.is_initialized():
            raise RuntimeError("the fsdp mode makes its own process group; one is already up")
        if lc is None:
            mt.init_process_group("gloo", comm=comm)
        else:
            # line_up: the example's --align (docs/results.md: ranks that
            # time-share cores reach each reduce-scatter far apart)
            mt.init_process_group("mpilossy", comm=comm,
                                  pg_options=mt.BackendOptions(communicator=lc, line_up=line_up))
        self.lossy = lc is not None
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    def step_stats(self) -> Tuple[float, float]:
        """(delivered, seconds) of the lossy calls since the last step
        ((1.0, 0.0) over Gloo, which says nothing of its time)."""
        if not self.lossy:
            return 1.0, 0.0
        stats = mt.lossy_group().step_stats()
        return stats.delivered, stats.comm_seconds

    def close(self) -> None:
        mt.destroy_process_group()

