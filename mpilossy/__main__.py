"""``python -m mpilossy info``: what to paste into a bug report.

Run it as the job runs (``mpiexec -n 2 python -m mpilossy info``): rank 0
prints the version, Python, mpi4py and the MPI library (and the file it was
loaded from), the channels built and usable here (libfabric's datagram
providers for ``channel="ud"``), every ``MPILOSSY_*`` setting in force and
where it came from, and one line per rank with its host, CPU and GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
from typing import Dict, List, Optional

from mpi4py import MPI

import mpilossy
from mpilossy import _core
from mpilossy._loader import loaded_mpi_libraries
from mpilossy.call import config
from mpilossy.hierarchy import NodeLayout


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> str:
    """CUDA devices as CuPy or PyTorch see them, without initialising either
    if it is not installed, nor importing either (seconds per rank) on a
    machine without a GPU driver's device files."""
    # (NVIDIA's driver, ROCm's, and WSL2's GPU paravirtualisation)
    if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return "none found (no /dev/nvidiactl, /dev/kfd or /dev/dxg)"
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return f"{n} CUDA device(s) (CuPy {cupy.__version__})"
    except Exception:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} CUDA device(s) (torch {torch.__version__})"
    except Exception:
        pass
    return "none found"


def _rank_line() -> str:
    return (f"{socket.gethostname()} pid {os.getpid()}, {os.cpu_count()} CPUs ({_cpu_model()}), "
            f"GPU: {_gpus()}")


def _datagram_channel() -> str:
    if not _core.HAVE_DATAGRAM_AUTH:
        return "not built (no OpenSSL libcrypto >= 3.0 at build time: install libssl-dev)"
    native = "native (mpilossy's UDP sockets)"
    if not _core.HAVE_LIBFABRIC:
        return f"built; providers: {native}; libfabric: not built (install libfabric-dev)"
    try:
        providers = _core.datagram_providers()
    except mpilossy.MPILossyError as exc:
        return f"built; providers: {native}; libfabric unusable here: {exc}"
    return f"built; providers: {native}, " + ", ".join(sorted(set(providers)))


def _erasure_codes() -> str:
    if _core.HAVE_ISAL:
        return "m = 1 (XOR) and m >= 2 (Intel ISA-L)"
    return "m = 1 (XOR) only; m >= 2 needs Intel ISA-L (install libisal-dev and rebuild)"


def report(comm: MPI.Comm) -> Optional[List[str]]:
    """The report's lines on rank 0 (None elsewhere).  Collective."""
    layout, node = NodeLayout.detect(comm)
    node.Free()
    ranks = comm.gather(_rank_line(), root=0)
    if ranks is None:           # not rank 0
        return None
    libraries = loaded_mpi_libraries()
    env = config.from_environment()
    lines = [
        f"mpilossy {mpilossy.__version__} ({os.path.dirname(mpilossy.__file__)})",
        f"compiled core: {_core.__file__}",
        f"Python {platform.python_version()} ({sys.executable}), {platform.platform()}",
        f"mpi4py {__import__('mpi4py').__version__}",
        "MPI: " + " ".join(MPI.Get_library_version().replace("\0", "").split("\n", 1)[0].split()),
        f"MPI library file: {', '.join(libraries) or 'unknown'}",
        f"MPI standard {'.'.join(map(str, MPI.Get_version()))}, {comm.Get_size()} rank(s)",
        "channel rma: built (MPI one-sided windows)",
        f"channel ud: {_datagram_channel()}",
        f"erasure codes: {_erasure_codes()}",
        "settings (variable = value [source]):",
    ]
    width = max(len(name) for name, _, _ in env.rows())
    lines += [f"  {name:<{width}} = {value!r} [{source}]" for name, value, source in env.rows()]
    provider = os.environ.get("FI_PROVIDER")
    lines.append(f"  {'FI_PROVIDER':<{width}} = {provider!r} "
                 f"[{'environment' if provider else 'default'}]")
    lines.append(f"nodes: {layout.describe()} (algorithm='auto' "
                 f"{'runs the hierarchy' if layout.hierarchical else 'runs flat'}; docs/hierarchy.md)")
    lines.append("ranks:")
    lines += [f"  {r}: {line}" for r, line in enumerate(ranks)]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpilossy", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, MPI, channels, settings, ranks (for bug reports)")
    parser.parse_args(argv)
    lines = report(MPI.COMM_WORLD)
    if lines is not None:
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
