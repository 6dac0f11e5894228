"""The fault matrix (docs/deadlines.md): each fault, at every size (the
matrix is meant for 3 and 4 ranks; smaller sizes run it too), on both
channels where built.  Every case asserts

- every rank that the fault does not stop returns within deadline + MARGIN;
- no element of any result is corrupted: each is the scaled sum of whole
  contributions of some set of ranks (exact where nothing was lost);
- the next calls on the same communicator are exact.

Rank r contributes 2**r * w[i] to element i (w = 1 + i % 7), so a result
element times |S| / size over w[i] must be the bit pattern of a set S of
ranks: anything else (a torn block, data from another call or another place)
is caught element by element."""

import itertools
import os
import resource
import signal
import time

import numpy as np
import pytest

import mpilossy
from mpilossy import _core
from mpilossy.loss import Bernoulli, GilbertElliott
from helpers import DOCUMENTED_FACTOR, is_singleton, last_report, run_mpi_script

TIMEOUT = 0.05
MARGIN = 0.03           # as tests/core/test_deadline.py; docs/deadlines.md has the measured one
N = 20_011              # elements: several blocks per chunk, not a multiple of anything
CHANNELS = ["rma"] + (["ud"] if _core.HAVE_LIBFABRIC and _core.HAVE_DATAGRAM_AUTH else [])
ALGORITHMS = ["ring", "tree", "direct"]


def contribution(rank, n=N, call=0):
    w = 1.0 + (np.arange(n) + call) % 7
    return (2.0 ** rank) * w, w


def decoded(out, w, size):
    """(elements that are no scaled sum of whole contributions, the mean
    share of the ranks in the sets of the others): that share is what
    `delivered` must report (a rank that kept only its own data has 1/N)."""
    sets = {}
    for k in range(1, size + 1):
        for ranks in itertools.combinations(range(size), k):
            sets[sum(2 ** r for r in ranks) * size / k] = k
    allowed = np.array(sorted(sets))
    ratio = out / w
    at = np.clip(np.searchsorted(allowed, ratio), 0, len(allowed) - 1)
    below = np.clip(at - 1, 0, len(allowed) - 1)
    hit = np.where(np.isclose(ratio, allowed[at], rtol=1e-12, atol=0), at,
                   np.where(np.isclose(ratio, allowed[below], rtol=1e-12, atol=0), below, -1))
    ok = hit >= 0
    counts = np.array([sets[v] for v in allowed])[hit[ok]]
    return int(np.count_nonzero(~ok)), float(counts.mean()) / size if counts.size else 0.0


def corrupted(out, w, size):
    """Elements that are no scaled sum of whole contributions."""
    return decoded(out, w, size)[0]


def check_call(lc, comm, algorithm, call, late_ok=False):
    """One call; returns (elapsed, corrupted elements (-1: delivered is not
    what the elements hold), delivered, exact)."""
    x, w = contribution(comm.rank, call=call)
    out = np.full_like(x, np.nan)
    began = time.monotonic()
    stats = lc.allreduce(x, out, algorithm=algorithm)
    took = time.monotonic() - began
    exact = bool(np.array_equal(out, (2 ** comm.size - 1) * w))
    bad, held = decoded(out, w, comm.size)
    if not bad and abs(held - stats.delivered) > 1e-9:
        bad = -1            # (what the elements hold is not what the call says it delivered)
    return took, bad, stats.delivered, exact


def then_exact(comm, lc, algorithm, calls=3):
    """After the fault: barrier, then calls without deadline are exact."""
    comm.Barrier()
    for call in range(calls):
        x, w = contribution(comm.rank, call=call)
        out = np.empty_like(x)
        stats = lc.allreduce(x, out, algorithm=algorithm, timeout=None)
        np.testing.assert_array_equal(out, (2 ** comm.size - 1) * w)
        assert stats.delivered == 1.0


def summarize(comm, rows, exempt=()):
    """Gather (rank, took, corrupted, delivered) rows; assert the bounds."""
    everyone = [row for rank_rows in comm.allgather(rows) for row in rank_rows]
    late = [(r, round(t, 4)) for r, t, _, _ in everyone if r not in exempt and t > TIMEOUT + MARGIN]
    bad = [(r, c) for r, _, c, _ in everyone if c]
    assert not bad, f"corrupted elements (rank, count): {bad}"
    # 4 ranks share 2 cores here: allow one scheduling outlier per case, bounded.
    assert len(late) <= 1 and all(t < TIMEOUT + 0.2 for _, t in late), f"late calls: {late}"
    return everyone


