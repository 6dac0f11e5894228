"""redundancy="auto": the code picked from the loss rate the ranks measured
and agreed (mpilossy/control/redundancy.py, docs/redundancy.md).  Every rank
must use the same code on every call, also when a rank is far behind; the
rule must pick the smallest m that meets the target; bad settings fail on
every rank."""

import itertools
import time

import numpy as np
from mpi4py import MPI
import pytest

import mpilossy
from mpilossy import _core
from mpilossy.control import redundancy as auto
from mpilossy.control.deadline import LAG, PERIOD
from mpilossy.errors import MismatchError, MPILossyError
from helpers import all_ranks_raise

needs_isal = pytest.mark.skipif(not _core.HAVE_ISAL,
                                reason="m >= 2 needs a build with Intel ISA-L (libisal-dev)")
FIRST_DUE = PERIOD + LAG        # the call at which the first agreement applies


# -- the rule ------------------------------------------------------------------
@pytest.mark.parametrize("k,m", [(2, 1), (4, 1), (4, 2), (5, 3), (8, 2)])
@pytest.mark.parametrize("p", [0.05, 0.1, 0.3])
def test_residual_loss_matches_every_loss_pattern(k, m, p):
    """residual_loss against the sum over all 2**(k+m) loss patterns of a
    group: block 0 is lost for good when it is lost and more than m of the
    group's records are."""
    exact = 0.0
    for pattern in itertools.product((0, 1), repeat=k + m):
        lost = sum(pattern)
        if pattern[0] and lost > m:
            exact += p ** lost * (1 - p) ** (k + m - lost)
    assert auto.residual_loss(p, k, m) == pytest.approx(exact, rel=1e-12)
    assert auto.residual_loss(p, k, 0) == p


@needs_isal
@pytest.mark.parametrize("p", [0.03, 0.1, 0.2, 0.25])
@pytest.mark.parametrize("target", [0.001, 0.01, 0.025])
def test_choose_takes_the_smallest_m_that_meets_the_target(p, target):
    k, m = auto.choose(p, target)
    assert k == auto.AUTO_K
    if m < auto.AUTO_MAX_M:
        assert auto.residual_loss(p, k, m) <= target
    if m > 1:
        assert auto.residual_loss(p, k, m - 1) > target


def test_choose_without_need_or_knowledge_adds_nothing():
    assert auto.choose(None, 0.01) is None       # before the first agreement
    assert auto.choose(0.0, 0.01) is None
    assert auto.choose(0.01, 0.01) is None       # already within the target


@needs_isal
def test_choose_caps_m_where_the_target_is_out_of_reach():
    assert auto.choose(0.5, 0.001) == (auto.AUTO_K, auto.AUTO_MAX_M)


def test_choose_keeps_to_codes_this_build_has(monkeypatch):
    """Without ISA-L only m = 1 exists: auto offers the best it has."""
    monkeypatch.setattr(auto, "fec_check", lambda k, m: None if m == 1 else "no ISA-L")
    assert auto.choose(0.3, 0.001) == (auto.AUTO_K, 1)


# -- on a communicator -------------------------------------------------------
def run_calls(lc, calls, n=6000, before=None):
    """`calls` all-reduces; returns [(seq, code, rebuilt)]."""
    x = np.ones(n)
    seen = []
    for _ in range(calls):
        if before is not None:
            before(lc.calls + 1)
        st = lc.allreduce(x.copy(), op="avg", algorithm="direct")
        seen.append((st.seq, st.redundancy, st.rebuilt))
    return seen


