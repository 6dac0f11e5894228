"""Background traffic in the scale model: on/off TCP flows between nodes, as
the emulated cluster makes them (mpilossy/cluster/background.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["Background", "start_background"]


@dataclass(frozen=True)
class Background:
    """On/off TCP flows from each node to the next (mpilossy.cluster's
    `--background ON/OFF:FLOWS`): on and off periods uniform in 0.5-1.5 x
    their means, each flow sending as fast as the network lets it."""

    on_ms: float
    off_ms: float
    flows: int = 1
    # every node on and off together: another job's collectives, which load
    # every link at once (OptiReduce's background jobs run ring all-reduces)
    aligned: bool = False

    @classmethod
    def parse(cls, text: str) -> "Background":
        """ON/OFF[:FLOWS][:aligned], e.g. 100/400:1 or 5/95:2:aligned."""
        times, _, rest = text.partition(":")
        flows, _, kind = rest.partition(":")
        if kind not in ("", "aligned"):
            raise ValueError(f"background {text!r}: the third field can only be 'aligned'")
        on, _, off = times.partition("/")
        return cls(float(on), float(off), int(flows or 1), kind == "aligned")

    def __str__(self) -> str:
        return f"{self.on_ms:g}/{self.off_ms:g}:{self.flows}" + (":aligned" if self.aligned else "")


def start_background(world: Any) -> None:
    """The flows, and on every node a sink that takes what they send."""
    sg, bg = world.sg, world.s.background
    assert bg is not None
    for node in range(world.s.nodes):
        for f in range(bg.flows):
            # (aligned: every flow of every node draws the same periods)
            ident = 0 if bg.aligned else node * 1000 + f
            rng = random.Random(world.s.seed * 1_000_000 + ident)
            dest = (node + 1) % world.s.nodes
            # (not daemons: a daemon killed mid-sleep at the end prints a backtrace;
            # these end at the first period boundary after the ranks are done)
            sg.Actor.create(f"bg{node}.{f}", world.hosts[node], _flow, world, rng, node, dest, bg)
    for node in range(world.s.nodes):
        _sink(world, node)


def _sink(world: Any, node: int) -> None:
    sg = world.sg

    def idle() -> None:
        sg.this_actor.sleep_for(1e9)

    actor = sg.Actor.create(f"sink{node}", world.hosts[node], idle)
    actor.daemonize()
    sg.Mailbox.by_name(f"sink-{node}").set_receiver(actor)


def _flow(world: Any, rng: random.Random, node: int, dest: int, bg: Background) -> None:
    sg = world.sg
    sg.this_actor.sleep_for(rng.uniform(0, (bg.on_ms + bg.off_ms) / 1e3))
    mailbox = sg.Mailbox.by_name(f"sink-{dest}")
    while not world.done:
        on = rng.uniform(0.5, 1.5) * bg.on_ms / 1e3
        comm = mailbox.put_async(None, int(1e12))
        sg.this_actor.sleep_for(on)
        comm.cancel()
        sg.this_actor.sleep_for(rng.uniform(0.5, 1.5) * bg.off_ms / 1e3)
