"""Group averaging (GroupAverager, Moshpit SGD): the grid, one round
averages within its group only, d rounds give the global average without
loss, loss keeps it unbiased, and bad arguments fail on every rank."""

import numpy as np
import pytest

import mpilossy
from mpilossy.group import grid_shape
from helpers import all_ranks_raise


@pytest.mark.parametrize("size,group,shape", [
    (1, 2, ()), (2, 2, (2,)), (3, 2, (3,)), (4, 2, (2, 2)), (4, 4, (4,)), (6, 2, (3, 2)),
    (8, 2, (2, 2, 2)), (8, 4, (4, 2)), (16, 4, (4, 4)), (12, 4, (4, 3)), (7, 2, (7,)),
])
def test_grid_shape(size, group, shape):
    assert grid_shape(size, group) == shape
    assert int(np.prod(shape)) == size


@pytest.mark.parametrize("bad", [1, 0, -2, 2.0, True, "2"])
def test_grid_shape_refuses_bad_group_sizes(bad):
    with pytest.raises(ValueError):
        grid_shape(4, bad)


def rank_values(comm, n=1000):
    """Distinct data per rank: rank r holds r**2 + sin(e + r)."""
    e = np.arange(n)
    return [r * r + np.sin(e + r) for r in range(comm.size)]


@pytest.mark.mpi
def test_one_round_averages_its_group_only(comm):
    values = rank_values(comm)
    with mpilossy.GroupAverager(comm, group_size=2, timeout=None) as ga:
        x = values[comm.rank].copy()
        ga.average(x)
        if comm.size == 1:
            np.testing.assert_array_equal(x, values[0])
            return
        coords = comm.allgather(ga.coordinates)
        # Round 0 runs along the first dimension: the group is every rank
        # that agrees with this one on the other coordinates.
        members = [r for r, c in enumerate(coords) if c[1:] == coords[comm.rank][1:]]
        np.testing.assert_allclose(x, np.mean([values[r] for r in members], axis=0), rtol=1e-12)
        assert len(members) == ga.shape[0]


@pytest.mark.mpi
def test_d_rounds_give_the_global_average(comm):
    values = rank_values(comm)
    exact = np.mean(values, axis=0)
    with mpilossy.GroupAverager(comm, group_size=2, timeout=None) as ga:
        x = values[comm.rank].copy()
        for _ in range(ga.rounds_to_mix):
            stats = ga.average(x)
            assert stats is None or stats.delivered == 1.0
        np.testing.assert_allclose(x, exact, rtol=1e-12, atol=1e-12)
        # Any d rounds in a row: once more around, still the average.
        for _ in range(ga.rounds_to_mix):
            ga.average(x)
        np.testing.assert_allclose(x, exact, rtol=1e-12, atol=1e-12)
        assert ga.round == 2 * ga.rounds_to_mix


@pytest.mark.mpi(min_size=2)
def test_under_loss_the_mixed_result_is_unbiased(comm):
    """30% injected loss: each round rescales what arrived, so over many
    trials the d-round result of every element averages to the global
    average (t statistic over trials), while single trials miss it."""
    values = rank_values(comm, n=256)
    exact = np.mean(values, axis=0)
    trials, errors = 80, []
    with mpilossy.GroupAverager(comm, group_size=2, timeout=0.05,
                                loss="bernoulli:0.3,seed=11", block_bytes=256) as ga:
        for _ in range(trials):
            x = values[comm.rank].copy()
            for _ in range(ga.rounds_to_mix):
                ga.average(x)
            errors.append(x - exact)
    errors = np.asarray(errors)                            # trials x elements
    per_trial = np.asarray(comm.allgather(errors.mean(axis=1))).mean(axis=0)
    assert np.abs(per_trial).max() > 1e-6                  # loss did change results
    t = abs(per_trial.mean()) / (per_trial.std(ddof=1) / np.sqrt(trials))
    assert t < 4.5, f"biased: t = {t:.2f}"


@pytest.mark.mpi
def test_bad_group_size_fails_on_every_rank(comm):
    bad = 1 if comm.rank == comm.size - 1 else 2
    all_ranks_raise(comm, lambda: mpilossy.GroupAverager(comm, group_size=bad), ValueError)


@pytest.mark.mpi
def test_torch_parameters_mix_to_their_average(comm):
    """group_average_parameters: a model's floating-point tensors, d rounds
    in a row, end at the average of every rank's model; integer buffers are
    left alone."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    import mpilossy.torch as mt
    base = [torch.linspace(-1, 2, 30).reshape(5, 6), torch.arange(7.0)]
    mine = [t * (1 + comm.rank) for t in base] + [torch.tensor([comm.rank])]
    with mpilossy.GroupAverager(comm, group_size=2, timeout=None) as ga:
        for _ in range(ga.rounds_to_mix):
            assert mt.group_average_parameters(mine, ga) == 1.0
    factor = np.mean([1 + r for r in range(comm.size)])
    for got, want in zip(mine[:2], base):
        np.testing.assert_allclose(got.numpy(), want.numpy() * factor, rtol=1e-6)
    assert mine[2].item() == comm.rank


# -- construction fails on every rank, or on none ------------------------------------
@pytest.mark.mpi(min_size=2)
def test_group_averager_fails_everywhere_when_one_group_fails(comm, monkeypatch):
    """A setting that rank 0 alone rejects fails the Communicator of rank 0's
    group only (agreed within the group).  Every rank of the whole
    communicator must raise the same error, where the other groups used to
    wait for ever in the next dimension's Split (4 ranks: a 2 x 2 grid).
    Afterwards every rank builds and averages normally."""
    if comm.rank == 0:
        monkeypatch.setenv("MPILOSSY_BLOCK_BYTES", "banana")
    message = all_ranks_raise(
        comm, lambda: mpilossy.GroupAverager(comm, group_size=2, timeout=None), ValueError)
    messages = comm.allgather(message)
    assert all(m == messages[0] for m in messages), messages
    assert "MPILOSSY_BLOCK_BYTES" in message and "rank 0" in message, message
    monkeypatch.delenv("MPILOSSY_BLOCK_BYTES", raising=False)
    with mpilossy.GroupAverager(comm, group_size=2, timeout=None) as ga:
        x = np.full(8, float(comm.rank))
        for _ in range(ga.rounds_to_mix):
            ga.average(x)
    np.testing.assert_allclose(x, (comm.size - 1) / 2)
