"""torch.distributed under mpiexec: a process group whose rank, size and
rendezvous come from MPI (for DDP, whose gradient buckets the hook of
hooks.py then reduces lossy, or for the "mpilossy" backend of backend.py)."""

import os
import socket
from datetime import timedelta
from typing import Any, Dict, Optional

import torch.distributed as dist
from mpi4py import MPI

from .backend import gloo_group, use_comm
from .communicators import reliable_comm

__all__ = ["init_process_group", "destroy_process_group", "local_group"]


def init_process_group(backend: str = "gloo", *, comm: Optional[MPI.Intracomm] = None,
                       timeout: Optional[timedelta] = None, pg_options: Any = None) -> None:
    """Start torch.distributed under mpiexec: rank and world size from MPI,
    MASTER_ADDR/MASTER_PORT from rank 0's environment if it sets them, else
    127.0.0.1 (when all ranks share rank 0's host; rank 0's host name
    otherwise) and a port rank 0's store was given by the kernel.
    Collective; does nothing if a process group already exists.

    backend: "gloo", "mpilossy" (gradient collectives lossy: docs/backend.md;
    pg_options: a BackendOptions) or a device map such as
    "cpu:mpilossy,cuda:nccl"."""
    reliable = reliable_comm(comm)
    if dist.is_initialized():
        return
    host = MPI.Get_processor_name()
    hosts = reliable.allgather(host)
    wait = timeout if timeout is not None else timedelta(minutes=5)
    store = None
    choice = None
    if reliable.rank == 0:
        same_host = all(h == host for h in hosts)
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if same_host
                                                 else socket.gethostname())
        # Rank 0's store listens first, on MASTER_PORT or on a port the
        # kernel picks (choosing a free port and binding it later lost the
        # port to another process now and then, and the peers then waited).
        store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT") or 0), reliable.size,
                              is_master=True, timeout=wait, wait_for_workers=False)
        choice = (addr, str(store.port))
    addr, port = reliable.bcast(choice, 0)
    if store is None:
        store = dist.TCPStore(addr, int(port), reliable.size, is_master=False, timeout=wait)
    for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        if os.environ.get(name) != value:       # (a value the user set stays theirs)
            os.environ[name] = _exported[name] = value
    # (only when given: torch's own default otherwise)
    kwargs: Dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if pg_options is not None:
        kwargs["pg_options"] = pg_options
    use_comm(reliable)
    dist.init_process_group(backend, store=store, rank=reliable.rank,
                            world_size=reliable.size, **kwargs)


# What init_process_group wrote into os.environ: taken back on destroy, so
# that a later init does not read its predecessor's port as the user's
# MASTER_PORT (that port may still be held: EADDRINUSE).
_exported: Dict[str, str] = {}


def destroy_process_group() -> None:
    """Barrier, then destroy the process group (without the barrier, about
    one run in three aborted at exit on the development machine)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    for name, value in _exported.items():
        if os.environ.get(name) == value:
            del os.environ[name]
    _exported.clear()


def local_group(timeout: Optional[timedelta] = None) -> dist.ProcessGroup:
    """A process group of this process alone (Gloo, size 1), for
    ``DistributedDataParallel(model, process_group=local_group())`` when
    the hook's Communicator grows (spares=k, rendezvous=DIR): DDP's
    construction and buffer broadcasts then wait for nobody, so a newcomer
    can build its DDP while the others train, and every gradient goes
    through the hook.  (DDP still reorders its buckets after its first
    step on such a group; the hook reduces in the model's parameter order
    there, whatever the buckets.)  Not collective."""
    return gloo_group(dist.HashStore(), 0, 1, timeout if timeout is not None
                      else timedelta(minutes=5))
