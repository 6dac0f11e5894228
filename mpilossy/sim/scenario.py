"""What one simulated scenario is (platform, call, traffic) and what it
returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .mpich import RTO_SHARE
from .traffic import Background

__all__ = ["Scenario", "Outcome", "fat_tree", "two_level_tree"]


@dataclass(frozen=True)
class Scenario:
    nodes: int = 4
    ppn: int = 1
    rate: float = 200e6                 # bit/s of each node's port, each way
    nbytes: int = 1 << 20
    algorithm: str = "direct"
    deadline: float = 0.25
    calls: int = 20
    background: Optional[Background] = None
    drop: float = 0.0                   # random drops on the switch (datagrams and TCP)
    rto_share: float = RTO_SHARE        # TCP messages that wait for the timer, per unit of drop
    payload: int = 1408                 # datagram payload (MTU 1500)
    pace: bool = True
    latency: float = 25e-6              # one way, per link
    memory: float = 2e9                 # bytes/s between the ranks of a node
    pieces: int = 8
    tree: Tuple[int, ...] = ()          # fat tree (levels, down..., up..., count...); () one switch
    mpi: bool = True                    # also time MPI_Allreduce
    network: str = "CM02"               # SimGrid's network model (LV08: TCP-calibrated factors)
    cores: int = 0                      # >0: all ranks share this many cores (the emulated cluster)
    core_rate: float = 0.0              # bytes/s one core sends through the stack
    copy_rate: float = 0.0              # bytes/s one core copies in the hierarchy's node stages; 0: `memory`
    jitter: float = 0.0                 # s: variance of a rank's CPU time per second of it (shared cores)
    sharing: bool = False               # the cores serve whoever has work (else a fixed share each)
    seal_rate: float = 0.0              # bytes/s a rank seals and checks (datagrams' MAC); 0: free
    datagram_cost: float = 0.0          # s of a rank's CPU per datagram it sends and its peer reads
    seed: int = 1
    redundancy: Tuple[int, ...] = ()    # (k, m) parity records per k blocks; () none
    # the node-level engine (aggregate.py)
    fanout: int = 0                     # flows per node and stage-2 phase; 0: per-rank engine
    ring_steps: int = 0                 # >0: also a ring among the leaders, in this many steps
    auto: bool = False                  # stage 2 under the learned deadline (`deadline`: its cap)
    floor: float = 1e-3                 # the learned deadline's floor...
    target: float = 0.99                # ...and its delivered target

    @property
    def size(self) -> int:
        return self.nodes * self.ppn

    def label(self) -> str:
        bg = f" bg {self.background}" if self.background else ""
        drop = f" drop {self.drop:g}" if self.drop else ""
        drop += f" fec {self.redundancy[0]},{self.redundancy[1]}" if self.redundancy else ""
        deadline = f"auto<={self.deadline:g}" if self.auto else f"{self.deadline:g}"
        return (f"{self.nodes}x{self.ppn} {self.rate / 1e6:g}Mbit {self.algorithm} "
                f"{self.nbytes >> 10}KiB T={deadline}{bg}{drop}")


@dataclass
class Outcome:
    scenario: Dict[str, Any]
    lossy: List[float] = field(default_factory=list)       # seconds, every rank and call
    delivered: List[float] = field(default_factory=list)
    mpi: List[float] = field(default_factory=list)
    events: int = 0                                         # messages simulated
    tcp_messages: int = 0                                   # MPI's messages between nodes
    timeouts: List[float] = field(default_factory=list)     # stage 2's deadline per call
    ring: List[float] = field(default_factory=list)         # MPI as a ring (ring_steps)


def fat_tree(scenario: Scenario) -> Tuple[int, List[int], List[int], List[int]]:
    if not scenario.tree:
        return 1, [scenario.nodes], [1], [1]
    levels = scenario.tree[0]
    rest = list(scenario.tree[1:])
    return levels, rest[:levels], rest[levels:2 * levels], rest[2 * levels:3 * levels]


def two_level_tree(nodes: int) -> Tuple[int, ...]:
    """Scenario.tree of the projections: leaf switches of 8 nodes, each with
    one link up to each of 8 spines (full bisection); one switch below 9
    nodes."""
    if nodes <= 8:
        return ()
    return (2, 8, nodes // 8, 1, 8, 1, 1)
