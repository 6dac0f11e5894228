"""What elastic=True costs when nobody is lost: the heartbeat after every call
(one small message to every peer, and a look at what arrived).  The same
lossy all-reduce on an elastic Communicator and on a plain one, with
MPI_Allreduce as the peer, in alternating batches on the same buffers.

    mpiexec -n 4 python -m mpilossy.bench elastic --sizes 4K,64K,1M,16M

Per size and channel: mean time per call of each side (the slowest rank's
batches), the elastic call's time against the plain one's, and both against
MPI_Allreduce; the elastic side's results that lost nothing are checked against the exact
sum (#wrong; #checked of them).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

import numpy as np
from mpi4py import MPI

import mpilossy

from .harness import Contender, parse_sizes, say, time_contenders, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="4K,64K,1M,16M", help="bytes of float32 per rank")
    p.add_argument("-c", "--channel", default="rma,ud", help="rma, ud, or both")
    p.add_argument("-a", "--algorithm", default="ring", help="of every lossy call")
    p.add_argument("-t", "--timeout", type=float, default=2.0,
                   help="deadline (s): elastic needs one; generous, nothing is lost")
    p.add_argument("--evict-after", type=int, default=20)
    p.add_argument("--heartbeat-span", type=int, default=2,
                   help="ranks on each side that each heartbeat goes to (every peer: size // 2)")
    p.add_argument("-n", "--iters", type=int, default=40)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def measure(comm: MPI.Intracomm, channel: str, nbytes: int, args: argparse.Namespace
            ) -> Dict[str, Any]:
    count = max(nbytes // 4, 1)
    send = (np.arange(count, dtype=np.float32) % 7) + comm.rank   # (exact in float32)
    exact = (np.arange(count, dtype=np.float32) % 7) * comm.size + sum(range(comm.size))
    recv = np.empty_like(send)
    mpi_recv = np.empty_like(send)
    capacity = max(4 << 20, 2 * nbytes + (1 << 20))
    common = dict(channel=channel, timeout=args.timeout, loss=None, capacity=capacity)
    wrong, lossless = 0, 0
    last: List[Any] = [None]
    with mpilossy.Communicator(comm, **common) as plain, \
            mpilossy.Communicator(comm, elastic=True, evict_after=args.evict_after,
                                  heartbeat_span=args.heartbeat_span, **common) as elastic:
        sides = [Contender("mpi", lambda: comm.Allreduce(send, mpi_recv)),
                 Contender("plain", lambda: plain.allreduce(send, recv,
                                                            algorithm=args.algorithm)),
                 Contender("elastic", lambda: last.__setitem__(0, elastic.allreduce(
                     send, recv, algorithm=args.algorithm)) or last[0])]

        def check(measuring: bool) -> None:
            """The elastic call's result, the last of each round, if nothing of
            it was lost (the datagram channel drops some at large sizes)."""
            nonlocal wrong, lossless
            if last[0] is not None and last[0].delivered == 1.0:
                lossless += 1
                wrong += int(np.count_nonzero(recv != exact))

        timed = time_contenders(comm, sides, args.iters, args.warmup, after_batch=check)
        excluded = sum(len(s.excluded) for s in timed.stats["elastic"])
    t = {name: timed.seconds(name) for name in ("mpi", "plain", "elastic")}
    return {"size": nbytes, "channel": channel, "ranks": comm.size,
            "mpi_us": t["mpi"] * 1e6, "plain_us": t["plain"] * 1e6,
            "elastic_us": t["elastic"] * 1e6, "elastic_over_plain": t["elastic"] / t["plain"],
            "mpi_over_plain": t["mpi"] / t["plain"], "mpi_over_elastic": t["mpi"] / t["elastic"],
            "wrong": comm.allreduce(wrong, op=MPI.MAX),
            "checked": comm.allreduce(lossless, op=MPI.MIN),
            "excluded": comm.allreduce(excluded, op=MPI.MAX)}


def run(args: argparse.Namespace) -> int:
    comm = MPI.COMM_WORLD
    rows: List[Dict[str, Any]] = []
    for channel in args.channel.split(","):
        for nbytes in parse_sizes(args.sizes):
            rows.append(measure(comm, channel, nbytes, args))
    say(comm, f"# elastic=True against a plain Communicator, {comm.size} ranks, "
              f"{args.algorithm}, deadline {args.timeout} s, evict_after {args.evict_after}, "
              f"heartbeat_span {args.heartbeat_span}, "
              f"{args.iters} calls each in alternating batches",
        f"# {'size':>10} {'channel':>7} {'plain us':>10} {'elastic us':>11} "
        f"{'elastic/plain':>13} {'MPI/plain':>10} {'MPI/elastic':>11} {'#wrong':>6} "
        f"{'#checked':>8}")
    for r in rows:
        say(comm, f"  {r['size']:>10} {r['channel']:>7} {r['plain_us']:>10.1f} "
                  f"{r['elastic_us']:>11.1f} {r['elastic_over_plain']:>13.3f} "
                  f"{r['mpi_over_plain']:>10.3f} {r['mpi_over_elastic']:>11.3f} "
                  f"{r['wrong']:>6} {r['checked']:>8}")
    if comm.rank == 0:
        write_json(args.json, {"rows": rows})
    bad = any(r["wrong"] or r["excluded"] for r in rows)
    return 1 if bad else 0
