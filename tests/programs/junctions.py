"""Where two features meet: one scenario per defect a review found at such
a junction (issue "Features that compose"), each checking the invariant
the docs promise there.

    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 4 python junctions.py SCENARIO [--channel ud]

Prints one JSON line from rank 0 ({"scenario", "failures", ...}); exits
nonzero where any rank's check failed.  A hang fails too (faulthandler
prints every rank's stack and exits).
"""

import argparse
import array
import faulthandler
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy import MismatchError
from mpilossy.call.spec import FLOOR_SHARE

p = argparse.ArgumentParser()
p.add_argument("scenario")
p.add_argument("--channel", default="rma")
args = p.parse_args()
comm = MPI.COMM_WORLD
faulthandler.dump_traceback_later(100, exit=True)
failures = []
report = {}


def check(ok, what):
    if not ok:
        failures.append(what)


def weighted_mean(values, weights):
    return float(np.dot(values, weights) / np.sum(weights))


def extreme_weights():
    """Item 1: weights far outside the data's dtype (float16: 1e5, 1e-6;
    float32: 1e-40, 1e39) in the hierarchy: the weighted mean, as flat
    direct gives it, on every rank; no warning (run under -W error)."""
    cases = [(np.float16, 1e5), (np.float16, 1e-6), (np.float32, 1e-40), (np.float32, 1e39)]
    with mpilossy.Communicator(comm, channel=args.channel, timeout=None) as lc:
        check(lc.layout.hierarchical, f"layout {lc.layout.describe()} has one level")
        for dtype, base in cases:
            w = base * (1 + comm.rank)
            x = np.full(1001, 1 + comm.rank, dtype)
            want = weighted_mean(np.arange(1, comm.size + 1), base * np.arange(1, comm.size + 1))
            for algorithm in ("hierarchical", "direct"):
                try:
                    out = np.empty_like(x)
                    lc.allreduce(x, out, op="avg", weight=w, algorithm=algorithm)
                    check(np.allclose(out.astype(np.float64), want, rtol=2e-3),
                          f"{np.dtype(dtype).name} w={base:g} {algorithm}: {out[0]} != {want}")
                except Exception as exc:     # noqa: BLE001
                    check(False, f"{np.dtype(dtype).name} w={base:g} {algorithm}: "
                                 f"{type(exc).__name__}: {exc}")


def missed_stage_one():
    """Item 4: a rank that misses its node's stage (x = 2^rank): every block
    is the mean over the ranks its record names, less, at most, some ranks
    of other nodes that missed their own node's stage 1 (a record cannot
    see another node's stage 1: docs/hierarchy.md); never a rank of this
    rank's own node, and never the late rank counted where it is absent."""
    values = 2.0 ** np.arange(comm.size)
    late = comm.size - 2          # the first node's second rank (rank 2 at 2x2)
    wrong, missed = [], 0
    with mpilossy.Communicator(comm, channel=args.channel, timeout=0.1) as lc:
        layout = lc.layout
        check(layout.hierarchical, f"layout {layout.describe()} has one level")
        for call in range(6):
            if call == 2 and comm.rank == late:
                time.sleep(0.3)
            x = np.full(3001, values[comm.rank])
            out = np.empty_like(x)
            stats = lc.allreduce(x, out, op="avg")
            members = stats.contributors.members()
            firsts, lengths = stats.contributors.blocks()
            for f, n, named in zip(firsts, lengths, members):
                ranks = np.flatnonzero(named)
                blind = [r for r in ranks if layout.node_of[r] != layout.node]
                means = {float(np.mean(values[[r for r in ranks if r not in drop]]))
                         for k in range(1 << len(blind))
                         for drop in [[b for i, b in enumerate(blind) if k >> i & 1]]
                         if len(drop) < len(ranks)}
                if not any(np.allclose(out[f:f + n], m, rtol=1e-12) for m in means):
                    wrong.append((call, int(f), float(out[f]), sorted(means)))
            missed += int(not members[:, late].all())
        comm.Barrier()
    check(not wrong, f"blocks that are not the mean of the ranks their record names: "
                     f"{wrong[:4]}")
    report["calls_missing_the_late_rank"] = comm.allreduce(missed, op=MPI.MAX)


def auto_cap():
    """Item 7: timeout="auto" with MPILOSSY_AUTO_CAP=0.2: a hierarchical call
    with a rank asleep for 1 s ends within about the cap on the others, as a
    flat one does; and every call, on every rank, within the deadline it
    reports (the hierarchy's: the sum of its stages'), with FLOOR_SHARE
    more for what agreements took out of it, and 50 ms."""
    sleeper = comm.size - 1
    longest, past = {}, {}
    for algorithm in ("hierarchical", "direct"):
        with mpilossy.Communicator(comm, channel=args.channel, timeout="auto") as lc:
            took, over = [], []
            for call in range(6):
                if call == 3 and comm.rank == sleeper:
                    time.sleep(1.0)
                began = time.perf_counter()
                stats = lc.allreduce(np.ones(20000), algorithm=algorithm)
                took.append(time.perf_counter() - began)
                over.append(took[-1] - (1 + FLOOR_SHARE) * stats.timeout)
            comm.Barrier()
        mine = max(took) if comm.rank != sleeper else 0.0
        longest[algorithm] = comm.allreduce(mine, op=MPI.MAX)
        past[algorithm] = comm.allreduce(max(over), op=MPI.MAX)
    report["longest_call_s"] = longest
    report["past_its_deadline_s"] = past
    cap = float(os.environ["MPILOSSY_AUTO_CAP"])
    for algorithm, t in longest.items():
        check(t < 1.5 * cap + 0.05, f"{algorithm}: a call took {t:.3f} s with the cap at {cap}")
        check(past[algorithm] < 0.05, f"{algorithm}: a call ran {past[algorithm]:.3f} s past "
                                      f"{1 + FLOOR_SHARE} times the deadline it reported")


