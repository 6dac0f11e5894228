"""The one place that chooses how a call runs: its route, flat (one core
call), pipelined (a GPU all-reduce in segments, call/pipeline.py),
hierarchical (the two-level stages, hierarchy/) or answered alone (elastic,
call/alone.py), and within the flat routes the algorithm "auto" picks
(flat_algorithm, which call/spec.py asks).

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

from .._core import ALLGATHER, DIRECT, REDUCE_SCATTER, RING, TREE
from .dtypes import is_float

__all__ = ["Route", "Routing", "plan", "flat_algorithm", "tree_max_bytes", "TREE_MAX_BYTES"]

ALGORITHMS = {"ring": RING, "tree": TREE, "direct": DIRECT}
# Largest message for which algorithm="auto" picks the tree, by rank count,
# measured with `mpiexec -n N python -m mpilossy.bench crossover` on the
# development machine (docs/performance.md).  Larger jobs could not be
# measured there: they use TREE_MAX_BYTES_LARGE until calibrated
# (MPILOSSY_TREE_MAX_BYTES overrides the table).
TREE_MAX_BYTES = {1: 0, 2: 1024, 3: 2 * 1024, 4: 16 * 1024}
TREE_MAX_BYTES_LARGE = 32 * 1024
# algorithm="auto" above the tree's sizes, for calls without a deadline: the
# ring (True) or direct (False), whichever was faster without loss
# (docs/performance.md).  Calls with a deadline take direct.
RING_WITHOUT_DEADLINE = True


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
    if routing.two_levels and _two_level(
            collective, algorithm if algorithm is not None else routing.algorithm, dtype,
            routing):
        return Route.HIERARCHICAL
    return Route.PIPELINED if segmented else Route.FLAT


def _two_level(collective: int, chosen: Any, dtype: Optional[np.dtype],
               routing: Routing) -> bool:
    """"hierarchical" always (what the layout cannot do is refused there,
    on every rank); "auto" where the hierarchy takes the call: the
    reduce-scatter and the all-gather on nodes of equal size; the
    all-reduce on nodes of equal size, or on unequal ones floating-point
    data with unbiased scaling (the slices then travel as weighted
    averages)."""
    if not isinstance(chosen, str) or chosen not in ("hierarchical", "auto"):
        return False
    if chosen == "hierarchical" or routing.uniform:
        return True
    if collective in (REDUCE_SCATTER, ALLGATHER):
        return False
    floating = dtype is None or is_float(dtype)
    return floating and routing.scaling == "unbiased"


def tree_max_bytes(setting: Optional[int], size: int) -> int:
    """The largest message "auto" sends down the tree at `size` ranks."""
    return setting if setting is not None else TREE_MAX_BYTES.get(size, TREE_MAX_BYTES_LARGE)


def flat_algorithm(algorithm: str, nbytes: int, deadline: bool, tree_ok: bool,
                   tree_max: int) -> int:
    """The core's algorithm of a flat call (a weight or compression takes
    direct before this is asked).  "auto" (docs/performance.md): the tree
    up to its measured crossover `tree_max`; above it, direct whenever the
    call has a deadline (the ring loses whole partial sums: at 3 ranks and
    more it keeps fewer contributions than direct), else the faster of ring
    and direct without loss (RING_WITHOUT_DEADLINE)."""
    if algorithm != "auto":
        return ALGORITHMS[algorithm]
    if tree_ok and nbytes <= tree_max:
        return TREE
    if deadline or not RING_WITHOUT_DEADLINE:
        return DIRECT
    return RING
