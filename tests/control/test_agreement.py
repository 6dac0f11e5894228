"""Agreements across ranks (mpilossy/control/agreement.py, used by
timeout="auto" and redundancy="auto") outlive a communicator that is freed
while one is still in flight: close() returns within its bound, but neither
the request nor its buffers are freed while a peer may still complete into
them."""

import gc
import time
import weakref

import numpy as np
import pytest

import mpilossy
from mpilossy.control import deadline


def _start_agreement(auto: deadline.AutoDeadline, value: float) -> None:
    """Tick `auto` up to the call that starts its first agreement, with one
    complete call of `value` seconds learnt."""
    auto.record((0, 0, 10), value, True)
    while auto.started == 0:
        auto.tick(True)


@pytest.mark.mpi(min_size=2)
def test_close_keeps_an_agreement_that_a_late_peer_completes(comm):
    """Rank 0 closes while its agreement waits for peers that have not
    started theirs: close() returns within its limit, but neither frees the
    request (erroneous for a collective) nor its buffers, into which the late
    peers' values still land.  Once they have, the agreement holds the right
    maximum and reap() lets it go."""
    private = comm.Dup()
    auto = deadline.AutoDeadline(private, cap=1.0)
    outcome = {}
    slot = deadline._slot((0, 0, 10))
    try:
        if comm.rank == 0:
            _start_agreement(auto, 0.01)
            recv = weakref.ref(auto.pending[0].recv)
            began = time.monotonic()
            auto.close(limit=0.05)
            outcome["close_seconds"] = time.monotonic() - began
            gc.collect()
            outcome["alive_after_close"] = recv() is not None
    except Exception as exc:        # (every rank reaches the barriers below)
        outcome["error"] = repr(exc)
    comm.Barrier()                  # (the late peers start theirs now)
    try:
        if comm.rank != 0:
            _start_agreement(auto, 0.01 * (comm.rank + 1))
            auto.close(limit=10.0)  # completes: rank 0 drives progress in the barrier below
            outcome["peer_done"] = not auto.pending
    except Exception as exc:
        outcome["error"] = repr(exc)
    comm.Barrier()
    try:
        if comm.rank == 0:
            kept = recv()
            outcome["maximum"] = None if kept is None else float(kept[slot])
            del kept
            deadline.reap(limit=5.0)
            gc.collect()
            outcome["released_after_reap"] = recv() is None
    except Exception as exc:
        outcome["error"] = repr(exc)
    private.Free()
    everyone = comm.allgather(outcome)
    assert not any("error" in o for o in everyone), everyone
    root = everyone[0]
    assert root["close_seconds"] < 1.0, everyone
    assert root["alive_after_close"], f"buffers freed while the agreement was in flight: {everyone}"
    assert root["maximum"] == pytest.approx(0.01 * comm.size), everyone
    assert root["released_after_reap"], everyone
    assert all(o["peer_done"] for o in everyone[1:]), everyone


@pytest.mark.mpi(min_size=2)
def test_free_returns_with_an_agreement_no_peer_joins(comm, monkeypatch):
    """One rank makes a call more than its peers, the one that starts an
    agreement: its free() still returns (bounded), and the agreement is kept
    rather than freed."""
    monkeypatch.setenv("MPILOSSY_AUTO_CAP", "0.02")
    x = np.ones(64)
    lc = mpilossy.Communicator(comm, timeout="auto")
    for _ in range(deadline.PERIOD - 1):
        lc.allreduce(x, np.empty_like(x))
    if comm.rank == 0:
        lc.allreduce(x, np.empty_like(x))       # the peers never make this call
    started = lc._state.auto.started
    before = len(deadline._lingering)
    began = time.monotonic()
    lc.free()
    took = time.monotonic() - began
    kept = len(deadline._lingering) - before
    everyone = comm.allgather((started, kept, took))
    assert [s for s, _, _ in everyone] == [1] + [0] * (comm.size - 1), everyone
    assert everyone[0][1] == 1, everyone        # kept, with its buffers
    assert all(t < 5.0 for _, _, t in everyone), everyone
