"""Who owns a cluster, and what is left when its owner is gone.

Every namespace and state folder made here is named for its owner's pid
(PREFIX-PID-K...), and the state folder holds an owner record, the pid and
its start time, written before any namespace.  A run killed with SIGKILL
leaves its clusters; clean_leftovers() (called by every open(), and by the
`clean` command) removes those whose owner is gone (_owner_alive says how it
knows), with the processes in them, and leaves running clusters alone.

While a cluster is open in a program that has no SIGTERM (SIGHUP) handler
of its own, such a signal removes the clusters first, then kills the
program as before (_take_signals)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Tuple

from .host import _kill_in, _netns_names

PREFIX = "mpilossy-cluster-"        # of every namespace and state folder made here
STATE_ROOT = Path("/run")
GRACE = 10.0            # seconds: how young a cluster without owner record may be (_owner_alive)
_serial = 0


class _Open(Protocol):
    """What this module needs of an open cluster (lifetime.Cluster; named
    by shape, so that this module does not import the one above it)."""

    owner: int
    cid: str
    state: Path

    def close(self) -> None: ...


_open: List[_Open] = []     # the clusters of this process that close() has not removed
_dying = False


def new_cid() -> str:
    """The name of a new cluster of this process: PREFIX-PID-K (K counts from 1)."""
    global _serial
    _serial += 1
    return f"{PREFIX}{os.getpid()}-{_serial}"


def _start_time(pid: int) -> Optional[str]:
    """The start time of process `pid` (field 22 of /proc/PID/stat), or None
    when there is no such process: with the pid it names a process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def write_owner(state: Path, pid: int) -> None:
    """The owner record of the cluster whose state folder is `state`: `pid`
    and its start time, complete or absent, never torn."""
    tmp = state / "owner.tmp"
    tmp.write_text(f"{pid} {_start_time(pid)}\n")
    tmp.rename(state / "owner")


def _owner_alive(state: Path, pid: int) -> bool:
    """Whether the cluster of state folder `state`, named for `pid`, may still
    be in use.  open() writes the owner record (pid and start time) atomically
    into the state folder before it makes any namespace, and close() removes
    the folder after the namespaces.  So: with a record, the owner lives iff a
    process with that pid and start time runs.  Without one the pid proves
    nothing (it may belong to another process by now): the cluster is stale,
    unless its folder changed in the last GRACE seconds (a cluster being made
    or removed right now); a namespace without a folder is stale.  Our own
    pid: only the clusters open in this process are alive."""
    if pid == os.getpid():
        return any(c.state == state for c in _open)
    try:
        owner = state.joinpath("owner").read_text().split()
    except OSError:
        try:
            return time.time() - state.stat().st_mtime < GRACE
        except OSError:
            return False
    return owner == [str(pid), str(_start_time(pid))]


def clean_leftovers(verbose: bool = False) -> List[str]:
    """Remove the namespaces and state folders of clusters whose owner process
    is gone (a run killed with SIGKILL).  Returns what it removed."""
    removed: List[str] = []
    owners: Dict[str, Tuple[Path, int]] = {}
    for state in STATE_ROOT.glob(PREFIX + "*"):
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", state.name)
        if m:
            owners[state.name] = (state, int(m.group(1)))
    stale_ns: Dict[str, List[str]] = {}
    for name in _netns_names():
        m = re.match(re.escape(PREFIX) + r"(\d+)-(\d+)-", name)
        if not m:
            continue
        cid = f"{PREFIX}{m.group(1)}-{m.group(2)}"
        if not _owner_alive(STATE_ROOT / cid, int(m.group(1))):
            stale_ns.setdefault(cid, []).append(name)
    for cid, names in stale_ns.items():
        _kill_in(names)
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    for cid, (state, pid) in owners.items():
        if not _owner_alive(state, pid):
            shutil.rmtree(state, ignore_errors=True)
            removed.append(str(state))
    if verbose:
        for what in removed:
            print(f"cluster: removed {what}", file=sys.stderr)
    return removed


# -- signals while a cluster is open --------------------------------------------------
def _take_signals() -> None:
    """While a cluster is open, a SIGTERM or SIGHUP that would kill the
    process outright (default disposition: a program that uses Cluster as a
    library) first removes the clusters (_die_clean).  A handler of the
    program's own is left alone: main()'s unwinds like Ctrl-C, through
    close().  signal.signal works in the main thread only: a cluster opened
    in another thread relies on its program's handlers and atexit."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _die_clean)


def _give_back_signals() -> None:
    """The default disposition again, once no cluster is open (from the main
    thread; elsewhere _die_clean stays, and with nothing open it acts as the
    default would)."""
    if _open or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is _die_clean:
            signal.signal(signum, signal.SIG_DFL)


def _die_clean(signum: int, frame: object) -> None:
    """SIGTERM or SIGHUP where the default disposition was to die: close
    this process's clusters (not a forked parent's), then die of the signal
    as the default would have.  A second signal meanwhile changes nothing."""
    global _dying
    if _dying:
        return
    _dying = True
    for cluster in [c for c in _open if c.owner == os.getpid()]:
        try:
            cluster.close()
        except BaseException as exc:        # the others still go
            print(f"cluster: while removing {cluster.cid}: {exc!r}", file=sys.stderr)
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    signal.raise_signal(signum)
