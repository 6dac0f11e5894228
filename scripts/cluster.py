"""The emulated cluster's command line, as the docs run it:

    python scripts/cluster.py run|bench|train|clean [options]

is `python -m mpilossy.cluster ...`; the emulated cluster itself is the
package mpilossy.cluster (docs/emulated-cluster.md)."""

import sys

from mpilossy.cluster import main

if __name__ == "__main__":
    sys.exit(main())
