"""timeout="auto": learned from earlier calls, agreed by every rank, and it
bounds the wait for a straggler far below the cap."""

import time

import numpy as np
import pytest

import mpilossy
from mpilossy.control import deadline


@pytest.mark.mpi
def test_one_rank_learns_nothing(comm, monkeypatch):
    # A single rank only copies: there is no peer to wait for, nothing to learn.
    if comm.size != 1:
        pytest.skip("one rank only")
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "2.0")
    x = np.ones(4096)
    with mpilossy.Communicator(comm, timeout="auto") as lc:
        used = {lc.allreduce(x, np.empty_like(x)).timeout for _ in range(3 * deadline.PERIOD)}
        assert used == {2.0} and set(lc.auto_timeouts.values()) <= {2.0}


@pytest.mark.mpi(min_size=2)
def test_learned_deadline_is_agreed_and_shrinks(comm, monkeypatch):
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "2.0")
    x = np.ones(4096)
    used = []
    with mpilossy.Communicator(comm, timeout="auto") as lc:
        assert lc.timeout == "auto"
        for _ in range(3 * deadline.PERIOD):
            used.append(lc.allreduce(x, np.empty_like(x), algorithm="ring").timeout)
        kinds = lc.auto_timeouts
    everyone = comm.allgather(used)
    assert all(u == everyone[0] for u in everyone), "ranks used different deadlines"
    assert used[0] == 2.0                                   # the cap, until the first agreement
    learned = used[-1]
    assert 1e-3 <= learned < 2.0, learned                   # between floor and cap
    first = deadline.PERIOD + deadline.LAG                  # first call under an agreed deadline
    assert used[first - 2] == 2.0 and used[first - 1] < 2.0
    assert list(kinds.values()) == [learned]


@pytest.mark.mpi(min_size=2)
def test_straggler_costs_the_learned_deadline_not_the_cap(comm, monkeypatch):
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "1.0")
    x = np.ones(4096)
    sleeper = comm.size - 1
    with mpilossy.Communicator(comm, timeout="auto") as lc:
        for _ in range(2 * deadline.PERIOD):
            stats = lc.allreduce(x, np.empty_like(x))
        learned = stats.timeout
        comm.Barrier()
        if comm.rank == sleeper:
            time.sleep(0.5)
        began = time.monotonic()
        stats = lc.allreduce(x, np.empty_like(x))
        took = time.monotonic() - began
        comm.Barrier()
    outcome = comm.allgather((comm.rank == sleeper or took <= learned + 0.03, learned, took))
    assert learned < 0.25, outcome
    assert all(ok for ok, _, _ in outcome), outcome


@pytest.mark.mpi
def test_auto_per_call_and_bad_values(comm):
    with mpilossy.Communicator(comm, timeout=None) as lc:
        stats = lc.allreduce(np.ones(8), timeout="auto")
        assert stats.timeout == 1.0
        assert lc.allreduce(np.ones(8)).timeout is None
    with pytest.raises(TypeError):
        mpilossy.Communicator(comm, timeout="soon")
