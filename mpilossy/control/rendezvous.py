"""Processes started after a loss join a running elastic communicator
through MPI's ports (Communicator(elastic=True, rendezvous=DIR) on the
ranks in, Communicator.join(DIR) on the newcomer; docs/elastic.md,
"Growing back").

Why ports and a directory: with the ``mpich`` wheel a process started
outside the job (a rank restarted by a wrapper script, or an ``srun -n 1``
step of the same allocation) reaches the survivors through
MPI_Comm_connect under mpiexec and under srun, where MPI_Comm_spawn hung
(tests/programs/join_by_port.py, rank_replaced.py).  MPI's name service
needs a server the launchers here do not start; a directory that every
node and the newcomer see (the job's working directory on a cluster's
shared file system) needs nothing.

The files, in DIR:

``knock.<stamp>.<host>.<pid>``
    a newcomer waiting (its JSON: how many processes it brings), touched
    every poll while it waits: a knock not touched for STALE seconds is a
    newcomer that died, never accepted (MPI_Comm_accept would wait for it
    for ever) and removed;
``port.<knock>``
    the port the ranks in accept that newcomer on (written by the lowest
    rank in, after the ranks agreed on it);
``taken.<knock>``
    the port, taken by its newcomer (it renames ``port.<knock>``, then
    connects).  Only then do the ranks in enter MPI_Comm_accept
    (collective over them), which would wait for ever for a newcomer that
    died or gave up after the agreement: the lowest rank waits a bound for
    the rename, and past it withdraws the port (removes ``port.<knock>``);
    one of the two succeeds, so both sides know whether it was taken;
``closed``
    the job freed its communicator: a newcomer still waiting gives up.

Where MPI fails to accept a newcomer, it fails on every side: the ranks
in go on without it (Refused), the newcomer raises.  Seen with two
newcomers started as singletons (python without a launcher): MPICH takes
the second for the first (their process ids overlap); newcomers started
with a launcher (``mpiexec -n 1``, ``srun -n 1``) are told apart.

One newcomer (one knock, of one or more processes) per growth; the ranks
in and the newcomer merge (MPI_Intercomm_merge), the ranks in first.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from mpi4py import MPI

from ..errors import MPILossyError

__all__ = ["Rendezvous", "Refused", "directory_problem", "STALE"]

KNOCK, PORT, TAKEN, CLOSED = "knock.", "port.", "taken.", "closed"
STALE = 2.0         # seconds without a touch after which a knock is a newcomer gone
POLL = 0.01         # seconds between a newcomer's looks for its port


class Refused(Exception):
    """MPI could not accept the newcomer (raised on every rank in: the
    failure is collective; they go on without it)."""


def directory_problem(directory: Any) -> Optional[str]:
    """Why this rank cannot use `directory` as a rendezvous (None if it can)."""
    if not os.path.isdir(directory):
        return f"rendezvous={directory!r} is not a directory on this rank's host"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"rendezvous={directory!r} is not writable on this rank's host"
    return None


def _write(path: Path, text: str) -> None:
    """Whole, or not there (a reader on another node never sees half)."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


