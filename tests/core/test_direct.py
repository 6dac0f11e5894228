"""The direct (one-hop) algorithm: who contributed, early close, and the
fraction of contributions it keeps at scale.  (Exactness, unbiasedness,
deadlines, lagging ranks and errors are checked with the other algorithms in
test_lossless, test_unbiased, test_deadline, test_collectives, test_errors
and test_ud.)"""

import json
import time

import numpy as np
import pytest

import mpilossy
from helpers import is_singleton, run_bounded, mpiexec


def signature(rank):
    return float(2 ** rank)


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_bitmaps_say_whose_data_is_in_each_block(comm, collective):
    """Rank r sends 2**r everywhere, so a block's value tells exactly whose
    data it holds: avg * K must be the sum of 2**r over its bitmap."""
    n = 1000
    x = np.full(n, signature(comm.rank))
    loss = mpilossy.loss.Bernoulli(0.3, seed=5)
    missing = 0
    with mpilossy.Communicator(comm, timeout=0.5, loss=loss, block_bytes=128) as lc:
        lo, hi = lc.chunk_bounds(n)
        for _ in range(30):
            if collective == "allreduce":
                out = np.full(n, -1.0)
                st = lc.allreduce(x, out, op="avg", algorithm="direct")
            else:
                out = np.full(hi - lo, -1.0)
                st = lc.reduce_scatter(x, out, op="avg", algorithm="direct")
            c = st.contributors
            members = c.members()
            firsts, lengths = c.blocks()
            assert lengths.sum() == out.size and members.shape == (len(firsts), comm.size)
            for first, length, who in zip(firsts, lengths, members):
                if length == 0:
                    continue
                k = int(who.sum())
                assert k >= 1
                expected = sum(signature(r) for r in np.flatnonzero(who))
                block = out[first:first + length]
                np.testing.assert_allclose(block * k, expected, rtol=1e-12)
                missing += k < comm.size
            mask = c.mask()
            assert mask.shape == out.shape
            if out.size:
                assert abs(c.fraction() - mask.mean()) < 1e-12
            assert st.contributed(comm.rank) == c.fraction()
    if comm.size > 1:
        assert missing > 0, "no loss happened: the test would prove nothing"


