"""Group averaging (mpilossy.GroupAverager, Moshpit SGD) against a full lossy
all-reduce, in one run on the same ranks and buffers.

    mpiexec -n 8 python -m mpilossy.bench group --group-size 2 --loss 0,0.1
    mpiexec -n 16 python -m mpilossy.bench group --group-size 4 --sizes 1M

Per (size, loss): the time of one averaging round (its group only) and of
one full all-reduce average (p50 over calls, every rank), their ratio; and,
after `rounds_to_mix` rounds in a row, the distance of each rank's result to
the exact global average (root mean square over elements, relative to the
spread of the ranks' data; largest rank), against the same distance after
one full lossy all-reduce.  Injected Bernoulli loss; a generous deadline, so
that oversubscribed ranks are not counted as lost.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import numpy as np
from mpi4py import MPI

import mpilossy

from .harness import parse_sizes, say, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-size", type=int, default=2, help="largest group (grid side)")
    p.add_argument("--sizes", default="64K,1M", help="bytes of float32 per rank")
    p.add_argument("--loss", default="0,0.1", help="Bernoulli loss probabilities")
    p.add_argument("-n", "--iters", type=int, default=20, help="mixes (of rounds_to_mix rounds)")
    p.add_argument("-t", "--timeout", type=float, default=0.2, help="deadline of each call (s)")
    p.add_argument("-a", "--algorithm", default="direct", help="of every lossy call")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def _distance(comm: MPI.Intracomm, x: np.ndarray, exact: np.ndarray, spread: float) -> float:
    """Largest rank's RMS distance to the exact average, relative to `spread`."""
    mine = float(np.sqrt(np.mean((x - exact) ** 2))) / spread
    return float(comm.allreduce(mine, op=MPI.MAX))


def _measure(comm: MPI.Intracomm, args: argparse.Namespace, nbytes: int,
             loss: float) -> Dict[str, Any]:
    n = nbytes // 4
    e = np.arange(n, dtype=np.float64)
    data = (comm.rank + np.sin(e + comm.rank)).astype(np.float32)
    exact = np.mean([r + np.sin(e + r) for r in range(comm.size)], axis=0)
    spread = float(np.std([r + np.sin(e + r) for r in range(comm.size)])) or 1.0
    spec = f"bernoulli:{loss},seed=7" if loss > 0 else None
    kwargs = dict(timeout=args.timeout, loss=spec, algorithm=args.algorithm)
    rounds: List[float] = []
    fulls: List[float] = []
    mixed: List[float] = []
    single: List[float] = []
    with mpilossy.GroupAverager(comm, group_size=args.group_size, **kwargs) as ga, \
            mpilossy.Communicator(comm, **kwargs) as lc:
        d = max(ga.rounds_to_mix, 1)
        for it in range(args.iters + 1):
            x = data.copy()
            for _ in range(d):
                comm.Barrier()
                began = time.perf_counter()
                ga.average(x)
                if it:
                    rounds.append(time.perf_counter() - began)
            y = data.copy()
            comm.Barrier()
            began = time.perf_counter()
            lc.allreduce(y, op="avg")
            if it:                               # (the first mix warms up)
                fulls.append(time.perf_counter() - began)
                mixed.append(_distance(comm, x, exact, spread))
                single.append(_distance(comm, y, exact, spread))
        shape = ga.shape
    every_round = np.concatenate(comm.allgather(np.asarray(rounds)))
    every_full = np.concatenate(comm.allgather(np.asarray(fulls)))
    return {
        "ranks": comm.size, "grid": list(shape), "rounds_to_mix": d, "bytes": nbytes,
        "loss": loss, "round_p50_us": float(np.percentile(every_round, 50)) * 1e6,
        "allreduce_p50_us": float(np.percentile(every_full, 50)) * 1e6,
        "round_over_allreduce": float(np.percentile(every_round, 50) / np.percentile(every_full, 50)),
        "mixed_distance": float(np.mean(mixed)), "allreduce_distance": float(np.mean(single)),
    }


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    rows = [_measure(comm, args, size, float(loss))
            for size in parse_sizes(args.sizes) for loss in args.loss.split(",")]
    head = (f"# group averaging, {comm.size} ranks, grid {'x'.join(map(str, rows[0]['grid'])) or '-'}"
            f", {args.algorithm}, deadline {args.timeout} s\n"
            f"#    bytes  loss  round-p50(us)  allreduce-p50(us)  round/allreduce"
            f"  dist-after-{rows[0]['rounds_to_mix']}-rounds  dist-after-allreduce")
    lines = [f"{r['bytes']:10d} {r['loss']:5.2f} {r['round_p50_us']:14.1f} "
             f"{r['allreduce_p50_us']:18.1f} {r['round_over_allreduce']:16.2f} "
             f"{r['mixed_distance']:22.2e} {r['allreduce_distance']:20.2e}" for r in rows]
    say(comm, head, *lines)
    if comm.rank == 0:
        write_json(args.json, {"rows": rows})
    return 0
