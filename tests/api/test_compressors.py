"""The compressors of mpilossy.compression (LowBit, aligned TopK) on NumPy
vectors: the same blocks on every rank, the chosen values reduced exactly,
what is sent plus what is kept is the vector (error feedback), bad
settings refused.  (The optimizers and the hook with them:
test_torch_compression.py.)"""

import numpy as np
import pytest
from mpi4py import MPI

import mpilossy
from mpilossy.compression import LowBit, TopK
from helpers import all_ranks_raise


def same_on_every_rank(comm, values):
    return all(np.array_equal(v, values) for v in comm.allgather(values))


def grad(rank, n, step=0):
    """Each rank's gradient: a shared part with a few strong blocks, and its own noise."""
    rng = np.random.default_rng([step, 99])
    shared = rng.standard_normal(n) * np.repeat(rng.random(-(-n // 64)) ** 4, 64)[:n]
    own = np.random.default_rng([step, rank]).standard_normal(n) * 0.1
    return (shared + own).astype(np.float32)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 1000, 10_007])
def test_topk_sends_the_same_blocks_and_keeps_the_rest(comm, n):
    topk = TopK(0.1, block=64)
    with mpilossy.Communicator(comm, timeout=None) as lc:
        g = grad(comm.rank, n)
        data = g.copy()
        topk.allreduce(lc, "k", data, op="avg")
    nonzero = np.flatnonzero(data)
    assert same_on_every_rank(comm, nonzero.astype(np.float64))
    blocks = np.unique(nonzero // 64)
    assert blocks.size == min(-(-n // 64), max(1, -(-(-(-n // 64)) // 10)))
    mean = comm.allreduce(g.astype(np.float64)) / comm.size
    np.testing.assert_allclose(data[nonzero], mean[nonzero], rtol=1e-5, atol=1e-6)
    residual = topk.residual("k")
    sent = np.zeros(n, bool)
    sent[nonzero] = True
    assert not residual[sent].any()
    np.testing.assert_array_equal(residual[~sent], g[~sent])
    # the chosen blocks hold the most energy (max over ranks): none left out is larger
    energy = np.square(np.pad(g.astype(np.float64), (0, -n % 64))).reshape(-1, 64).sum(axis=1)
    comm.Allreduce(MPI.IN_PLACE, energy, op=MPI.MAX)
    chosen = np.zeros(energy.size, bool)
    chosen[blocks] = True
    if (~chosen).any():
        assert energy[chosen].min() >= energy[~chosen].max()


@pytest.mark.mpi
@pytest.mark.parametrize("make", [lambda: TopK(0.05), lambda: LowBit("int4")],
                         ids=["topk", "int4"])
def test_error_feedback_sends_every_gradient_eventually(comm, make):
    """Lossless: the sum of the reduced gradients over steps is the sum of the
    true averages less the average residual still held (nothing is lost)."""
    compressor = make()
    n, steps = 5000, 12
    total = np.zeros(n)
    truth = np.zeros(n)
    with mpilossy.Communicator(comm, timeout=None, rotate=False) as lc:
        for step in range(steps):
            g = grad(comm.rank, n, step)
            truth += comm.allreduce(g.astype(np.float64)) / comm.size
            lo, hi = lc.chunk_bounds(n)
            out = np.empty(hi - lo, np.float32)
            compressor.reduce_scatter(lc, "g", g.copy(), out, op="avg")
            total[lo:hi] += out
        held = comm.allreduce(compressor.residual("g").astype(np.float64)) / comm.size
    np.testing.assert_allclose(total[lo:hi], (truth - held)[lo:hi], rtol=1e-4, atol=1e-4)
    # and without feedback the same sum misses what was left out
    if comm.size > 1 or isinstance(compressor, TopK):
        assert np.abs(held).max() > 1e-3


@pytest.mark.mpi
def test_topk_density_one_is_the_plain_average(comm):
    with mpilossy.Communicator(comm, timeout=None) as lc:
        g = grad(comm.rank, 3000)
        data = g.copy()
        TopK(1.0, error_feedback=False).allreduce(lc, 0, data, op="avg")
        plain = g.copy()
        lc.allreduce(plain, op="avg", algorithm="direct")
    np.testing.assert_allclose(data, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.mpi
@pytest.mark.parametrize("make,exc", [
    (lambda: TopK(0.0), ValueError), (lambda: TopK(1.5), ValueError),
    (lambda: TopK(0.1, block=0), ValueError), (lambda: LowBit("int2"), ValueError),
    (lambda: LowBit("int8", error_feedback=1), TypeError)])
def test_bad_compressors(make, exc):
    with pytest.raises(exc):
        make()


@pytest.mark.mpi(min_size=2)
def test_topk_under_loss_averages_what_arrived(comm):
    """30% of blocks lost: every rank still chooses the same blocks (the
    selection is reliable), and each chosen value is an average of some of
    the ranks' values (between their smallest and largest)."""
    n = 20_000
    g = grad(comm.rank, n)
    data = g.copy()
    with mpilossy.Communicator(comm, timeout=0.5, block_bytes=256,
                               loss=mpilossy.loss.Bernoulli(0.3, seed=5)) as lc:
        stats = TopK(0.2, error_feedback=False).allreduce(lc, 0, data, op="avg")
    assert stats.delivered < 1.0
    every = np.stack(comm.allgather(g))
    chosen = data != 0
    assert same_on_every_rank(comm, np.unique(np.flatnonzero(chosen) // 64))
    lo, hi = every.min(axis=0), every.max(axis=0)
    slack = 1e-5 * np.abs(every).max()
    assert np.all(data[chosen] >= lo[chosen] - slack) and np.all(data[chosen] <= hi[chosen] + slack)


# -- NaN, infinities and ties: the same blocks on every rank, by construction ------
def _chosen(result: np.ndarray, block: int) -> list:
    """The blocks that TopK sent: those of the result that are not all zero."""
    rows = result.reshape(-1, block)
    return [b for b in range(rows.shape[0]) if not np.all(rows[b] == 0)]


@pytest.mark.mpi
def test_topk_nan_and_inf_on_one_rank_choose_the_same_blocks_everywhere(comm, lc):
    """One rank's NaN in a block of little energy, another's -inf: both
    blocks count as of infinite energy on every rank (a NaN gradient is sent,
    not hidden), whatever the reduction's order of operands, and each
    reduced block holds that block's values only (no mix of blocks)."""
    block, nblocks = 4, 8
    # rank r, block b: (b + 1) (r + 1) / 8, so block 7 has the most energy
    mine = np.repeat((np.arange(nblocks) + 1.0) * (comm.rank + 1) / 8, block).astype(np.float32)
    exact = np.repeat((np.arange(nblocks) + 1.0) * comm.size * (comm.size + 1) / 16, block)
    topk = TopK(3 / nblocks, error_feedback=False, block=block)
    for culprit in range(comm.size):
        data = mine.copy()
        if comm.rank == culprit:
            data[2 * block + 1] = np.nan
        if comm.rank == (culprit + 1) % comm.size:
            data[5 * block] = -np.inf
        topk.allreduce(lc, "g", data, op="sum")
        chosen = comm.allgather(_chosen(data, block))
        assert all(c == [2, 5, 7] for c in chosen), (culprit, chosen)
        assert np.isnan(data[2 * block + 1]) and data[5 * block] == -np.inf, data
        rows = [b for b in range(nblocks) if b not in (2, 5)]
        got = data.reshape(nblocks, block)[rows]
        want = np.where(np.isin(rows, [7]), 1.0, 0.0)[:, None] * exact.reshape(nblocks, block)[rows]
        np.testing.assert_array_equal(got, want.astype(np.float32))
        np.testing.assert_array_equal(data.reshape(nblocks, block)[5, 1:],
                                      exact[5 * block + 1:6 * block])
    # Three blocks, one chosen: before NaN was mapped first, MPICH's maximum
    # at 4 ranks chose block 1 on some ranks and block 2 on others.
    few = mine[:3 * block]
    for culprit in range(comm.size):
        data = few.copy()
        if comm.rank == culprit:
            data[block] = np.nan
        TopK(1 / 3, error_feedback=False, block=block).allreduce(lc, "h", data, op="sum")
        chosen = comm.allgather(_chosen(data, block))
        assert all(c == [1] for c in chosen), (culprit, chosen)


@pytest.mark.mpi
def test_topk_ties_go_to_the_lowest_block_index(comm, lc):
    """Equal energies: the lower block index wins, a rule (a stable sort by
    energy, then index) rather than what np.argpartition's build happens to
    pick among ties."""
    block, nblocks = 4, 40
    data = np.repeat(np.tile([1.0, 2.0], nblocks // 2), block).astype(np.float32)
    TopK(0.07, error_feedback=False, block=block).allreduce(lc, "g", data, op="sum")
    chosen = comm.allgather(_chosen(data, block))
    assert all(c == [1, 3, 5] for c in chosen), chosen      # ceil(0.07 * 40) = 3 of the ties
    np.testing.assert_array_equal(data.reshape(nblocks, block)[[1, 3, 5]], 2.0 * comm.size)


@pytest.mark.mpi
def test_topk_on_an_elastic_communicator_chooses_as_on_a_plain_one(comm):
    """TopK's block choice is a bounded wait there (Communicator.bounded_comm;
    a rank lost during it: tests/control/test_elastic_waits.py), and with
    nobody lost it chooses the same blocks and reduces them as on a plain
    communicator;
    LowBit works there as well."""
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(1000).astype(np.float32)
    with mpilossy.Communicator(comm, timeout=0.5, elastic=True) as elastic, \
            mpilossy.Communicator(comm, timeout=0.5) as plain:
        lo, hi = plain.chunk_bounds(x.size)
        got, want = {}, {}
        for lc, out in ((elastic, got), (plain, want)):
            reduced = x.copy()
            TopK(0.25, error_feedback=False).allreduce(lc, "g", reduced, op="avg")
            chunk = np.empty(hi - lo, np.float32)
            TopK(0.25, error_feedback=False).reduce_scatter(lc, "g", x.copy(), chunk, op="avg")
            low = x.copy()
            LowBit("int8").allreduce(lc, "g", low, op="avg")
            out.update(allreduce=reduced, reduce_scatter=chunk, lowbit=low)
        for name in want:       # (the same blocks; sums in another order: an ulp apart)
            np.testing.assert_array_equal(got[name] != 0, want[name] != 0, err_msg=name)
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        # (it did choose: a quarter of the 16 blocks of 64, the last one short)
        assert 0 < np.count_nonzero(got["allreduce"]) <= 4 * 64
