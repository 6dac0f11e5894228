"""The stages within a node on device memory (CUDA IPC,
mpilossy/hierarchy/device_node.py) against today's path for GPU buffers,
which stages them through pinned host memory, in one run:

    mpiexec -n 4 python -m mpilossy.bench device-node --sizes 1M,16M,64M,256M
    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 4 python -m mpilossy.bench device-node

Per size, over the ranks of this rank's node (MPI's COMM_TYPE_SHARED split;
fake nodes split it further), a float32 all-reduce of CuPy arrays:

- ipc: reduce-scatter and all-gather between the node's ranks in device
  memory (DeviceNodeStages.allreduce);
- staged: mpilossy's all-reduce on the node communicator (lossless, the
  direct algorithm: the hierarchy's node stages on the host, with the
  copies to and from pinned host memory around them);
- staging: those copies alone (device -> pinned host -> device).

Every node measures at once; the slowest rank's batches count.  Both
results are checked against MPI_Allreduce of the host data.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.hierarchy.device_node import DeviceNodeStages

from .device import staging_copies
from .harness import Contender, parse_sizes, say, time_contenders, write_json
from .spec import small_ints


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="bytes of float32 per rank")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def _measure(comm: MPI.Comm, node: MPI.Comm, cupy: Any, stages: DeviceNodeStages,
             lc: mpilossy.Communicator, args: argparse.Namespace, nbytes: int) -> Dict[str, Any]:
    n = nbytes // 4
    host = small_ints(n, node.rank, np.dtype(np.float32))
    exact = np.empty_like(host)
    node.Allreduce(host, exact)
    x = cupy.asarray(host)
    by_ipc, by_host = cupy.empty_like(x), cupy.empty_like(x)
    copies = staging_copies(x, by_host)
    contenders = [Contender("ipc", lambda: stages.allreduce(x, by_ipc)),
                  Contender("staged", lambda: lc.allreduce(x, by_host, algorithm="direct")),
                  Contender("staging", copies)]
    timed = time_contenders(comm, contenders, args.iters, args.warmup)
    stages.allreduce(x, by_ipc)
    lc.allreduce(x, by_host, algorithm="direct")
    exact_ipc = bool(np.array_equal(cupy.asnumpy(by_ipc), exact))
    exact_host = bool(np.array_equal(cupy.asnumpy(by_host), exact))
    us = {name: timed.seconds(name) * 1e6 for name in timed.totals}
    return {"node_ranks": node.size, "bytes": nbytes,
            "exact_ipc": comm.allreduce(exact_ipc, op=MPI.LAND),
            "exact_staged": comm.allreduce(exact_host, op=MPI.LAND),
            **{f"{name}_us": value for name, value in us.items()},
            "staged_over_ipc": us["staged"] / us["ipc"],
            "staging_over_ipc": us["staging"] / us["ipc"]}


def run(args: argparse.Namespace) -> int:
    try:
        import cupy
    except ImportError:
        raise SystemExit("device-node needs CuPy and a GPU") from None
    comm = MPI.COMM_WORLD
    sizes = parse_sizes(args.sizes)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    count = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(node.rank % count).use()
    rows: List[Dict[str, Any]] = []
    try:
        with DeviceNodeStages(node, max(sizes)) as stages, \
                mpilossy.Communicator(node, timeout=None, loss=None,
                                      capacity=max(4 << 20, 2 * max(sizes) + (1 << 20))) as lc:
            rows = [_measure(comm, node, cupy, stages, lc, args, size) for size in sizes]
        layout = sorted(set(comm.allgather(node.size)))
    finally:
        node.Free()
    head = (f"# within a node on a GPU: all-reduce of CuPy float32, {comm.size} ranks, nodes of "
            f"{'/'.join(map(str, layout))}; mean per call, slowest rank\n"
            "#     bytes    ipc(us)  staged(us)  staging(us)  staged/ipc  staging/ipc  exact")
    lines = [f"{r['bytes']:11d} {r['ipc_us']:10.1f} {r['staged_us']:11.1f} {r['staging_us']:12.1f}"
             f" {r['staged_over_ipc']:11.2f} {r['staging_over_ipc']:12.2f}  "
             f"{r['exact_ipc'] and r['exact_staged']}" for r in rows]
    say(comm, head, *lines)
    if comm.rank == 0:
        write_json(args.json, {"ranks": comm.size, "rows": rows})
    return 0 if all(r["exact_ipc"] and r["exact_staged"] for r in rows) else 1
