"""The sub-communicators of a Communicator's two-level collectives, and what
a call needs of them besides its stages: what the layout takes, scratch
buffers, the two-level order of chunks (docs/hierarchy.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol, Tuple

import numpy as np
from mpi4py import MPI

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from ..call.config import Config
from ..call.dtypes import is_float
from ..call.request import Request
from ..call.stats import CollectiveStats
from ..errors import MPILossyError
from .layout import NodeLayout, Pieces

if TYPE_CHECKING:
    from ..control.deadline import AutoDeadline

__all__ = ["Hierarchy", "Level", "Run"]


class Level(Protocol):
    """What a stage needs of a level (mpilossy/state.py's State)."""

    config: Config
    auto: AutoDeadline          # its own learned deadline (Communicator.auto_timeouts_by_level)

    @property
    def max_block(self) -> int: ...

    @property
    def scaling(self) -> str: ...

    def refuse_next(self, request: Request, exc: BaseException) -> None: ...

    def free(self) -> None: ...


Run = Callable[[Any, Request], CollectiveStats]


class Hierarchy:
    """The levels of one Communicator's two-level collectives.

    intra: this node's ranks (channel "rma": shared-memory windows, no
    injected loss).  inter: the ranks of the same local index on every node
    (the parent's channel and settings); None on local ranks past the
    fewest ranks of any node."""

    def __init__(self, layout: NodeLayout, intra: Level, inter: Optional[Level],
                 total: int, block_bytes: int, max_block: int, run: Run) -> None:
        self.layout = layout
        self.run = run                             # one call on a level (dispatch.run)
        self.intra, self.inter = intra, inter
        self.cap = intra.config.auto_cap           # the learned deadline's cap, the parent's
        self.total = total                         # ranks of the parent communicator
        self.block_bytes = block_bytes             # the parent's setting
        self.max_block = max_block                 # of stage 2's channel
        self.leaders = min(layout.sizes)           # S: slices, owners per node
        self.calls = 0
        self._scratch: Dict[Tuple[str, Any, int], np.ndarray] = {}
        self._pieces: Optional[Tuple[int, Pieces]] = None

    @classmethod
    def build(cls, comm: MPI.Intracomm, layout: NodeLayout, node: MPI.Comm,
              make: Callable[[Any, bool], Level], block_bytes: int, run: Run) -> "Hierarchy":
        """Collective over `comm`.  `make(comm, within_node)` builds a level
        with the parent's settings on `comm` (within_node: the settings of
        the stage in shared memory); `run(level, request)` makes one call
        on a level."""
        leaders = min(layout.sizes)
        color = layout.local_rank if layout.local_rank < leaders else MPI.UNDEFINED
        cross = comm.Split(color, key=layout.node)
        intra: Optional[Level] = None
        inter: Optional[Level] = None
        error: Optional[BaseException] = None
        try:
            intra = make(node, True)
            if cross != MPI.COMM_NULL:
                inter = make(cross, False)
        except BaseException as exc:      # (agreed below: no rank waits for one that raised)
            error = exc
        finally:
            if cross != MPI.COMM_NULL:
                cross.Free()
        # local rank 0 owns a slice on every node; its channel is every owner's
        max_block = node.bcast(inter.max_block if inter is not None else 0, root=0)
        if comm.allreduce(error is not None, op=MPI.LOR):
            for sub in (inter, intra):
                if sub is not None:
                    sub.free()
            if error is not None:
                raise error
            raise MPILossyError("the hierarchy's levels failed on another rank")
        assert intra is not None
        # timeout="auto": the node's stages wait for the delivered target's
        # share of its late ranks, and the network stage for a node as long
        # (AutoDeadline.within_node, follow; docs/deadlines.md)
        intra.auto.within_node()
        if inter is not None:
            inter.auto.follow(intra.auto)
        return cls(layout, intra, inter, comm.Get_size(), block_bytes, max_block, run)

    def free(self) -> None:
        if self.inter is not None:
            self.inter.free()
        self.intra.free()
        self._scratch.clear()

    def takes(self, dtype: Any) -> bool:
        """Can this layout reduce `dtype`?  (Nodes of different sizes:
        floating point only, with scaling="unbiased": the slices travel as
        weighted averages.)"""
        if self.layout.uniform:
            return True
        if self.intra.scaling != "unbiased":
            return False
        try:
            return is_float(dtype)
        except TypeError:
            return False

    # -- what a call needs ---------------------------------------------------------
    def check(self, send: np.ndarray, collective: int = ALLREDUCE) -> None:
        """What this layout cannot reduce (before the call's first stage)."""
        if collective in (REDUCE_SCATTER, ALLGATHER) and not self.layout.uniform:
            name = "reduce_scatter" if collective == REDUCE_SCATTER else "allgather"
            raise ValueError(f"algorithm='hierarchical' {name} needs nodes of equal "
                             f"size, got {list(self.layout.sizes)}; use 'auto' (flat there)")
        if collective == ALLGATHER:
            return                  # (any dtype: nothing is reduced)
        if not self.layout.uniform and self.intra.scaling != "unbiased":
            raise ValueError(f"algorithm='hierarchical' on nodes of different sizes "
                             f"{list(self.layout.sizes)} needs scaling='unbiased' (the slices "
                             f"travel as weighted averages); 'auto' stays flat there")
        if not self.takes(send.dtype):
            raise TypeError(f"algorithm='hierarchical' on nodes of different sizes "
                            f"{list(self.layout.sizes)} needs floating-point data (the "
                            f"slices travel as weighted averages), got {send.dtype}")

    def pieces(self, count: int) -> Pieces:
        """The two-level order of the chunks of a vector of `count` (kept for
        the last count asked)."""
        if self._pieces is None or self._pieces[0] != count:
            self._pieces = (count, Pieces(self.layout, count))
        return self._pieces[1]

    def buffer(self, role: str, dtype: Any, n: int) -> np.ndarray:
        """Scratch kept between calls (one per role, of the last size asked)."""
        key = (role, np.dtype(dtype), n)
        buf = self._scratch.get(key)
        if buf is None:
            self._scratch = {k: v for k, v in self._scratch.items() if k[0] != role}
            buf = self._scratch[key] = np.empty(n, dtype)
        return buf