class Rendezvous:
    """One communicator's rendezvous directory, on the ranks in (knocks,
    admit, close) and on a newcomer (knock_and_connect)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    # -- the ranks in ---------------------------------------------------------
    def opened(self) -> None:
        """On the lowest rank at construction: an old run's end mark and
        ports are not this run's."""
        for path in self.directory.iterdir():
            if path.name == CLOSED or path.name.startswith((PORT, TAKEN)):
                path.unlink(missing_ok=True)

    def knocks(self) -> List[Tuple[str, int]]:
        """On the lowest rank in: the newcomers waiting, oldest first, as
        (knock, processes); knocks not touched for STALE seconds are
        removed (their newcomer is gone)."""
        now = time.time()
        found = []
        for path in sorted(self.directory.glob(KNOCK + "*")):
            if path.name.endswith(".tmp"):
                continue
            try:
                touched = path.stat().st_mtime
                size = int(json.loads(path.read_text())["size"])
            except (OSError, ValueError, KeyError, TypeError):
                continue        # (removed meanwhile, or being written)
            if now - touched > STALE:
                path.unlink(missing_ok=True)
                continue
            found.append((path.name, size))
        return found

    def admit(self, comm: MPI.Intracomm, knock: Optional[str], info: Dict[str, Any],
              bound: float, between: Callable[[], None]) -> MPI.Intracomm:
        """Collective over `comm` (the ranks in, agreed that one newcomer is
        taken in; `knock` its file on comm's rank 0): the port offered to
        it, then, once it took the port within `bound` seconds (rank 0
        calls `between` while it waits), accept it and merge, the ranks in
        first, and send it `info` (from rank 0).  The merged communicator;
        Refused if it did not take the port or MPI failed to accept it."""
        port, taken = "", False
        if comm.Get_rank() == 0:
            assert knock is not None
            port = MPI.Open_port()
            _write(self.directory / (PORT + knock), port)
            taken = self._taken(knock, bound, between)
        try:
            if not comm.bcast(taken, root=0):
                raise Refused(f"it did not take its port within {bound:.1f} s (gone or stalled)")
            try:
                inter = comm.Accept(port, root=0)
            except MPI.Exception as exc:
                raise Refused(str(exc).strip().splitlines()[-1]) from exc
        finally:
            if knock is not None:
                for name in (PORT + knock, TAKEN + knock, knock):
                    (self.directory / name).unlink(missing_ok=True)
                MPI.Close_port(port)
        try:
            merged = inter.Merge(high=False)
        finally:
            inter.Disconnect()
        merged.bcast(info, root=0)
        return merged

    def _taken(self, knock: str, bound: float, between: Callable[[], None]) -> bool:
        """On the lowest rank in: whether the newcomer of `knock` took its
        port within `bound` seconds; past it the port is withdrawn (its
        removal and the newcomer's rename exclude each other)."""
        began = time.monotonic()
        while time.monotonic() - began < bound:
            if (self.directory / (TAKEN + knock)).exists():
                return True
            between()
        try:
            (self.directory / (PORT + knock)).unlink()
        except FileNotFoundError:
            return True                 # (taken in the last instant)
        return False

    def close(self) -> None:
        """On the lowest rank in, at the end: newcomers still waiting give up."""
        try:
            _write(self.directory / CLOSED, "")
        except OSError:
            pass        # (the directory went away: nobody can be waiting in it)

    # -- a newcomer ------------------------------------------------------------
    def knock_and_connect(self, comm: MPI.Intracomm, bound: float
                          ) -> Optional[Tuple[MPI.Intracomm, Dict[str, Any]]]:
        """Collective over `comm` (the newcomer's processes): knock, wait up
        to `bound` seconds for a port, connect and merge (last).  (the
        merged communicator, what the ranks in sent), or None: the job
        ended, or nobody took this newcomer in within `bound`."""
        port: Optional[str] = None
        if comm.Get_rank() == 0:
            port = self._wait_for_port(comm.Get_size(), bound)
        port = comm.bcast(port, root=0)
        if port is None:
            return None
        try:
            inter = comm.Connect(port, root=0)
        except MPI.Exception as exc:
            launched = any(name in os.environ for name in ("PMI_RANK", "PMI_FD", "PMIX_RANK"))
            raise MPILossyError(
                f"the ranks at {self.directory} could not take this process in: "
                f"{str(exc).strip().splitlines()[-1]}" + ("" if launched else
                " (this process was started without a launcher: start newcomers with "
                "'mpiexec -n 1' or 'srun -n 1', two singletons look alike to MPI)")) from exc
        try:
            merged = inter.Merge(high=True)
        finally:
            inter.Disconnect()
        info = merged.bcast(None, root=0)
        return merged, info

    def _wait_for_port(self, size: int, bound: float) -> Optional[str]:
        name = f"{KNOCK}{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        knock, port = self.directory / name, self.directory / (PORT + name)
        _write(knock, json.dumps({"size": size}))
        began = time.monotonic()
        taken: Optional[str] = None
        try:
            while True:
                if port.exists():
                    taken = self._take(port, self.directory / (TAKEN + name))
                    if taken is not None:
                        return taken
                if (self.directory / CLOSED).exists() or time.monotonic() - began > bound:
                    return None
                try:
                    os.utime(knock)                 # (alive: STALE)
                except FileNotFoundError:
                    # (taken: the port is being written) or removed as stale, or
                    # with its port withdrawn: knock again
                    if not port.exists() and not (self.directory / (PORT + name + ".tmp")).exists():
                        _write(knock, json.dumps({"size": size}))
                time.sleep(POLL)
        finally:
            if taken is None:
                knock.unlink(missing_ok=True)

    @staticmethod
    def _take(port: Path, taken: Path) -> Optional[str]:
        """The port offered, taken (renamed: from now on the ranks in wait in
        MPI_Comm_accept for this process), or None if the ranks withdrew it."""
        try:
            os.rename(port, taken)
        except FileNotFoundError:
            return None
        return taken.read_text()
