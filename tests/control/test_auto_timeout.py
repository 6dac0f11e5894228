"""timeout="auto": learned from earlier calls, agreed by every rank, and it
bounds the wait for a straggler far below the cap."""

import time

import numpy as np
import pytest

from mpi4py import MPI

import mpilossy
from mpilossy.control import deadline
from helpers import learned_as_documented


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
    used, walls = [], []
    with mpilossy.Communicator(comm, timeout="auto") as lc:
        assert lc.timeout == "auto"
        for _ in range(3 * deadline.PERIOD):
            began = time.monotonic()
            stats = lc.allreduce(x, np.empty_like(x), algorithm="ring")
            walls.append(time.monotonic() - began)
            used.append(stats.timeout)
        kinds = lc.auto_timeouts
        levels = lc.auto_timeouts_by_level      # one node: no hierarchy, one level
        learned, rule, agreed = learned_as_documented(lc, stats)
    everyone = comm.allgather(used)
    assert all(u == everyone[0] for u in everyone), "ranks used different deadlines"
    assert used[0] == 2.0                                   # the cap, until the first agreement
    # the documented rule, from what the ranks agreed; and what they agreed
    # on is no longer than the calls it was learned from took
    assert learned == pytest.approx(rule) and learned < 2.0, (learned, rule)
    assert agreed <= comm.allreduce(max(walls), op=MPI.MAX), agreed
    first = deadline.PERIOD + deadline.LAG                  # first call under an agreed deadline
    assert used[first - 2] == 2.0 and used[first - 1] < 2.0
    assert list(kinds.values()) == [learned]
    assert levels == {"flat": kinds}


@pytest.mark.mpi(min_size=2)
def test_straggler_costs_the_learned_deadline_not_the_cap(comm, monkeypatch):
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "1.0")
    x = np.ones(4096)
    sleeper = comm.size - 1
    with mpilossy.Communicator(comm, timeout="auto") as lc:
        for _ in range(2 * deadline.PERIOD):
            stats = lc.allreduce(x, np.empty_like(x))
        learned, rule, _ = learned_as_documented(lc, stats)
        comm.Barrier()
        if comm.rank == sleeper:
            time.sleep(0.5)
        began = time.monotonic()
        stats = lc.allreduce(x, np.empty_like(x))
        took = time.monotonic() - began
        comm.Barrier()
    outcome = comm.allgather((comm.rank == sleeper or took <= learned + 0.03, learned, took))
    assert learned == pytest.approx(rule) and learned < 0.25, (rule, outcome)
    assert all(ok for ok, _, _ in outcome), outcome


@pytest.mark.mpi
def test_auto_per_call_and_bad_values(comm):
    with mpilossy.Communicator(comm, timeout=None) as lc:
        stats = lc.allreduce(np.ones(8), timeout="auto")
        assert stats.timeout == 1.0
        assert lc.allreduce(np.ones(8)).timeout is None
    with pytest.raises(TypeError):
        mpilossy.Communicator(comm, timeout="soon")


def test_scale_steps():
    allowed = 0.03
    assert deadline.next_scale(1.0, 0.0, allowed, 100.0) == 1.0            # never below 1
    assert deadline.next_scale(4.0, 0.0, allowed, 100.0) == 4.0 * deadline.STEP_DOWN
    assert deadline.next_scale(4.0, 0.02, allowed, 100.0) == 4.0          # within the band: hold
    grown = deadline.next_scale(1.0, 0.06, allowed, 100.0)
    assert grown == pytest.approx(2 ** 0.5)                                 # sqrt(cut / allowed)
    assert deadline.next_scale(1.0, 0.9, allowed, 100.0) == deadline.STEP_UP
    assert deadline.next_scale(3.0, 0.9, allowed, 4.0) == 4.0              # no wind-up past the cap


