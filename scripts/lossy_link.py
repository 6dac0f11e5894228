"""The former lossy link, now a mode of the emulated cluster (kept so that
the commands written in the docs keep working):

    python scripts/lossy_link.py bench [options]   is
    python scripts/cluster.py bench --loopback --rate none [options]

(and `train` alike): one node whose ranks reach each other through its
loopback (MPIR_CVAR_NOLOCAL=1: no shared memory), MTU 1500 and offloads
off there, drops made by nftables on the loopback.  --np N: ranks.  New
work should use scripts/cluster.py (python -m mpilossy.cluster), whose
nodes meet on a switch."""

import sys

from mpilossy.cluster import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv[:1] + ["--loopback", "--rate", "none"] + argv[1:]))
