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

    if "libmpi" in str(_exc) or "libmpich" in str(_exc):
        # The core exists but its MPI library does not load: mpi4py loaded
        # another MPI (the core relies on finding the one mpi4py loaded).
        _theirs = _MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
        raise ImportError(
            f"mpilossy's compiled core cannot load its MPI library ({_exc}); mpi4py loaded "
            f"{_theirs!r}. mpilossy and mpi4py must use the same MPI: rebuild mpilossy "
            "against mpi4py's MPI, or make mpi4py load mpilossy's (MPI4PY_LIBMPI); see "
            "docs/cluster.md.") from _exc
    raise ImportError(
        f"mpilossy's compiled core cannot be imported from {_os.path.dirname(__file__)} "
        f"({_exc}). If this is the source tree (Python puts the current directory first on "
        "sys.path), run from another directory, or install it editable, as "
        "scripts/setup.sh does: `pip install --no-build-isolation -e .`") from _exc
from . import loss
from .communicator import (AllreduceStats, CollectiveStats, Communicator, allgather, allreduce,
                           default_communicator, reduce_scatter)
from .contributors import Contributors
from .errors import LaggingError, MismatchError, MPILossyError
from .group import GroupAverager
from . import compression  # (after communicator, which it builds on)

__version__: str = _core.VERSION      # VERSION, through meson.build

__all__ = [
    "AllreduceStats",
    "CollectiveStats",
    "Communicator",
    "Contributors",
    "GroupAverager",
    "MPILossyError",
    "LaggingError",
    "MismatchError",
    "allgather",
    "allreduce",
    "default_communicator",
    "reduce_scatter",
    "loss",
]


def _check_single_mpi() -> None:
    """Two MPI libraries in one process crash or hang: refuse early when the
    MPI that mpi4py loaded is not the one the core was built against, and
    warn when two MPI library files are loaded at all."""
    ours, theirs = _core.library_version(), _MPI.Get_library_version()
    ours, theirs = (" ".join(v.replace("\0", "").split("\n", 1)[0].split()) for v in (ours, theirs))
    files = _loaded_mpi_libraries()
    if ours != theirs:
        raise ImportError(
            "mpilossy was built against a different MPI than the one mpi4py loaded:\n"
            f"  mpilossy: {ours}\n  mpi4py:   {theirs}\n"
            f"  MPI libraries in this process: {', '.join(files) or 'unknown'}\n"
            "Two MPI libraries in one process crash or hang. Rebuild mpilossy against "
            "mpi4py's MPI, or make mpi4py load mpilossy's (docs/cluster.md, "
            "'Two MPI libraries in one process').")
    if len(files) > 1:
        import warnings

        warnings.warn(f"more than one MPI library is loaded ({', '.join(files)}); if the "
                      "job crashes or hangs, this is why (docs/cluster.md, 'Two MPI "
                      "libraries in one process')", RuntimeWarning, stacklevel=3)


def _loaded_mpi_libraries() -> list[str]:
    """Files of core MPI libraries mapped into this process (Linux only; the
    Fortran, C++ and GPU companions of an MPI library do not count)."""
    import os
    import re

    core = re.compile(r"^lib(mpi|mpich)(_[a-z]+(_\d+)?)?\.so(\.\d+)*$")
    companions = ("cxx", "fort", "mpifh", "usempi", "java", "gtl", "f77", "f90", "f08")
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                name = os.path.basename(path)
                if (core.match(name) and not any(c in name for c in companions)
                        and os.path.realpath(path) not in found):
                    found.append(os.path.realpath(path))
    except OSError:
        pass
    return found


_check_single_mpi()
