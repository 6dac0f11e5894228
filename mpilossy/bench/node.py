"""The stages within a node of the hierarchical all-reduce against MPI's
own, on the same node communicator, buffers and ranks, in one run.

    mpiexec -n 2 python -m mpilossy.bench node --sizes 1M,16M
    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 4 python -m mpilossy.bench node

Per size: a reduce-scatter then an all-gather over the ranks of this rank's
node (MPI's COMM_TYPE_SHARED split): mpilossy's on the one-sided channel's
shared-memory windows, as the hierarchy runs them (channel="rma", no
injected loss, a deadline: the direct algorithm), against MPI's
Reduce_scatter + Allgatherv and MPI's Allreduce on the same communicator.
Every node measures at once; the slowest rank's batches count (nccl-tests
style); each column is the mean time of one pair of calls (one Allreduce).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.buffers import chunk_bounds

from .harness import Contender, parse_sizes, say, time_contenders, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1M,16M", help="bytes of float32 per rank")
    p.add_argument("-n", "--iters", type=int, default=30)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("-t", "--timeout", type=float, default=1.0,
                   help="deadline of mpilossy's calls (s): long enough to lose nothing")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def _measure(comm: MPI.Intracomm, node: MPI.Comm, lc: mpilossy.Communicator,
             args: argparse.Namespace, nbytes: int) -> Dict[str, Any]:
    n = nbytes // 4
    size, rank = node.Get_size(), node.Get_rank()
    counts = [hi - lo for lo, hi in (chunk_bounds(n, size, r) for r in range(size))]
    x = ((np.arange(n) * 7 + rank) % 101).astype(np.float32)
    mine = np.empty(counts[rank], np.float32)
    ours, theirs, whole = (np.empty(n, np.float32) for _ in range(3))

    def lossy() -> None:
        lc.reduce_scatter(x, mine)
        lc.allgather(mine, ours)

    def mpi() -> None:
        node.Reduce_scatter(x, mine, counts)
        node.Allgatherv(mine, [theirs, counts])

    def mpi_allreduce() -> None:
        node.Allreduce(x, whole)

    timed = time_contenders(comm, [Contender("mpilossy", lossy), Contender("mpi", mpi),
                                   Contender("mpi_allreduce", mpi_allreduce)],
                            args.iters, args.warmup)
    exact = bool(np.array_equal(ours, theirs) and np.array_equal(ours, whole))
    return {"node_ranks": size, "bytes": nbytes, "exact": comm.allreduce(exact, op=MPI.LAND),
            **{f"{name}_us": timed.seconds(name) * 1e6 for name in timed.totals},
            "mpilossy_over_mpi": timed.seconds("mpilossy") / timed.seconds("mpi")}


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        with mpilossy.Communicator(node, channel="rma", timeout=args.timeout) as lc:
            rows = [_measure(comm, node, lc, args, size) for size in parse_sizes(args.sizes)]
        sizes = sorted(set(comm.allgather(node.Get_size())))
    finally:
        node.Free()
    head = (f"# within a node: reduce-scatter + all-gather, {comm.size} ranks, nodes of "
            f"{'/'.join(map(str, sizes))}; mean per pair of calls, slowest rank\n"
            f"#    bytes  mpilossy(us)    MPI(us)  MPI-allreduce(us)  mpilossy/MPI  exact")
    lines = [f"{r['bytes']:10d} {r['mpilossy_us']:13.1f} {r['mpi_us']:10.1f} "
             f"{r['mpi_allreduce_us']:18.1f} {r['mpilossy_over_mpi']:13.2f}  {r['exact']}"
             for r in rows]
    say(comm, head, *lines)
    if comm.rank == 0:
        write_json(args.json, {"rows": rows})
    return 0 if all(r["exact"] for r in rows) else 1
