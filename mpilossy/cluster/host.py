"""What the emulated cluster needs of this machine, and the commands it runs
there: whether a cluster can be made here (unavailable), set-up commands
whose failure says why (sh), and the processes inside network namespaces
(listed, and killed before a namespace is deleted)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, List, Optional, Sequence

UNAVAILABLE = 3          # exit status: no root, a tool or a kernel feature missing (tests skip)
TOOLS = (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool"),
         ("unshare", "util-linux"), ("mount", "util-linux"))


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the emulated cluster (not root, a tool or a
    kernel feature missing)."""


def unavailable() -> Optional[str]:
    """Why a cluster cannot be made here, or None."""
    if sys.platform != "linux":
        return "needs Linux (network namespaces)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc and nftables)"
    for tool, package in TOOLS:
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian: {package})"
    return None


def sh(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a set-up command; its stderr goes into the exception."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, list(cmd), proc.stdout, proc.stderr)
    return proc


def _netns_names() -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(name: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_in(names: Sequence[str], timeout: float = 10.0) -> None:
    """SIGKILL every process inside the namespaces `names` and wait until
    they are gone (a namespace keeps its interfaces while a process holds it)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for name in names for p in _netns_pids(name)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
