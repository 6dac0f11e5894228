"""``mpiexec -n 4 python -m mpilossy.bench device [options]``: all-reduce of
GPU buffers against its peers, in one run.  For every size:

- mpilossy on CuPy arrays (staged through pinned host memory, docs/gpu.md);
- the staging alone: device -> pinned host -> device, the copies such a
  call makes;
- the same call on host arrays: what the staging wraps (transport and
  reduction, both on the CPU);
- mpi4py with host staging: ``cupy.asnumpy``, ``MPI_Allreduce``, upload;
- ``torch.distributed`` with the Gloo backend on CUDA tensors (without
  torch, or with --no-gloo, left out).

``--device cpu`` runs the same table on host buffers (no staging; MPI and
Gloo on host memory): how the benchmark itself is checked on machines
without a GPU.  Ratios are peer time / mpilossy time (> 1: mpilossy faster).

    mpiexec -n 4 python -m mpilossy.bench device --sizes 1M,16M,256M --loss none,bernoulli:0.1
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.device import Staging, describe

from .spec import small_ints
from .harness import (BATCH, Contender, max_over_ranks, mean_over_ranks, parse_size, parse_sizes,
                      parse_timeout, say, time_contenders, write_json)


@dataclass
class DeviceRow:
    device: str
    size: int                 # bytes
    loss: str
    algorithm: str
    time_us: float            # mpilossy, buffers on `device`
    staging_us: float         # the staging copies alone (0 on the CPU)
    host_us: float            # mpilossy on host buffers of the same size
    mpi_us: float             # mpi4py, host-staged where the buffers are on a GPU
    gloo_us: float            # torch.distributed Gloo (nan: not measured)
    whole_us: float           # mpilossy staged in one piece (pipeline_bytes=0; the CPU: time_us)
    delivered: float          # mean over calls and ranks
    wrong: int                # elements off the exact sum, any rank (lossless rows)


class Buffers:
    """Arrays, copies and synchronisation on the device under test."""

    def __init__(self, device: str, comm: MPI.Comm) -> None:
        self.device = device
        self.name = "host"
        if device == "cpu":
            self.xp: Any = np
            return
        try:
            import cupy
        except ImportError:
            raise SystemExit("--device cuda needs CuPy (pip install 'mpilossy[cuda12]' "
                             "or '[cuda13]'); --device cpu runs without") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise SystemExit(f"--device cuda: no CUDA device ({exc})") from None
        # Ranks of a node take its GPUs round-robin (all share one where one is all).
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        index = local.rank % count
        local.Free()
        cupy.cuda.Device(index).use()
        self.xp = cupy
        self.index = index
        self.name = cupy.cuda.runtime.getDeviceProperties(index)["name"].decode()

    def upload(self, host: np.ndarray) -> Any:
        return self.xp.asarray(host)

    def download(self, array: Any) -> np.ndarray:
        return array if self.xp is np else self.xp.asnumpy(array)

    def sync(self) -> None:
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()


def gloo_allreduce(bufs: Buffers, send: Any) -> Optional[Callable[[], None]]:
    """One Gloo all-reduce of a copy of `send` (a CUDA tensor where `send`
    is on a GPU), or None without torch.distributed."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_initialized():
        return None
    source = torch.from_dlpack(send)
    work = torch.empty_like(source)
    cuda = source.is_cuda

    def call() -> None:
        work.copy_(source)
        dist.all_reduce(work)
        if cuda:
            torch.cuda.synchronize()
    return call


def staging_copies(send: Any, recv: Any) -> Callable[[], None]:
    """The copies of one staged call, alone: `send` to pinned host memory
    and back into `recv`, on send's stream, waited for."""
    staging = Staging()
    dsend, drecv = describe(send, "sendbuf"), describe(recv, "recvbuf")
    pinned = staging.host(0, dsend)
    back = staging.backend
    stream = back.stream_of(dsend)

    def copies() -> None:
        back.to_host(pinned, dsend, stream)
        back.to_device(drecv, pinned, stream)
        back.synchronize(stream)
    return copies


def measure(comm: MPI.Comm, bufs: Buffers, lc: mpilossy.Communicator,
            whole: mpilossy.Communicator, loss: str, algorithm: str, size: int,
            args: argparse.Namespace) -> DeviceRow:
    """One row; `whole`: a communicator like `lc` that stages in one piece."""
    count = size // 4
    host_send = small_ints(count, comm.rank, np.dtype(np.float32))
    exact = np.empty_like(host_send)
    comm.Allreduce(host_send, exact)
    send, recv = bufs.upload(host_send), bufs.upload(np.zeros_like(host_send))
    host_recv = np.empty_like(host_send)
    delivered: List[float] = []

    def lossy() -> None:            # (every call counts, warm-up and the check included)
        stats = lc.allreduce(send, recv, algorithm=algorithm)
        delivered.append(stats.delivered)

    def on_host() -> None:
        lc.allreduce(host_send, host_recv, algorithm=algorithm)

    contenders = [Contender("lossy", lossy)]
    if bufs.xp is np:               # (host buffers: the host call is the call itself)
        contenders.append(Contender("mpi", lambda: comm.Allreduce(host_send, host_recv)))
    else:
        copies = staging_copies(send, recv)

        def mpi_staged() -> None:
            staged = bufs.xp.asnumpy(send)
            comm.Allreduce(MPI.IN_PLACE, staged)
            recv.set(staged)
            bufs.sync()

        contenders += [Contender("whole", lambda: whole.allreduce(send, recv,
                                                                  algorithm=algorithm)),
                       Contender("staging", copies), Contender("host", on_host),
                       Contender("mpi", mpi_staged)]
    gloo = None if args.no_gloo else gloo_allreduce(bufs, send)
    if gloo is not None:
        contenders.append(Contender("gloo", gloo))
    timed = time_contenders(comm, contenders, args.iters, args.warmup)
    times = {c.name: timed.seconds(c.name) * 1e6 for c in contenders}
    wrong = -1
    if loss == "none":
        lossy()
        wrong = max_over_ranks(comm, int(np.count_nonzero(bufs.download(recv) != exact)))
    mean_delivered = mean_over_ranks(comm, float(np.mean(delivered)))
    return DeviceRow(bufs.device, size, loss, algorithm, times["lossy"],
                     times.get("staging", 0.0), times.get("host", times["lossy"]), times["mpi"],
                     times.get("gloo", math.nan), times.get("whole", times["lossy"]),
                     mean_delivered, wrong)


