"""Two-level collectives for nodes that hold several ranks: exact within a
node (shared memory), lossy between nodes (docs/hierarchy.md).

layout (where the ranks are), levels (the sub-communicators), stages (a
call's deadline split, failures, refusals), allreduce and scatter (the
collectives), record (who contributed)."""

from .layout import NodeLayout
from .levels import Hierarchy

__all__ = ["NodeLayout", "Hierarchy"]
