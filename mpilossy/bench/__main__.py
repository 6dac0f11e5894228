"""``mpiexec -n 4 python -m mpilossy.bench [options]``: lossy all-reduce against
MPI_Allreduce, side by side, nccl-tests style table on rank 0."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from mpi4py import MPI

from .harness import (BenchConfig, format_table, format_tail, plot, run_allreduce_bench,
                      run_tail_bench, write_json)

SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().lower().rstrip("b").rstrip("i")
    if text and text[-1] in SUFFIXES:
        return int(float(text[:-1]) * SUFFIXES[text[-1]])
    return int(text)


def size_range(lo: int, hi: int, factor: int) -> list:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpilossy.bench", description=__doc__)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--sizes", help="comma-separated sizes (overrides -b/-e/-f), e.g. 64K,1M,16M")
    p.add_argument("-d", "--dtype", default="float32",
                   choices=["float16", "float32", "float64", "int32", "int64"])
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg"])
    p.add_argument("-a", "--algorithm", default="ring",
                   help="ring, tree, auto, or a comma-separated list")
    p.add_argument("-c", "--channel", default="rma", help="rma, ud, or a comma-separated list")
    p.add_argument("-t", "--timeout", type=parse_timeout,
                   default=parse_timeout(os.environ.get("MPILOSSY_TIMEOUT", "none")),
                   help="seconds, 'auto' or 'none' (default: $MPILOSSY_TIMEOUT, else none)")
    p.add_argument("--loss", default=os.environ.get("MPILOSSY_LOSS") or None,
                   help="loss model, MPILOSSY_LOSS syntax (default: $MPILOSSY_LOSS)")
    p.add_argument("--scenario", default=None,
                   help="tail latency: 'straggler:rank=R,delay=S,prob=P' or "
                        "'microburst:p_good_to_bad=A,p_bad_to_good=B,rto=S', applied to "
                        "MPI_Allreduce and mpilossy alike")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--block-bytes", type=parse_size, default=None)
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="busbw against size, and the latency CDF "
                   "of the scenario (needs matplotlib)")
    return p


def parse_timeout(text):
    text = str(text).strip().lower()
    if text in ("", "none", "inf"):
        return None
    return "auto" if text == "auto" else float(text)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes
             else size_range(args.minbytes, args.maxbytes, args.stepfactor))
    cfg = BenchConfig(sizes=sizes, dtype=args.dtype, op=args.op,
                      algorithms=[a.strip() for a in args.algorithm.split(",")],
                      channels=[c.strip() for c in args.channel.split(",")],
                      timeout=args.timeout, loss=args.loss, iters=args.iters,
                      warmup=args.warmup, block_bytes=args.block_bytes)
    rows = run_allreduce_bench(comm, cfg) if not args.scenario else []
    tail = run_tail_bench(comm, cfg, args.scenario) if args.scenario else []
    if comm.rank == 0:
        if rows:
            print(format_table(rows, comm, cfg), flush=True)
        if tail:
            print(format_tail(tail, comm, cfg), flush=True)
        if args.json:
            write_json(args.json, rows, comm, cfg, tail)
        if args.plot:
            plot(args.plot, rows, tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
