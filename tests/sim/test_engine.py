"""The scale model's engine on SimGrid (mpilossy.sim.engine): a call takes
at least what its bytes need at the rank's pace, a lossless call delivers
everything (the tree too, and under drops what its hops keep), a deadline shorter than the transfer ends the call on time with
blocks missing, and MPI_Allreduce (recursive halving and doubling at a
power of two) takes what its bytes need.  Each
scenario runs in a fresh process (one SimGrid engine per process)."""

import pytest

from mpilossy.sim.engine import Scenario
from mpilossy.sim.world import UD_HEADERS
from mpilossy.sim.mpich import TCP_FRAME, TCP_PAYLOAD

MiB = 1 << 20


def pace_seconds(s: Scenario, nbytes: float) -> float:
    frame = (s.payload + UD_HEADERS) / s.payload
    return nbytes * frame / (0.95 * s.rate / 8 / s.ppn)


@pytest.mark.timeout(120)
def test_direct_and_ring_take_what_their_bytes_need_and_deliver_everything(run):
    direct = Scenario(nodes=4, ppn=1, rate=200e6, nbytes=MiB, algorithm="direct",
                      deadline=5.0, calls=2)
    ring = Scenario(nodes=3, ppn=1, rate=200e6, nbytes=MiB, algorithm="ring",
                    deadline=5.0, calls=2)
    rows = run(direct, ring)
    for s, row in zip((direct, ring), rows):
        P = s.size
        # every rank sends (P - 1) / P of the vector twice (direct: its
        # contributions and its reduced chunk; ring: the chain and the fan-out)
        least = pace_seconds(s, 2 * s.nbytes * (P - 1) / P)
        assert least <= row["lossy"]["p50"] <= 1.3 * least, (s.algorithm, least, row)
        assert row["delivered"] == pytest.approx(1.0)
        if P == 4:
            mpi_least = 2 * s.nbytes * (P - 1) / P * TCP_FRAME / TCP_PAYLOAD / (s.rate / 8)
            assert mpi_least <= row["mpi"]["p50"] <= 1.3 * mpi_least, row


@pytest.mark.timeout(120)
def test_the_tree_delivers_everything_and_what_its_hops_keep_under_drops(run):
    from dataclasses import replace
    # a rank's MAC (1.6 GB/s) well below its port: a parent's 3 children fit
    # through its port (the model drops what a port cannot carry, no queue)
    quiet = Scenario(nodes=6, ppn=1, rate=100e9, nbytes=MiB, algorithm="tree", deadline=1.0,
                     calls=2, mpi=False, seal_rate=1.6e9, latency=1e-6, payload=8192, pieces=4)
    tree, lossy_tree, lossy_direct = run(quiet, replace(quiet, drop=0.05),
                                         replace(quiet, drop=0.05, algorithm="direct"))
    # 6 ranks, radix 4: the root's 4 children (one with a child of its own)
    # send it the whole vector, then it sends each the result: 4 vectors out
    # at its pace bound the call, the pieces pipelining the rest
    frame = (quiet.payload + UD_HEADERS) / quiet.payload
    least = 4 * quiet.nbytes * frame / quiet.seal_rate
    assert least <= tree["lossy"]["p50"] <= 2 * least, (least, tree)
    assert tree["delivered"] == pytest.approx(1.0)
    # under drops, in expectation (q: a hop kept): the root holds itself, its 3
    # leaves and rank 4's partial (4 and its child 5) as far as they came; a
    # leaf or rank 4 gets the root's result with q, else its own partial;
    # rank 5, two hops below, with q^2
    q = 1 - 0.05
    root = 1 + 3 * q + q * (1 + q)
    ranks = [root] + 3 * [q * root + (1 - q)] + [q * root + (1 - q) * (1 + q),
                                                 q * q * root + (1 - q * q)]
    assert lossy_tree["delivered"] == pytest.approx(sum(ranks) / 36), lossy_tree
    assert 0.8 < lossy_direct["delivered"] < 1.0, lossy_direct


