"""Exceptions.  Loss is a result (see AllreduceStats), never an exception:
these are for misuse and for protocol failures."""

from __future__ import annotations

__all__ = ["MPILossyError", "MismatchError", "LaggingError", "EvictedError", "MembershipChanged"]


class MPILossyError(RuntimeError):
    """A collective could not run (protocol violation, MPI failure)."""


class MismatchError(MPILossyError, ValueError):
    """Ranks called the same collective with different buffers, dtypes or ops."""


class LaggingError(MPILossyError):
    """This rank found every peer already past its call on many calls in a
    row: it no longer takes part in the others' calls (a call made on some
    ranks only, or a rank that cannot keep up)."""


class EvictedError(MPILossyError):
    """Communicator(elastic=True): the other ranks went on without this one
    (it was behind, stopped or cut off, or it is in a minority of the ranks
    still running).  Every later call on the communicator raises it too."""


class MembershipChanged(MPILossyError):
    """Communicator(elastic=True): ranks were excluded while a reliable
    collective that mpilossy.torch makes was in flight.  The communicator
    already goes on over the survivors (on_exclusion ran); the collective
    did not complete, and is made again by whoever made it, with the
    survivors' ranks and roots (docs/elastic.md)."""
