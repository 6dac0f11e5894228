"""The module-level collectives (mpilossy.allreduce, ...): one Communicator
over COMM_WORLD, made on first use with its settings from the environment
(MPILOSSY_TIMEOUT, MPILOSSY_LOSS, ...: docs/cluster.md)."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np
from mpi4py import MPI

from .call.config import UNSET
from .call.stats import CollectiveStats
from .communicator import Communicator

__all__ = ["default_communicator", "allreduce", "reduce_scatter", "allgather"]

_default: Optional[Communicator] = None


def default_communicator() -> Communicator:
    """The communicator behind mpilossy.allreduce(): COMM_WORLD, settings
    from the environment (MPILOSSY_TIMEOUT, MPILOSSY_LOSS, ...).  Created on
    first use, which is collective."""
    global _default
    if _default is None or _default._state is None:
        _default = Communicator(MPI.COMM_WORLD)
    return _default


def allreduce(sendbuf: Any, recvbuf: Any = None, *, op: str = "sum",
              algorithm: Optional[str] = None, timeout: Any = UNSET,
              weight: Optional[float] = None,
              compression: Optional[str] = UNSET,
              residual: Optional[np.ndarray] = None,
              redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
    """mpilossy.Communicator.allreduce on default_communicator()."""
    return default_communicator().allreduce(sendbuf, recvbuf, op=op, algorithm=algorithm,
                                            timeout=timeout, weight=weight,
                                            compression=compression, residual=residual,
                                            redundancy=redundancy)


def reduce_scatter(sendbuf: Any, recvbuf: Any, *, op: str = "sum",
                   algorithm: str = "auto", timeout: Any = UNSET,
                   weight: Optional[float] = None,
                   compression: Optional[str] = UNSET,
                   residual: Optional[np.ndarray] = None,
                   redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
    """mpilossy.Communicator.reduce_scatter on default_communicator()."""
    return default_communicator().reduce_scatter(sendbuf, recvbuf, op=op, algorithm=algorithm,
                                                 timeout=timeout, weight=weight,
                                                 compression=compression, residual=residual,
                                                 redundancy=redundancy)


def allgather(sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto", timeout: Any = UNSET,
              redundancy: Union[None, str, Tuple[int, int]] = UNSET) -> CollectiveStats:
    """mpilossy.Communicator.allgather on default_communicator()."""
    return default_communicator().allgather(sendbuf, recvbuf, algorithm=algorithm,
                                            timeout=timeout, redundancy=redundancy)