@pytest.mark.timeout(120)
def test_a_deadline_shorter_than_the_transfer_ends_the_call_on_time(run):
    s = Scenario(nodes=4, ppn=1, rate=200e6, nbytes=MiB, algorithm="direct", deadline=0.05,
                 calls=2, mpi=False)
    slow = Scenario(nodes=2, ppn=2, rate=200e6, nbytes=MiB, algorithm="hierarchical",
                    deadline=0.02, calls=2, mpi=False)
    for scenario, row in zip((s, slow), run(s, slow)):
        assert row["lossy"]["p99"] <= scenario.deadline + 1e-3, row
        assert 0.0 < row["delivered"] < 0.9, row


@pytest.mark.timeout(120)
def test_background_flows_slow_mpi_and_cost_datagrams(run):
    from mpilossy.sim.engine import Background
    quiet = Scenario(nodes=4, ppn=1, rate=200e6, nbytes=MiB, algorithm="direct", deadline=0.25,
                     calls=10)
    busy = Scenario(nodes=4, ppn=1, rate=200e6, nbytes=MiB, algorithm="direct", deadline=0.25,
                    calls=10, background=Background(200, 200, 2))
    q, b = run(quiet, busy)
    assert b["mpi"]["p50"] > 1.5 * q["mpi"]["p50"], (q, b)
    assert q["delivered"] == pytest.approx(1.0) and b["delivered"] < 0.95, (q, b)


def test_scenarios_refuse_what_they_cannot_model():
    from mpilossy.sim.engine import simulate
    with pytest.raises(ValueError, match="algorithm"):
        simulate(Scenario(algorithm="butterfly"))
    with pytest.raises(ValueError, match="core_rate"):
        simulate(Scenario(cores=2, sharing=True))
    from mpilossy.sim.aggregate import simulate_nodes
    with pytest.raises(ValueError, match="parity"):
        simulate_nodes(Scenario(nodes=4, ppn=2, algorithm="hierarchical", fanout=2,
                                redundancy=(4, 2)))
    with pytest.raises(ValueError, match="shared cores"):
        simulate_nodes(Scenario(nodes=4, ppn=2, algorithm="hierarchical", fanout=2,
                                cores=2, core_rate=1e8, sharing=True))


@pytest.mark.timeout(120)
def test_heartbeat_sends_what_elastic_sends_and_costs_its_datagrams(run):
    """The simulated heartbeat (mpilossy.sim.heartbeat) sends each rank's
    beats to the ranks control/elastic.py watches: 2 span per rank at span
    1 and 2 on 16 ranks, every peer at span 0.  A call costs the rank its
    own datagrams' core time, each sent and read once, and nothing that
    grows with the ranks (it never waits for a beat); the beats arrive
    later than that, by the links they cross."""
    from mpilossy.sim.heartbeat import simulate_heartbeat
    from mpilossy.sim.mechanisms import UNIT
    from mpilossy.sim.runner import run_each
    calls = [(2, 8, 1, 100e9), (2, 8, 2, 100e9), (2, 8, 0, 100e9), (8, 8, 2, 100e9)]
    one, two, every, wider = run_each(simulate_heartbeat, calls, jobs=2)
    assert [r["messages"] for r in (one, two, every, wider)] == \
        [16 * 2, 16 * 4, 16 * 15, 64 * 4]
    per = UNIT["datagram_s"] + UNIT["mac_fixed_s"] + UNIT["heartbeat_b"] * UNIT["mac_per_byte_s"]
    for r, peers in ((one, 2), (two, 4), (wider, 4)):
        assert r["cost_max_us"] == pytest.approx(2 * peers * per * 1e6, rel=1e-6), r
        assert r["arrived_p50_us"] > per * 1e6, r
    assert one["cost_p50_us"] < two["cost_p50_us"] < every["cost_p50_us"], (one, two, every)
    assert wider["cost_max_us"] == pytest.approx(two["cost_max_us"], rel=1e-6), (two, wider)


def test_a_group_keeps_what_at_most_m_losses_leave():
    """_World.kept: without parity the arrival probability itself; with one
    parity record per block the block is lost only with both; more parity
    keeps more."""
    from mpilossy.sim.world import _World

    def kept(k, m, q):
        w = _World.__new__(_World)
        w._groups = (k, m)
        return w.kept(q)
    for q in (0.0, 0.5, 0.9, 1.0):
        assert kept(8, 0, q) == q
        assert kept(1, 1, q) == pytest.approx(1 - (1 - q) ** 2)
    assert 0.9 < kept(8, 1, 0.9) < kept(8, 2, 0.9) < kept(4, 2, 0.9) < 1.0


