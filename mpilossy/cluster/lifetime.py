"""The Cluster: its parts put together (network, conditions, jobs, control),
and its life: open() makes it, close() removes everything, on every way
out (a normal end, an exception, SIGINT, SIGTERM, SIGHUP, also one that
arrives while close() works).  A cluster counts as made from the start of
open() until close() has removed everything, so a close() cut short is
finished by the next (atexit's at the latest)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import threading
from typing import Optional

from .background import Background
from .conditions import Conditions
from .control import Requests
from .host import ClusterUnavailable, _kill_in, unavailable
from .jobs import Jobs
from .leftovers import _give_back_signals, _open, _take_signals, clean_leftovers, write_owner
from .network import Network

SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}        # blocked while close() works


class Cluster(Requests, Background, Conditions, Jobs, Network):
    """`nodes` network namespaces on a bridge in a switch namespace (see the
    package's text).  A context manager: everything goes away on exit.

    rate, queue: each switch port's egress (toward its node): tbf rate (tc
    syntax, '1gbit'; None: uncapped) and queue bytes ('128kb').  node_rate,
    node_queue: each node's eth0 egress (default: rate, and 1 MB).  burst:
    the token bucket (default: 4 frames, at least 16 KB).  mtu: 1500 or
    9000.  offloads: 'nic', 'off' or 'on'.  loopback: one node whose ranks
    reach each other through its loopback (MPIR_CVAR_NOLOCAL=1), drops and
    rate on the loopback: the former scripts/lossy_link.py.

    Its parts: Network (names, namespaces, wires, counters), Conditions
    (drops), Background (other traffic), Jobs (launching, stopping
    processes), Requests (answering a running job); each sets up the state
    it owns in its __init__."""

    def __init__(self, nodes: int = 2, rate: Optional[str] = "1gbit", queue: str = "128kb",
                 node_rate: Optional[str] = "", node_queue: str = "1mb", burst: str = "",
                 mtu: int = 1500, offloads: str = "nic", loopback: bool = False) -> None:
        Network.__init__(self, nodes, rate, queue, node_rate, node_queue, burst, mtu, offloads,
                         loopback)
        Conditions.__init__(self)
        Jobs.__init__(self)
        Background.__init__(self)
        Requests.__init__(self)
        self._made = False          # True from open() until close() has removed everything
        self._lock = threading.RLock()      # reentrant: _die_clean may run inside close()
        self.owner = os.getpid()

    # -- life --------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        if not self._made:
            self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> "Cluster":
        why = unavailable()
        if why:
            raise ClusterUnavailable(why)
        clean_leftovers()
        with self._lock:
            if self._made:
                raise RuntimeError(f"{self.cid} is open already")
            # Made before anything exists, so that a close() from here on (a
            # signal's, atexit's) removes whatever there is by then.
            self.owner = os.getpid()
            _open.append(self)
            self._made = True
            atexit.register(self.close)
        _take_signals()
        try:
            self.state.mkdir(mode=0o755)
            write_owner(self.state, self.owner)
            self._build()
        except subprocess.CalledProcessError as exc:
            self.close()
            detail = (exc.stderr or "").strip()
            raise ClusterUnavailable(f"`{' '.join(exc.cmd)}` failed: {detail}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self._build_network()
        self._write_launcher()
        self.control.mkdir()
        self.meet.mkdir()

    def close(self) -> None:
        """Stop the loss processes and every process on the nodes, delete
        the namespaces and the state folder.  Idempotent, and whole: the
        cluster counts as made until everything is removed, so a close()
        cut short (an error) is finished by the next one (atexit's at the
        latest).  Ctrl-C, SIGTERM and SIGHUP are blocked in the calling
        thread meanwhile; one that reaches another thread still runs its
        Python handler in the main thread, and if that handler raises here,
        the removal starts over and the exception follows once it is done.
        Any thread may call it (pthread_sigmask works in every thread)."""
        cut: Optional[BaseException] = None
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            with self._lock:
                if not self._made:
                    return
                while True:
                    try:
                        self._close()           # every step may run again
                        break
                    except (KeyboardInterrupt, SystemExit) as exc:
                        cut = cut or exc
                self._made = False
                _open.remove(self)
                atexit.unregister(self.close)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        _give_back_signals()
        if cut is not None:
            raise cut

    def _close(self) -> None:
        self._stop_serving()
        self.stop_bursts()
        self.stop_background()
        self._cancel_resumes()
        self._kill_sessions()
        names = self._namespaces()
        _kill_in(names)
        self._reap()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(self.state, ignore_errors=True)
