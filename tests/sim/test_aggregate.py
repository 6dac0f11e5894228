"""The node-level engine (mpilossy.sim.aggregate), which the projection to
1,024 nodes runs on: where every peer gets its own flow it gives the
per-rank engine's times and delivered share; a deadline shorter than the
transfer ends its calls on time with blocks missing; the learned deadline
is the cap until the first agreement and then FACTOR times what stage 2
took; the ring among the leaders takes what its bytes and steps need.
Each scenario runs in a fresh process (one SimGrid engine per process)."""

from dataclasses import replace

import pytest

from mpilossy.sim.aggregate import peer_ranges
from mpilossy.sim.mpich import TCP_FRAME, TCP_PAYLOAD
from mpilossy.sim.scenario import Scenario

MiB = 1 << 20
BASE = Scenario(nodes=4, ppn=2, rate=1e9, nbytes=MiB, algorithm="hierarchical", deadline=1.0,
                calls=3, pieces=4)


@pytest.mark.parametrize("nodes, fanout", [(2, 1), (5, 4), (5, 2), (1024, 8), (9, 100)])
def test_peer_ranges_cover_every_peer_once(nodes, fanout):
    ranges = peer_ranges(nodes, fanout)
    assert len(ranges) == min(fanout, nodes - 1)
    assert sum(count for _, count in ranges) == nodes - 1
    offsets = [off for off, _ in ranges]
    assert offsets == sorted(set(offsets)) and 1 <= offsets[0] and offsets[-1] <= nodes - 1
    if fanout >= nodes - 1:
        assert ranges == [(off, 1) for off in range(1, nodes)]


@pytest.mark.timeout(180)
def test_with_a_flow_per_peer_it_gives_the_per_rank_engines_figures(run):
    per_rank, nodes = run(BASE, replace(BASE, fanout=BASE.nodes - 1))
    assert nodes["lossy"]["p50"] == pytest.approx(per_rank["lossy"]["p50"], rel=0.01)
    assert nodes["mpi"]["p50"] == pytest.approx(per_rank["mpi"]["p50"], rel=0.02)
    assert nodes["delivered"] == pytest.approx(1.0) == per_rank["delivered"]
    # a deadline shorter than the transfer: both end on time and lose alike
    short = replace(BASE, deadline=0.004, mpi=False)
    per_rank, nodes = run(short, replace(short, fanout=short.nodes - 1))
    for row in (per_rank, nodes):
        assert row["lossy"]["p99"] <= short.deadline + 1e-4, row
        assert 0.0 < row["delivered"] < 0.9, row
    assert nodes["delivered"] == pytest.approx(per_rank["delivered"], abs=0.05)


@pytest.mark.timeout(180)
def test_the_learned_deadline_is_the_cap_then_factor_times_stage_two(run):
    from mpilossy.control.agreement import LAG, PERIOD
    from mpilossy.control.deadline import FACTOR
    s = replace(BASE, fanout=3, auto=True, calls=PERIOD + LAG + 4, mpi=False)
    fixed = replace(s, auto=False, calls=3)
    row, plain = run(s, fixed)
    timeouts = row["timeouts"]
    assert timeouts[:PERIOD + LAG] == [s.deadline] * (PERIOD + LAG)
    learned = timeouts[-1]
    # a lossless network: stage 2 takes what the fixed call's stage 2 took
    # (its memory stages aside), and the scale stays at 1
    assert learned < s.deadline / 10
    stage2 = plain["lossy"]["p50"]
    assert FACTOR * 0.5 * stage2 <= learned <= FACTOR * stage2, (learned, stage2)
    assert row["delivered"] == pytest.approx(1.0)


@pytest.mark.timeout(180)
def test_the_ring_among_leaders_takes_its_bytes_and_steps(run):
    s = replace(BASE, fanout=3, ring_steps=2 * (BASE.nodes - 1), calls=2)
    row, = run(s)
    N = s.nodes
    wire = 2 * (N - 1) / N * s.nbytes * TCP_FRAME / TCP_PAYLOAD / (s.rate / 8)
    memory = 2 * (s.ppn - 1) * s.nbytes / s.memory
    least = wire + memory
    assert least <= row["ring"]["p50"] <= 1.3 * least, (least, row["ring"])
    # MPICH's halving and doubling moves the same bytes in fewer steps
    assert row["mpi"]["p50"] <= row["ring"]["p50"]


@pytest.mark.timeout(300)
def test_the_scale_command_prints_its_rows_and_the_step(run, tmp_path, capsys):
    from mpilossy.sim.__main__ import main
    main(["scale", "--nodes", "4", "--ppn", "2", "--rate", "1gbit", "--sizes", "1M",
          "--calls", "30", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in printed.splitlines()
            if line.startswith("| 4 x 2")]
    assert [r[3].split("<=")[0].strip() for r in rows] == ["fixed", "fixed", "auto"], printed
    for r in rows:
        assert 0.0 < float(r[8]) <= 1.0, r
    low, high = (float(x) for x in rows[2][9].split("-"))
    assert 0 < low <= high < 1000.0, rows[2]          # learned, below the 1 s cap
    assert "step at 4 x 2" in printed and (tmp_path / "scale.json").exists()
    # the table again, from the JSON alone
    main(["scale", "--table-only", "--out", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[2:5] == printed.splitlines()[2:5]
