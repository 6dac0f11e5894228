"""mpilossy: loss-tolerant, deadline-bound collectives over MPI.

    from mpi4py import MPI
    import mpilossy
    with mpilossy.Communicator(MPI.COMM_WORLD, timeout=0.05,
                               loss=mpilossy.loss.Bernoulli(0.1, seed=0)) as lc:
        stats = lc.allreduce(sendbuf, recvbuf, op="avg")
"""

from ._loader import core as _core     # libmpi, then the compiled core, checked
from . import compression, loss
from .call.contributors import Contributors
from .call.stats import AllreduceStats, CollectiveStats
from .communicator import Communicator
from .default import allgather, allreduce, default_communicator, reduce_scatter
from .errors import EvictedError, LaggingError, MembershipChanged, MismatchError, MPILossyError
from .group import GroupAverager

__version__: str = _core.VERSION      # VERSION, through meson.build

__all__ = [
    "AllreduceStats",
    "CollectiveStats",
    "Communicator",
    "Contributors",
    "GroupAverager",
    "MPILossyError",
    "LaggingError",
    "EvictedError",
    "MembershipChanged",
    "MismatchError",
    "allgather",
    "allreduce",
    "compression",
    "default_communicator",
    "reduce_scatter",
    "loss",
]
