"""redundancy=(k, m): parity records with every group of k blocks, and the
blocks rebuilt from them (docs/redundancy.md).  Rebuilt blocks must hold
exactly what was sent (checked against the contributor bitmaps of direct,
and against the only values a ring or tree block can hold), loss must take
parity as it takes data, and bad or mismatched codes fail on every rank.
(The erasure-code kernels themselves: test_fec_kernels.py.)"""

import numpy as np
import pytest

import mpilossy
from mpilossy import _core
from helpers import all_ranks_raise, all_ranks_raise_by_next_call, mpi_sum, small_ints

CHANNELS = ["rma", "ud"]
# m >= 2 is Reed-Solomon through ISA-L: built where its headers were found.
CODES = [(4, 1), pytest.param((8, 2), marks=pytest.mark.skipif(
    not _core.HAVE_ISAL, reason="m >= 2 needs a build with Intel ISA-L (libisal-dev)"))]


def signature(rank, n):
    """What rank r sends: 2**r times a pattern, so that an element's value
    tells whose data it holds, and a block rebuilt wrong cannot pass."""
    return (2.0 ** rank) * (1 + np.arange(n) % 7)


def subset_average(value, size):
    """Is `value` the average of 2**r over some set of ranks?"""
    for k in range(1, size + 1):
        total = value * k
        whole = round(total)
        if abs(total - whole) < 1e-9 * max(1.0, abs(total)) and 0 < whole < 2 ** size \
                and bin(whole).count("1") == k:
            return True
    return False


