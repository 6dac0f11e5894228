"""``python -m mpilossy.cluster COMMAND [options]``: the emulated cluster's
command line (run, bench, train, clean; needs root)."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m mpilossy.cluster"))
