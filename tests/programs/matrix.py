"""The combination matrix (docs/deadlines.md, "Features together"): cells
of pairwise combinations of the settings (tests/core/test_matrix.py makes
them), each a Communicator that makes CALLS calls of x = 2^rank, with one
fault at call FAULT_AT, and the invariants the docs promise checked in
every cell:

- one outcome per call on every rank: a call fails on every rank or on
  none (a rank that had returned from it raises at its next call, naming
  it);
- every block of a result with a record (direct, hierarchical) is the
  (weighted) mean over the ranks its record names; without one (ring,
  tree) the mean over some set of ranks; of an all-gather, its owner's
  data where the record names the owner, and recvbuf's previous
  contents where it names nobody;
- every call ends within its deadline plus MARGIN (fixed), the learned
  deadline's cap plus MARGIN ("auto"), hierarchical calls too;
- the levels of a hierarchy count the same calls on every rank after
  the faults, and a last call is consistent.

    MPIR_CVAR_NUM_CLIQUES=2 mpiexec [-disable-auto-cleanup] -n 4 python matrix.py CELLS_JSON

CELLS_JSON: a list of cells (dicts of the settings).  Prints one JSON line
from the lowest rank still running: {"cells": n, "failures": [...]}.
"""

import faulthandler
import json
import os
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.call.buffers import chunk_bounds

comm = MPI.COMM_WORLD
faulthandler.dump_traceback_later(240, exit=True)
CALLS, FAULT_AT = 7, 3
T = 0.1                   # a fixed deadline
MARGIN = 0.15             # seconds past the deadline a call may take on loaded shared cores
CAP = float(os.environ.get("MPILOSSY_AUTO_CAP", "1.0"))
N = 6007                  # elements: several blocks, not a multiple of anything
UNTOUCHED = -1.0          # an all-gather's recvbuf before the call (no rank's value)
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16}
failures = []


def timeout_of(cell):
    return {"none": None, "fixed": T, "auto": "auto"}[cell["timeout"]]


def bound(cell):
    """Longest a call may take on a rank that is not the faulty one."""
    timeout = cell["timeout"]
    if timeout == "none":
        return None
    return (T if timeout == "fixed" else 1.5 * CAP) + MARGIN


def means_allowed(named, weights, values, blind):
    """The (weighted) mean over the ranks `named`, or over them less some of
    `blind` (ranks of other nodes, in a hierarchical record: a record
    cannot see another node's stage 1, docs/hierarchy.md)."""
    ranks = np.flatnonzero(named)
    unseen = [r for r in ranks if r in blind]
    out = []
    for k in range(1 << len(unseen)):
        kept = [r for r in ranks if r not in [u for i, u in enumerate(unseen) if k >> i & 1]]
        if kept:
            out.append(float(np.dot(weights[kept], values[kept]) / weights[kept].sum()))
    return out


def check_value(cell, stats, out, values, weights, blind, where):
    """The result against the record it carries, or any subset's mean."""
    # (bfloat16: 8 bits of mantissa, rounded once per stage; int8 codes)
    tolerance = (2e-2 if cell.get("dtype") == "bfloat16" else
                 2e-3 if cell["compression"] else 1e-5)
    out = out.astype(np.float64)
    if stats.contributors is not None:
        firsts, lengths = stats.contributors.blocks()
        unseen = blind if stats.algorithm == "hierarchical" else ()
        for f, n, named in zip(firsts, lengths, stats.contributors.members()):
            allowed = means_allowed(named, weights, values, unseen)
            if n and not any(np.allclose(out[f:f + n], m, rtol=tolerance) for m in allowed):
                failures.append(f"{where}: block at {f} is {out[f]}, its record's mean "
                                f"{allowed[0] if allowed else None}")
                return
        return
    subsets = np.array([np.mean(values[[r for r in range(len(values)) if m >> r & 1]])
                        for m in range(1, 1 << len(values))])
    nearest = np.abs(out[:, None] - subsets[None, :]).min(axis=1)
    if np.any(nearest > tolerance * values.max()):
        failures.append(f"{where}: values that are no set of ranks' mean")