def communicator(comm, channel, code, p, **kwargs):
    loss = mpilossy.loss.Bernoulli(p, seed=11) if p else None
    return mpilossy.Communicator(comm, channel=channel, timeout=kwargs.pop("timeout", 1.0),
                                 loss=loss, block_bytes=512, redundancy=code, **kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_rebuilt_blocks_match_the_bitmaps(comm, channel, code, collective):
    """Direct under 20% loss: every block of the result, rebuilt or not, is
    the average of the signatures of the ranks its bitmap names, and blocks
    were rebuilt (at 2 ranks and more)."""
    n = 5000
    x = signature(comm.rank, n)
    pattern = 1 + np.arange(n) % 7
    rebuilt = 0
    with communicator(comm, channel, code, 0.2) as lc:
        lo, hi = lc.chunk_bounds(n)
        for _ in range(8):
            if collective == "allreduce":
                out = np.full(n, -1.0)
                st = lc.allreduce(x, out, op="avg", algorithm="direct")
                mine = pattern
            else:
                out = np.full(hi - lo, -1.0)
                st = lc.reduce_scatter(x, out, op="avg", algorithm="direct")
                mine = pattern[lo:hi]
            members = st.contributors.members()
            firsts, lengths = st.contributors.blocks()
            for first, length, who in zip(firsts, lengths, members):
                if length:
                    expected = sum(2.0 ** r for r in np.flatnonzero(who)) / who.sum()
                    np.testing.assert_allclose(out[first:first + length],
                                               expected * mine[first:first + length],
                                               rtol=1e-12)
            rebuilt += st.rebuilt
    if comm.size > 1:
        assert rebuilt > 0, "nothing was rebuilt: the test would prove nothing"
    else:
        assert rebuilt == 0


@pytest.mark.mpi
def test_compressed_and_weighted_records_are_rebuilt(comm):
    """Direct's other record layouts (int8 payloads with their scales; the
    weight trailer of a weighted average) are rebuilt as they were sent."""
    n = 4000
    x = signature(comm.rank, n).astype(np.float32)
    pattern = 1 + np.arange(n) % 7
    rebuilt = 0
    with communicator(comm, "ud", (4, 1), 0.2) as lc:
        # int8: off by up to a step (the group's largest value / 127) twice
        for kwargs, steps in (({"compression": "int8"}, 2 * 7 / 127), ({"weight": 1.0}, 1e-6)):
            for _ in range(4):
                out = np.full(n, -1.0, np.float32)
                st = lc.allreduce(x, out, op="avg", algorithm="direct", **kwargs)
                firsts, lengths = st.contributors.blocks()
                for first, length, who in zip(firsts, lengths, st.contributors.members()):
                    expected = sum(2.0 ** r for r in np.flatnonzero(who)) / who.sum()
                    np.testing.assert_allclose(out[first:first + length],
                                               expected * pattern[first:first + length],
                                               rtol=0, atol=steps * expected * 1.01)
                rebuilt += st.rebuilt
    if comm.size > 1:
        assert rebuilt > 0


@pytest.mark.mpi
@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_ring_and_tree_rebuild_what_was_sent(comm, channel, algorithm):
    """Ring and tree keep no bitmaps, but with signatures an element can only
    be the average of 2**r over some ranks (times its pattern); a rebuilt
    block with wrong bytes, count or length would break that."""
    n = 4000
    x = signature(comm.rank, n)
    pattern = 1 + np.arange(n) % 7
    rebuilt = 0
    with communicator(comm, channel, (4, 1), 0.15) as lc:
        for _ in range(8):
            out = np.full(n, -1.0)
            st = lc.allreduce(x, out, op="avg", algorithm=algorithm)
            base = out / pattern
            for value in np.unique(np.round(base, 12)):
                assert subset_average(value, comm.size), (value, st)
            rebuilt += st.rebuilt
    if comm.size > 1:
        assert rebuilt > 0


@pytest.mark.mpi
@pytest.mark.parametrize("channel", CHANNELS)
def test_redundancy_keeps_more_than_none(comm, channel):
    """Same loss, same calls: with (4, 1) more contributions arrive than
    without.  At 10% loss a lost block stays lost when another of the 4
    other records of its group is lost too (1 - 0.9**4 = 34%): 3.4% of
    blocks instead of 10%, in each of direct's two hops."""
    n = 20000
    x = small_ints(n, comm.rank, np.float64)
    delivered = {}
    for code in (None, (4, 1)):
        with communicator(comm, channel, code, 0.1) as lc:
            delivered[code] = np.mean([lc.allreduce(x, np.empty_like(x), algorithm="direct")
                                       .delivered for _ in range(10)])
    if comm.size > 1:
        assert delivered[(4, 1)] > delivered[None] + 0.03, delivered
        assert delivered[(4, 1)] > 0.94, delivered
    else:
        assert delivered == {None: 1.0, (4, 1): 1.0}


@pytest.mark.mpi
@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64])
def test_lossless_with_redundancy_is_exact(comm, channel, algorithm, dtype):
    """No loss, no deadline: the result is exact (odd lengths leave the last
    group short and padded)."""
    for n in (1, 777, 10001):
        x = small_ints(n, comm.rank, dtype)
        out = np.empty_like(x)
        with communicator(comm, channel, (4, 1), 0.0, timeout=None) as lc:
            st = lc.allreduce(x, out, algorithm=algorithm)
        np.testing.assert_array_equal(out, mpi_sum(comm, x))
        # (A block may still be rebuilt: the rest of its group and the
        # parity can be read before the block itself.  It is the same data.)
        assert st.delivered == 1.0


@pytest.mark.mpi
@pytest.mark.parametrize("channel", CHANNELS)
def test_without_deadline_dropped_blocks_are_rebuilt_or_given_up(comm, channel):
    """timeout=None with injected loss: a dropped block whose group can be
    rebuilt is rebuilt (waiting for its parity), one whose group cannot is
    lost at once; the call ends, and keeps more than without redundancy."""
    n = 20000
    x = small_ints(n, comm.rank, np.float64)
    delivered = {}
    for code in (None, (4, 1)):
        with communicator(comm, channel, code, 0.1, timeout=None) as lc:
            stats = [lc.allreduce(x, np.empty_like(x), algorithm="direct") for _ in range(5)]
        delivered[code] = np.mean([st.delivered for st in stats])
    if comm.size > 1:
        assert delivered[(4, 1)] > delivered[None] + 0.03, delivered


@pytest.mark.mpi
def test_parity_is_lost_like_data(comm):
    """Injected loss drops parity records as it drops data: at 100% loss
    nothing can be rebuilt and only this rank's own data is left."""
    n = 3000
    x = small_ints(n, comm.rank, np.float64)
    with communicator(comm, "rma", (4, 1), 1.0) as lc:
        st = lc.allreduce(x, np.empty_like(x), algorithm="direct")
    assert st.rebuilt == 0
    assert st.delivered == pytest.approx(1.0 / comm.size, abs=1e-9)


