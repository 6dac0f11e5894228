"""The route of a call (call/plan.py): which collectives the hierarchy
takes on which layouts."""

import numpy as np
import pytest

from mpilossy._core import ALLGATHER, ALLREDUCE, REDUCE_SCATTER
from mpilossy.call.plan import Route, Routing, plan

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
UNIFORM = Routing("auto", two_levels=True, uniform=True, scaling="unbiased")
UNEQUAL = Routing("auto", two_levels=True, uniform=False, scaling="unbiased")
ONE_LEVEL = Routing("auto", two_levels=False, uniform=True, scaling="unbiased")


@pytest.mark.parametrize("collective", [ALLREDUCE, REDUCE_SCATTER, ALLGATHER])
def test_auto_takes_the_hierarchy_on_equal_nodes(collective):
    assert plan(collective, "auto", F32, UNIFORM) is Route.HIERARCHICAL
    assert plan(collective, None, I32, UNIFORM) is Route.HIERARCHICAL      # (the default)
    assert plan(collective, "direct", F32, UNIFORM) is Route.FLAT
    assert plan(collective, "auto", F32, ONE_LEVEL) is Route.FLAT


def test_on_unequal_nodes_only_the_floating_point_allreduce_is_two_level():
    assert plan(ALLREDUCE, "auto", F32, UNEQUAL) is Route.HIERARCHICAL
    assert plan(ALLREDUCE, "auto", I32, UNEQUAL) is Route.FLAT
    for collective in (REDUCE_SCATTER, ALLGATHER):
        assert plan(collective, "auto", F32, UNEQUAL) is Route.FLAT
        # asked for by name: the hierarchy's route, where it is refused on every rank
        assert plan(collective, "hierarchical", F32, UNEQUAL) is Route.HIERARCHICAL


def test_the_route_does_not_wait_for_the_dtype():
    """Before intake (dtype None) the route is the one valid buffers take."""
    for collective in (ALLREDUCE, REDUCE_SCATTER, ALLGATHER):
        assert plan(collective, "auto", None, UNIFORM) is plan(collective, "auto", F32, UNIFORM)