def check_gathered(stats, out, values, size, where):
    """An all-gather's result against its record: each block holds its
    owner's value where the record names the owner (and nobody else),
    recvbuf's previous contents where it names nobody."""
    if stats.contributors is None:
        failures.append(f"{where}: an all-gather without a record")
        return
    firsts, lengths = stats.contributors.blocks()
    if int(np.sum(lengths)) != out.size:
        failures.append(f"{where}: the record covers {int(np.sum(lengths))} of {out.size}")
    starts = [chunk_bounds(out.size, size, r)[0] for r in range(size)]
    out = out.astype(np.float64)            # (values and UNTOUCHED are exact in every dtype)
    for f, n, named in zip(firsts, lengths, stats.contributors.members()):
        if not n:
            continue
        owner = int(np.searchsorted(starts, f, side="right")) - 1
        who = np.flatnonzero(named).tolist()
        want = UNTOUCHED if not who else values[owner] if who == [owner] else None
        if want is None or not np.all(out[f:f + n] == want):
            failures.append(f"{where}: block at {f} (rank {owner}'s chunk) is {out[f]}, its "
                            f"record names {who}")
            return


def buffers(cell, value, shape):
    """sendbuf and recvbuf of a call, for a communicator of `shape`
    (size, rank): the chunks of reduce_scatter and allgather are cut for it."""
    collective = cell.get("collective", "allreduce")
    dtype = DTYPES[cell.get("dtype", "float32")]
    lo, hi = chunk_bounds(N, *shape)
    if collective == "allgather":
        return np.full(hi - lo, value, dtype), np.full(N, UNTOUCHED, dtype)
    x = np.full(N, value, dtype)
    return x, np.empty(hi - lo if collective == "reduce_scatter" else N, dtype)


def call(lc, cell, x, out, kwargs):
    collective = cell.get("collective", "allreduce")
    if collective == "allreduce":
        return lc.allreduce(x, out, **kwargs)
    # (their algorithm= is their own argument, "auto" by default)
    if collective == "reduce_scatter":
        return lc.reduce_scatter(x, out, algorithm=cell["algorithm"], **kwargs)
    return lc.allgather(x, out, algorithm=cell["algorithm"],
                        **{k: v for k, v in kwargs.items() if k == "redundancy"})


