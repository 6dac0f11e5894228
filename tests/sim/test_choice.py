"""`python -m mpilossy.sim choose` (mpilossy.sim.choice): a datagram's CPU
cost shows in a call's time where its bytes do not; at one rank per node
the node-level engine's direct gives the per-rank engine's; what the
command calls auto's pick is what the library's plan picks; the command
prints a line per point, skips what passes its budget and says why."""

import json
from dataclasses import replace

import pytest

from mpilossy.call.plan import TREE_MAX_BYTES_LARGE, tree_max_bytes
from mpilossy.sim.choice import auto_pick, messages
from mpilossy.sim.scenario import Scenario

BASE = Scenario(nodes=6, ppn=1, rate=1e9, nbytes=4096, algorithm="direct", deadline=1.0,
                calls=2, pieces=1, payload=8192, latency=1e-6, mpi=False)


@pytest.mark.timeout(180)
def test_a_datagrams_cost_shows_where_bytes_do_not(run):
    cost = 100e-6
    free, costly = run(BASE, replace(BASE, datagram_cost=cost))
    # 4 KiB among 6 ranks: one datagram a peer and phase, 5 peers, 2 phases
    least = 2 * (BASE.nodes - 1) * cost
    assert free["lossy"]["p50"] < least / 4, free
    assert least <= costly["lossy"]["p50"] <= least + 2e-4, costly
    assert costly["delivered"] == pytest.approx(1.0)


@pytest.mark.timeout(180)
def test_node_level_direct_gives_the_per_rank_engines_time(run):
    for nbytes in (4096, 1 << 20):
        s = replace(BASE, nbytes=nbytes, datagram_cost=1e-6)
        per_rank, merged = run(s, replace(s, fanout=2))
        assert merged["lossy"]["p50"] == pytest.approx(per_rank["lossy"]["p50"], rel=0.05)
        assert merged["delivered"] == pytest.approx(1.0) == per_rank["delivered"]


def test_auto_pick_is_the_plans():
    assert auto_pick(8, 64, 4096) == "hierarchical"
    assert auto_pick(1, 64, TREE_MAX_BYTES_LARGE) == "tree"
    assert auto_pick(1, 64, TREE_MAX_BYTES_LARGE + 4) == "direct"
    assert auto_pick(1, 2, tree_max_bytes(None, 2) + 4) == "direct"
    # one node: no hierarchy, the flat choice
    assert auto_pick(8, 1, 1 << 20) == "direct"


def test_message_counts():
    assert messages("tree", 8, 2) == 2 * 7 * 2
    assert messages("direct", 8, 1) == messages("ring", 8, 1) == 2 * 8 * 7


@pytest.mark.timeout(300)
def test_the_choose_command_prints_a_line_per_point(run, tmp_path, capsys):
    from mpilossy.sim.__main__ import main
    main(["choose", "--nodes", "3", "--ppns", "1,2", "--sizes", "1K", "--rate", "100gbit",
          "--max-messages", "59", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    lines = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in printed.splitlines()
             if line.startswith("| 3 x")}
    assert set(lines) == {"3 x 1", "3 x 2"}, printed
    one, two = lines["3 x 1"], lines["3 x 2"]
    # no hierarchy at one rank per node; nothing lost on a quiet network
    assert one[1].strip() == "-" and float(one[2]) > 0 and float(one[3]) > 0, one
    assert float(two[1]) > 0 and float(two[3]) > 0, two
    # the ring and direct among 6 ranks send 60 messages: past the budget
    assert two[4].strip() == "(60 msgs)" and two[2].strip() == "(60 msgs)", two
    assert two[7].strip() == "hierarchical" and one[7].strip() == "tree"
    saved = json.loads((tmp_path / "choice.json").read_text())
    assert {(p["nodes"], p["ppn"]) for p in saved["points"]} == {(3, 1), (3, 2)}
    for p in saved["points"]:
        assert p["fastest"] == min(p["times"], key=p["times"].get)
        assert all(d == pytest.approx(1.0) for d in p["delivered"].values()), p
