"""The communicators mpilossy.torch works on: a lossy one (default: the
module's default communicator) for gradients and parameters, and a
reliable MPI one for validation, broadcasts and the drift meter."""

from __future__ import annotations

from typing import Optional, Union

from mpi4py import MPI

from .. import Communicator, default_communicator
from ..reliable import BoundedComm

CommLike = Union[None, MPI.Intracomm, Communicator]


def lossy_communicator(communicator: Optional[Communicator]) -> Communicator:
    if communicator is None:
        return default_communicator()
    if not isinstance(communicator, Communicator):
        raise TypeError(f"communicator must be an mpilossy.Communicator, "
                        f"not {type(communicator).__name__}")
    return communicator


_world: Optional[MPI.Intracomm] = None


def reliable_comm(comm: CommLike) -> MPI.Intracomm:
    """The MPI communicator for reliable traffic (validation, broadcasts, the
    drift meter).  Default: a private duplicate of COMM_WORLD, made on first
    use (collectively), so that our messages never mix with the caller's.  A
    Communicator lends its own duplicate: the lossy and reliable calls of one
    training loop then run in program order on one communicator; an elastic
    one its bounded_comm(), whose calls a rank that hangs cannot block (they
    raise MembershipChanged when ranks are excluded during one)."""
    global _world
    if comm is None:
        if _world is None:
            _world = MPI.COMM_WORLD.Dup()
        return _world
    if isinstance(comm, Communicator):
        if comm.elastic:        # (bounded waits: a rank that hangs cannot block them)
            return comm.bounded_comm()      # type: ignore[return-value]
        lent = comm.comm
        if isinstance(lent, MPI.Intracomm):     # (always: it duplicates one)
            return lent
    if isinstance(comm, MPI.Intracomm) and comm != MPI.COMM_NULL:
        return comm
    if isinstance(comm, BoundedComm):       # (one reliable_comm() gave: passed on)
        return comm         # type: ignore[return-value]
    raise TypeError(f"comm must be an mpi4py intracommunicator or an mpilossy.Communicator, "
                    f"not {type(comm).__name__}")
