"""One call as the user asked for it: the per-call arguments every public
collective takes, in one frozen record built once per call.

Everything downstream (the plan, the spec, the hierarchy's stages) reads
the request by name; nothing re-lists the arguments.  `limit` is not a user
argument, nor is `tag`: a caller that runs this call as part of a larger
one (a stage of the hierarchy) bounds it by the seconds the larger call
has left, and marks what its peers must share (call/spec.py's TAG_*).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from .._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from .config import UNSET

__all__ = ["Request", "ALLREDUCE", "REDUCE_SCATTER", "ALLGATHER"]


@dataclass(frozen=True, eq=False)
class Request:
    """The arguments of one collective call (UNSET: the communicator's)."""

    collective: int
    sendbuf: Any
    recvbuf: Any = None
    op: Any = "sum"
    algorithm: Any = None
    timeout: Any = UNSET
    weight: Any = None
    compression: Any = UNSET
    residual: Any = None
    redundancy: Any = UNSET
    limit: Optional[float] = None      # seconds the enclosing call has left (internal)
    tag: int = 0                       # bits the enclosing call adds to the signature (internal)

    def but(self, **changes: Any) -> "Request":
        """This request with some fields changed."""
        return replace(self, **changes)
