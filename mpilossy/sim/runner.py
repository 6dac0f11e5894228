"""Run scenarios, each in a fresh process (SimGrid keeps one engine per
process), and summarise them."""

from __future__ import annotations

import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
import os
from dataclasses import asdict
from typing import Any, Callable, Dict, Iterator, List, Sequence

import numpy as np

from .engine import Scenario, simulate

__all__ = ["one", "run_all", "run_each"]


def one(scenario: Scenario) -> Dict[str, Any]:
    """One scenario, on the node-level engine where it asks for it (fanout)."""
    if scenario.fanout:
        from .aggregate import simulate_nodes
        out = simulate_nodes(scenario)
    else:
        out = simulate(scenario)
    row: Dict[str, Any] = {"scenario": asdict(scenario), "label": scenario.label(),
                           "messages": out.events, "messages_tcp": out.tcp_messages}
    row.update(_summary(out, 0))
    if out.timeouts:
        row["timeouts"] = out.timeouts
    if scenario.auto:
        # the calls under a learned deadline: from the first agreement's on
        from ..control.agreement import LAG, PERIOD
        row["learned"] = _summary(out, (PERIOD + LAG) * scenario.nodes)
    return row


def _summary(out: Any, skip: int) -> Dict[str, Any]:
    """p50, p99 and mean of each kind of call, and the mean delivered, over
    the records after the first `skip` (records are call-major)."""
    row: Dict[str, Any] = {}
    for name in ("lossy", "mpi", "ring"):
        values = np.array(getattr(out, name)[skip:])
        if values.size:
            row[name] = {"p50": float(np.percentile(values, 50)),
                         "p99": float(np.percentile(values, 99)),
                         "mean": float(values.mean()), "calls": int(values.size)}
    row["delivered"] = float(np.mean(out.delivered[skip:])) if out.delivered[skip:] else None
    return row


# What a launcher tells its processes: a child that kept it would take
# itself for one of the job's ranks (importing mpilossy initialises MPI).
_LAUNCHER = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "SLURM_")


@contextlib.contextmanager
def _as_singletons() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(_LAUNCHER)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def run_all(scenarios: Sequence[Scenario], jobs: int) -> List[Dict[str, Any]]:
    """Each scenario in a fresh process (SimGrid: one engine per process),
    started outside any MPI job this one runs in."""
    return run_each(one, [(s,) for s in scenarios], jobs)


def run_each(fn: Callable[..., Any], calls: Sequence[tuple], jobs: int) -> List[Any]:
    """fn(*args) for each args in `calls`, each in a fresh process as above
    (fn: a module-level function of this package).  An exception in a
    simulated actor aborts its process (SimGrid prints the traceback):
    that raises BrokenProcessPool here rather than waiting for ever, as a
    multiprocessing.Pool would."""
    ctx = multiprocessing.get_context("spawn")
    with _as_singletons(), ProcessPoolExecutor(max(1, jobs), mp_context=ctx,
                                               max_tasks_per_child=1) as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        return [f.result() for f in futures]