@pytest.fixture(params=CHANNELS)
def channel(request):
    return request.param


# -- a rank stopped (SIGSTOP) for 10x the deadline, then continued --------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sigstop_a_rank(comm, channel, algorithm):
    victim = comm.size - 1
    pids = comm.allgather(os.getpid())
    rows = []
    with mpilossy.Communicator(comm, channel=channel, timeout=TIMEOUT) as lc:
        for call in range(3):
            check_call(lc, comm, algorithm, call)
        comm.Barrier()
        if comm.rank == 0:
            os.kill(pids[victim], signal.SIGSTOP)
        began = time.monotonic()
        for call in range(12):
            took, bad, delivered, _ = check_call(lc, comm, algorithm, call)
            rows.append((comm.rank, took, bad, delivered))
            if comm.rank == 0 and time.monotonic() - began > 10 * TIMEOUT and pids[victim]:
                os.kill(pids[victim], signal.SIGCONT)
                pids[victim] = 0
        if comm.rank == 0 and pids[victim]:
            os.kill(pids[victim], signal.SIGCONT)
        everyone = summarize(comm, rows, exempt=(victim,))
        if comm.size > 1:
            assert min(d for r, _, _, d in everyone if r != victim) < 1.0   # the stop was felt
        then_exact(comm, lc, algorithm)


# -- a rank lagging 3 or 10 calls ---------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("lag", [3, 10])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_rank_lagging_calls(comm, channel, algorithm, lag):
    laggard = comm.size - 1
    rows = []
    with mpilossy.Communicator(comm, channel=channel, timeout=TIMEOUT) as lc:
        for call in range(3):
            check_call(lc, comm, algorithm, call)
        comm.Barrier()
        for call in range(lag + 10):
            if comm.rank == laggard and call == 0:
                time.sleep(lag * TIMEOUT)          # the others make ~lag calls meanwhile
            took, bad, delivered, _ = check_call(lc, comm, algorithm, call)
            rows.append((comm.rank, took, bad, delivered))
        summarize(comm, rows)
        then_exact(comm, lc, algorithm)


# -- injected loss: 30% Bernoulli, and Gilbert-Elliott bursts ----------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["bernoulli", "bursts"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_heavy_and_bursty_loss(comm, channel, algorithm, model):
    loss = (Bernoulli(0.3, seed=5) if model == "bernoulli"
            else GilbertElliott(p_good_to_bad=0.05, p_bad_to_good=0.3, seed=5))
    rows = []
    with mpilossy.Communicator(comm, channel=channel, timeout=TIMEOUT, loss=loss) as lc:
        for call in range(15):
            took, bad, delivered, _ = check_call(lc, comm, algorithm, call)
            rows.append((comm.rank, took, bad, delivered))
        everyone = summarize(comm, rows)
        assert min(d for _, _, _, d in everyone) < 1.0
        lc._state.core.configure_loss({})            # loss off: the same communicator goes on exact
        then_exact(comm, lc, algorithm)


