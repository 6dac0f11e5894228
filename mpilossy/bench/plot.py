"""The allreduce command's figure (--plot): busbw against size, and with a
scenario the distribution of per-call times.  matplotlib is imported only
when a figure is drawn (harness.figure)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Sequence

import numpy as np

from .harness import figure, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .spec import Row
    from .tail import TailRow


def plot(path: str, rows: Sequence[Row], tail_rows: Sequence[TailRow]) -> None:
    """busbw against size (mpilossy and MPI_Allreduce), and, with a scenario,
    the distribution of per-call times (CDF) of both."""
    panels = (1 if rows else 0) + (1 if tail_rows else 0)
    fig, axes = figure(max(panels, 1), 6.5, 4.5)
    if rows:
        _plot_busbw(axes.pop(0), rows)
    if tail_rows:
        _plot_cdf(axes.pop(0), tail_rows)
    save_figure(fig, path)


def _plot_busbw(ax: Axes, rows: Sequence[Row]) -> None:
    groups = sorted({(r.algorithm, r.channel) for r in rows})
    for algorithm, channel in groups:
        sel = sorted((r for r in rows if (r.algorithm, r.channel) == (algorithm, channel)),
                     key=lambda r: r.size)
        ax.plot([r.size for r in sel], [r.busbw for r in sel], "o-",
                label=f"mpilossy {algorithm}/{channel}")
    if rows:
        ref: Dict[int, List[float]] = {}
        for r in rows:
            ref.setdefault(r.size, []).append(r.mpi_busbw)
        sizes = sorted(ref)
        ax.plot(sizes, [float(np.mean(ref[s])) for s in sizes], "k--", label="MPI_Allreduce")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("all-reduce bus bandwidth, same run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_cdf(ax: Axes, tail_rows: Sequence[TailRow]) -> None:
    for r in tail_rows:
        for label, times, style in ((f"mpilossy {r.algorithm}/{r.channel}", r.times_us, "-"),
                                    ("MPI_Allreduce", r.mpi_times_us, "--")):
            t = np.sort(np.asarray(times)) / 1e3
            ax.plot(t, np.arange(1, len(t) + 1) / len(t), style, label=f"{label} ({r.size} B)")
    ax.set_xscale("log")
    ax.set_xlabel("time inside the call (ms), every rank")
    ax.set_ylabel("fraction of calls")
    ax.set_title(tail_rows[0].scenario, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
