"""What the emulated cluster measured, for the model to be calibrated against.

`bash scripts/calibration_runs.sh` runs every scenario of ROWS twice on the
emulated cluster (`scripts/cluster.py bench`: MPI over TCP and mpilossy's
ud channel, alternating) and keeps the raw outputs, every rank's time of
every call, in docs/results/scale/emulated/NAME-run1.json and -run2.json.
The two runs of a scenario, back to back, are the cluster against itself:
the model is held to what it measured and told how far apart its own runs
were.  All were taken on the 2-core development machine: the 1 Gbit/s rows
are bound by its CPU as much as by the ports (docs/performance.md, "Where
the time went").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import numpy as np

from .engine import Background, Scenario

__all__ = ["Run", "Measured", "load", "FIT", "FIT_COPY", "FIT_NOISE", "FIT_RTO", "MEASURED"]

MEASURED = "docs/results/scale/emulated"      # (relative to the repository's root)
MiB = 1 << 20


@dataclass(frozen=True)
class Run:
    """One run of a scenario on the emulated cluster: p50 and p99 in
    seconds over every rank and call."""
    mpi: Tuple[float, float]
    ud: Tuple[float, float]
    delivered: float
    mpi_times: Tuple[float, ...]        # s, every rank and call
    ud_times: Tuple[float, ...]


@dataclass(frozen=True)
class Measured:
    scenario: Scenario
    runs: Tuple[Run, ...]
    source: str

    @property
    def mpi(self) -> Tuple[float, float]:
        """p50 and p99 of MPI_Allreduce, the mean of the runs'."""
        return _mean(r.mpi for r in self.runs)

    @property
    def ud(self) -> Tuple[float, float]:
        return _mean(r.ud for r in self.runs)

    @property
    def delivered(self) -> float:
        return float(np.mean([r.delivered for r in self.runs]))


def _mean(pairs: Iterable[Tuple[float, float]]) -> Tuple[float, float]:
    a = np.array(list(pairs))
    return float(a[:, 0].mean()), float(a[:, 1].mean())


# name (file prefix), condition, size, and the scenario as the model takes it
_ROWS: Tuple[Tuple[str, str, int, Dict[str, Any]], ...] = (
    # 200 Mbit/s ports, 4 x 1, direct, 0.25 s: quiet and beside on/off TCP flows
    ("4x1-200m", "drop 0", MiB, dict(nodes=4, ppn=1, rate=200e6, deadline=0.25)),
    ("4x1-200m-bg50-450-1", "background 50/450:1", MiB,
     dict(nodes=4, ppn=1, rate=200e6, deadline=0.25, background="50/450:1")),
    ("4x1-200m-bg100-400-1", "background 100/400:1", MiB,
     dict(nodes=4, ppn=1, rate=200e6, deadline=0.25, background="100/400:1")),
    ("4x1-200m-bg200-200-2", "background 200/200:2", MiB,
     dict(nodes=4, ppn=1, rate=200e6, deadline=0.25, background="200/200:2")),
    # 1 Gbit/s ports, random drops on the switch
    ("4x1-1g", "drop 0", MiB, dict(nodes=4, ppn=1, rate=1e9, deadline=0.3)),
    ("4x1-1g", "drop 0.001", MiB, dict(nodes=4, ppn=1, rate=1e9, deadline=0.3, drop=0.001)),
    ("4x1-1g", "drop 0.01", MiB, dict(nodes=4, ppn=1, rate=1e9, deadline=0.3, drop=0.01)),
    ("4x1-1g", "drop 0.05", MiB, dict(nodes=4, ppn=1, rate=1e9, deadline=0.3, drop=0.05)),
    # ...with parity, redundancy=(4, 1)
    ("4x1-1g-fec", "drop 0.01", MiB,
     dict(nodes=4, ppn=1, rate=1e9, deadline=0.3, drop=0.01, redundancy=(4, 1))),
    ("4x1-1g-fec", "drop 0.05", MiB,
     dict(nodes=4, ppn=1, rate=1e9, deadline=0.3, drop=0.05, redundancy=(4, 1))),
    ("4x1-1g-16m", "drop 0", 16 * MiB, dict(nodes=4, ppn=1, rate=1e9, deadline=5.0)),
    ("2x2-1g-hier", "drop 0", MiB,
     dict(nodes=2, ppn=2, rate=1e9, deadline=0.3, algorithm="hierarchical")),
    ("2x2-1g-hier", "drop 0.01", MiB,
     dict(nodes=2, ppn=2, rate=1e9, deadline=0.3, algorithm="hierarchical", drop=0.01)),
    ("2x2-1g-hier-16m", "drop 0", 16 * MiB,
     dict(nodes=2, ppn=2, rate=1e9, deadline=5.0, algorithm="hierarchical")),
    ("2x2-1g-direct", "drop 0", MiB, dict(nodes=2, ppn=2, rate=1e9, deadline=0.3)),
    ("2x3-1g-hier", "drop 0", MiB,
     dict(nodes=2, ppn=3, rate=1e9, deadline=0.3, algorithm="hierarchical")),
    ("2x3-1g-hier", "drop 0", 16 * MiB,
     dict(nodes=2, ppn=3, rate=1e9, deadline=5.0, algorithm="hierarchical")),
    ("2x3-1g-direct", "drop 0", MiB, dict(nodes=2, ppn=3, rate=1e9, deadline=0.3)),
)

