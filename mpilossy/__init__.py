"""mpilossy: loss-tolerant, deadline-bound collectives over MPI.

    from mpi4py import MPI
    import mpilossy
    with mpilossy.Communicator(MPI.COMM_WORLD, timeout=0.05,
                               loss=mpilossy.loss.Bernoulli(0.1, seed=0)) as lc:
        stats = lc.allreduce(sendbuf, recvbuf, op="avg")
"""

from mpi4py import MPI as _MPI  # loads libmpi before the compiled core

from . import errors  # the compiled core raises these
try:
    from . import _core
except ImportError as _exc:  # pragma: no cover - depends on how Python was started
    import os as _os

    raise ImportError(
        f"mpilossy's compiled core cannot be imported from {_os.path.dirname(__file__)} "
        f"({_exc}). If this is the source tree (Python puts the current directory first on "
        "sys.path), run from another directory, or install in place with "
        "`pip install --no-build-isolation -e .`") from _exc
from . import loss
from .communicator import (AllreduceStats, CollectiveStats, Communicator, allgather, allreduce,
                           default_communicator, reduce_scatter)
from .errors import MismatchError, MPILossyError

__version__ = "0.1.0"

__all__ = [
    "AllreduceStats",
    "CollectiveStats",
    "Communicator",
    "MPILossyError",
    "MismatchError",
    "allgather",
    "allreduce",
    "default_communicator",
    "reduce_scatter",
    "loss",
]


def _check_single_mpi() -> None:
    """Two MPI libraries in one process crash or hang: refuse early."""
    ours, theirs = _core.library_version(), _MPI.Get_library_version()
    if ours.split("\n", 1)[0].strip() != theirs.split("\n", 1)[0].strip():
        raise ImportError(
            "mpilossy was built against a different MPI than the one mpi4py loaded:\n"
            f"  mpilossy: {ours.splitlines()[0]}\n  mpi4py:   {theirs.splitlines()[0]}\n"
            "Rebuild mpilossy against mpi4py's MPI (see README, 'Site MPI').")


_check_single_mpi()
