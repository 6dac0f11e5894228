"""MPILOSSY_TRACE=DIR: one line per call and rank, for tuning deadlines."""

from __future__ import annotations

import os
from typing import Any, Optional, TextIO

from .stats import ALGORITHM_NAMES, COLLECTIVE_NAMES

__all__ = ["Trace"]

COLUMNS = ("seq", "algorithm", "bytes", "timeout", "start", "anchor_ms", "elapsed_ms",
           "delivered", "lost_injected", "lost_late", "lost_gone", "lost_torn", "error")


class Trace:
    """A tab-separated file per communicator and rank: trace-SERIAL-rankR.tsv,
    and for the levels of a hierarchical one trace-SERIAL-rankR-node.tsv (the
    stages within the node) and trace-SERIAL-rankR-nodes.tsv (across nodes),
    R the rank in the communicator the user made."""

    def __init__(self, directory: str, serial: int, rank: int, level: str = "") -> None:
        os.makedirs(directory, exist_ok=True)
        name = f"trace-{serial}-rank{rank}" + (f"-{level}" if level else "")
        path = os.path.join(directory, name + ".tsv")
        self._file: Optional[TextIO] = open(path, "w", buffering=1)
        self._file.write("\t".join(COLUMNS) + "\n")

    @classmethod
    def open(cls, directory: Optional[str], serial: int, rank: int,
             level: str = "") -> Optional["Trace"]:
        """The trace, or None where no directory is set."""
        return cls(directory, serial, rank, level) if directory else None

    def write(self, result: Any, spec: Any) -> None:
        """One call: its CallResult and CallSpec."""
        if self._file is None:
            return
        start, anchor = result.timing[:2]
        self._file.write("\t".join(map(str, (
            result.seq,
            f"{COLLECTIVE_NAMES[spec.collective]}/{ALGORITHM_NAMES[spec.algorithm]}",
            spec.nbytes, spec.timeout, f"{start:.6f}",
            f"{(anchor - start) * 1e3:.3f}" if anchor >= 0 else "-", f"{result.elapsed * 1e3:.3f}",
            f"{result.delivered:.4f}", *result.lost_blocks, result.err_kind))) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
