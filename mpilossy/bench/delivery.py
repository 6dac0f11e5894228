"""How many contributions each algorithm keeps under loss, at several scales.

    python -m mpilossy.bench delivery --ranks 2,3,4,8,16 --loss 0.1,0.3
    mpiexec -n 8 python -m mpilossy.bench delivery --loss 0.1 --json out.json

With --ranks (and not under mpiexec) it starts itself under ``mpiexec -n R``
for every R and prints one table.  Per (ranks, algorithm, loss): ``agreed``,
the fraction of all contributions in the reduced blocks that arrived (mean
over calls and ranks, with a 95% interval over calls), against what the
topology predicts with q = 1 - p: one hop (direct) 1 + (N-1) q of N, ring
(1 - q^N) / p of N, k-nomial tree the mean of q^depth; then ``delivered``
(fallbacks counted with what they hold), ``fallback`` (fraction of elements
for which a rank used its own data) and the fraction of calls that ran into
a deadline.  Injected Bernoulli loss, so the figures are the same on any
machine; the deadline is generous, so oversubscribed ranks are not counted
as lost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Dict, List

import numpy as np

from .harness import say, write_json

if TYPE_CHECKING:
    from mpi4py import MPI

Row = Dict[str, Any]


def expected(algorithm: str, n: int, p: float, radix: int = 4) -> float:
    """Expected fraction of contributions in a reduced block."""
    q = 1.0 - p
    if n == 1:
        return 1.0
    if algorithm == "direct":
        return (1 + (n - 1) * q) / n
    if algorithm == "ring":
        return (1 - q ** n) / p / n if p > 0 else 1.0
    depths: List[int] = []
    for v in range(n):
        d = 0
        while v:
            d += v % radix != 0
            v //= radix
        depths.append(d)
    return float(np.mean([q ** d for d in depths]))


def measure(comm: MPI.Comm, algorithm: str, p: float, calls: int, elements: int,
            timeout: float, seed: int) -> Row:
    import mpilossy
    x = np.ones(elements, np.float32)
    out = np.empty_like(x)
    rows = np.empty((calls, 4))
    with mpilossy.Communicator(comm, timeout=timeout, loss=mpilossy.loss.Bernoulli(p, seed=seed),
                               block_bytes=1024) as lc:
        for k in range(calls):
            st = lc.allreduce(x, out, op="avg", algorithm=algorithm)
            rows[k] = st.agreed, st.delivered, st.fallback, st.deadline_hit
    per_call = comm.allreduce(rows) / comm.size          # mean over ranks, per call
    agreed = per_call[:, 0]
    half = 1.96 * agreed.std(ddof=1) / np.sqrt(calls) if calls > 1 else 0.0
    return {"ranks": comm.size, "algorithm": algorithm, "loss": p, "calls": calls,
            "agreed": float(agreed.mean()), "agreed_ci95": float(half),
            "expected": expected(algorithm, comm.size, p),
            "delivered": float(per_call[:, 1].mean()), "fallback": float(per_call[:, 2].mean()),
            "deadline_calls": float(per_call[:, 3].mean())}


HEADER = (f"{'ranks':>5} {'algorithm':>9} {'loss':>5} {'agreed':>7} {'±95%':>6} {'expected':>8} "
          f"{'delivered':>9} {'fallback':>8} {'deadline':>8}")


def format_row(r: Row) -> str:
    return (f"{r['ranks']:>5} {r['algorithm']:>9} {r['loss']:>5.2f} {r['agreed']:>7.4f} "
            f"{r['agreed_ci95']:>6.4f} {r['expected']:>8.4f} {r['delivered']:>9.4f} "
            f"{r['fallback']:>8.4f} {r['deadline_calls']:>8.3f}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ranks", help="comma-separated rank counts: launch mpiexec for each")
    ap.add_argument("--loss", default="0.1,0.3", help="comma-separated loss rates")
    ap.add_argument("-a", "--algorithm", default="ring,tree,direct")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--elements", type=int, default=4096, help="float32 elements per call")
    ap.add_argument("--timeout", type=float, default=0.5, help="deadline, seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    if args.ranks:
        return launch(args)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = [measure(comm, a, float(p), args.calls, args.elements, args.timeout, args.seed)
            for p in args.loss.split(",") for a in args.algorithm.split(",")]
    say(comm, HEADER, *(format_row(r) for r in rows))
    if comm.rank == 0:
        write_json(args.json, rows)
    return 0


def launch(args: argparse.Namespace) -> int:
    """Run this command under mpiexec once per rank count; one table."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    rest = ["--loss", args.loss, "-a", args.algorithm, "--calls", str(args.calls),
            "--elements", str(args.elements), "--timeout", repr(args.timeout),
            "--seed", str(args.seed)]
    rows: List[Row] = []
    print(HEADER, flush=True)
    for n in [int(r) for r in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpilossy.bench", "delivery",
                   *rest, "--json", out]
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                print(f"{n} ranks failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            with open(out) as f:
                batch = json.load(f)
        for r in batch:
            print(format_row(r), flush=True)
        rows += batch
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":          # the old spelling: python -m mpilossy.bench.delivery
    from .__main__ import main
    sys.exit(main(["delivery", *sys.argv[1:]]))