@pytest.mark.timeout(120)
def test_parity_costs_its_bytes_and_keeps_what_its_groups_rebuild(run):
    from dataclasses import replace
    from mpilossy.sim.world import _World
    plain = Scenario(nodes=4, ppn=1, rate=100e9, nbytes=MiB, algorithm="direct", deadline=1.0,
                     calls=2, mpi=False, seal_rate=1.6e9, latency=1e-6, payload=8192, pieces=4,
                     drop=0.1)
    coded = replace(plain, redundancy=(4, 2))
    a, b = run(plain, coded)
    w = _World.__new__(_World)
    w._groups = (4, 2)
    for row, q in ((a, 0.9), (b, w.kept(0.9))):
        # a rank's own chunk holds 1 + q (P - 1) contributions; another chunk
        # that came (q) holds as many, else the rank's own contribution only
        P = 4
        own = 1 + q * (P - 1)
        expect = (own + (P - 1) * (q * own + (1 - q))) / P / P
        assert row["delivered"] == pytest.approx(expect, rel=1e-9), (row, expect)
    # 6 records for 4 blocks on the wire: the call is bound by its bytes
    assert 1.3 < b["lossy"]["p50"] / a["lossy"]["p50"] < 1.6, (a, b)


def test_tcp_recovery_waits_for_timers_as_often_as_its_share_says():
    from mpilossy.sim.mpich import RTO_MIN, tcp_recovery
    keys = [f"m{n}:rs1:{a}:{b}" for n in range(400) for a in range(4) for b in range(4) if a != b]
    waits = [tcp_recovery(7, k, 0.05, 0.5) for k in keys]
    timed_out = [w for w in waits if w]
    # 4,800 messages, each waiting with probability 0.5 x 0.05
    assert 0.018 * len(keys) < len(timed_out) < 0.032 * len(keys), len(timed_out)
    # the first timer, then doubled for each retransmission dropped again
    allowed = {RTO_MIN * (2 ** j - 1) for j in range(1, 8)}
    assert all(min(abs(w - a) for a in allowed) < 1e-9 for w in timed_out), set(timed_out)
    assert min(timed_out) == pytest.approx(RTO_MIN)
    # the same draw for the same seed and message; none without drops or share
    assert waits == [tcp_recovery(7, k, 0.05, 0.5) for k in keys]
    assert waits != [tcp_recovery(8, k, 0.05, 0.5) for k in keys]
    assert not any(tcp_recovery(7, k, 0.0, 0.5) or tcp_recovery(7, k, 0.05, 0.0) for k in keys)


