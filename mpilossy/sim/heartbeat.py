"""The elastic heartbeat's cost to a call, simulated on the fat tree.

After every call each rank sends a heartbeat datagram to each rank it
watches and reads one from each (mpilossy/control/elastic.py: the
`heartbeat_span` ranks on either side on the ring of ranks; before that
setting, every peer).  Each datagram costs its sender and its receiver one
core's time (mechanisms.UNIT: the send or receive path and the MAC) and the
fabric its bytes.  The time from the end of the call until every rank has
sent and read all of its heartbeats is what the heartbeat adds to the call.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from . import _simgrid
from .engine import _World
from .mechanisms import UNIT, beat_bytes
from .scenario import Scenario

__all__ = ["simulate_heartbeat", "watched"]


def watched(rank: int, size: int, span: int) -> List[int]:
    """The peers `rank` beats to: control/elastic.py's neighbours(), or
    every peer for span 0 (the heartbeat before heartbeat_span)."""
    from ..control.elastic import neighbours
    if span <= 0:
        return [r for r in range(size) if r != rank]
    return neighbours(rank, size, span)


def simulate_heartbeat(nodes: int, ppn: int, span: int, rate: float,
                       tree: tuple = ()) -> Dict[str, Any]:
    """One call's heartbeats on `nodes` x `ppn` ranks (one engine: call in a
    fresh process, runner.run_all)."""
    sg = _simgrid.load()
    engine = sg.Engine(["mpilossy-sim", "--log=root.thr:critical",
                        "--log=xbt_cfg.thr:critical"])
    s = Scenario(nodes=nodes, ppn=ppn, rate=rate, latency=1e-6, tree=tree, pace=False,
                 mpi=False)
    world = _World(sg, s)
    size = s.size
    # the datagram: header, no rank bitmaps (signals.py), the MAC; on the wire with
    # UDP/IP and Ethernet framing.  Before heartbeat_span it carried two bitmaps.
    payload = beat_bytes(size, span)
    cpu = UNIT["datagram_s"] + UNIT["mac_fixed_s"] + payload * UNIT["mac_per_byte_s"]
    flops = cpu * 1e9                   # (hosts compute 1e9 flops a second per core)
    wire = payload + UNIT["wire_overhead_b"]
    done = [0.0] * size

    def rank(me: int) -> None:
        peers = watched(me, size, span)
        sends = []
        for peer in peers:
            sg.this_actor.execute(flops)
            sends.append(world.put(f"hb-{peer}-{me}", wire))
        for arrival in [world.get(f"hb-{me}-{peer}") for peer in peers]:
            arrival.comm.wait()
            sg.this_actor.execute(flops)
        for comm in sends:
            comm.wait()
        done[me] = sg.Engine.clock

    for r in range(size):
        sg.Actor.create(f"rank{r}", world.host_of(r), rank, r)
    engine.run()
    times = np.array(done)
    return {"nodes": nodes, "ppn": ppn, "ranks": size, "span": span,
            "messages": world.events, "p50_us": float(np.median(times)) * 1e6,
            "max_us": float(times.max()) * 1e6}
