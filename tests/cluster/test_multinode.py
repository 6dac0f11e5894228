"""Several nodes: one MPI job across the nodes of an emulated cluster
(mpilossy.cluster: a network namespace, host name and /dev/shm per node,
a switch with 1 Gbit/s ports and 128 KB queues), ranks of a node on shared
memory, MPI over TCP between nodes, mpilossy's channels rma and ud (native
sockets) on top.

One job per topology (2 nodes x 2 ranks, 3 nodes x 1 rank) runs every check
(tests/programs/multinode.py) and prints what it measured; the tests below
assert on it, so a topology costs one launch (about 15 s).  At 2 x 3 and
3 x 2 one more job each checks the hierarchy alone (about 5 s each).  Needs root and
the tools mpilossy.cluster names (iproute2, nftables, ethtool, util-linux):
where they are missing the tests skip and say why.  They start their own mpiexec,
so they run in the single-rank session only."""

import json
import subprocess
import sys

import pytest

import mpilossy.cluster as emulated
from mpilossy import _core
from helpers import unavailable, is_singleton, PROGRAMS

SCRIPT = PROGRAMS / "multinode.py"
TOPOLOGIES = {"2x2": (2, 2), "3x1": (3, 1)}
HIERARCHY_ONLY = {"2x3": (2, 3), "3x2": (3, 2)}     # six ranks: the hierarchy's checks only
CHANNELS = ["rma", "ud"]
ALGORITHMS = ["direct", "ring", "tree", "hierarchical"]   # (at 3 x 1: the flat one)
# How far past its deadline a call may return here: 4 ranks poll on 2 shared
# cores, so a rank can wait a time slice or two for its turn; a TCP
# retransmission timeout (200 ms and more) would not fit.
MARGIN = 0.05           # past the deadline: deadline + 50 ms (docs/deadlines.md)
T_LIMIT = 5.0           # |t| above this on any element means biased (test_unbiased.py)

pytestmark = [
    pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1"),
    pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                       reason="channel='ud' not built (OpenSSL headers missing)"),
]


@pytest.fixture(scope="module")
def cluster():
    why = emulated.unavailable()
    if why:
        unavailable(f"emulated cluster: {why}")
    try:
        c = emulated.Cluster(nodes=3, rate="1gbit", queue="128kb").open()
    except emulated.ClusterUnavailable as exc:
        unavailable(f"emulated cluster: {exc}")
    with c:
        yield c


def measure(cluster, name, nodes, ppn, *args):
    """What tests/programs/multinode.py measured on one topology."""
    try:
        proc = cluster.run([sys.executable, str(SCRIPT), *args], ppn=ppn, nodes=nodes,
                           timeout=150)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{name}: the job ran past 150 s "
                             f"(killed):\n{exc.stdout}\n{exc.stderr}") from None
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n" \
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MULTINODE ")]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[0][len("MULTINODE "):])
    out["nodes"], out["ppn"] = nodes, ppn
    return out


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def report(request, cluster):
    return measure(cluster, request.param, *TOPOLOGIES[request.param])


@pytest.fixture(scope="module", params=sorted(HIERARCHY_ONLY))
def hierarchy_report(request, cluster):
    return measure(cluster, request.param, *HIERARCHY_ONLY[request.param], "--phases",
                   "topology,lossless,unbiased,drops", "--algorithms", "hierarchical")


def test_topology(report):
    """Ranks sit on the nodes hydra was told, each node with its own host
    name and /dev/shm; shared memory within a node, the network between."""
    nodes, ppn = report["nodes"], report["ppn"]
    topo = report["topology"]
    assert topo["hosts"] == [f"node{r // ppn + 1}" for r in range(nodes * ppn)], topo
    assert topo["node_sizes"] == [ppn] * (nodes * ppn), topo
    assert topo["sees_rank0_shm"] == [r < ppn for r in range(nodes * ppn)], topo
    assert [r["shared_memory_peers"] for r in topo["rma"]] == [ppn - 1] * (nodes * ppn), topo
    for r, ud in enumerate(topo["ud"]):
        assert ud["domain"] == "eth0", ud
        assert ud["address"].startswith(f"10.77.0.{r // ppn + 1}:"), ud