@pytest.mark.mpi(min_size=2)
def test_cut_lengthens_the_deadline_on_every_rank_and_it_comes_back(comm, monkeypatch):
    # Rank 0 reports that the deadline cut half of its blocks for the first
    # three periods (as under congestion); every rank must lengthen its
    # deadline at the same call by the same scale, then return to 1.
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "2.0")
    observe = deadline.AutoDeadline.observe
    congested = 3 * deadline.PERIOD

    def observe_cut(self, key, result):
        if comm.rank == 0 and self.calls <= congested and result.read_blocks:
            result = result._replace(lost_blocks=(0, result.read_blocks // 2, 0, 0),
                                     deadline_hit=True)
        else:
            # (a real cut, on a loaded machine, would lengthen it as well:
            # seen once, under heavy load; this test is about the agreement)
            result = result._replace(lost_blocks=(0, 0, 0, 0), deadline_hit=False)
        observe(self, key, result)

    monkeypatch.setattr(deadline.AutoDeadline, "observe", observe_cut)
    x = np.ones(4096)

    def run_once():
        used, scales = [], []
        with mpilossy.Communicator(comm, timeout="auto") as lc:
            for _ in range(14 * deadline.PERIOD):
                used.append(lc.allreduce(x, np.empty_like(x), algorithm="direct").timeout)
                scales.append(lc._state.auto.scale)
        return used, scales, comm.allgather((used, scales))

    def steps(values):
        return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]

    # Every rank applies the same agreements in the same order (asserted on
    # every run); one whose peer was descheduled past the settling budget (a
    # loaded machine) applies an agreement a few calls later, and uses its
    # previous deadline meanwhile (control/deadline.py).  How late depends on
    # the load: once in CI, at 3 ranks beside nothing else, the lengthening
    # came 3 calls past its bound.  So the run is made again, at most three
    # times, until the agreements came on time on every rank (the same
    # decision everywhere: it is taken from the gathered runs).
    for attempt in range(3):
        used, scales, everyone = run_once()
        assert all(steps(s) == steps(everyone[0][1]) for _, s in everyone), \
            [steps(s) for _, s in everyone]
        apart = sum(len({round(u[i], 9) for u, _ in everyone}) > 1 for i in range(len(used)))
        # (each agreement applied at most two calls late: a rank applying every
        # one three calls late differs on 3 calls an agreement, and fails)
        agreements = len(used) // deadline.PERIOD
        on_time = [apart <= 2 * agreements] + [
            max(s) >= 2.0 and s.index(max(s)) <= congested + deadline.PERIOD + deadline.LAG
            for _, s in everyone]
        if all(on_time):
            break
    assert apart <= 2 * agreements, f"ranks used different deadlines on {apart} calls"
    top = max(scales)
    assert top >= 2.0, scales                       # lengthened while the cut lasted
    assert scales.index(top) <= congested + deadline.PERIOD + deadline.LAG, scales
    assert scales[-1] == 1.0, scales                # and back once it stopped


@pytest.mark.mpi(min_size=2)
def test_injected_loss_is_not_cut_and_the_deadline_is_learned(comm, monkeypatch):
    # Blocks lost to injected loss were never late: the calls still teach
    # the deadline, and the scale stays 1 (no deadline brings them back).
    # (A call that lost a block waits the cap until the first agreement:
    # 0.5 s keeps the test short, far above the few ms it learns.)
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "0.5")
    x = np.ones(4096 * 8)
    with mpilossy.Communicator(comm, timeout="auto", block_bytes=4096,
                               loss="bernoulli:p=0.2") as lc:
        stats = [lc.allreduce(x, np.empty_like(x), algorithm="direct")
                 for _ in range(4 * deadline.PERIOD)]
        scale = lc._state.auto.scale
        learned, rule, _ = learned_as_documented(lc, stats[-1])
    assert min(s.delivered for s in stats) < 1.0             # the loss happened
    assert learned == pytest.approx(rule) and learned < 0.5, (learned, rule)   # learned
    # (blocks really late under load do count: say how many there were)
    assert scale == 1.0, (scale, "blocks late:", sum(s.lost_blocks[1] for s in stats))
