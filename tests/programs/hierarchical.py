"""The hierarchical all-reduce on the node layout the job was launched with
(on one machine: MPIR_CVAR_NUM_CLIQUES=K splits it into K fake nodes).

    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 4 python hierarchical.py [--channel ud] [--calls N]

Checks, with one JSON line from rank 0 (and a nonzero exit on any rank
whose check failed):
- exact: lossless calls equal MPI_Allreduce (bit for bit where every node
  holds the same number of ranks and the data are small integers; to 1e-6
  otherwise), in place and not, op sum and avg, several sizes and dtypes;
  algorithm='auto' runs the hierarchy;
- unbiased: under 20% injected loss, the rank-averaged result of N calls
  against the exact average (tests/unbiasedness.py's t statistic) where
  every node holds as many ranks; on unequal nodes, that every value is
  the average of the ranks of the nodes that arrived (docs/hierarchy.md);
- stopped: one rank of a node sleeps 0.5 s before one call with a 0.1 s
  deadline: how long the others' call took, and the calls after it exact.
"""

import argparse
import json
import os
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import unbiasedness  # noqa: E402  (tests/unbiasedness.py)

import mpilossy  # noqa: E402
from mpilossy.call.buffers import chunk_bounds  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--channel", default="rma")
p.add_argument("--calls", type=int, default=600)
args = p.parse_args()
comm = MPI.COMM_WORLD
failures = []
BF16 = np.dtype(ml_dtypes.bfloat16)


def check(ok, what):
    if not ok:
        failures.append(what)


def exact(lc):
    layout = lc.layout
    want_algorithm = "hierarchical" if layout.hierarchical else None
    for n in (1, 2, 5, 1000, 70001):
        for dtype in (np.float32, np.float64, np.int32):
            x = ((np.arange(n) * 7 + 3 * comm.rank) % 101).astype(dtype)
            want = np.empty_like(x)
            comm.Allreduce(x, want)
            bit_exact = layout.uniform or dtype == np.int32
            for op in ("sum", "avg"):
                if op == "avg" and dtype == np.int32:
                    continue
                expect = want / comm.size if op == "avg" else want
                for in_place in (False, True):
                    out = x.copy() if in_place else np.full_like(x, -1)
                    stats = lc.allreduce(out, op=op) if in_place else lc.allreduce(x, out, op=op)
                    same = (np.array_equal(out, expect) if bit_exact and op == "sum"
                            else np.allclose(out, expect, rtol=1e-6, atol=0))
                    check(same, f"{n} {np.dtype(dtype).name} {op} in_place={in_place}: "
                                f"max error {np.abs(out - expect).max()}")
                    if want_algorithm and (layout.uniform or dtype != np.int32):
                        check(stats.algorithm == want_algorithm,
                              f"algorithm='auto' ran {stats.algorithm}")
                    check(stats.delivered == 1.0, f"delivered {stats.delivered} without loss")


def weighted(lc):
    """weight=: sum(w x) / sum(w), exact without loss, in place and not."""
    w = 1.0 + comm.rank
    for n in (1, 5, 70001):
        for dtype in (np.float32, np.float64):
            x = ((np.arange(n) * 5 + 11 * comm.rank) % 97).astype(dtype)
            want = comm.allreduce(w * x.astype(np.float64)) / comm.allreduce(w)
            for in_place in (False, True):
                out = x.copy() if in_place else np.full_like(x, -1)
                stats = lc.allreduce(out, op="avg", weight=w) if in_place \
                    else lc.allreduce(x, out, op="avg", weight=w)
                check(np.allclose(out, want, rtol=1e-6 if dtype == np.float32 else 1e-12),
                      f"weighted {n} {np.dtype(dtype).name} in_place={in_place}: "
                      f"max error {np.abs(out - want).max()}")
                if lc.layout.hierarchical:
                    check(stats.algorithm == "hierarchical", f"weighted ran {stats.algorithm}")
                check(stats.delivered == 1.0 and stats.contributed(0) == 1.0,
                      f"weighted without loss: delivered {stats.delivered}")


