"""Loading the compiled core: libmpi first (through mpi4py), a clear error
where the core cannot load, and a refusal where the core and mpi4py use
different MPI libraries (two MPIs in one process crash or hang)."""

from __future__ import annotations

import os
import re
from typing import List

from mpi4py import MPI

try:
    import mpilossy._core as core
except ImportError as _exc:  # pragma: no cover - depends on how Python was started
    if "libmpi" in str(_exc) or "libmpich" in str(_exc):
        # The core exists but its MPI library does not load: mpi4py loaded
        # another MPI (the core relies on finding the one mpi4py loaded).
        _theirs = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
        raise ImportError(
            f"mpilossy's compiled core cannot load its MPI library ({_exc}); mpi4py loaded "
            f"{_theirs!r}. mpilossy and mpi4py must use the same MPI: rebuild mpilossy "
            "against mpi4py's MPI, or make mpi4py load mpilossy's (MPI4PY_LIBMPI); see "
            "docs/cluster.md.") from _exc
    raise ImportError(
        f"mpilossy's compiled core cannot be imported from {os.path.dirname(__file__)} "
        f"({_exc}). If this is the source tree (Python puts the current directory first on "
        "sys.path), run from another directory, or install it editable, as "
        "scripts/setup.sh does: `pip install --no-build-isolation -e .`") from _exc

__all__ = ["core", "check_single_mpi", "loaded_mpi_libraries"]


def check_single_mpi() -> None:
    """Refuse when the MPI that mpi4py loaded is not the one the core was
    built against, and warn when two MPI library files are loaded at all."""
    ours, theirs = core.library_version(), MPI.Get_library_version()
    ours, theirs = (" ".join(v.replace("\0", "").split("\n", 1)[0].split()) for v in (ours, theirs))
    files = loaded_mpi_libraries()
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
                      "libraries in one process')", RuntimeWarning, stacklevel=4)


def loaded_mpi_libraries() -> List[str]:
    """Files of core MPI libraries mapped into this process (Linux only; the
    Fortran, C++ and GPU companions of an MPI library do not count)."""
    pattern = re.compile(r"^lib(mpi|mpich)(_[a-z]+(_\d+)?)?\.so(\.\d+)*$")
    companions = ("cxx", "fort", "mpifh", "usempi", "java", "gtl", "f77", "f90", "f08")
    found: List[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                name = os.path.basename(path)
                if (pattern.match(name) and not any(c in name for c in companions)
                        and os.path.realpath(path) not in found):
                    found.append(os.path.realpath(path))
    except OSError:
        pass
    return found


check_single_mpi()
