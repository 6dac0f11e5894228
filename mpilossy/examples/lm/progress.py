"""Progress output fit for a terminal and for a job log alike.

On a terminal: a tqdm bar.  Anywhere else (a Slurm output file, a pipe, a
file the output was redirected to): a plain line every few percent and at
the end, e.g.

    train step 105/300 (35%), elapsed 00:12, ETA 00:22, loss=3.214, delivered=0.899

instead of a bar redrawn with carriage returns, which in a file is one line
thousands of updates long.  tqdm draws the bar and formats the lines
(`tqdm.format_meter`); what tqdm cannot do is said here: when to print a line
(it redraws by time, with carriage returns), and whether a rank started by an
MPI launcher writes to a terminal after all (the launcher hands each rank a
pipe and copies it to its own output, which may be a terminal).

    bar = progress(300, "train", "step")        # mode "auto": bar or lines
    for step in range(300):
        ...
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update()
    bar.close()
"""

from __future__ import annotations

import math
import os
import stat
import sys
import time
from typing import IO, Any, Iterable, Iterator, Optional, TypeVar

__all__ = ["MODES", "Lines", "choose", "progress", "track", "writes_to_terminal"]

MODES = ("auto", "bar", "lines", "none")
EVERY = 0.05            # a line every 5% of the total
LINE = "{desc} {unit} {n_fmt}/{total_fmt} ({percentage:.0f}%), elapsed {elapsed}, ETA {remaining}{postfix}"

# Processes that start ranks and copy the ranks' output pipes to their own
# output (/proc/PID/comm, at most 15 characters): MPICH's and Intel MPI's
# hydra, Open MPI's mpirun and its daemons.
LAUNCHERS = frozenset({"mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy", "pmi_proxy",
                       "prterun", "prted", "orterun", "orted"})

T = TypeVar("T")


def _is_terminal(path: str) -> bool:
    return path.startswith(("/dev/pts/", "/dev/tty")) or path == "/dev/console"


def _launcher_terminal(fd: int) -> bool:
    """Whether the pipe on `fd` (stdout or stderr) leads, through MPI
    launchers only, to a launcher that writes to a terminal on the same
    descriptor (Linux: /proc; elsewhere, or where /proc cannot be read,
    False)."""
    if fd not in (1, 2):
        return False
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        pid = os.getppid()
        for _ in range(4):          # rank <- proxy <- launcher (<- a wrapper)
            if pid <= 1:
                return False
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() not in LAUNCHERS:
                    return False
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if _is_terminal(target):
                return True
            if not target.startswith("pipe:"):
                return False        # a file, /dev/null: not a terminal
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return False


def writes_to_terminal(file: IO[str]) -> bool:
    """Whether what is written to `file` ends up on a terminal: the file is
    one, or it is the pipe through which an MPI launcher (mpiexec on a
    terminal) collects this rank's output."""
    try:
        if file.isatty():
            return True
        fd = file.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return _launcher_terminal(fd)


class Lines:
    """tqdm's update/set_postfix/close, printing a plain line each time the
    count passes another `every` of the total, and at the end."""

    def __init__(self, total: int, desc: str, unit: str, file: IO[str],
                 every: float = EVERY) -> None:
        from tqdm import tqdm
        self._format_meter = tqdm.format_meter
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.n = 0
        self.postfix = ""
        self._stride = max(1, math.ceil(total * every))
        self._printed = 0               # the count at the last line
        self._began = time.monotonic()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        if self.n >= self.total or self.n // self._stride > before // self._stride:
            self._line()

    def close(self) -> None:
        if self.n != self._printed:
            self._line()

    def _line(self) -> None:
        text = self._format_meter(self.n, self.total, time.monotonic() - self._began, prefix=self.desc,
                                  unit=self.unit, postfix=self.postfix, bar_format=LINE)
        self.file.write(text + "\n")
        self.file.flush()
        self._printed = self.n


class _Silent:
    """The same methods, showing nothing."""

    def __init__(self) -> None:
        self.n = 0

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass


def choose(mode: str, file: IO[str]) -> str:
    """'bar', 'lines' or 'none' for `mode` ('auto': a bar where the output
    reaches a terminal, else lines)."""
    if mode not in MODES:
        raise ValueError(f"progress must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return "bar" if writes_to_terminal(file) else "lines"
    return mode


def progress(total: int, desc: str, unit: str, mode: str = "auto",
             file: Optional[IO[str]] = None, every: float = EVERY) -> Any:
    """A progress display of `total` units on `file` (default stderr), as
    `mode` says: 'bar' (tqdm), 'lines', 'none', or 'auto'.  What it returns
    has tqdm's `update(n)`, `set_postfix(refresh=False, **values)` and
    `close()`."""
    file = sys.stderr if file is None else file
    kind = choose(mode, file)
    if kind == "none":
        return _Silent()
    if kind == "lines":
        return Lines(total, desc, unit, file, every)
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=file, dynamic_ncols=True, disable=False)


def track(items: Iterable[T], desc: str, unit: str, mode: str = "auto",
          file: Optional[IO[str]] = None) -> Iterator[T]:
    """The items of a list, with progress shown as they are taken."""
    items = list(items)
    bar = progress(len(items), desc, unit, mode, file)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()