def scattered(lc):
    """reduce_scatter: this rank's chunk of MPI's reduction (bit for bit on
    small integers), two-level where every node holds as many ranks, flat
    with algorithm='auto' otherwise, where 'hierarchical' is a ValueError."""
    layout = lc.layout
    two_level = layout.hierarchical and layout.uniform
    for n in (1, 5, 1000, 70001):
        for dtype in (np.float32, np.float64, np.int32):
            x = ((np.arange(n) * 3 + 5 * comm.rank) % 89).astype(dtype)
            want = np.empty_like(x)
            comm.Allreduce(x, want)
            lo, hi = chunk_bounds(n, comm.size, comm.rank)
            for op in ("sum", "avg"):
                if op == "avg" and dtype == np.int32:
                    continue
                expect = want[lo:hi] / comm.size if op == "avg" else want[lo:hi]
                out = np.full(hi - lo, -1, dtype)
                stats = lc.reduce_scatter(x, out, op=op)
                same = (np.array_equal(out, expect) if op == "sum"
                        else np.allclose(out, expect, rtol=1e-6, atol=0))
                check(same, f"reduce_scatter {n} {np.dtype(dtype).name} {op}: "
                            f"max error {np.abs(out - expect).max() if out.size else 0}")
                check((stats.algorithm == "hierarchical") == two_level,
                      f"reduce_scatter ran {stats.algorithm}")
                check(stats.delivered == 1.0, f"reduce_scatter delivered {stats.delivered}")
    if layout.hierarchical and not layout.uniform:
        lo, hi = chunk_bounds(8, comm.size, comm.rank)
        try:
            lc.reduce_scatter(np.ones(8), np.ones(hi - lo), algorithm="hierarchical")
            check(False, "a two-level reduce_scatter on unequal nodes did not raise")
        except ValueError:
            pass


def gathered(lc):
    """allgather: every rank's chunk everywhere, bit for bit, given apart or
    in place (sendbuf this rank's chunk of recvbuf), any dtype; two-level
    where every node holds as many ranks, flat with algorithm='auto'
    otherwise, where 'hierarchical' is a ValueError on every rank."""
    layout = lc.layout
    two_level = layout.hierarchical and layout.uniform
    for n in (1, 5, 1000, 70001):
        for dtype in (np.float32, np.int32, np.float64):
            full = ((np.arange(n) * 7 + 3) % 101).astype(dtype)
            lo, hi = chunk_bounds(n, comm.size, comm.rank)
            out = np.full(n, 77, dtype)
            stats = lc.allgather(full[lo:hi].copy(), out)
            check(np.array_equal(out, full), f"allgather {n} {np.dtype(dtype).name}: "
                                             f"{int(np.sum(out != full))} elements differ")
            check((stats.algorithm == "hierarchical") == two_level,
                  f"allgather ran {stats.algorithm}")
            check(stats.delivered == 1.0 and stats.contributors.received().all(),
                  f"allgather delivered {stats.delivered}")
            inplace = np.full(n, 77, dtype)
            inplace[lo:hi] = full[lo:hi]
            lc.allgather(inplace[lo:hi], inplace)
            check(np.array_equal(inplace, full), f"allgather in place {n}")
    lo, hi = chunk_bounds(8, comm.size, comm.rank)
    try:        # (the algorithm is the same on every rank: it sets the route)
        lc.allgather(np.ones(hi - lo), np.ones(8), algorithm="ring")
        check(False, "allgather with algorithm='ring' did not raise")
    except ValueError:
        pass
    if layout.hierarchical and not layout.uniform:
        try:
            lc.allgather(np.ones(hi - lo), np.ones(8), algorithm="hierarchical")
            check(False, "a two-level allgather on unequal nodes did not raise")
        except ValueError:
            pass


