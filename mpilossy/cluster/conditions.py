"""Extra drops on the switch: nftables rules in the cluster's table (bridge
family, forward hook; a node's loopback ingress in loopback mode) that drop
IPv4 TCP and UDP packets, counted in the named counter "dropped".

set_drop: a share dropped at random (chain `drops`).  Loss processes in
time, one at a time (chain `bursts`, driven by a Flapper): microbursts
(everything dropped for a while, gaps uniform in 0.5-1.5 x their mean) and
Gilbert-Elliott (good and bad states of exponential length, a share
dropped in the bad one)."""

from __future__ import annotations

import random
import subprocess
import threading
from typing import Callable, Optional

from .host import sh
from .network import PACKETS, Network


def _drop_rule(share: float) -> str:
    """The nftables rule that drops `share` of PACKETS, counted in the named
    counter "dropped" (which outlives the rule)."""
    if not 0 <= share <= 1:
        raise ValueError(f"drop share {share}: 0 <= share <= 1")
    if share >= 1:
        return f'{PACKETS} counter name "dropped" drop'
    return (f"{PACKETS} numgen random mod 100000 < {round(share * 100000)} "
            f'counter name "dropped" drop')


class Flapper:
    """A two-state drop process in time, driven through one `nft -i` shell:
    `good()` and `bad()` draw how long each state lasts; entering the bad
    state installs `bad_rule` in the chain, the good state empties it."""

    def __init__(self, cluster: Network, good: Callable[[], float], bad: Callable[[], float],
                 bad_rule: str) -> None:
        self.cluster, self.good, self.bad, self.bad_rule = cluster, good, bad, bad_rule
        self.stop_event = threading.Event()
        self.bad_periods = 0
        self.shell = subprocess.Popen(cluster.in_filter_ns(["nft", "-i"]), stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      text=True)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _say(self, line: str) -> None:
        assert self.shell.stdin is not None
        self.shell.stdin.write(line + "\n")
        self.shell.stdin.flush()

    def _loop(self) -> None:
        chain = self.cluster.chain("bursts")
        try:
            while not self.stop_event.wait(self.good()):
                self._say(f"add rule {chain} {self.bad_rule}")
                self.bad_periods += 1
                self.stop_event.wait(self.bad())
                self._say(f"flush chain {chain}")
        except (BrokenPipeError, ValueError):
            pass

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
        try:
            self._say(f"flush chain {self.cluster.chain('bursts')}")
            assert self.shell.stdin is not None
            self.shell.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass
        try:
            self.shell.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.shell.kill()
            self.shell.wait()


class Conditions(Network):
    """The drops of a cluster (a part of Cluster): one random share and at
    most one loss process in time."""

    def __init__(self) -> None:
        self._flapper: Optional[Flapper] = None

    def set_drop(self, share: float) -> None:
        """Drop `share` (0..1) of the IPv4 TCP and UDP packets crossing the
        switch, at random."""
        chain = self.chain("drops")
        rule = f"add rule {chain} {_drop_rule(share)}\n" if share else ""
        sh(self.in_filter_ns(["nft", "-f", "-"]), input=f"flush chain {chain}\n" + rule)

    def start_bursts(self, length: float, every: float, seed: int = 1) -> None:
        """Microbursts: every TCP/UDP packet dropped for `length` seconds,
        every `every` seconds on average (gaps uniform in 0.5-1.5 times)."""
        rng = random.Random(seed)
        self._start_flapper(Flapper(self, lambda: rng.uniform(0.5, 1.5) * every,
                                    lambda: length, _drop_rule(1.0)))

    def start_gilbert(self, good: float, bad: float, loss_bad: float, seed: int = 1) -> None:
        """Gilbert-Elliott in time: good and bad states of exponential
        length (means `good`, `bad` seconds); `loss_bad` dropped in bad."""
        rng = random.Random(seed)
        self._start_flapper(Flapper(self, lambda: rng.expovariate(1 / good),
                                    lambda: rng.expovariate(1 / bad), _drop_rule(loss_bad)))

    def _start_flapper(self, flapper: Flapper) -> None:
        self.stop_bursts()
        self._flapper = flapper

    def stop_bursts(self) -> None:
        if self._flapper is not None:
            self._flapper.stop()
            self._flapper = None

    def clear(self) -> None:
        """No extra drops."""
        self.stop_bursts()
        self.set_drop(0)