def run(cell, index):
    where = f"cell {index} {cell}"
    size = comm.size
    values = 2.0 ** np.arange(size)
    weights = (1.0 + np.arange(size)) if cell["weight"] else np.ones(size)
    fault_rank = size - 1 if cell["fault"] != "fail" else 1 % size
    settings = dict(channel=cell["channel"], timeout=timeout_of(cell),
                    elastic=cell["elastic"], algorithm=cell["algorithm"],
                    redundancy="auto" if cell["redundancy"] == "auto" else None,
                    compression="int8" if cell["compression"] else None)
    if cell["elastic"]:
        settings.update(evict_after=4, elastic_wait=5.0)
    outcomes, took = [], []
    lc = mpilossy.Communicator(comm, **settings)
    before = members = list(range(size))     # (original ranks of the calls' communicator)
    layout_before = layout = lc.layout       # (and its layout)
    shape = (lc.size, lc.rank)                # (the chunks' communicator, below)
    for number in range(CALLS):
        if not lc.behind:       # (calls answered alone keep the old chunks, docs/elastic.md)
            shape = (lc.size, lc.rank)
        x, out = buffers(cell, values[comm.rank], shape)
        kwargs = dict(op="avg")
        if cell["weight"]:
            kwargs["weight"] = float(weights[comm.rank])
        if cell["residual"]:
            kwargs["residual"] = np.zeros(x.size, np.float32)
        if cell["redundancy"] == "fixed":
            kwargs["redundancy"] = (4, 1)
        faulty = number == FAULT_AT and comm.rank == fault_rank
        if faulty and cell["fault"] == "late":
            time.sleep(2 * T if cell["timeout"] != "none" else 0.2)
        if faulty and cell["fault"] == "exit":
            os._exit(0)
        if faulty and cell["fault"] == "fail":
            out.flags.writeable = False
        began = time.perf_counter()
        try:
            stats = call(lc, cell, x, out, kwargs)
            outcomes.append("ok")
        except Exception as exc:      # noqa: BLE001
            late = "failed after rank" in str(exc)
            outcomes.append(("late " if late else "") + type(exc).__name__)
            took.append(None if faulty else time.perf_counter() - began)
            continue
        took.append(None if faulty or stats.excluded else time.perf_counter() - began)
        ranks = before if stats.alone else members      # (whose call it was)
        nodes = layout_before if stats.alone else layout
        blind = [r for r in range(len(ranks)) if nodes.node_of[r] != nodes.node]
        if cell.get("collective") == "allgather":
            check_gathered(stats, out, values[ranks], shape[0], f"{where} call {number}")
        else:
            check_value(cell, stats, out, values[ranks], weights[ranks], blind,
                        f"{where} call {number}")
        if stats.excluded:              # (the agreement's call: documented as longer)
            before, members = members, list(lc.members)
            layout_before, layout = layout, lc.layout
    limit = bound(cell)
    slow = [(c, round(t, 3)) for c, t in enumerate(took) if t is not None and limit and t > limit]
    if slow:
        failures.append(f"{where}: calls past {limit:.2f} s: {slow}")
    counts = None
    state = lc._state
    if state is not None and state.hierarchy is not None:
        h = state.hierarchy
        counts = (h.layout.node, h.intra.core.seq, h.layout.local_rank,
                  None if h.inter is None else h.inter.core.seq)
    return lc, outcomes, counts


def agree_on_outcomes(cells_outcomes, survivors, where):
    """One outcome per call: the calls each rank failed, counting a call a
    rank returned from as failed where its next call raised naming it."""
    failed = []
    for outcomes in cells_outcomes:
        mine = set()
        for call, o in enumerate(outcomes):
            if o.startswith("late "):
                mine.add(call - 1)
            elif o != "ok":
                mine.add(call)
        failed.append(sorted(mine))
    if len({tuple(f) for f in failed}) > 1:
        failures.append(f"{where}: ranks {survivors} failed different calls {failed} "
                        f"({cells_outcomes})")


cells = json.loads(sys.argv[1])
group = comm
for index, cell in enumerate(cells):
    lc, outcomes, counts = run(cell, index)
    exits = cell["fault"] == "exit"
    group = lc.comm if exits else comm       # (the survivors, after an exit)
    everyone = group.allgather((comm.rank, outcomes, counts))
    agree_on_outcomes([o for _, o, _ in everyone], [r for r, _, _ in everyone], f"cell {index}")
    levels = {}
    for rank, _, c in everyone:
        if c is not None:
            levels.setdefault(("node", c[0]), set()).add(c[1])
            if c[3] is not None:
                levels.setdefault(("across", c[2]), set()).add(c[3])
    if any(len(v) > 1 for v in levels.values()):
        failures.append(f"cell {index}: levels counted different calls {levels}")
    if not exits:
        lc.free()
    group.Barrier()
gathered = group.gather(failures, root=0)
if group.Get_rank() == 0:
    print(json.dumps({"cells": len(cells), "failures": [f for fs in gathered for f in fs]}),
          flush=True)
sys.stdout.flush()
if cells and cells[-1]["fault"] == "exit":
    os._exit(1 if failures else 0)       # (MPI_Finalize hangs after a death)
sys.exit(1 if failures else 0)
