"""Agreements across ranks that never make a call wait: one nonblocking
``MPI_Iallreduce`` on a communicator's private duplicate every ``PERIOD``
calls, applied ``LAG`` calls later, so that every rank switches at the same
call (the learned deadline, control/deadline.py; the loss rate behind
redundancy="auto", control/redundancy.py).

An agreement still in flight when its communicator is freed (a peer late,
or never coming) is waited for a bounded time, then kept, request and
buffers, in a module-level list that completes it later: MPI cannot cancel
a collective, and freeing the request or the buffers while a peer may still
complete into them would be erroneous and unsafe.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Deque, List, NamedTuple

from mpi4py import MPI

__all__ = ["PERIOD", "LAG", "Agreement", "wait", "finish", "reap", "linger"]

PERIOD = 16             # calls between agreements
LAG = 8                 # calls between an agreement's start and the call it applies at
WAIT_FIRST_SLEEP = 50e-6    # seconds between wait()'s tests of an agreement, at first...
WAIT_MAX_SLEEP = 5e-3       # ...and at most


class Agreement(NamedTuple):
    request: MPI.Request
    send: Any                   # kept alive until the request completes
    recv: Any
    due: int                    # the call at which the result applies


# Agreements that close() could not finish (a peer had not started its
# part yet, or never will).  MPI cannot cancel a collective, and dropping the
# request object would free it (mpi4py's Request.__dealloc__ calls
# MPI_Request_free, erroneous for an active collective) together with the
# buffers that a late peer's values still land in.  They are kept here until
# they complete (reap(), at every close() and agreement tick) or the process
# ends.  The interpreter clears module globals before mpi4py's MPI_Finalize
# (a Py_AtExit function), so the list holds one reference that is never
# given back: what is still in it then is never freed, and MPI_Finalize
# finds the buffers where the collective left them.
_lingering: List[Agreement] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_lingering))


def wait(agreement: Agreement, limit: float) -> float:
    """Test `agreement` until it completes or `limit` seconds have passed,
    sleeping between tests (from WAIT_FIRST_SLEEP, doubling to
    WAIT_MAX_SLEEP): the late peer it waits for may share the cores, and a
    loop of Test() holding the GIL and a core would starve it.  Returns the
    seconds waited; the agreement is done if its request tests true."""
    began = time.monotonic()
    pause = WAIT_FIRST_SLEEP
    while not agreement.request.Test():
        if time.monotonic() - began > limit:
            break
        time.sleep(pause)
        pause = min(2 * pause, WAIT_MAX_SLEEP)
    return time.monotonic() - began


def reap(limit: float = 0.0) -> int:
    """Drive the lingering agreements (MPI_Test) for up to `limit` seconds,
    forget those that completed; returns how many are left."""
    end = time.monotonic() + limit
    while True:
        _lingering[:] = [a for a in _lingering if not a.request.Test()]
        if not _lingering or time.monotonic() >= end:
            return len(_lingering)
        time.sleep(1e-4)


def linger(request: MPI.Request, send: Any, recv: Any) -> None:
    """Keep a collective that will not be waited for (elastic: abandoned
    for the survivors' communicator), request and buffers, until it
    completes or the process ends (never freed while active)."""
    _lingering.append(Agreement(request, send, recv, -1))


def finish(pending: Deque[Agreement], limit: float = 1.0) -> None:
    """Finish the agreements in flight; after `limit` seconds (a peer that
    is late, or never gets here) stop waiting rather than hang, and keep
    what is unfinished, request and buffers, in the module's lingering list
    until it completes (never freed while active)."""
    end = time.monotonic() + limit
    while pending and time.monotonic() < end:
        if pending[0].request.Test():
            pending.popleft()
        else:
            time.sleep(1e-4)
    _lingering.extend(pending)
    pending.clear()
    reap()
