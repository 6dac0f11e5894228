"""Where the ranks of a communicator are: which node (MPI's
COMM_TYPE_SHARED split) holds each rank, numbered by each node's lowest rank."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
from mpi4py import MPI

from ..call.buffers import chunk_bounds

__all__ = ["NodeLayout", "Pieces"]


class NodeLayout:
    """The nodes of a communicator, as seen from one rank.

    node_of[r]: the node of rank r; sizes[n]: ranks on node n; rank, node,
    local_rank, local_size: this rank's.  Built collectively by detect()."""

    __slots__ = ("node_of", "local_ranks", "sizes", "rank", "node", "local_rank", "local_size")

    def __init__(self, node_of: Tuple[int, ...], local_ranks: Tuple[int, ...],
                 rank: int) -> None:
        self.node_of = node_of
        self.local_ranks = local_ranks
        nodes = max(node_of) + 1
        self.sizes = tuple(node_of.count(n) for n in range(nodes))
        self.rank = rank
        self.node = node_of[rank]
        self.local_rank = local_ranks[rank]
        self.local_size = self.sizes[self.node]

    @classmethod
    def detect(cls, comm: MPI.Comm) -> Tuple["NodeLayout", MPI.Comm]:
        """Collective over `comm`: the layout, and this rank's node
        communicator (ranks in the order of `comm`; the caller frees it)."""
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        lowest = node.bcast(comm.Get_rank(), root=0)
        found: List[Tuple[int, int]] = comm.allgather((lowest, node.Get_rank()))
        numbers = {low: n for n, low in enumerate(sorted({low for low, _ in found}))}
        layout = cls(tuple(numbers[low] for low, _ in found),
                     tuple(local for _, local in found), comm.Get_rank())
        return layout, node

    @property
    def nodes(self) -> int:
        return len(self.sizes)

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        return min(self.sizes) == max(self.sizes)

    @property
    def hierarchical(self) -> bool:
        """More than one node, and some node with more than one rank: where a
        two-level collective differs from a flat one."""
        return self.nodes > 1 and max(self.sizes) > 1

    def ranks_of(self, node: int) -> List[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def describe(self) -> str:
        """One line: '2 nodes: [0, 2] [1, 3]'."""
        return (f"{self.nodes} node{'s' if self.nodes != 1 else ''}: "
                + " ".join(str(self.ranks_of(n)) for n in range(self.nodes)))

    def __repr__(self) -> str:
        return f"<NodeLayout {self.describe()}>"


class Pieces:
    """Where each rank's chunk lies in the two-level order: piece (j, n),
    the chunk of local rank j of node n, at (j * nodes + n) * width."""

    def __init__(self, layout: NodeLayout, count: int) -> None:
        ranks = len(layout.node_of)
        self.width = -(-count // ranks)
        self.nodes = layout.nodes
        # (position in the two-level order, first, end in the user's vector)
        self.moves: List[Tuple[int, int, int]] = []
        # (each move's piece: its number in the two-level order, and its rank)
        self.slots: List[Tuple[int, int]] = []
        for n in range(layout.nodes):
            for j, r in enumerate(layout.ranks_of(n)):
                lo, hi = chunk_bounds(count, ranks, r)
                self.moves.append(((j * self.nodes + n) * self.width, lo, hi))
                self.slots.append((j * self.nodes + n, r))

    def gather(self, part: np.ndarray, out: np.ndarray, local: int) -> None:
        """Slice `local` in the two-level order (`part`: its pieces, node by
        node) into the user's order `out`; zeros everywhere else."""
        out[...] = 0
        for at, lo, hi in self.moves:
            n, j = divmod(at // self.width, self.nodes)[::-1]
            if j == local:
                out[lo:hi] = part[n * self.width:n * self.width + hi - lo]

    def scatter(self, send: np.ndarray, wide: np.ndarray) -> None:
        """The user's vector into the two-level order (zeros to the width)."""
        for at, lo, hi in self.moves:
            wide[at:at + hi - lo] = send[lo:hi]
            wide[at + hi - lo:at + self.width] = 0
