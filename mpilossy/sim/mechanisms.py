"""What each per-call mechanism costs as the job grows, from the message
counts and sizes in the code, and the scale at which it passes a share of a
training step.  Analytic: these are counts times measured unit costs, not
simulated (the unit costs and where they come from are in UNIT)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

__all__ = ["UNIT", "table", "print_table"]

UNIT = {
    # seal + check of one datagram's MAC, fixed part (docs/ud.md: 0.96 us at
    # 1408 B, 4.86 us at 8192 B, one core: 0.15 us + 0.575 ns per byte)
    "mac_fixed_s": 0.15e-6,
    "mac_per_byte_s": 0.575e-9,
    # the send and receive path of one datagram on a batching or hardware
    # transport (assumed: sendmmsg/recvmmsg batches, or verbs UD)
    "datagram_s": 1.0e-6,
    "wire_overhead_b": 28 + 38,          # UDP/IP + Ethernet framing
    "heartbeat_b": 39,                   # mpilossy/control/signals.py: BEAT (no bitmaps)
    "heartbeat_span": 2,                 # Communicator(heartbeat_span=...)'s default
    "packet_b": 8256,                    # a receive buffer (ud_mtu 8192 + headers)
    "latency_s": 2e-6,                   # one message across the fat tree
}


def beat_bytes(ranks: int, span: int) -> int:
    """A heartbeat datagram's bytes: no rank bitmaps since heartbeat_span;
    before it (span 0) two bitmaps that grew with the ranks."""
    return int(UNIT["heartbeat_b"]) if span > 0 else 23 + 16 * -(-ranks // 64) + 16


def _beats(peers: int, payload: int, ppn: int, link_Bps: float) -> float:
    """Seconds per call of `peers` heartbeats per rank, each sent and received."""
    per_rank_cpu = peers * (UNIT["datagram_s"] + UNIT["mac_fixed_s"]
                            + payload * UNIT["mac_per_byte_s"]) * 2
    wire = ppn * peers * (payload + UNIT["wire_overhead_b"] + 64) / link_Bps
    return max(per_rank_cpu, wire)


def _heartbeat(ranks: int, ppn: int, link_Bps: float) -> float:
    """Every rank beats to its neighbours after each call, heartbeat_span on
    each side on the ring of ranks (mpilossy/control/elastic.py)."""
    span = int(UNIT["heartbeat_span"])
    return _beats(min(ranks - 1, 2 * span), beat_bytes(ranks, span), ppn, link_Bps)


def _heartbeat_to_all(ranks: int, ppn: int, link_Bps: float) -> float:
    """The heartbeat before heartbeat_span: to every peer after each call."""
    return _beats(ranks - 1, beat_bytes(ranks, 0), ppn, link_Bps)


def _agreements(ranks: int, ppn: int, link_Bps: float) -> float:
    """Seconds per call: the learned deadline's MPI_Iallreduce of (576 + P)
    doubles every 16 calls (mpilossy/control/deadline.py), and the
    redundancy's 16 bytes (control/redundancy.py), each once per hierarchy
    level; recursive doubling, log2 P rounds."""
    rounds = math.ceil(math.log2(max(2, ranks)))
    deadline = rounds * (UNIT["latency_s"] + (576 + ranks) * 8 / link_Bps)
    redundancy = rounds * (UNIT["latency_s"] + 16 / link_Bps)
    return 2 * (deadline + redundancy) / 16


def _direct_across_nodes(ranks: int, ppn: int, link_Bps: float, bucket: int = 25 << 20,
                         payload: int = 8192) -> float:
    """Seconds per call of per-message cost in the hierarchy's stage 2: each
    slice owner sends its slice's share to every other node's owner and back
    (2 (n - 1) streams); a share below one datagram still costs one."""
    nodes = max(1, ranks // ppn)
    share = bucket / ppn / nodes
    datagrams = 2 * (nodes - 1) * max(1, math.ceil(share / payload))
    full = 2 * (nodes - 1) * share / payload                  # what the bytes alone would need
    return (datagrams - full) * UNIT["datagram_s"] + 2 * (nodes - 1) * UNIT["latency_s"] / 8


def _flat_direct(ranks: int, ppn: int, link_Bps: float, bucket: int = 25 << 20,
                 payload: int = 8192) -> float:
    """The flat direct algorithm (algorithm="direct", or "auto" on one rank
    per node): 2 (P - 1) streams per rank."""
    share = bucket / ranks
    datagrams = 2 * (ranks - 1) * max(1, math.ceil(share / payload))
    full = 2 * (ranks - 1) * share / payload
    return (datagrams - full) * UNIT["datagram_s"]


def _memory_gib(ranks: int, ppn: int, link_Bps: float, bucket: int = 25 << 20) -> float:
    """GiB per rank of a flat ud communicator: fixed receive, control and
    stash/replay buffers (512 + 256 + 2 (512 + 8 P) packets,
    src_cython/channels/dgram_endpoint.pxi), two outboxes and an inbox."""
    fixed = (512 + 256 + 2 * (512 + 8 * ranks)) * UNIT["packet_b"]
    return (fixed + 2 * bucket + 2 * bucket * (ranks - 1) / ranks) / (1 << 30)


MECHANISMS: Dict[str, Callable[..., float]] = {
    "heartbeat (elastic=True, heartbeat_span=2)": _heartbeat,
    "heartbeat to every peer (before heartbeat_span)": _heartbeat_to_all,
    "learned-deadline and redundancy agreements": _agreements,
    "hierarchy stage 2, per-message cost (25 MiB)": _direct_across_nodes,
    "flat direct, per-message cost (25 MiB)": _flat_direct,
}


def _first_over(cost: Callable[..., float], ppn: int, link_Bps: float, limit: float) -> int:
    """The fewest ranks (a whole number of nodes, up to 2^24) at which
    `cost` passes `limit`; 0 if it never does."""
    nodes = 1
    while nodes <= (1 << 24) // ppn:
        if cost(nodes * ppn, ppn, link_Bps) > limit:
            lo, hi = nodes // 2, nodes
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if cost(mid * ppn, ppn, link_Bps) > limit:
                    hi = mid
                else:
                    lo = mid
            return hi * ppn
        nodes *= 2
    return 0


def table(ppn: int = 8, link_bps: float = 100e9, step: float = 0.1,
          share: float = 0.05) -> List[Dict[str, Any]]:
    link_Bps = link_bps / 8
    rows = []
    for name, cost in MECHANISMS.items():
        rows.append({"mechanism": name,
                     "at_1024x8_ms": cost(1024 * ppn, ppn, link_Bps) * 1e3,
                     "breaks_at_ranks": _first_over(cost, ppn, link_Bps, share * step),
                     "limit_ms": share * step * 1e3})
    memory = {"mechanism": "ud buffers per rank, flat communicator (GiB)",
              "at_1024x8_ms": _memory_gib(1024 * ppn, ppn, link_Bps),
              "breaks_at_ranks": _first_over(_memory_gib, ppn, link_Bps, 1.0), "limit_ms": None}
    return rows + [memory]


def print_table(rows: List[Dict[str, Any]]) -> None:
    print("| mechanism | cost at 1,024 x 8 | first scale past the limit (ranks) | limit |")
    print("|---|---|---|---|")
    for r in rows:
        limit = f"{r['limit_ms']:g} ms a call" if r["limit_ms"] is not None else "1 GiB"
        unit = "" if r["limit_ms"] is None else " ms"
        where = f"{r['breaks_at_ranks']:,}" if r["breaks_at_ranks"] else "never (below 16.7 M)"
        print(f"| {r['mechanism']} | {r['at_1024x8_ms']:.3g}{unit} | {where} | {limit} |")