def gathered_under_loss(channel):
    """Under 20% injected loss across nodes: each element of the result is
    its owner's value where the record says it arrived and the previous
    contents of recvbuf where it says not; this rank's own chunk always
    arrives; delivered is what the record holds; another node's chunks
    arrive mostly (0.8 of the blocks: one crossing of the network).
    Returns delivered."""
    delivered, wrong, others = [], [], []
    T = 0.5
    with mpilossy.Communicator(comm, channel=channel, timeout=T, block_bytes=512,
                               loss=mpilossy.loss.Bernoulli(0.2, seed=7)) as lc:
        layout = lc.layout
        away = np.concatenate([np.arange(*chunk_bounds(3001, comm.size, r))
                               for r in range(comm.size) if layout.node_of[r] != layout.node])
        for call in range(30):
            full = np.arange(3001, dtype=np.float64) + 10000.0 * call
            before = -1.0 - np.arange(3001, dtype=np.float64)
            lo, hi = chunk_bounds(full.size, comm.size, comm.rank)
            out = before.copy()
            stats = lc.allgather(full[lo:hi].copy(), out, algorithm="hierarchical")
            came = stats.contributors.received()
            if (np.any(out[came] != full[came]) or np.any(out[~came] != before[~came])
                    or not came[lo:hi].all() or abs(came.mean() - stats.delivered) > 1e-12):
                wrong.append(call)
            members = stats.contributors.members()
            firsts, lengths = stats.contributors.blocks()
            owners = [np.searchsorted([chunk_bounds(full.size, comm.size, r)[1]
                                       for r in range(comm.size)], f, side="right")
                      for f in firsts]
            if any(m.sum() > 1 or (m.any() and not m[o]) for m, o in zip(members, owners)):
                wrong.append(("owner", call))
            delivered.append(stats.delivered)
            others.append(came[away].mean() if away.size else 1.0)
    check(not wrong, f"allgather results not as their records say: {wrong}")
    check(0.6 < np.mean(others) < 1.0, f"other nodes' chunks arrived in {np.mean(others):.3f}")
    return float(np.mean(delivered))


def bfloat16(lc):
    """bfloat16 through the stages: small integers (every partial sum exact
    in bfloat16) summed bit for bit where nodes hold as many ranks; else
    within three roundings, each at most 2^-8 relative (half a step at the
    bottom of a binade): a node's partial travels in bfloat16, on unequal
    nodes stage 2 scales it by its weight's mantissa, and the result is
    rounded; weighted averages within 2 x 2^-8 of the weighted value
    (tests/core/test_bfloat16.py); reduce_scatter too."""
    layout = lc.layout
    for n in (5, 70001):
        x = ((np.arange(n) * 7 + 3 * comm.rank) % 32).astype(BF16)
        want = np.sum(comm.allgather(x.astype(np.float64)), axis=0)
        for op in ("sum", "avg"):
            expect = want / comm.size if op == "avg" else want
            out = np.full(n, -1, BF16)
            stats = lc.allreduce(x, out, op=op)
            got = out.astype(np.float64)
            if op == "sum" and layout.uniform:
                check(np.array_equal(got, expect), f"bfloat16 {n} sum: max error "
                                                   f"{np.abs(got - expect).max()}")
            else:
                check(np.all(np.abs(got - expect) <= 3 * 2.0 ** -8 * np.abs(expect)),
                      f"bfloat16 {n} {op}: max relative error "
                      f"{np.max(np.abs(got - expect) / np.maximum(np.abs(expect), 1e-30))}")
            if layout.hierarchical:
                check(stats.algorithm == "hierarchical", f"bfloat16 ran {stats.algorithm}")
        w = 1.0 + comm.rank
        ws = comm.allgather(w)
        xs = comm.allgather(x.astype(np.float64))
        want_w = sum(wi * xi for wi, xi in zip(ws, xs)) / sum(ws)
        out = np.empty_like(x)
        lc.allreduce(x, out, op="avg", weight=w)
        check(np.all(np.abs(out.astype(np.float64) - want_w) <= 2 * 2.0 ** -8 * want_w + 1e-12),
              f"bfloat16 weighted {n}: max error {np.abs(out.astype(np.float64) - want_w).max()}")
        if layout.uniform:
            lo, hi = chunk_bounds(n, comm.size, comm.rank)
            part = np.full(hi - lo, -1, BF16)
            stats = lc.reduce_scatter(x, part, op="sum")
            check(np.array_equal(part.astype(np.float64), want[lo:hi]),
                  f"bfloat16 reduce_scatter {n} ran {stats.algorithm}")


