"""How a call fails: one rank's bad input becomes the same exception on
every rank, and the core's error records become Python exceptions."""

from __future__ import annotations

from typing import Any, Optional, Type

from .._core import ERRORS, CallResult
from ..errors import MismatchError, MPILossyError
from .stats import COLLECTIVE_NAMES

__all__ = ["refuse", "call_error", "failure_bound"]

_EXCEPTIONS = {
    ERRORS["type"]: TypeError,
    ERRORS["value"]: ValueError,
    ERRORS["buffer"]: BufferError,
    ERRORS["mismatch"]: MismatchError,
    ERRORS["protocol"]: MPILossyError,
    ERRORS["mpi"]: MPILossyError,
}
# (MismatchError first: it is a ValueError too.  A rank raises one of its
# own only as a stage of the hierarchy passing on what an earlier stage found.)
_KINDS = {MismatchError: "mismatch", TypeError: "type", ValueError: "value",
          BufferError: "buffer"}


def refuse(core: Any, collective: int, exc: BaseException, rank: int,
           timeout: float) -> Optional[Exception]:
    """This rank cannot take part in its next call because of `exc`: count
    the call and tell the peers (within `timeout` seconds).  Returns the
    exception to raise for a validation error (TypeError, ValueError,
    BufferError: the one every rank raises); None for anything else (a
    device error, Ctrl-C), which the caller re-raises as it is while the
    peers learn that this rank dropped out of the call."""
    kind = next((k for cls, k in _KINDS.items() if isinstance(exc, cls)), None)
    message = str(exc) if kind is not None else (
        f"rank {rank} could not take part: {type(exc).__name__}: {exc}")
    result = core.fail(ERRORS[kind or "protocol"], message, timeout)
    if kind is not None and isinstance(exc, Exception):
        return call_error(collective, result, type(exc))
    return None


def failure_bound(timeout: float, cap: float) -> float:
    """How long a failing call may take to tell its peers: the
    communicator's deadline (`timeout`, < 0 for none or "auto"), or the
    auto deadline's `cap`, never unbounded."""
    return min(timeout, cap) if timeout > 0 else cap


def call_error(collective: int, result: CallResult,
               local: Optional[Type[Exception]] = None) -> Exception:
    """The exception of a failed call.  `local`: the type this rank's own
    validation raised (kept, unless ranks disagreed)."""
    kind, rank, message, seq = result.err_kind, result.err_rank, result.err_msg, result.seq
    cls = _EXCEPTIONS.get(kind, MPILossyError)
    if local is not None and kind != ERRORS["mismatch"]:
        cls = local
    error = cls(f"{COLLECTIVE_NAMES[collective]} call {seq}: rank {rank}: {message}")
    # The rank it began at and what it said, apart (the hierarchy passes them on).
    setattr(error, "origin", rank)
    setattr(error, "detail", message)
    return error
