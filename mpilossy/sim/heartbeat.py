"""The elastic heartbeat's cost to a call, simulated on the fat tree.

After every call each rank sends a heartbeat datagram to each rank it
watches (mpilossy/control/elastic.py: the `heartbeat_span` ranks on either
side on the ring of ranks; before that setting, every peer) and reads the
ones that have arrived; it never waits for one (Membership.after_call: the
sends, then a drain).  So a call pays the rank's own datagrams' core time,
each beat sent and each read once (mechanisms.UNIT: the send or receive
path and the MAC), whatever the network's latency; the beats' arrival, a
few links later, is what the detection waits for (a neighbour silent for
`evict_after` calls), not the call.  Both are reported: `cost_*` the core
time a call spends on heartbeats, `arrived_*` the time from the end of the
call until every beat the rank watches for has arrived.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from . import _simgrid
from .world import _World
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
    cost = [0.0] * size
    arrived = [0.0] * size

    def rank(me: int) -> None:
        peers = watched(me, size, span)
        start = sg.Engine.clock
        sends = []
        for peer in peers:
            sg.this_actor.execute(flops)
            sends.append(world.put(f"hb-{peer}-{me}", wire))
        spent = sg.Engine.clock - start
        for arrival in [world.get(f"hb-{me}-{peer}") for peer in peers]:
            arrival.comm.wait()
        arrived[me] = sg.Engine.clock
        # (read at this call's drain or the next's: one read per beat either way)
        start = sg.Engine.clock
        for _ in peers:
            sg.this_actor.execute(flops)
        cost[me] = spent + sg.Engine.clock - start
        for comm in sends:
            comm.wait()

    for r in range(size):
        sg.Actor.create(f"rank{r}", world.host_of(r), rank, r)
    engine.run()
    row: Dict[str, Any] = {"nodes": nodes, "ppn": ppn, "ranks": size, "span": span,
                           "messages": world.events}
    for name, values in (("cost", cost), ("arrived", arrived)):
        times = np.array(values) * 1e6
        row[f"{name}_p50_us"] = float(np.median(times))
        row[f"{name}_max_us"] = float(times.max())
    return row