def integers_as_buffers():
    """Item 8: algorithm="auto" on nodes of different sizes with integers as
    array.array and memoryview (no .dtype): the exact sum, every rank."""
    with mpilossy.Communicator(comm, channel=args.channel, timeout=None) as lc:
        check(lc.layout.hierarchical and not lc.layout.uniform,
              f"layout {lc.layout.describe()}: not nodes of different sizes")
        want = np.full(1000, sum(range(1, comm.size + 1)), np.int32)
        for kind in ("array", "memoryview", "numpy"):
            base = array.array("i", [1 + comm.rank] * 1000)
            buf = {"array": base, "memoryview": memoryview(base),
                   "numpy": np.frombuffer(base, np.int32)}[kind]
            try:
                stats = lc.allreduce(buf, algorithm="auto")
                got = np.frombuffer(base, np.int32)
                check(np.array_equal(got, want), f"{kind}: {got[:3]} != {want[:3]}")
                report[f"algorithm_{kind}"] = stats.algorithm
            except Exception as exc:     # noqa: BLE001
                check(False, f"{kind}: {type(exc).__name__}: {exc}")


def extras_on_some_ranks():
    """Item 9: residual= or weight= on one rank only, no deadline: a
    MismatchError on every rank (reduce_scatter and allreduce, "auto"),
    never a wait; the next call exact."""
    with mpilossy.Communicator(comm, channel=args.channel, timeout=None) as lc:
        n = 4000
        lo, hi = lc.chunk_bounds(n)
        x = np.full(n, 1.0 + comm.rank, np.float32)
        for collective in ("reduce_scatter", "allreduce"):
            for extra in ("residual", "weight"):
                kwargs = {}
                if comm.rank == 0:
                    kwargs = ({"residual": np.zeros(n, np.float32)} if extra == "residual"
                              else {"weight": 2.0})
                op = "avg" if extra == "weight" else "sum"
                try:
                    if collective == "reduce_scatter":
                        lc.reduce_scatter(x, np.empty(hi - lo, np.float32), op=op, **kwargs)
                    else:
                        lc.allreduce(x, np.empty_like(x), op=op, **kwargs)
                    outcome = "returned"
                except MismatchError:
                    outcome = "MismatchError"
                except Exception as exc:     # noqa: BLE001
                    outcome = f"{type(exc).__name__}: {exc}"
                outcomes = comm.allgather(outcome)
                check(all(o == "MismatchError" for o in outcomes),
                      f"{collective} with {extra} on rank 0 only: {outcomes}")
                out = np.empty(hi - lo, np.float32)
                lc.reduce_scatter(x, out)
                check(np.all(out == sum(range(1, comm.size + 1))), "the call after: inexact")


def calls_counted():
    """Suspected: Communicator.calls counts every call, whatever its route."""
    with mpilossy.Communicator(comm, channel=args.channel, timeout=None) as lc:
        for algorithm in ("hierarchical", "direct", "hierarchical"):
            lc.allreduce(np.ones(100), algorithm=algorithm)
        check(lc.calls == 3, f"calls = {lc.calls} after 3 calls")


def paced_node():
    """Suspected: a datagram to a rank of this node (free under pacing)
    waited behind one to another node that the tokens could not pay yet.
    At 2 Mbit/s a node (native sockets, two fake nodes), a direct
    all-reduce with a 0.3 s deadline loses most of what crosses nodes; the
    chunks reduced on this node must hold both of its ranks' data."""
    with mpilossy.Communicator(comm, channel="ud", timeout=0.3, rotate=False) as lc:
        layout = lc.layout
        mate = [r for r in layout.ranks_of(layout.node) if r != comm.rank][0]
        x = np.full(1 << 16, 1.0 + comm.rank, np.float32)
        held, lost = [], []
        for call in range(3):
            comm.Barrier()
            stats = lc.allreduce(x.copy(), algorithm="direct")
            members = stats.contributors.members()
            firsts, _ = stats.contributors.blocks()
            ours = [b for b, f in enumerate(firsts)
                    if lc.chunk_bounds(x.size, comm.rank)[0] <= f < lc.chunk_bounds(x.size, comm.rank)[1]
                    or lc.chunk_bounds(x.size, mate)[0] <= f < lc.chunk_bounds(x.size, mate)[1]]
            held.append(float(members[ours][:, [comm.rank, mate]].mean()))
            lost.append(stats.delivered)
        report["node_share_held"] = comm.allreduce(min(held), op=MPI.MIN)
        report["delivered"] = comm.allreduce(float(np.mean(lost)), op=MPI.MIN)
        check(min(held) == 1.0, f"this node's chunks held {held} of its two ranks' data")
        check(np.mean(lost) < 0.9, f"delivered {lost}: the rate did not bite (no test)")


SCENARIOS = {f.__name__.replace("_", "-"): f for f in (
    extreme_weights, missed_stage_one, auto_cap, integers_as_buffers, extras_on_some_ranks,
    calls_counted, paced_node)}
SCENARIOS[args.scenario]()
everyone = comm.gather(failures, root=0)
merged = comm.gather(report, root=0)
if comm.rank == 0:
    print(json.dumps({"scenario": args.scenario, "failures":
                      [f"rank {r}: {f}" for r, fs in enumerate(everyone) for f in fs],
                      **merged[0]}), flush=True)
sys.exit(1 if failures else 0)
