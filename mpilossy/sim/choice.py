"""Which algorithm `algorithm="auto"` should pick at scale: every lossy
algorithm the model can run at a given node count, on a quiet network,
against what the library's plan (mpilossy/call/plan.py) picks today.

Each algorithm runs on the engine that reaches furthest with it: the
hierarchy, and direct at one rank per node (the hierarchy's stage 2
alone), on the node-level engine (aggregate.py); the tree and the ring,
and direct with several ranks per node, on the per-rank engine, up to a
message budget (`max_messages` a call) and MAX_ACTORS threads: what would
pass either is reported as not simulated, with what it would need.  Every datagram costs its rank
`datagram_cost` of CPU (sent, and read by its peer), so that an
algorithm's message count shows in its time where its bytes do not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .scenario import Scenario, two_level_tree

__all__ = ["Candidate", "candidates", "auto_pick", "messages", "print_table"]

BLOCK = 256 * 1024          # the tree pipelines its vector in blocks of about this size

# SimGrid's Python actors are threads, two memory maps and a stack each:
# about 12,000 fit in a process beside another run under Linux's default
# 65,530 maps (a 1,024 x 8 tree, 24,576, ran alone with the limit raised,
# and failed to start its threads beside another run)
MAX_ACTORS = 12_000


@dataclass(frozen=True)
class Candidate:
    """One algorithm at one point: its scenario, or why it is not run."""

    nodes: int
    ppn: int
    nbytes: int
    algorithm: str
    scenario: Optional[Scenario]
    skipped: str = ""               # why it is not run


def actors(algorithm: str, ranks: int) -> int:
    """SimGrid actors (threads here) the per-rank engine starts for a call:
    a rank, its pacer and its reducer; the ring a helper per chain position."""
    return ranks * (ranks + 1) if algorithm == "ring" else 3 * ranks


def messages(algorithm: str, ranks: int, pieces: int) -> int:
    """Messages a call of the per-rank engine sends (its cost on this machine)."""
    if algorithm == "tree":
        return 2 * (ranks - 1) * pieces
    return 2 * ranks * (ranks - 1) * pieces        # direct and ring alike


def auto_pick(ppn: int, nodes: int, nbytes: int) -> str:
    """What the library's plan picks for a float all-reduce with a deadline
    on `nodes` nodes of `ppn` ranks (mpilossy/call/plan.py)."""
    from ..call.plan import DIRECT, TREE, flat_algorithm, tree_max_bytes
    if ppn > 1 and nodes > 1:
        return "hierarchical"
    size = nodes * ppn
    core = flat_algorithm("auto", nbytes, True, True, tree_max_bytes(None, size))
    return {TREE: "tree", DIRECT: "direct"}.get(core, "ring")


def candidates(base: Scenario, nodes: Sequence[int], ppns: Sequence[int],
               sizes: Sequence[int], max_messages: int, fanout: int) -> List[Candidate]:
    """Every algorithm at every point; `base` holds the platform.  MPICH's
    MPI_Allreduce is timed beside the node-level engine's scenario."""
    out: List[Candidate] = []
    for ppn in ppns:
        for n in nodes:
            for nbytes in sizes:
                at = replace(base, nodes=n, ppn=ppn, nbytes=nbytes, tree=two_level_tree(n))
                ranks = n * ppn
                node_level = "hierarchical" if ppn > 1 else "direct"
                out.append(Candidate(n, ppn, nbytes, node_level,
                                     replace(at, algorithm=node_level, fanout=fanout, pieces=1)))
                per_rank = ["tree", "ring"] + (["direct"] if ppn > 1 else [])
                for algorithm in per_rank:
                    pieces = max(1, min(16, nbytes // BLOCK)) if algorithm == "tree" else 1
                    count = messages(algorithm, ranks, pieces)
                    s = replace(at, algorithm=algorithm, pieces=pieces, mpi=False)
                    threads = actors(algorithm, ranks)
                    why = (f"{count:,} msgs" if count > max_messages else
                           f"{threads:,} threads" if threads > MAX_ACTORS else "")
                    out.append(Candidate(n, ppn, nbytes, algorithm, None if why else s, why))
    return out


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def print_table(cands: Sequence[Candidate], rows: Sequence[Optional[Dict[str, Any]]]) -> \
        List[Dict[str, Any]]:
    """One line per point: each algorithm's p50 (and its delivered share
    where below 1), the fastest, auto's pick and its cost against the
    fastest; returns the lines as records."""
    points: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
    for c, row in zip(cands, rows):
        point = points.setdefault((c.ppn, c.nodes, c.nbytes), {
            "ppn": c.ppn, "nodes": c.nodes, "nbytes": c.nbytes, "times": {},
            "skipped": {}, "mpi": None})
        if row is None:
            point["skipped"][c.algorithm] = c.skipped
            continue
        point["times"][c.algorithm] = row["lossy"]["p50"]
        point.setdefault("delivered", {})[c.algorithm] = row["delivered"]
        if "mpi" in row:
            point["mpi"] = row["mpi"]["p50"]
    names = ("hierarchical", "direct", "tree", "ring")
    print("| nodes x ranks | bucket | " + " | ".join(f"{a} (ms)" for a in names)
          + " | MPI_Allreduce (ms) | fastest | auto picks | auto vs fastest |")
    print("|---|---|" + "---|" * (len(names) + 4))
    records = []
    for (ppn, n, nbytes), p in sorted(points.items()):
        cells = []
        for a in names:
            if a in p["times"]:
                # (the delivered share where something was lost)
                kept = p["delivered"][a]
                cells.append(f"{p['times'][a] * 1e3:.3f}"
                             + (f" ({kept:.3f} delivered)" if kept < 0.9995 else ""))
            elif a in p["skipped"]:
                cells.append(f"({p['skipped'][a]})")
            else:
                cells.append("-")
        fastest = min(p["times"], key=p["times"].get)
        pick = auto_pick(ppn, n, nbytes)
        ratio = p["times"][pick] / p["times"][fastest] if pick in p["times"] else None
        mpi = f"{p['mpi'] * 1e3:.3f}" if p["mpi"] else "-"
        print(f"| {n} x {ppn} | {_size(nbytes)} | " + " | ".join(cells)
              + f" | {mpi} | {fastest} | {pick} | "
              + (f"{ratio:.2f}x |" if ratio else "not simulated |"))
        records.append({**p, "fastest": fastest, "auto": pick, "auto_vs_fastest": ratio})
    return records
