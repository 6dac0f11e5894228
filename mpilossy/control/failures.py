"""Ranks that MPI reports as failed, and the communicator of the survivors:
the ground an elastic communicator stands on (issue: a rank that is gone).

MPICH exports ``MPIX_Comm_get_failed`` even where its ULFM calls are stubs
(ch4): under ``mpiexec -disable-auto-cleanup`` a rank that exited is in the
group it returns within milliseconds.  mpi4py builds its own ULFM methods
for MPICH as fallbacks (``Get_failed()`` is always empty), so the symbol is
called through ctypes.  Where the library does not export it, nothing is
ever reported (``reports_failures()`` says which).  A rank killed by a
signal is not survivable under Hydra: its proxy kills the whole job
(docs/elastic.md).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, FrozenSet, Iterable, Optional

from mpi4py import MPI

__all__ = ["failed_ranks", "reports_failures", "survivors"]


@functools.lru_cache(maxsize=1)
def _get_failed() -> Optional[Any]:
    """MPIX_Comm_get_failed of the MPI library mpi4py loaded, or None.
    (MPICH's handles are 32-bit words: unsigned, as mpi4py takes them.)"""
    if "MPICH" not in MPI.Get_library_version():
        return None
    try:
        function = ctypes.CDLL(MPI.__file__).MPIX_Comm_get_failed
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
    function.restype = ctypes.c_int
    return function


def reports_failures() -> bool:
    """Does this MPI library report failed ranks (MPIX_Comm_get_failed)?"""
    return _get_failed() is not None


def failed_ranks(comm: MPI.Comm) -> FrozenSet[int]:
    """Ranks of `comm` that MPI knows to have failed (local, not
    collective: ranks may learn of a failure at different times).  Empty
    where the library does not report failures."""
    function = _get_failed()
    if function is None:
        return frozenset()
    handle = ctypes.c_uint32(0)
    if function(ctypes.c_uint32(comm.handle), ctypes.byref(handle)) != MPI.SUCCESS:
        return frozenset()
    group = MPI.Group.fromhandle(handle.value)
    try:
        if group.Get_size() == 0:
            return frozenset()
        mine = comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), mine)
        finally:
            mine.Free()
        return frozenset(r for r in ranks if r != MPI.UNDEFINED)
    finally:
        group.Free()


def survivors(comm: MPI.Intracomm, gone: Iterable[int]) -> MPI.Intracomm:
    """A new communicator of `comm`'s ranks but `gone`, in their order.
    Collective over those ranks only (MPI_Comm_create_group): every one of
    them must pass the same `gone`."""
    group = comm.Get_group()
    try:
        kept = group.Excl(sorted(set(gone)))
    finally:
        group.Free()
    try:
        return comm.Create_group(kept)
    finally:
        kept.Free()