@pytest.mark.timeout(120)
def test_random_drops_give_mpi_a_tail_of_retransmission_timeouts(run):
    from dataclasses import replace
    from mpilossy.sim.mpich import RTO_MIN
    quiet = Scenario(nodes=4, ppn=1, rate=1e9, nbytes=MiB, algorithm="direct", deadline=0.3,
                     calls=40)
    dropped = replace(quiet, drop=0.05, rto_share=1.0)
    never = replace(dropped, rto_share=0.0)
    q, d, n = run(quiet, dropped, never)
    # 16 messages between nodes a call (recursive halving and doubling)
    assert d["messages_tcp"] == q["messages_tcp"] == 16 * quiet.calls, d
    # a call waits for a timer with probability 1 - (1 - 0.05)^16 = 0.56:
    # the tail holds a timer, the median may too; without the share, none
    assert d["mpi"]["p99"] >= q["mpi"]["p50"] + RTO_MIN, (q, d)
    assert n["mpi"]["p99"] < q["mpi"]["p50"] + RTO_MIN / 2, (q, n)
    assert q["mpi"]["p99"] < q["mpi"]["p50"] + RTO_MIN / 2, q


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharing", [False, True], ids=["fixed-shares", "shared"])
def test_on_shared_cores_every_datagram_and_the_node_stages_copies_cost_cpu(run, sharing):
    from dataclasses import replace
    # 2 x 3 on 2 shared cores: a rank has a third of a core, and the port's
    # pace (0.95 Gbit/s / 3) is far above it (shared: every rank is busy at
    # once here, so each has a third of a core too, and a message is not in
    # before the CPU that sends it is done, though its bytes go at the pace)
    rate = 30e6
    flat = Scenario(nodes=2, ppn=3, rate=1e9, nbytes=MiB, algorithm="direct", deadline=5.0,
                    calls=2, mpi=False, cores=2, core_rate=rate, sharing=sharing)
    hier = replace(flat, algorithm="hierarchical", nbytes=4 * MiB)
    copied = replace(hier, copy_rate=60e6)
    f, h, c = run(flat, hier, copied)
    share = rate * 2 / 6
    # flat direct: all 5 streams of both stages at the rank's CPU share,
    # the 2 to peers on the node too (they cross no port, but are sealed and sent)
    frame = (flat.payload + UD_HEADERS) / flat.payload
    least = 2 * flat.nbytes * 5 / 6 * frame / share
    assert least <= f["lossy"]["p50"] <= 1.2 * least, (least, f)
    # the hierarchy's node stages: each rank copies its slice to 2 peers in
    # stage 1 and again in stage 4, at its share of the copy rate
    copies = 2 * 2 * hier.nbytes / 3 / (60e6 * 2 / 6)
    extra = c["lossy"]["p50"] - h["lossy"]["p50"]
    assert 0.9 * copies <= extra <= 1.2 * copies, (copies, h, c)
    assert [r["delivered"] for r in (f, h, c)] == pytest.approx([1.0] * 3)


def test_a_ranks_cpu_time_is_a_gamma_process_of_the_jitters_variance():
    from mpilossy.sim.world import _World
    w = _World.__new__(_World)
    w.s = Scenario(jitter=1e-3, seed=3)
    w._rngs = {}
    draws = [w.cpu_time(0, 0.01) for _ in range(20000)]
    mean = sum(draws) / len(draws)
    var = sum((d - mean) ** 2 for d in draws) / len(draws)
    assert mean == pytest.approx(0.01, rel=0.02)
    assert var == pytest.approx(1e-3 * 0.01, rel=0.1)
    # seeded per rank: the same draws again, others for another rank
    w2 = _World.__new__(_World)
    w2.s, w2._rngs = w.s, {}
    assert [w2.cpu_time(0, 0.01) for _ in range(5)] == draws[:5]
    assert [w2.cpu_time(1, 0.01) for _ in range(5)] != draws[:5]
    # no jitter: the mean itself
    w.s = Scenario(jitter=0.0)
    assert w.cpu_time(0, 0.01) == 0.01


@pytest.mark.timeout(120)
def test_jitter_gives_quiet_calls_a_tail_and_a_late_stage_loses_nothing(run):
    from dataclasses import replace
    steady = Scenario(nodes=2, ppn=2, rate=1e9, nbytes=MiB, algorithm="hierarchical",
                      deadline=0.3, calls=20, cores=2, core_rate=100e6, copy_rate=250e6)
    jittered = replace(steady, jitter=5e-4)
    a, b = run(steady, jittered)
    for kind in ("lossy", "mpi"):
        assert a[kind]["p99"] == pytest.approx(a[kind]["p50"], rel=0.01), a
        assert b[kind]["p99"] > 1.1 * b[kind]["p50"], b
    # ranks now start the network stage at different times; a datagram sent
    # before its reader asked for it waits in the reader's socket, not lost
    assert a["delivered"] == pytest.approx(1.0) and b["delivered"] == pytest.approx(1.0), b