# -- bad input on one rank only, every validation rule -------------------------------------
def bad_inputs():
    good = np.ones(1000)
    shared = np.ones(1500)
    ro = np.ones(1000)
    ro.flags.writeable = False
    cases = {
        "size": (np.ones(1001), None, {}),
        "dtype": (np.ones(1000, np.float32), None, {}),
        "unsupported dtype": (np.ones(1000, np.complex64), None, {}),
        "non-contiguous": (np.ones(2000)[::2], None, {}),
        "read-only": (good, ro, {}),
        "recv size": (good, np.ones(999), {}),
        "recv dtype": (good, np.ones(1000, np.float32), {}),
        "overlap": (shared[:1000], shared[500:], {}),
        "not a buffer": ("gradients", None, {}),
        "op": (good, None, {"op": "max"}),
        "timeout": (good, None, {"timeout": -1.0}),
        "algorithm": (good, None, {"algorithm": "butterfly"}),
    }
    return cases


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rule", list(bad_inputs()))
def test_bad_input_on_one_rank(comm, channel, rule):
    culprit = comm.rank == comm.size - 1
    with mpilossy.Communicator(comm, channel=channel, timeout=0.5) as lc:
        send, recv, kwargs = bad_inputs()[rule] if culprit else (np.ones(1000), None, {})
        if recv is None and not isinstance(send, str):
            recv = np.empty(send.shape, send.dtype) if send.flags.writeable else None
        began = time.monotonic()
        try:
            lc.allreduce(send, recv, **kwargs)
            outcome = "returned"
        except (TypeError, ValueError, BufferError, mpilossy.MPILossyError) as exc:
            outcome = type(exc).__name__
        took = time.monotonic() - began
        outcomes = comm.allgather((outcome, took))
        assert all(o != "returned" for o, _ in outcomes), outcomes
        assert all(t < 0.5 + MARGIN for _, t in outcomes), outcomes
        then_exact(comm, lc, "direct")


# -- 10,000 calls: no memory growth -------------------------------------------------------
def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_ten_thousand_calls_do_not_grow_memory(comm, channel):
    if comm.size == 3:
        # (what grows per call is the same at 2 and 4 ranks; 3 saves CI ~30 s)
        pytest.skip("memory growth is measured at 2 and 4 ranks")
    x = np.ones(4096)
    out = np.empty_like(x)
    algorithms = ["ring", "tree", "direct"]
    # A 10 ms deadline: the calls whose injected loss took both copies of an
    # end mark wait it out (docs/deadlines.md): at 50 ms this test took 33 s
    # at 4 ranks, at 10 ms 21 s; what it measures is per call, not per second.
    with mpilossy.Communicator(comm, channel=channel, timeout=0.01,
                               loss=Bernoulli(0.1, seed=1)) as lc:
        for call in range(500):                  # every path warmed up, buffers grown
            lc.allreduce(x, out, algorithm=algorithms[call % 3])
        before = rss_bytes()
        for call in range(10_000):
            lc.allreduce(x, out, algorithm=algorithms[call % 3])
        after = rss_bytes()
        comm.Barrier()
    growth = comm.allgather(after - before)
    assert max(growth) < 4 << 20, f"resident memory grew by {growth} bytes per rank"


# -- timeout="auto" with a straggler from the first call ----------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [3, 4])
def test_auto_deadline_holds_with_a_straggler(ranks):
    """The last rank sleeps 20 ms before 5% of 300 calls (1 MiB, no barrier).
    Before: the ranks' calls blocked on the deadline agreement until the
    straggler joined it, up to 33 ms past a learned 1-2 ms deadline."""
    if not is_singleton():
        pytest.skip("starts its own mpiexec: runs at size 1")
    # The deadline is the documented rule of what the ranks agreed, far below
    # the cap; every sleep outlasts it (the straggler sleeps 3x the deadline
    # in force), so the others' calls the sleeper misses are cut; and they
    # end within the deadline + 30 ms, but for one outlier under 200 ms on a
    # loaded machine (docs/deadlines.md, "Measured margin").  Before the fix
    # every other rank waited out every sleep (20-33 ms past the deadline).
    # "Far below the cap" needs calls that are fast: once in CI, beside the
    # builds, 4 ranks learned 295 ms from slow calls.  The run is made again,
    # at most three times, until the learned deadline is under a tenth of the
    # cap; the other checks hold for that run.
    for attempt in range(3):
        proc = run_mpi_script("auto_straggler.py", ranks, "--calls", "300", timeout=90)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        result = last_report(proc.stdout, proc.stderr)
        rule = min(max(DOCUMENTED_FACTOR * result["scale"] * result["agreed_ms"],
                       result["floor_ms"]), result["cap_ms"])
        assert result["last_ms"] == pytest.approx(rule), result
        if rule < 0.1 * result["cap_ms"]:
            break
    assert rule < 0.1 * result["cap_ms"], result
    assert result["straggled"] >= 5 and result["delivered_straggled"] < 1.0, result
    assert result["over_30ms"] <= 1 and result["max_over_deadline_ms"] < 200, result
