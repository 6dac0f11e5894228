"""Exceptions.  Loss is a result (see AllreduceStats), never an exception:
these are for misuse and for protocol failures."""

from __future__ import annotations

__all__ = ["MPILossyError", "MismatchError"]


class MPILossyError(RuntimeError):
    """A collective could not run (protocol violation, MPI failure)."""


class MismatchError(MPILossyError, ValueError):
    """Ranks called the same collective with different buffers, dtypes or ops."""
