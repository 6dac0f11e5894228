"""A character-level transformer language model trained data-parallel with
mpilossy, on the Python standard library's own sources (docs/results.md).

    mpiexec -n 4 python -m mpilossy.examples.lm --loss 0.1
    python -m mpilossy.examples.lm.results          # the results table
"""
