"""Two-level collectives for nodes that hold several ranks: exact within a
node (shared memory), lossy between nodes (docs/hierarchy.md)."""

from .layout import NodeLayout
from .allreduce import Hierarchy

__all__ = ["NodeLayout", "Hierarchy"]
