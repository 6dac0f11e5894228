"""The one place that chooses how a call runs: flat (one core call),
pipelined (a GPU all-reduce in segments, call/pipeline.py), hierarchical
(the two-level stages, hierarchy/) or answered alone (elastic, call/alone.py).

The choice reads only what every rank shares when the ranks make the same
call: the communicator's agreed settings and node layout, the collective,
the algorithm asked for, and the dtype after buffer intake (an
``array.array('i')`` and an int32 NumPy array plan alike).  Per-rank
extras that do not change what travels where (``weight=``, ``residual=``)
never change the route: a rank that passes one where its peers do not then
meets them in the same call, whose signature tells the difference, and
every rank raises MismatchError instead of waiting in another route.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional

import numpy as np

from .._core import ALLGATHER, REDUCE_SCATTER

__all__ = ["Route", "Routing", "plan"]


class Route(enum.Enum):
    FLAT = "flat"
    PIPELINED = "pipelined"
    HIERARCHICAL = "hierarchical"
    ALONE = "alone"


class Routing(NamedTuple):
    """What the plan needs of a communicator, the same on every rank."""

    algorithm: str          # the communicator's default (Config.algorithm)
    two_levels: bool        # it has a hierarchy (several nodes, some with several ranks)
    uniform: bool           # every node holds the same number of ranks
    scaling: str


def plan(collective: int, algorithm: Any, dtype: Optional[np.dtype], routing: Routing,
         segmented: bool = False, alone: bool = False) -> Route:
    """The route of one call.  algorithm: the call's argument (None: the
    communicator's); dtype: of sendbuf after intake (None where intake
    failed: the route the same call with valid buffers would take, so
    that the refusal reaches the peers where they wait); segmented: the
    buffers came staged in segments; alone: this rank owes calls it
    answers alone (elastic)."""
    if alone:
        return Route.ALONE
    if routing.two_levels and collective != ALLGATHER and _two_level(
            collective, algorithm if algorithm is not None else routing.algorithm, dtype,
            routing):
        return Route.HIERARCHICAL
    return Route.PIPELINED if segmented else Route.FLAT


def _two_level(collective: int, chosen: Any, dtype: Optional[np.dtype],
               routing: Routing) -> bool:
    """"hierarchical" always (what the layout cannot do is refused there,
    on every rank); "auto" where the hierarchy takes the call: the
    reduce-scatter on nodes of equal size; the all-reduce on nodes of equal
    size, or on unequal ones floating-point data with unbiased scaling (the
    slices then travel as weighted averages)."""
    if not isinstance(chosen, str) or chosen not in ("hierarchical", "auto"):
        return False
    if chosen == "hierarchical" or routing.uniform:
        return True
    if collective == REDUCE_SCATTER:
        return False
    floating = dtype is None or dtype.kind == "f"
    return floating and routing.scaling == "unbiased"