def check_against_bitmaps(out, contributors):
    """Every block's value is the average of the signatures of its members."""
    members = contributors.members()
    firsts, lengths = contributors.blocks()
    for first, length, who in zip(firsts, lengths, members):
        if length:
            expected = sum(signature(r) for r in np.flatnonzero(who)) / who.sum()
            np.testing.assert_allclose(out[first:first + length], expected, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_late_rank_in_place_many_rows(comm, monkeypatch):
    """A rank that enters after the others finished finds every reduced block
    published at once; its sends are still produced row by row.  In place, a
    reduced block must not overwrite (and a fallback must not read) a row of
    its own data before that row was sent: its result must still match the
    bitmaps, fallbacks included.  (Grace 0: dropped blocks resolve at once.)"""
    monkeypatch.setenv("MPILOSSY_EARLY_CLOSE", "0")
    late = comm.size - 1
    loss = mpilossy.loss.Bernoulli(0.3, seed=9)
    wrong = []
    with mpilossy.Communicator(comm, timeout=0.1, loss=loss, block_bytes=64) as lc:
        for call in range(4):
            x = np.full(4000, signature(comm.rank))
            comm.Barrier()
            if comm.rank == late:
                time.sleep(0.15)
            st = lc.allreduce(x, op="avg", algorithm="direct")
            try:
                check_against_bitmaps(x, st.contributors)
            except AssertionError as exc:      # collectives first, assertions after
                wrong.append(f"call {call}: {str(exc)[:300]}")
        comm.Barrier()
    everyone = comm.allgather(wrong)
    assert not any(everyone), everyone


@pytest.mark.mpi
def test_other_algorithms_do_not_claim_to_know(comm, lc):
    st = lc.allreduce(np.ones(10), algorithm="ring")
    assert st.contributors is None
    with pytest.raises(ValueError, match="direct"):
        st.contributed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("loss", [0.0, 0.2])
def test_early_close_waits_for_a_late_sender(comm, loss):
    """A rank that enters late but well before the deadline is waited for:
    the others' early close must not end the call without its data."""
    late = comm.size - 1
    x = np.full(4096, signature(comm.rank))
    delay, timeout = 0.05, 1.0
    with mpilossy.Communicator(comm, timeout=timeout, loss=f"bernoulli:{loss}") as lc:
        lc.allreduce(x, np.empty_like(x), algorithm="direct")
        have = []
        for _ in range(5):
            comm.Barrier()
            if comm.rank == late:
                time.sleep(delay)
            st = lc.allreduce(x, np.empty_like(x), algorithm="direct")
            have.append(st.contributed(late))
            if comm.rank != late:
                assert delay * 0.8 <= st.elapsed < timeout / 2, st
    have = np.mean(have)
    if loss == 0:
        assert have == 1.0
    else:
        # Lost blocks miss it as often as anyone's; late blocks would miss it always.
        assert have > 0.5, have


@pytest.mark.mpi(min_size=2)
def test_early_close_ends_lossy_calls_before_the_deadline(comm, monkeypatch):
    """Under 10% injected loss a lossy call ends when the senders are done,
    not at its deadline; with early close off it ends at the deadline."""
    x = np.ones(64 * 1024, np.float32)
    loss = mpilossy.loss.Bernoulli(0.1, seed=3)
    with mpilossy.Communicator(comm, timeout=0.5, loss=loss, block_bytes=16 * 1024) as lc:
        stats = [lc.allreduce(x, np.empty_like(x), algorithm="direct") for _ in range(60)]
    lossy = sum(s.lost_blocks[0] > 0 for s in stats)
    hits = sum(s.deadline_hit for s in stats)
    lossy, hits = comm.allreduce(lossy), comm.allreduce(hits)
    assert lossy > 30, "too little loss to tell"
    # A call still reaches its deadline where an end mark was lost too (1% of streams).
    assert hits < 0.3 * lossy, (hits, lossy)
    monkeypatch.setenv("MPILOSSY_EARLY_CLOSE", "-1")
    with mpilossy.Communicator(comm, timeout=0.02, loss=loss, block_bytes=16 * 1024) as lc:
        stats = [lc.allreduce(x, np.empty_like(x), algorithm="direct") for _ in range(10)]
    assert all(s.deadline_hit for s in stats if s.lost_blocks[0] > 0)


@pytest.mark.timeout(400)
@pytest.mark.skipif(not is_singleton(), reason="starts its own 8 ranks (run at size 1)")
def test_direct_keeps_one_minus_p_at_8_ranks_and_the_ring_does_not(tmp_path):
    """At 8 ranks and 10% loss a reduced block holds 1 + 7q of 8
    contributions on the direct path (q = 0.9: 0.9125), within twice the
    half-width of its 95% interval over calls (plus 0.005), and clearly less
    on the ring ((1 - q^8)/p of 8: 0.71)."""
    out = tmp_path / "rows.json"
    proc = run_bounded([mpiexec(), "-n", "8", "python", "-m", "mpilossy.bench", "delivery",
                        "--loss", "0.1", "-a", "direct,ring", "--calls", "120",
                        "--elements", "2048", "--json", str(out)], timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["algorithm"]: r for r in json.loads(out.read_text())}
    direct, ring = rows["direct"], rows["ring"]
    bound = 2 * direct["agreed_ci95"] + 0.005
    assert abs(direct["agreed"] - direct["expected"]) < bound, direct
    assert direct["expected"] == pytest.approx(1 - 0.1 + 0.1 / 8)
    assert ring["agreed"] + 2 * ring["agreed_ci95"] < direct["expected"] - 0.1, ring