SHARED_CORES_PROBE = """
import json, sys
from mpilossy.sim import _simgrid
from mpilossy.sim.engine import Scenario
from mpilossy.sim.flows import _Pacer, _wait
from mpilossy.sim.world import _World
sg = _simgrid.load()
engine = sg.Engine(["probe", "--log=root.thr:critical", "--log=xbt_cfg.thr:critical"])
w = _World(sg, Scenario(nodes=4, ppn=1, rate=1e9, cores=2, core_rate=100e6, sharing=True))
done = {}
def work(rank, start, seconds):
    sg.this_actor.sleep_for(start)
    w.compute(rank, seconds).join()
    done[rank] = sg.Engine.clock
def send(nbytes):
    pacer = _Pacer(w, 0, 10.0)
    pacer.send([("probe", 1, nbytes)])
    pacer.settle()
    pacer.close()
def receive():
    _wait([w.get("probe")], 10.0, lambda: sg.Engine.clock)
    done[1] = sg.Engine.clock
plan = json.loads(sys.argv[1])
if plan[0] == "message":
    sg.Actor.create("r0", w.host_of(0), send, plan[1])
    w.receivers[1] = sg.Actor.create("r1", w.host_of(1), receive)
    plan = [None, None]
else:
    for rank, (start, seconds) in enumerate(plan):
        sg.Actor.create(f"r{rank}", w.host_of(rank), work, rank, start, seconds)
engine.run()
print(json.dumps([done.get(r) for r in range(len(plan))]))
"""


def _shared_cores(plan):
    """When each rank's CPU work (start, seconds at its mean share) ends on
    4 ranks sharing 2 cores of 100 MB/s (or ["message", bytes]: when rank 1
    has rank 0's message of that many bytes)."""
    import json
    import subprocess
    import sys
    from mpilossy.sim import _simgrid
    try:
        _simgrid.load()
    except ImportError as e:
        pytest.skip(str(e))
    out = subprocess.run([sys.executable, "-c", SHARED_CORES_PROBE, json.dumps(plan)],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_shared_cores_serve_whoever_has_work_one_core_at_most_each():
    # 4 ranks on 2 cores: 10 ms of work at the mean share (half a core).
    # Ranks 0-2 start at once and have 2/3 of a core each until rank 3
    # comes at 5 ms, then half; rank 3 ends alone on one core (not two).
    ends = _shared_cores([[0, 0.01], [0, 0.01], [0, 0.01], [0.005, 0.01]])
    first = 0.005 + (0.01 * 50e6 - 0.005 * 2e8 / 3) / 50e6
    last = first + (0.01 * 50e6 - (first - 0.005) * 50e6) / 100e6
    assert ends[:3] == pytest.approx([first] * 3, rel=1e-6), ends
    assert ends[3] == pytest.approx(last, rel=1e-6), ends
    assert first < 0.01 and last < 0.015         # fixed shares: 10 and 15 ms
    # alone, a rank has one core: its work takes half its mean-share time
    assert _shared_cores([[0, 0.01]]) == pytest.approx([0.005], rel=1e-6)
    # a message is in once its sender's CPU is done (one core: 100 MB/s),
    # though its bytes cross the port at the pace (0.95 Gbit/s)
    nbytes = 4e6
    cpu = nbytes / 100e6
    arrived = _shared_cores(["message", nbytes])[1]
    assert cpu <= arrived <= 1.01 * cpu, (cpu, arrived)


@pytest.mark.timeout(120)
def test_shared_cores_speed_up_the_hierarchy_and_leave_mpi_its_share(run):
    from dataclasses import replace
    # 2 x 3 hierarchical: the node stages leave ranks idle in turn, whose
    # share the busy ones take; MPI's ranks poll without yielding, so its
    # figures are those of fixed shares, call for call
    fixed = Scenario(nodes=2, ppn=3, rate=1e9, nbytes=MiB, algorithm="hierarchical",
                     deadline=0.3, calls=6, cores=2, core_rate=100e6, copy_rate=250e6,
                     jitter=5e-4)
    a, b = run(fixed, replace(fixed, sharing=True))
    assert [b["mpi"][q] for q in ("p50", "p99")] == pytest.approx(
        [a["mpi"][q] for q in ("p50", "p99")], rel=1e-9), (a["mpi"], b["mpi"])
    assert b["lossy"]["p50"] < 0.95 * a["lossy"]["p50"], (a["lossy"], b["lossy"])
    assert b["delivered"] == pytest.approx(1.0), b


@pytest.mark.timeout(60)
def test_a_process_that_dies_in_a_run_fails_it_at_once():
    # (an exception in a simulated actor aborts its process: SimGrid's
    # maestro does not survive it; the runner must not wait for ever)
    import os
    from concurrent.futures.process import BrokenProcessPool
    from mpilossy.sim.runner import run_each
    with pytest.raises(BrokenProcessPool):
        run_each(os.abort, [()], jobs=1)
