"""What the benchmarks share (nccl-tests' common.cu): the measuring loop,
the aggregation across ranks, bandwidth; sizes and timeouts on the command
line, output from rank 0, JSON and PNG files.

A command supplies only what differs (nccl-tests' testColl): how to set up
a size (buffers, the exact result), how to run one call of each contender,
and the bus factor that turns algbw into busbw.  Importing this module
starts no MPI: a command that never touches MPI (kernels) imports it as
well, and the functions that communicate import mpi4py when called."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar,
                    Union)

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from mpi4py import MPI

Timeout = Union[float, str, None]     # seconds, "auto" or None

BATCH = 5   # calls per timed batch; the contenders' batches alternate

N = TypeVar("N", int, float)


# -- the measuring loop (nccl-tests' TimeTest) ----------------------------------

@dataclass(frozen=True)
class Contender:
    """One side of a side-by-side measurement: a name and one call, which
    returns the call's statistics (kept, for the measured calls) or None."""
    name: str
    call: Callable[[], Any]


@dataclass
class Timed:
    """What `time_contenders` measured, per contender name."""
    iters: int
    totals: Dict[str, float]        # s: the slowest rank's measured batches, summed
    calls: Dict[str, List[float]]   # s: this rank's measured calls, one by one
    stats: Dict[str, List[Any]]     # what those calls returned (where not None)

    def seconds(self, name: str) -> float:
        """Mean time of one call (the slowest rank's batches / calls)."""
        return self.totals[name] / max(self.iters, 1)


def time_contenders(comm: MPI.Comm, contenders: Sequence[Contender], iters: int, warmup: int,
                    batch: int = BATCH,
                    after_batch: Optional[Callable[[bool], None]] = None) -> Timed:
    """nccl-tests style: back-to-back calls timed in batches of `batch`, the
    slowest rank's batch time (MPI MAX) divided by its calls.  Batches of the
    contenders alternate (each after a Barrier), so that drift in the
    machine's load hits all alike; `warmup` calls of each first, in the same
    batches, not counted.  Every measured call's own duration is kept (for
    p50/p99), and what it returned where not None.  `after_batch(measuring)`
    runs after each round of batches: the command's correctness check."""
    from mpi4py import MPI

    names = [c.name for c in contenders]
    timed = Timed(iters, dict.fromkeys(names, 0.0), {n: [] for n in names},
                  {n: [] for n in names})
    for measuring, count in ((False, warmup), (True, iters)):
        left = count
        while left > 0:
            calls = min(max(batch, 1), left)
            left -= calls
            for c in contenders:
                comm.Barrier()
                began = time.perf_counter()
                for _ in range(calls):
                    t0 = time.perf_counter()
                    stats = c.call()
                    if measuring:
                        timed.calls[c.name].append(time.perf_counter() - t0)
                        if stats is not None:
                            timed.stats[c.name].append(stats)
                elapsed = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
                if measuring:
                    timed.totals[c.name] += elapsed
            if after_batch is not None:
                after_batch(measuring)
    return timed


# -- across ranks, and bandwidth -------------------------------------------------

def every_call(comm: MPI.Comm, seconds: Sequence[float]) -> np.ndarray:
    """Every rank's per-call durations, in microseconds (the same on all ranks)."""
    return np.concatenate(comm.allgather(np.asarray(seconds))) * 1e6


def percentile(times: np.ndarray, q: float) -> float:
    """The q-th percentile (0..100) of `times`, e.g. every_call's."""
    return float(np.percentile(times, q))


def mean_over_ranks(comm: MPI.Comm, value: float) -> float:
    """The mean of one number per rank (the same on all ranks)."""
    return float(np.mean(comm.allgather(float(value))))


def max_over_ranks(comm: MPI.Comm, value: N) -> N:
    """The largest of one number per rank (the same on all ranks)."""
    from mpi4py import MPI
    return comm.allreduce(value, op=MPI.MAX)


def bandwidth(nbytes: int, seconds: float, bus_factor: float) -> Tuple[float, float]:
    """nccl-tests' getBw: (algbw, busbw) in decimal GB/s; algbw = bytes /
    time, busbw = algbw * the collective's bus factor."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor


# -- the command line -----------------------------------------------------------

SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'64K', '1M', '1MiB', '4096': bytes (binary suffixes)."""
    text = text.strip().lower().rstrip("b").rstrip("i")
    if text and text[-1] in SUFFIXES:
        return int(float(text[:-1]) * SUFFIXES[text[-1]])
    return int(text)


def parse_sizes(text: str) -> List[int]:
    """A comma-separated list of sizes, e.g. '64K,1M,16M'."""
    return [parse_size(s) for s in text.split(",")]


def size_range(lo: int, hi: int, factor: int) -> List[int]:
    """lo, lo * factor, ... up to hi (nccl-tests' -b, -e, -f)."""
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def parse_timeout(text: str) -> Timeout:
    """'0.01', 'auto', 'none' (also '' and 'inf'): seconds, "auto" or None."""
    text = str(text).strip().lower()
    if text in ("", "none", "inf"):
        return None
    return "auto" if text == "auto" else float(text)


# -- output ---------------------------------------------------------------------

def is_root(comm: Optional[MPI.Comm]) -> bool:
    """Whether this process prints and writes files: rank 0, or any process
    that runs without a communicator."""
    return comm is None or comm.rank == 0


def say(comm: Optional[MPI.Comm], *lines: str) -> None:
    """Print on rank 0 only, at once (ranks' output interleaves otherwise)."""
    if is_root(comm):
        for line in lines:
            print(line, flush=True)


def write_json(path: Optional[str], doc: Any) -> None:
    """Every number, as JSON, where a path was given (call it on rank 0)."""
    if path:
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)


def figure(panels: int, width: float, height: float) -> Tuple[Figure, List[Axes]]:
    """A figure of `panels` side by side (width and height of one, inches),
    drawn without a display; matplotlib is imported here, only when a plot
    was asked for (pip install 'mpilossy[bench]')."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig: Figure, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
