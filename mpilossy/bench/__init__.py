"""Benchmarks, run from rank 0's point of view: ``mpiexec -n 4 python -m
mpilossy.bench COMMAND [options]``, COMMAND one of allreduce (the default),
crossover, deadline, kernels, delivery, torch; ``--help`` lists them.

Every all-reduce row is measured side by side with MPI_Allreduce (through
mpi4py, same buffers, same ranks, interleaved iterations), and the figures
that matter are the ratios: absolute times on a shared machine are not stable.
"""

from .allreduce import run_allreduce_bench
from .spec import BenchConfig, Row

__all__ = ["BenchConfig", "Row", "run_allreduce_bench"]
