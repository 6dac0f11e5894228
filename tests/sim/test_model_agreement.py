"""The scale model (mpilossy.sim) and the library agree on what they both
compute: fed the losses a real run suffers (the core's injected loss, decided
from counters the model mirrors), the model's contributor set of every block
gives exactly the value the library returned, on every rank, for every
algorithm, with and without redundancy (the model rebuilding what each
group can).  A model that drifts from the core (a stream order, a rotation,
a fallback, a parity record's place) fails here."""

import numpy as np
import pytest

import mpilossy
from mpilossy.loss import Bernoulli, GilbertElliott
from mpilossy.sim.injected import LossState
from mpilossy.sim.outcome import contributors, injected
from mpilossy.sim.patterns import ALGORITHMS, geometry

COUNT = 1_003           # not a multiple of anything: short chunks, empty last blocks
BLOCK_BYTES = 256       # 32 float64: several blocks per chunk
CALLS = 8
LOSSES = {"bernoulli": Bernoulli(0.2, seed=11),
          "bursts": GilbertElliott(p_good_to_bad=0.1, p_bad_to_good=0.4, seed=7)}


def data(rank, call):
    """Distinct powers of two: a mean over a set of ranks names the set."""
    w = 1.0 + (np.arange(COUNT) + call) % 5
    return (2.0 ** rank) * w, w


def predicted(sets, geo, size, call, rank):
    """The result the model's sets give (op="avg": the mean over each set)."""
    out = np.full(COUNT, np.nan)
    for (chunk, block), mask in sets[rank].items():
        n = geo.block_len(chunk, block)
        if not n:
            continue
        lo = geo.block_first(chunk, block)
        members = [r for r in range(size) if mask >> r & 1]
        w = data(0, call)[1][lo:lo + n]
        out[lo:lo + n] = w * sum(2.0 ** r for r in members) / len(members)
    return out


@pytest.mark.mpi(min_size=2)     # (one rank has no link to lose anything on)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fec", [None, (3, 2)], ids=["plain", "parity"])
@pytest.mark.parametrize("model", list(LOSSES))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_model_and_library_agree_block_by_block(comm, algorithm, model, fec):
    size, rank = comm.size, comm.rank
    loss = LOSSES[model]
    states = [LossState(r, size, [loss]) for r in range(size)]
    geo = geometry(algorithm, size, COUNT, itemsize=8, block_bytes=BLOCK_BYTES)
    compared = wrong = lossy = rebuilt = miscounted = 0
    with mpilossy.Communicator(comm, timeout=0.5, block_bytes=BLOCK_BYTES, loss=loss,
                               redundancy=fec) as lc:
        for call in range(CALLS):
            x, _ = data(rank, call)
            out = np.full(COUNT, np.nan)
            stats = lc.allreduce(x, out, op="avg", algorithm=algorithm)
            assert stats.algorithm == algorithm
            lost = injected(algorithm, size, stats.seq, geo.nblocks, states, fec=fec)
            rebuilt += stats.rebuilt
            sets = contributors(algorithm, size, stats.seq, geo, lost)
            # the model's injected losses are the core's, block for block
            # (counted, not asserted here: a rank that stopped would leave the
            # others waiting in the next call)
            mine = sum(sum(row) for row in lost[rank])
            miscounted += mine != stats.lost_blocks[0]
            # only losses the injection decided: a block late on a busy
            # machine is a timing outcome the counters cannot know
            timing = comm.allreduce(sum(stats.lost_blocks[1:]))
            if timing:
                continue
            compared += 1
            lossy += stats.delivered < 1.0
            expect = predicted(sets, geo, size, call, rank)
            if not np.allclose(out, expect, rtol=1e-12, atol=0):
                wrong += 1
    everyone = comm.allgather((compared, wrong, lossy, rebuilt, miscounted))
    assert all(m == 0 for *_, m in everyone), f"injected losses counted apart: {everyone}"
    assert all(w == 0 for _, w, *_ in everyone), everyone
    assert min(c for c, *_ in everyone) >= CALLS // 2, everyone
    assert sum(lo for _, _, lo, *_ in everyone) > 0, "no call lost anything: nothing was compared"
    if fec:     # (both outcomes of a group: rebuilt, and lost for good)
        assert sum(r for _, _, _, r, _ in everyone) > 0, "no group rebuilt anything"