@pytest.mark.mpi
@needs_isal
def test_every_rank_uses_the_code_of_the_agreed_rate(comm):
    """10% loss: no parity before the first agreement, then on every rank
    the same code on every call, the one the agreed rate calls for, and
    blocks rebuilt from it."""
    loss = mpilossy.loss.Bernoulli(0.1, seed=5 + comm.rank)
    with mpilossy.Communicator(comm, timeout=1.0, loss=loss, block_bytes=512,
                               redundancy="auto") as lc:
        assert lc.loss_rate is None and lc.auto_redundancy() is None
        seen = run_calls(lc, FIRST_DUE + 8)
        rates = comm.allgather(lc.loss_rate)
        codes = comm.allgather([code for _, code, _ in seen])
        assert all(c == codes[0] for c in codes), "ranks used different codes"
        assert all(code is None for _, code, _ in seen[:FIRST_DUE - 1])
        if comm.size == 1:          # nothing read, nothing measured
            assert rates == [None] and all(code is None for _, code, _ in seen)
            return
        assert len(set(rates)) == 1 and 0.05 < rates[0] < 0.2, rates
        expected = auto.choose(rates[0], lc.config.redundancy_target)
        assert expected is not None and expected[1] >= 2
        assert all(code == expected for _, code, _ in seen[FIRST_DUE - 1:])
        assert sum(r for _, _, r in seen[FIRST_DUE - 1:]) > 0
        # a lower target asks for more parity, a higher one for less
        assert lc.auto_redundancy(0.001)[1] > expected[1]
        assert lc.auto_redundancy(0.5) is None


@pytest.mark.mpi
def test_lossless_auto_adds_no_parity_and_is_exact(comm):
    with mpilossy.Communicator(comm, timeout=None, block_bytes=512, redundancy="auto") as lc:
        x = np.arange(3001, dtype=np.float64) * (comm.rank + 1)
        for _ in range(FIRST_DUE + 2):
            out = np.empty_like(x)
            st = lc.allreduce(x, out)
            assert st.redundancy is None
        np.testing.assert_array_equal(out, np.arange(3001) * comm.size * (comm.size + 1) / 2)
        assert lc.loss_rate == (0.0 if comm.size > 1 else None)


@pytest.mark.mpi(min_size=2)
@needs_isal
@pytest.mark.timeout(120)
def test_a_rank_far_behind_gets_the_same_code(comm):
    """The last rank sleeps (1.5 s) past the others' due call: they wait for the
    agreement there instead of switching codes without it, so every call
    still has one code on every rank (a mismatch would fail the call)."""
    late = comm.size - 1
    loss = mpilossy.loss.Bernoulli(0.1, seed=7 + comm.rank)

    def nap(seq):
        if comm.rank == late and seq == PERIOD:
            time.sleep(1.5)

    with mpilossy.Communicator(comm, timeout=0.05, loss=loss, block_bytes=512,
                               redundancy="auto") as lc:
        try:
            outcome = [code for _, code, _ in run_calls(lc, FIRST_DUE + 6, before=nap)]
        except MPILossyError as exc:        # (MismatchError: the ranks' codes differed)
            outcome = f"{type(exc).__name__}: {exc}"
        outcomes = comm.allgather(outcome)
    assert all(o == outcomes[0] for o in outcomes), f"ranks used different codes: {outcomes}"
    assert outcomes[0][FIRST_DUE - 1] is not None


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_peer_that_never_comes_fails_the_due_call(comm, monkeypatch):
    """A peer more than LAG calls behind for longer than AGREE_WAIT: the
    due call raises on every rank instead of waiting for ever."""
    monkeypatch.setattr(auto, "AGREE_WAIT", 0.5)
    late = comm.size - 1

    def nap(seq):
        if comm.rank == late and seq == PERIOD:
            time.sleep(1.5)

    with mpilossy.Communicator(comm, timeout=0.05, block_bytes=512, redundancy="auto") as lc:
        def calls():
            run_calls(lc, FIRST_DUE, n=600, before=nap)
        message = all_ranks_raise(comm, calls, MPILossyError)
    assert "redundancy='auto'" in message or "could not take part" in message


@pytest.mark.mpi
@pytest.mark.parametrize("target", [0, 1, 1.5, -0.1, "1%", True])
def test_bad_targets_fail_on_every_rank(comm, target):
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(
        comm, redundancy="auto", redundancy_target=target), ValueError)
    assert "redundancy_target" in message


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_targets_fail_on_every_rank(comm):
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(
        comm, redundancy="auto", redundancy_target=0.01 if comm.rank else 0.02), MismatchError)
    assert "redundancy_target" in message


