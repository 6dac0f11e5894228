# What every compiled module of mpilossy cimports and imports: the C
# library, CPython, mpi4py's MPI and the native headers (native.pxd).

from libc.stdint cimport int32_t, int64_t, intptr_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset, strlen, strncmp
from libc.stdio cimport snprintf
from libc.math cimport frexp, isfinite, ldexp, llround
from posix.stdlib cimport posix_memalign
from posix.unistd cimport getpid
from cpython.exc cimport PyErr_Occurred
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE,
                             PyBUF_ANY_CONTIGUOUS)

import os
from collections import namedtuple

cimport cython
from mpi4py cimport MPI
from mpi4py.libmpi cimport *
from mpi4py.MPI import Exception as MPIException
from mpilossy.errors import MPILossyError as MPILossyChannelError

from native cimport *

cdef extern from "Python.h":
    int PyErr_CheckSignals()      # (no `except`: the loop that calls it decides)


cdef int chk(int ierr) except -1:
    """Raise mpi4py's exception (it carries MPI's error string)."""
    if ierr != MPI_SUCCESS:
        raise MPIException(ierr)
    return 0
