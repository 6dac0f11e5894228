"""What the benchmarks share: sizes on the command line, output from rank 0,
JSON and PNG files.  Nothing here measures anything, and nothing here
starts MPI: a command that never touches MPI (kernels) imports it as well."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from mpi4py import MPI

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