HEADER = ("#       size  loss          algo   mpilossy     whole   staging  host-call    mpi4py"
          "      gloo  whole/lossy  mpi/lossy  gloo/lossy  delivered  #wrong")
UNITS = ("#        (B)                         (us)      (us)      (us)       (us)      (us)"
         "      (us)")


def format_table(rows: Sequence[DeviceRow], comm: MPI.Comm, bufs: Buffers,
                 args: argparse.Namespace, segment: int) -> str:
    vendor = " ".join(MPI.Get_library_version().split()[:3])
    lines = [
        f"# mpilossy.bench device: {comm.size} ranks, {args.device} ({bufs.name}), {vendor}, "
        f"mpilossy {mpilossy.__version__}",
        f"# float32 sum, channel {args.channel}, timeout {args.timeout}, iters {args.iters}, "
        f"warmup {args.warmup}; time = batches of {BATCH} calls, slowest rank",
        f"# mpilossy = staged in segments of {segment} B where four fit; "
        "whole = staged in one piece;",
        "# staging = the device -> pinned host -> device copies of one call, alone; host-call = "
        "mpilossy on host buffers;",
        "# mpi4py = MPI_Allreduce" + (" with host staging (asnumpy, upload)"
                                      if args.device == "cuda" else "")
        + "; gloo = torch.distributed Gloo; #wrong: lossless rows only (-1 under loss)",
        "#", HEADER, UNITS]
    for r in rows:
        lines.append(
            f"{r.size:12d}  {r.loss:<13s} {r.algorithm:>5s} {r.time_us:10.1f} {r.whole_us:9.1f} "
            f"{r.staging_us:9.1f} {r.host_us:10.1f} {r.mpi_us:9.1f} {r.gloo_us:9.1f} "
            f"{r.whole_us / r.time_us:12.2f} {r.mpi_us / r.time_us:10.2f} "
            f"{r.gloo_us / r.time_us:11.2f} {r.delivered:10.4f} {r.wrong:7d}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    bufs = Buffers(args.device, comm)
    sizes = parse_sizes(args.sizes)
    losses = [s.strip() for s in args.loss.split(",")]
    algorithms = [a.strip() for a in args.algorithm.split(",")]
    gloo_group = False
    if not args.no_gloo:
        try:
            from mpilossy.torch import init_process_group
            init_process_group("gloo")
            gloo_group = True
        except ImportError:
            say(comm, "# torch is not installed: no Gloo column")
    rows: List[DeviceRow] = []
    segment = 0
    try:
        for loss in losses:
            settings = dict(channel=args.channel, timeout=args.timeout,
                            loss=None if loss == "none" else loss,
                            capacity=max(4 << 20, 2 * max(sizes) + (1 << 20)))
            with mpilossy.Communicator(comm, pipeline_bytes=args.pipeline_bytes,
                                       **settings) as lc, \
                    mpilossy.Communicator(comm, pipeline_bytes=0, **settings) as whole:
                segment = lc.config.pipeline_bytes
                for size in sizes:
                    for algorithm in algorithms:
                        rows.append(measure(comm, bufs, lc, whole, loss, algorithm, size, args))
    finally:
        if gloo_group:
            from mpilossy.torch import destroy_process_group
            destroy_process_group()
    say(comm, format_table(rows, comm, bufs, args, segment))
    if comm.rank == 0:
        write_json(args.json, {"ranks": comm.size, "device": args.device, "name": bufs.name,
                               "mpi": " ".join(MPI.Get_library_version().split()[:3]),
                               "mpilossy": mpilossy.__version__,
                               "rows": [asdict(r) for r in rows]})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the buffers live (cpu: host buffers, to check the benchmark)")
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="comma-separated, e.g. 1M,16M")
    p.add_argument("--loss", default="none,bernoulli:0.1",
                   help="comma-separated loss models (MPILOSSY_LOSS syntax), 'none' for lossless")
    p.add_argument("-a", "--algorithm", default="ring", help="ring, tree, direct, or a list")
    p.add_argument("-c", "--channel", default="rma", choices=["rma", "ud"])
    p.add_argument("-t", "--timeout", type=parse_timeout, default=parse_timeout("2"),
                   help="seconds, 'auto' or 'none' (default 2: a deadline for the lossy rows "
                        "that 256 MiB meets on one node)")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("--pipeline-bytes", type=parse_size, default=None,
                   help="segments of a pipelined call (default: the communicator's, 8M)")
    p.add_argument("--no-gloo", action="store_true", help="leave torch.distributed out")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")

