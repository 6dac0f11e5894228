"""What the scale model's tests share: a runner of scenarios, each in a
fresh process (SimGrid keeps one engine per process)."""

import pytest

from helpers import unavailable
from mpilossy.sim import _simgrid


@pytest.fixture(scope="module")
def run():
    try:
        _simgrid.load()
    except ImportError as e:
        unavailable(str(e))
    from mpilossy.sim.runner import run_all
    return lambda *scenarios: run_all(list(scenarios), jobs=2)