def fed_back(lc):
    """residual= with int8 compression: zeros outside the slice this rank
    sends across nodes, nonzero in it, and in this rank's units: of the
    means of x - s * residual, the result is nearest to s = 1's, the mean of
    what travelled (not equal to it: the reduced values are quantised again
    on their way back)."""
    layout = lc.layout
    owner = layout.local_rank < min(layout.sizes)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(20001).astype(np.float32)
    for weight in (None, 1.0 + comm.rank):
        residual = np.full_like(x, 7.0)
        out = np.empty_like(x)
        w = 1.0 if weight is None else weight
        lc.allreduce(x, out, op="avg", weight=weight, compression="int8", residual=residual)
        nonzero = np.flatnonzero(residual)
        if owner:
            width = (-(-x.size // min(layout.sizes)) if weight is not None or not layout.uniform
                     else None)
            lo, hi = ((min(x.size, layout.local_rank * width),
                       min(x.size, (layout.local_rank + 1) * width)) if width
                      else chunk_bounds(x.size, layout.local_size, layout.local_rank))
            check(nonzero.size > 0 and nonzero.min() >= lo and nonzero.max() < hi,
                  f"residual nonzero at {nonzero.min() if nonzero.size else None}.."
                  f"{nonzero.max() if nonzero.size else None}, slice {lo}..{hi}")
        else:
            check(nonzero.size == 0, "a rank that sends nothing across nodes has a residual")
        # the scale of the residual that best explains the result is 1
        total = comm.allreduce(w)
        error = {scale: np.abs(out - comm.allreduce(w * (x - scale * residual).astype(
            np.float64)) / total).mean() for scale in (0.5, 1.0, 2.0)}
        check(error[1.0] < min(error[0.5], error[2.0]),
              f"weight={weight}: mean distance of the result to the mean of x - s * residual "
              f"{error}")


def recorded(channel):
    """Under 20% injected loss (across nodes only) with a deadline long
    enough that no rank misses the stages within its node: every block of
    the result is the (weighted) mean of 2^r over the ranks its record
    names, and delivered is what the record holds; every call ends within
    its deadline + 30 ms (one outlier under 200 ms on loaded cores,
    docs/deadlines.md); and every other node is in most blocks (a node
    dropped on every call would still give blocks true to their record).
    Should a rank miss its node's stage 1 all the same (loaded cores), the
    other nodes' records still name it, as documented (record.py, "What an
    owner cannot see"): such a block must then be the mean over its record
    less the ranks their own node's record leaves out, and is counted apart.
    Returns delivered."""
    values = 2.0 ** np.arange(comm.size)
    weights = 1.0 + np.arange(comm.size)
    delivered, wrong, late, present, suspect = [], [], [], [], []
    T = 0.5
    with mpilossy.Communicator(comm, channel=channel, timeout=T, block_bytes=512,
                               loss=mpilossy.loss.Bernoulli(0.2, seed=5)) as lc:
        layout = lc.layout
        for call in range(40):
            weigh = call % 2 == 1
            x = np.full(3001, values[comm.rank])
            out = np.empty_like(x)
            began = time.perf_counter()
            stats = (lc.allreduce(x, out, op="avg", weight=weights[comm.rank]) if weigh
                     else lc.allreduce(x, out, op="avg"))
            late.append(time.perf_counter() - began - T)
            record = stats.contributors
            members = record.members()
            w = weights if weigh else np.ones(comm.size)
            expect = (members * (w * values)).sum(axis=1) / (members * w).sum(axis=1)
            firsts, lengths = record.blocks()
            _RECORDS[call] = (firsts, lengths, members)
            got = out[firsts]
            same = np.all([np.all(out[f:f + n] == out[f]) for f, n in zip(firsts, lengths)])
            if not same:
                wrong.append(call)
            elif not np.allclose(got, expect, rtol=1e-12):
                suspect.append((call, firsts, lengths, members, got, w))
            held = float((lengths * members.sum(axis=1)).sum()) / (x.size * comm.size)
            if abs(held - stats.delivered) > 1e-12 or int(lengths.sum()) != x.size:
                wrong.append(("delivered", call, held, stats.delivered))
            delivered.append(stats.delivered)
            present.append([float(np.dot(lengths, members[:, layout.ranks_of(n)].all(axis=1)))
                            / x.size for n in range(layout.nodes)])
            if lc.layout.uniform and not weigh:      # the two-level reduce-scatter
                lo, hi = chunk_bounds(x.size, comm.size, comm.rank)
                mine = np.empty(hi - lo)
                began = time.perf_counter()
                stats = lc.reduce_scatter(x, mine, op="avg")
                late.append(time.perf_counter() - began - T)
                members = stats.contributors.members()
                firsts, lengths = stats.contributors.blocks()
                expect = (members * values).sum(axis=1) / members.sum(axis=1)
                if not all(np.allclose(mine[f:f + k], e, rtol=1e-12)
                           for f, k, e in zip(firsts, lengths, expect)):
                    wrong.append(("reduce_scatter", call))
    unseen = _unseen_stage_1_misses(layout, suspect, values)
    wrong += [call for call, *_ in suspect if call not in unseen]
    check(not wrong, f"blocks that are not the mean of the ranks their record names: {wrong}")
    check(len(unseen) <= 2, f"ranks missed their node's stage 1 in calls {unseen} (deadline {T} s)")
    over = sorted(late)
    check(over[-2] <= 0.03 and over[-1] < 0.2,
          f"hierarchical calls past their {T} s deadline: the longest by {over[-3:]} s")
    # 20% loss across nodes: another node's slice reaches a block with at
    # least 0.8^2 (contribution to the reducer, reduced block back)
    share = np.mean(present, axis=0)
    others = [n for n in range(layout.nodes) if n != layout.node]
    check(all(share[n] > 0.4 for n in others),
          f"other nodes in {[round(share[n], 2) for n in others]} of the elements")
    return float(np.mean(delivered))


def _unseen_stage_1_misses(layout, suspect, values):
    """The calls of `suspect` ((call, firsts, lengths, members, got, w): not
    the mean over this rank's record) whose every block is the mean over
    that record less the ranks that their own node's records leave out:
    a rank that missed its node's stage 1, which other nodes cannot see.
    Collective (every rank of the job)."""
    calls = set().union(*comm.allgather([call for call, *_ in suspect]))
    # every rank's record of the calls anyone suspects (for its own node's ranks)
    every = comm.allgather({call: _RECORDS[call] for call in calls})
    unseen = []
    for call, firsts, lengths, members, got, w in suspect:
        # each block as the other ranks recorded it (the same span; a rank
        # whose slice fell back to its own data records other spans there)
        rows = [{span: row for span, row in zip(zip(*v[call][:2]), v[call][2])} for v in every]
        seen = members.copy()
        for b, span in enumerate(zip(firsts, lengths)):
            for n in range(layout.nodes):
                views = [rows[p][span] for p in layout.ranks_of(n) if span in rows[p]]
                if n != layout.node and views:
                    for q in layout.ranks_of(n):
                        seen[b, q] &= all(v[q] for v in views)
        if seen.sum(axis=1).all() and np.allclose(
                got, (seen * (w * values)).sum(axis=1) / (seen * w).sum(axis=1), rtol=1e-12):
            unseen.append(call)
    return unseen


_RECORDS: dict = {}     # call -> (firsts, lengths, members) of this rank's allreduce in recorded()


with mpilossy.Communicator(comm, channel=args.channel, timeout=None) as lc:
    layout = lc.layout
    exact(lc)
    if layout.hierarchical:       # op='avg' on integers: a clear error everywhere
        try:
            lc.allreduce(np.ones(4, np.int32), op="avg", algorithm="hierarchical")
            check(False, "op='avg' on int32 did not raise")
        except TypeError:
            pass
    if not layout.uniform:        # integers on nodes of different sizes: a clear error
        try:
            lc.allreduce(np.ones(4, np.int32), algorithm="hierarchical")
            check(False, "int32 on unequal nodes did not raise")
        except TypeError:
            pass
    weighted(lc)
    scattered(lc)
    gathered(lc)
    bfloat16(lc)
    if layout.hierarchical:
        fed_back(lc)

if layout.hierarchical and not layout.uniform:
    # zero-fill on nodes of different sizes: "auto" flat and exact, "hierarchical" refused
    with mpilossy.Communicator(comm, channel=args.channel, timeout=None,
                               scaling="zero-fill") as lc:
        x = np.arange(10.0) + comm.rank
        out = np.empty_like(x)
        stats = lc.allreduce(x, out, op="avg")
        check(stats.algorithm != "hierarchical" and np.allclose(
            out, np.arange(10.0) + (comm.size - 1) / 2), f"zero-fill, auto: {stats.algorithm}")
        try:
            lc.allreduce(x, out, op="avg", algorithm="hierarchical")
            check(False, "zero-fill on unequal nodes did not raise")
        except ValueError:
            pass

if layout.uniform:
    # 0.05 s, not the flat tests' 0.01: up to six ranks share two cores in CI,
    # and deadlines missed for scheduling (not independent of the rank) bias
    # the average (|t| = 6.1 seen once at 3 nodes of 2 with 0.01).
    results, _, delivered = unbiasedness.run(comm, "hierarchical", 0.2, calls=args.calls,
                                             timeout=0.05, channel=args.channel)
    t = unbiasedness.rank_averaged_t(comm, results)
    check(t < unbiasedness.T_LIMIT, f"biased: |t| = {t:.2f}")
else:
    # Unequal nodes: every value is the mean over the ranks whose data
    # reached it (each node's partial weighing the ranks of that node that
    # made its deadline), or a rank's own value (its fallback); never another
    # mix (recorded() checks each block against its record as well).
    t = None
    values = 2.0 ** np.arange(comm.size)                 # rank r holds 2^r
    allowed = np.array(sorted({float(np.mean(values[[r for r in range(comm.size)
                                                      if mask >> r & 1]]))
                               for mask in range(1, 1 << comm.size)}))
    x = np.full(4096, values[comm.rank])
    delivered, mixed = 0.0, 0
    # 0.05 s: five ranks share two cores in CI, and a 10 ms deadline missed
    # for scheduling alone took delivered below half (seen once).
    with mpilossy.Communicator(comm, channel=args.channel, timeout=0.05, block_bytes=512,
                               loss=mpilossy.loss.Bernoulli(0.2, seed=11)) as lc:
        for call in range(args.calls // 4):
            out = np.empty_like(x)
            delivered += lc.allreduce(x, out, op="avg", algorithm="hierarchical").delivered
            nearest = np.abs(out[:, None] - allowed[None, :]).min(axis=1)
            mixed += int(np.sum(nearest > 1e-9 * allowed.max()))
    delivered /= args.calls // 4
    check(mixed == 0, f"{mixed} values are not the average of the ranks of a set of nodes")
recorded_delivered = recorded(args.channel) if layout.hierarchical else None
gathered_delivered = (gathered_under_loss(args.channel)
                      if layout.hierarchical and layout.uniform else None)
# Loss was injected (every rank's result holds another node's lossy slices)
# and most of the data still arrived; recorded() bounds each node's share
check(0.3 < delivered < 1.0, f"delivered {delivered} under 20% loss")

# one rank of the last node, not its first, sleeps before call 3
sleeper = layout.ranks_of(layout.nodes - 1)[-1]
x = np.full(1 << 16, float(comm.rank), np.float32)
want = np.empty_like(x)
comm.Allreduce(x, want)
took, exact_after = [], []
with mpilossy.Communicator(comm, channel=args.channel, timeout=0.1) as lc:
    for call in range(20):
        if call == 3 and comm.rank == sleeper:
            time.sleep(0.5)
        comm_began = time.perf_counter()
        out = np.empty_like(x)
        stats = lc.allreduce(x, out)
        took.append(time.perf_counter() - comm_began)
        exact_after.append(bool(np.array_equal(out, want)))
    comm.Barrier()
slow_call = comm.gather(took[3] if comm.rank != sleeper else None, root=0)
late_exact = comm.gather(exact_after, root=0)
failed = comm.gather(failures, root=0)
if comm.rank == 0:
    print(json.dumps({
        "ranks": comm.size, "layout": layout.describe(), "channel": args.channel,
        "unbiased_t": t, "delivered_under_loss": delivered,
        "recorded_delivered": recorded_delivered, "gathered_delivered": gathered_delivered,
        "others_call_with_sleeper_ms": max(1e3 * s for s in slow_call if s is not None),
        "exact_after_sleep": all(all(v[-3:]) for v in late_exact),
        "inexact_calls": [c for c in range(len(late_exact[0])) if not all(v[c] for v in late_exact)],
        "failures": [f"rank {r}: {f}" for r, fs in enumerate(failed) for f in fs]}))
sys.exit(1 if failures else 0)
