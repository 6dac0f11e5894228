"""MPILOSSY_TRACE with the hierarchy: each rank writes its own files, one
per level.  Run on fake nodes:

    MPIR_CVAR_NUM_CLIQUES=2 MPILOSSY_TRACE=DIR mpiexec -n 4 python trace_levels.py CALLS
"""

import sys

import numpy as np
from mpi4py import MPI

import mpilossy

calls = int(sys.argv[1])
x = np.ones(100_000, dtype=np.float32)
with mpilossy.Communicator(MPI.COMM_WORLD, timeout=1.0, algorithm="hierarchical") as lc:
    for _ in range(calls):
        lc.allreduce(x, op="avg")