@pytest.mark.parametrize("channel", CHANNELS)
def test_lossless_equals_mpi_allreduce(report, channel):
    """No deadline, no loss: every algorithm, reduce_scatter and allgather
    equal MPI_Allreduce exactly (count of wrong elements over all ranks)."""
    wrong = report["lossless"][channel]
    assert len(wrong) == 3 * len(ALGORITHMS) + 2, wrong
    assert all(v == 0 for v in wrong.values()), wrong


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("channel", CHANNELS)
def test_unbiased_under_injected_loss(report, channel, algorithm):
    """10% injected loss, different data per rank: the rank-averaged result
    over the calls is the exact average, per element, within T_LIMIT
    standard errors."""
    r = report["unbiased"][f"{channel} {algorithm}"]
    assert r["lost_blocks"][0] > 0 and r["delivered"] < 0.99, r   # loss really happened
    assert r["max_t"] < T_LIMIT, r


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("channel", CHANNELS)
def test_lossy_calls_close_early(report, channel, algorithm):
    """A call that lost blocks ends when its producers are done, well before
    its deadline (the median of those calls), and none runs past it.

    Without early close a lossy call waits out its deadline (median at the
    deadline); with it, the median reached 52 and 54 ms on this 200 ms
    deadline in two CI runs (2x2 rma tree over two shared cores), so half the
    deadline separates the two with room on both sides."""
    r = report["unbiased"][f"{channel} {algorithm}"]
    assert r["lossy_elapsed_p50"] is not None, r
    assert r["lossy_elapsed_p50"] < 0.5 * r["timeout"], r
    assert r["elapsed_max"] < r["timeout"] + MARGIN, r


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("channel", CHANNELS)
def test_network_path_loses_only_injected_blocks(report, channel, algorithm):
    """Over a network that drops nothing, a lossy call loses what injected
    loss dropped and hardly anything else (issue 31: between nodes the
    one-sided channel lost sent blocks to early close and to reads waiting
    behind an injected loss): late, gone or torn blocks at most 5% of the
    injected ones; the delivered fraction within 0.02 of what the same
    seeded loss leaves on the datagram channel, which loses nothing else
    here; and no element of the average more than 4 standard errors off
    (before the fix: 20% to 37% of them on the ring)."""
    r = report["unbiased"][f"{channel} {algorithm}"]
    injected, late, gone, torn = r["lost_blocks"]
    assert late + gone + torn <= 0.05 * injected, r
    reference = report["unbiased"][f"ud {algorithm}"]["delivered"]
    assert abs(r["delivered"] - reference) <= 0.02, (r, reference)
    assert r["over_4"] == 0.0, r


@pytest.mark.parametrize("channel", CHANNELS)
def test_deadlines_hold_under_switch_drops(report, channel):
    """The switch drops 5% of the TCP and UDP packets: MPI over TCP
    retransmits, datagrams are lost, and every call still returns by its
    deadline."""
    r = report["drops"][channel]
    assert r["switch_drops"] > 0, r
    assert r["delivered_mean"] < 1.0, r       # the drops reached the calls
    if channel == "rma":
        assert r["tcp_retransmits"] > 0, r
    # (net of the time the kernel kept the rank off a core, helpers.cpu_wait:
    # 3-6 ranks, the cluster and the builds share 2 cores; raw, a call once
    # took 0.23-0.31 s in about one run of eight, on rma only)
    assert r["elapsed_net_max"] < r["timeout"] + MARGIN, r


@pytest.mark.parametrize("channel", CHANNELS)
def test_stopped_rank_does_not_stall_the_others(report, channel):
    """The last rank is SIGSTOPped for 0.8 s in the middle of a run of calls:
    the others' calls miss its contribution and keep returning by their
    deadline."""
    r = report["sigstop"][channel]
    assert r["others_missing_victim"] >= 3, r
    assert r["others_elapsed_max"] < r["timeout"] + MARGIN, r
    assert r["victim_span"] >= r["stop_seconds"], r


@pytest.mark.parametrize("channel", CHANNELS)
def test_hierarchy_at_six_ranks(hierarchy_report, channel):
    """2 x 3 and 3 x 2: the hierarchy (and the two-level reduce-scatter)
    exact without loss, unbiased under 10% injected loss (loss really
    happened), and every call by its deadline while the switch drops 5%."""
    r = hierarchy_report
    nodes, ppn = r["nodes"], r["ppn"]
    assert r["topology"]["node_sizes"] == [ppn] * (nodes * ppn), r["topology"]
    wrong = r["lossless"][channel]
    assert len(wrong) == 5 and all(v == 0 for v in wrong.values()), wrong
    lossy = r["unbiased"][f"{channel} hierarchical"]
    assert lossy["lost_blocks"][0] > 0 and lossy["delivered"] < 0.99, lossy
    assert lossy["max_t"] < T_LIMIT, lossy
    drops = r["drops"][channel]
    assert drops["switch_drops"] > 0 and drops["delivered_mean"] < 1.0, drops
    assert drops["elapsed_net_max"] < drops["timeout"] + MARGIN, drops   # (as above)