# The row the CPU rate is fitted to (ud p50), the row the hierarchy's
# copy rate in its node stages is fitted to (ud p50), the row the jitter of
# a rank's CPU time is fitted to (ud p99 / p50), and the row TCP's share of
# messages that wait for a retransmission timer is fitted to (the share of
# MPI's calls that waited); every other row checks them.
FIT = 4
FIT_COPY = 13
FIT_NOISE = 4
FIT_RTO = 7


def load(folder: Optional[str] = None) -> Tuple[Measured, ...]:
    """Every row of the calibration, from the raw outputs in `folder`
    (default MEASURED, from the repository's root)."""
    base = Path(folder or MEASURED)
    rows = []
    for name, condition, size, spec in _ROWS:
        runs = []
        files = sorted(base.glob(f"{name}-run*.json"))
        if not files:
            raise FileNotFoundError(f"no runs of {name} in {base} (bash scripts/calibration_runs.sh)")
        for path in files:
            found = [r for r in json.loads(path.read_text())["rows"]
                     if r["condition"] == condition and r["size"] == size]
            if len(found) != 1:
                raise ValueError(f"{path}: {len(found)} rows of {condition!r} at {size} bytes")
            runs.append(_run(found[0]))
        spec = dict(spec)
        background = spec.pop("background", None)
        calls = len(runs[0].mpi_times) // (spec["nodes"] * spec["ppn"])
        scenario = Scenario(nbytes=size, calls=calls, algorithm=spec.pop("algorithm", "direct"),
                            background=Background.parse(background) if background else None,
                            **spec)
        rows.append(Measured(scenario, tuple(runs),
                             ", ".join(str(p) for p in files) + f": {condition}"))
    return tuple(rows)


def _run(row: Dict[str, Any]) -> Run:
    mpi = np.array(row["mpi_times_us"]) / 1e6
    ud = np.array(row["times_us"]) / 1e6
    return Run((float(np.percentile(mpi, 50)), float(np.percentile(mpi, 99))),
               (float(np.percentile(ud, 50)), float(np.percentile(ud, 99))),
               float(row["delivered"]), tuple(mpi.tolist()), tuple(ud.tolist()))


def timer_share(measured: Measured, wait: float) -> float:
    """The share of MPI's rank-calls that took `wait` seconds more than the
    median: those that waited for a retransmission timer."""
    shares = []
    for run in measured.runs:
        times = np.array(run.mpi_times)
        shares.append(float(np.mean(times > np.median(times) + wait)))
    return float(np.mean(shares))