@pytest.mark.mpi
def test_auto_in_a_call_needs_an_auto_communicator(comm):
    with mpilossy.Communicator(comm, timeout=1.0) as lc:
        message = all_ranks_raise(
            comm, lambda: lc.allreduce(np.ones(100), redundancy="auto"), ValueError)
        assert "redundancy='auto'" in message
        with pytest.raises(ValueError, match="redundancy='auto'"):
            lc.auto_redundancy()
        # the communicator still works, and per-call auto works where built with it
        assert lc.allreduce(np.ones(100)).delivered == 1.0
    with mpilossy.Communicator(comm, timeout=1.0, redundancy="auto") as lc:
        assert lc.allreduce(np.ones(100), redundancy="auto").redundancy is None
        with pytest.raises(ValueError, match="target"):
            lc.auto_redundancy(2.0)


# -- the third hardening round (issue 38) ---------------------------------------
@pytest.mark.mpi(min_size=2)
@needs_isal
def test_ranks_whose_builds_differ_use_the_codes_every_build_has(comm, monkeypatch):
    """Rank 0 acts as a build without ISA-L (m = 1 only), the others have
    it.  Before: each rank chose m from its own build, so from the first
    agreement on every call failed as a mismatch; now the ranks agree on the
    largest m every build has at construction."""
    if comm.rank == 0:
        monkeypatch.setattr(auto, "fec_check", lambda k, m: None if m == 1 else "no ISA-L")
    loss = mpilossy.loss.Bernoulli(0.1, seed=5 + comm.rank)
    with mpilossy.Communicator(comm, timeout=1.0, loss=loss, block_bytes=512,
                               redundancy="auto") as lc:
        try:
            seen = [code for _, code, _ in run_calls(lc, FIRST_DUE + 4)]
        except MPILossyError as exc:
            seen = f"{type(exc).__name__}: {exc}"
        codes = comm.allgather(seen)
        assert all(c == codes[0] for c in codes), codes
        assert codes[0][-1] == (auto.AUTO_K, 1), codes
        assert lc.auto_redundancy(0.001) == (auto.AUTO_K, 1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_wait_for_a_late_peers_agreement_leaves_the_cpu_to_it(comm):
    """The last rank sleeps 1 s before the first agreement is due; the
    others wait for it at the due call.  Before: that wait spun on Test()
    and held a core (and the GIL) the whole second, starving a late rank
    that shares the cores; now it sleeps between tests."""
    late = comm.size - 1

    def nap(seq):
        if comm.rank == late and seq == PERIOD:
            time.sleep(1.0)

    with mpilossy.Communicator(comm, timeout=0.05, block_bytes=512, redundancy="auto") as lc:
        x = np.ones(600)
        waits = []
        for _ in range(FIRST_DUE + 1):
            nap(lc.calls + 1)
            wall, cpu = time.monotonic(), time.process_time()
            lc.allreduce(x.copy(), op="avg", algorithm="direct")
            waits.append((time.monotonic() - wall, time.process_time() - cpu))
        due = comm.allgather(waits[FIRST_DUE - 1])
    for rank, (wall, cpu) in enumerate(due[:-1]):
        assert wall > 0.5, due                  # it did wait for the late rank
        assert cpu < 0.25 * wall, due           # without holding a core


def test_late_blocks_are_the_deadlines_not_lost():
    """What the deadline cut is not counted: parity sent after late blocks is
    as late.  Dropped, gone, torn and rebuilt blocks are."""
    from types import SimpleNamespace
    comm = MPI.COMM_SELF.Dup()
    try:
        codes = auto.AutoRedundancy(comm, 0.025)
        codes.observe(SimpleNamespace(err_kind=0, read_blocks=100, lost_blocks=(2, 30, 3, 1),
                                      rebuilt=4))
        assert list(codes.recent) == [(2 + 3 + 1 + 4, 100)]
    finally:
        comm.Free()
