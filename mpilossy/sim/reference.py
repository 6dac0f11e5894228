"""What the emulated cluster measured, for the model to be calibrated against.

Each row: the scenario as the model takes it, and the per-call figures of
`scripts/cluster.py bench` (MPI over TCP and mpilossy's ud channel, p50 and
p99 in seconds over every rank and call, delivered), with the page they
were published on.  All were taken on the 2-core development machine: the
1 Gbit/s rows are bound by its CPU as much as by the ports
(docs/performance.md, "Where the time went").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .engine import Background, Scenario

__all__ = ["Measured", "ROWS", "FIT"]


@dataclass(frozen=True)
class Measured:
    scenario: Scenario
    mpi: Tuple[float, float]            # p50, p99 (s)
    ud: Tuple[float, float]
    delivered: float
    source: str


def _row(nodes: int, ppn: int, rate: float, algorithm: str, nbytes: int, deadline: float,
         mpi: Tuple[float, float], ud: Tuple[float, float], delivered: float, source: str,
         background: Optional[str] = None, drop: float = 0.0, calls: int = 15) -> Measured:
    s = Scenario(nodes=nodes, ppn=ppn, rate=rate, algorithm=algorithm, nbytes=nbytes,
                 deadline=deadline, calls=calls, drop=drop,
                 background=Background.parse(background) if background else None)
    return Measured(s, (mpi[0] / 1e3, mpi[1] / 1e3), (ud[0] / 1e3, ud[1] / 1e3), delivered, source)


MiB = 1 << 20
_P = "docs/performance.md"
_E = "docs/emulated-cluster.md"

ROWS = (
    # 200 Mbit/s ports, 4 x 1, direct, 0.25 s: quiet and beside on/off TCP flows
    _row(4, 1, 200e6, "direct", MiB, 0.25, (73.75, 114.55), (74.5, 81.4), 1.000,
         f"{_E}, background table (quiet: mean of two runs)", calls=40),
    _row(4, 1, 200e6, "direct", MiB, 0.25, (122.6, 461.9), (96.7, 164.9), 0.928,
         f"{_E}, background table", background="50/450:1", calls=40),
    _row(4, 1, 200e6, "direct", MiB, 0.25, (138.0, 415.1), (105.6, 159.2), 0.873,
         f"{_E}, background table", background="100/400:1", calls=40),
    _row(4, 1, 200e6, "direct", MiB, 0.25, (333.5, 936.9), (200.4, 263.2), 0.557,
         f"{_E}, background table", background="200/200:2", calls=40),
    # 1 Gbit/s ports, random drops on the switch
    _row(4, 1, 1e9, "direct", MiB, 0.3, (32.5, 39.6), (40.0, 45.2), 1.000, f"{_P}, 4 x 1"),
    _row(4, 1, 1e9, "direct", 16 * MiB, 5.0, (470.9, 605.0), (547.9, 644.0), 1.000, f"{_P}, 4 x 1"),
    _row(4, 1, 1e9, "direct", MiB, 0.3, (35.7, 250.0), (48.3, 76.7), 0.982, f"{_P}, 4 x 1",
         drop=0.01),
    _row(2, 2, 1e9, "hierarchical", MiB, 0.3, (25.8, 36.3), (14.2, 18.7), 1.000,
         f"{_P}, 2 x 2 hierarchical"),
    _row(2, 2, 1e9, "hierarchical", 16 * MiB, 5.0, (442.7, 490.0), (301.9, 341.5), 1.000,
         f"{_P}, 2 x 2 hierarchical"),
    _row(2, 2, 1e9, "hierarchical", MiB, 0.3, (28.5, 231.3), (15.6, 19.5), 0.993,
         f"{_P}, 2 x 2 hierarchical", drop=0.01),
    _row(2, 2, 1e9, "direct", MiB, 0.3, (26.7, 33.7), (31.2, 46.0), 1.000,
         f"{_P}, 2 x 2 flat direct"),
    _row(2, 3, 1e9, "hierarchical", MiB, 0.3, (39.5, 59.9), (18.6, 24.6), 1.000,
         f"{_P}, 2 x 3 hierarchical"),
    _row(2, 3, 1e9, "hierarchical", 16 * MiB, 5.0, (695.0, 848.1), (443.5, 460.7), 1.000,
         f"{_P}, 2 x 3 hierarchical"),
    _row(2, 3, 1e9, "direct", MiB, 0.3, (34.2, 41.0), (55.3, 80.1), 1.000,
         f"{_P}, 2 x 3 flat direct"),
)

# The one row the CPU rate is fitted to (ud p50); every other row checks it.
FIT = 4
