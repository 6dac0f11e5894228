"""Background traffic: another job's TCP flows sharing the switch ports with
the measured one, in on/off bursts (the congestion of a shared cluster).

The shape follows OptiReduce's evaluation, whose background jobs run TCP
ring all-reduces beside the measured job: here every node sends to the next
node of a ring (node i -> i + 1) over `flows` TCP connections, each on for
a time, then off for a time (both uniform in 0.5-1.5 x their means, seeded),
without MPI: a second MPI job would also busy-poll the CPUs, which on a
small machine measures CPU contention instead of the network.  Each node
runs one sink, which reads and discards (the processes: cluster/flows.py).
Bounded twice: each process exits after `seconds`, and the cluster kills
them when the condition ends or the cluster closes (every way out:
Cluster.close)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from .jobs import Jobs

__all__ = ["Background", "parse_background", "PORT"]

PORT = 5299                 # the sinks' TCP port on every node


def parse_background(text: str) -> Optional[Tuple[float, float, int]]:
    """'ON_MS/OFF_MS' or 'ON_MS/OFF_MS:FLOWS' -> (on s, off s, flows); ''
    or 'none' -> None.  ValueError for anything else."""
    if not text or text.lower() == "none":
        return None
    times, _, flows = text.partition(":")
    on, _, off = times.partition("/")
    try:
        spec = (float(on) / 1e3, float(off) / 1e3, int(flows or 1))
    except ValueError:
        raise ValueError(f"background {text!r}: expected ON_MS/OFF_MS[:FLOWS], "
                         f"e.g. 200/300:2") from None
    if spec[0] <= 0 or spec[1] < 0 or spec[2] < 1:
        raise ValueError(f"background {text!r}: ON_MS > 0, OFF_MS >= 0, FLOWS >= 1")
    return spec


class Background(Jobs):
    """The background flows of a cluster (a part of Cluster)."""

    def __init__(self) -> None:
        self._background: List[subprocess.Popen] = []
        self.background: Optional[Tuple[float, float, int]] = None   # (on s, off s, flows)

    def start_background(self, on: float, off: float, flows: int = 1, seed: int = 1,
                         seconds: float = 3600.0) -> None:
        """Every node sends to the next over `flows` TCP connections, on for
        `on` seconds and off for `off` on average, for at most `seconds`."""
        if self.nodes < 2:
            raise ValueError("background traffic needs two nodes or more")
        self.stop_background()
        env = self.job_environment()
        # the script, not the module: importing the package would start MPI
        me = [sys.executable, str(Path(__file__).with_name("flows.py"))]
        self._background = [self.popen(self.on_node(n, [*me, "sink", str(PORT), str(seconds)]),
                                       env=env,
                                       stdout=subprocess.DEVNULL)
                            for n in range(1, self.nodes + 1)]
        for n in range(1, self.nodes + 1):
            target = self.addresses[n % self.nodes]
            for f in range(flows):
                self._background.append(self.popen(self.on_node(n, [
                    *me, "source", target, str(PORT), str(round(on * 1e3, 3)),
                    str(round(off * 1e3, 3)), str(seed * 1_000_000 + n * 1000 + f), str(seconds)]),
                    env=env, stdout=subprocess.DEVNULL))
        self.background = (on, off, flows)

    def stop_background(self) -> None:
        """Stop every background process (their sessions), and wait for them."""
        for proc in self._background:
            if proc.poll() is None:          # (not one already reaped: its pid may be reused)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._background:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._background = []
        self.background = None
