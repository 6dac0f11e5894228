"""The unbiasedness check that tests of several channels share
(core/test_unbiased.py, channels/test_ud.py): many seeded lossy calls on
data that differs across ranks, and a t statistic per element of the
rank-averaged result against the exact average."""

import numpy as np

import mpilossy

CALLS = 1000
CALLS_BIASED = 1500       # enough to expose a chain that always starts alike (p = 0.5)
# Zero-filling is biased far more: max |t| 58-61 at 2 ranks and 115-129 at 4
# over 1500 calls, so 300 calls still give |t| near 25-50, 5-10x T_LIMIT.
CALLS_ZERO_FILL = 300
ELEMENTS = 64
BLOCK = 64                # bytes: 8 doubles per block, so chunks have several blocks
TIMEOUT = 0.01
T_LIMIT = 5.0             # |t| above this on any element means biased


def fixed_data(rank):
    """Rank r's vector: around r, different per element."""
    e = np.arange(ELEMENTS)
    return rank + 0.5 * np.sin(1.3 * e + rank)


def run(comm, algorithm, p, fresh_noise=False, calls=CALLS, timeout=TIMEOUT, **options):
    """Results of `calls` calls on this rank, shape (calls, ELEMENTS), and inputs.
    (Only injected loss is independent of the data: a deadline that a busy
    machine makes some ranks miss more than others biases the average.)"""
    loss = mpilossy.loss.Bernoulli(p, seed=11)
    results = np.empty((calls, ELEMENTS))
    inputs = np.empty((calls, ELEMENTS))
    rng = np.random.default_rng(1234 + comm.rank)
    with mpilossy.Communicator(comm, timeout=timeout, loss=loss, block_bytes=BLOCK,
                               **options) as lc:
        delivered = 0.0
        for call in range(calls):
            x = (3.0 + rng.standard_normal(ELEMENTS)) if fresh_noise else fixed_data(comm.rank)
            inputs[call] = x
            stats = lc.allreduce(x, results[call], op="avg", algorithm=algorithm)
            delivered += stats.delivered
    return results, inputs, delivered / calls


def delivered_floor(algorithm, n, p, margin=0.15):
    """A lower bound on the mean `delivered` of one rank under independent
    loss p: the share of contributions the topology keeps in the reduced
    blocks that arrive (docs/performance.md, "Contributions kept": direct
    1 + (N-1)q of N, the ring (1 - q^N)/p of N, the radix-4 tree the mean of
    q^depth), where at most a share p of the blocks fall back on this rank's
    own data (1 of N), less `margin` for blocks a loaded machine makes
    late.  A rank that kept only its own data delivers 1/N: below it."""
    q = 1.0 - p
    if algorithm == "direct":
        kept = (1 + (n - 1) * q) / n
    elif algorithm == "ring":
        kept = (1 - q ** n) / (p * n)
    else:
        depth = [0] * n
        for r in range(1, n):            # radix 4: the parent of r clears its lowest
            digit, step = r, 1           # nonzero base-4 digit
            while digit % 4 == 0:
                digit, step = digit // 4, step * 4
            depth[r] = depth[r - (digit % 4) * step] + 1
        kept = sum(q ** d for d in depth) / n
    return q * kept + p / n - margin


def max_t(samples, truth):
    """Largest |t| over elements of mean(samples) against truth."""
    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    t = np.abs(mean - truth) / np.where(se > 0, se, np.inf)
    exact_miss = np.any((se == 0) & (mean != truth))
    return np.inf if exact_miss else float(t.max())


def rank_averaged_t(comm, results):
    gathered = comm.gather(results, root=0)
    verdict = None
    if comm.rank == 0:
        z = np.mean(gathered, axis=0)                      # per call, averaged over ranks
        exact = np.mean([fixed_data(r) for r in range(comm.size)], axis=0)
        verdict = max_t(z, exact)
    return comm.bcast(verdict, root=0)
