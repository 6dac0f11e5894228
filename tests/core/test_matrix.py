"""The combination matrix: every pair of values of the settings below
appears in some cell (all-pairs, allpairspy), the three collectives
among them, and every cell holds the invariants the docs promise together (tests/programs/matrix.py: one
outcome per call on every rank; every block the (weighted) mean over the
ranks its record names; every call within its deadline plus a margin,
hierarchical ones too; a hierarchy's levels in step after the faults).
Layouts run on fake nodes (MPIR_CVAR_NUM_CLIQUES), each under its own
mpiexec; a cell where a rank exits needs one of its own."""

import functools
import itertools
import json

import pytest
from allpairspy import AllPairs

from mpilossy import _core
from mpilossy.control.failures import reports_failures
from helpers import is_singleton, last_report, run_mpi_script

# name -> values (the first of each is the plain case)
FACTORS = {
    "algorithm": ["auto", "direct", "ring", "hierarchical"],
    "collective": ["allreduce", "reduce_scatter", "allgather"],
    "dtype": ["float32", "bfloat16", "float64"],
    "channel": ["rma", "ud"],
    "timeout": ["fixed", "none", "auto"],
    "weight": [False, True],
    "redundancy": ["none", "fixed", "auto"],
    "compression": [False, True],
    "elastic": [False, True],
    "residual": [False, True],
    "layout": ["2x2", "one node", "2+1"],
    "fault": ["late", "fail", "exit"],
}
LAYOUTS = {"one node": (3, 1), "2x2": (4, 2), "2+1": (3, 2)}     # ranks, cliques
CAP = "0.3"              # MPILOSSY_AUTO_CAP: the learned deadline's cap, for the bound


def valid(row) -> bool:
    """Combinations the library takes (a partial row: the first len(row)
    factors).  What it refuses on purpose (a weight on the ring, say) is
    tested where it is refused (tests/api, tests/call)."""
    cell = dict(zip(FACTORS, row))
    get = cell.get
    if get("algorithm") == "ring" and (get("weight") or get("compression")):
        return False
    # the all-gather reduces nothing: no ring, weight or error feedback (a
    # communicator's compression it leaves aside, which is a cell)
    if get("collective") == "allgather" and (get("algorithm") == "ring" or get("weight")
                                             or get("residual")):
        return False
    # compression quantises float32 (float16 and bfloat16 widened to it)
    # and refuses float64; error feedback is float32 only
    if get("dtype") == "float64" and get("compression"):
        return False
    if get("dtype") not in (None, "float32") and get("residual"):
        return False
    # the two-level reduce-scatter and all-gather need nodes of equal size
    # ("hierarchical" is refused on 2+1: tests/core/test_hierarchical.py)
    if get("collective") in ("reduce_scatter", "allgather") \
            and get("algorithm") == "hierarchical" and get("layout") == "2+1":
        return False
    if get("elastic") and get("timeout") == "none":
        return False
    if get("fault") == "exit" and get("elastic") is False:
        return False
    # an exit across nodes is survived over datagrams only (docs/elastic.md)
    if get("fault") == "exit" and get("layout") not in (None, "one node") \
            and get("channel") == "rma":
        return False
    # a hierarchy is built on several nodes only where not elastic; on
    # nodes of different sizes it takes unbiased floating-point data (ours)
    return True


def route(row) -> str:
    """The route a cell's calls take: "two-level" where the hierarchy runs
    (docs/hierarchy.md: several nodes, not elastic; the reduce-scatter and
    all-gather on nodes of equal size only), else "flat"."""
    two = (row["layout"] != "one node" and not row["elastic"]
           and row["algorithm"] in ("auto", "hierarchical")
           and (row["collective"] == "allreduce" or row["layout"] == "2x2"))
    return "two-level" if two else "flat"


def pairs(row):
    """The cell's pairs of values, with the collective and the route it
    takes as one more (so that each value meets each collective on the
    hierarchy where it runs, not only the names)."""
    row = dict(row, path=(row["collective"], route(row)))
    names = list(FACTORS) + ["path"]
    return {(a, row[a], b, row[b]) for i, a in enumerate(names) for b in names[i + 1:]}


@functools.lru_cache(maxsize=None)
def _possible():
    return possible()


def possible():
    """Every valid full combination, as dicts (the factors' product, filtered)."""
    rows = (dict(zip(FACTORS, full)) for full in itertools.product(*FACTORS.values())
            if valid(list(full)))
    if not (_core.HAVE_DATAGRAM_AUTH and _core.HAVE_LIBFABRIC):
        rows = (r for r in rows if r["channel"] != "ud")
    return list(rows)


@functools.lru_cache(maxsize=None)
def _cells():
    return cells()


def cells():
    """allpairspy's cells, then, for any pair its filtered search left out,
    the valid combination that adds most of the missing pairs."""
    everything = possible()
    rows = [r for r in (dict(zip(FACTORS, row)) for row in AllPairs(
        list(FACTORS.values()), filter_func=valid)) if r in everything]
    missing = set().union(*map(pairs, everything)) - set().union(*map(pairs, rows))
    while missing:
        best = max(everything, key=lambda r: len(pairs(r) & missing))
        rows.append(best)
        missing -= pairs(best)
    return rows


def launches():
    """(id, layout, exit, cells): the cells of each layout in one launch,
    each cell with an exit in its own."""
    rows = _cells()
    out = []
    for layout in FACTORS["layout"]:
        batch = [r for r in rows if r["layout"] == layout and r["fault"] != "exit"]
        if batch:
            out.append((f"{layout}", layout, False, batch))
        for k, r in enumerate(r for r in rows if r["layout"] == layout and r["fault"] == "exit"):
            out.append((f"{layout}-exit-{k}", layout, True, [r]))
    return out


def test_every_pair_of_values_is_in_some_cell():
    """Every pair of values that some valid combination holds is in a cell."""
    rows = cells()
    assert set().union(*map(pairs, possible())) <= set().union(*map(pairs, rows))
    assert 10 <= len(rows) <= 40, len(rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, layout, exits, batch",
                         launches(), ids=[launch[0] for launch in launches()])
def test_cells_keep_the_invariants(name, layout, exits, batch):
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    if exits and not reports_failures():
        pytest.skip("this MPI does not report failed ranks")
    ranks, cliques = LAYOUTS[layout]
    proc = run_mpi_script("matrix.py", ranks, json.dumps(batch), timeout=260,
                          options=("-disable-auto-cleanup",) if exits else (),
                          MPIR_CVAR_NUM_CLIQUES=str(cliques), MPILOSSY_AUTO_CAP=CAP)
    result = last_report(proc.stdout, proc.stderr)
    assert result["cells"] == len(batch) and not result["failures"], result
    assert proc.returncode == 0, proc.stderr[-3000:]