@pytest.mark.mpi(min_size=2)
def test_network_path_rebuilds(comm, monkeypatch):
    """The one-sided channel read through MPI_Rget (MPILOSSY_RMA_SHM=0, as
    between nodes) reads parity records in order behind a dropped block."""
    monkeypatch.setenv("MPILOSSY_RMA_SHM", "0")
    n = 4000
    x = signature(comm.rank, n)
    rebuilt = 0
    with communicator(comm, "rma", (4, 1), 0.2) as lc:
        assert lc.channel_info()["shared_memory_peers"] == 0
        for _ in range(5):
            out = np.full(n, -1.0)
            st = lc.allreduce(x, out, op="avg", algorithm="direct")
            for value in np.unique(np.round(out / (1 + np.arange(n) % 7), 12)):
                assert subset_average(value, comm.size)
            rebuilt += st.rebuilt
    assert rebuilt > 0


@pytest.mark.mpi
def test_allgather_with_redundancy(comm):
    n = 1000
    lc = communicator(comm, "ud", (4, 1), 0.2)
    with lc:
        lo, hi = lc.chunk_bounds(n)
        mine = np.arange(lo, hi, dtype=np.float64)
        rebuilt = 0
        for _ in range(5):
            out = np.full(n, -1.0)
            st = lc.allgather(mine, out)
            arrived = st.contributors.received()
            np.testing.assert_array_equal(out[arrived], np.arange(n, dtype=np.float64)[arrived])
            assert (out[~arrived] == -1.0).all()
            rebuilt += st.rebuilt
    if comm.size > 1:
        assert rebuilt > 0


# -- bad input ------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("code,exc,words", [
    ((1, 1), ValueError, "k must be in 2..64"),
    ((65, 1), ValueError, "k must be in 2..64"),
    ((4, 0), ValueError, "m must be in 1..8"),
    ((4, 4), ValueError, "less than k"),
    ((4, 9), ValueError, "m must be in 1..8"),
    ((4,), TypeError, "pair of ints"),
    ("4,1", TypeError, "pair of ints"),
    ((4.0, 1), TypeError, "pair of ints"),
    ((True, 1), TypeError, "pair of ints"),
])
def test_bad_codes_fail_on_every_rank(comm, code, exc, words):
    msg = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, redundancy=code), exc)
    assert words in msg
    x = np.ones(10)
    with mpilossy.Communicator(comm, timeout=0.5) as lc:
        msg = all_ranks_raise(comm, lambda: lc.allreduce(x, redundancy=code), exc)
        assert words in msg
        lc.allreduce(x)     # still works


@pytest.mark.mpi(min_size=2)
def test_communicators_that_disagree_fail_on_every_rank(comm):
    code = (4, 1) if comm.rank == comm.size - 1 else None
    msg = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, redundancy=code),
                          mpilossy.MismatchError)
    assert "redundancy" in msg


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("timeout", [None, 0.5])
def test_calls_that_disagree_fail_on_every_rank(comm, channel, timeout):
    x = small_ints(3000, comm.rank, np.float64)
    code = (4, 1) if comm.rank == comm.size - 1 else None
    with mpilossy.Communicator(comm, channel=channel, timeout=timeout) as lc:
        msg = all_ranks_raise_by_next_call(
            comm, lambda: lc.allreduce(x, algorithm="ring", redundancy=code),
            None if timeout is None else lambda: lc.allreduce(x, algorithm="ring"),
            mpilossy.MismatchError, timeout)
        out = np.empty_like(x)
        lc.allreduce(x, out, algorithm="ring")
        np.testing.assert_array_equal(out, mpi_sum(comm, x))
    assert "redundancy" in msg


@pytest.mark.skipif(_core.HAVE_ISAL, reason="this build has ISA-L")
def test_reed_solomon_without_isal_says_what_to_install(comm):
    with pytest.raises(ValueError, match="libisal-dev"):
        mpilossy.Communicator(comm, redundancy=(8, 2))
