"""`scripts/cluster.py train`'s paired comparison, on rows made up here (the
runs themselves need the emulated cluster: tests/cluster/test_multinode.py)."""

import pytest

from mpilossy.cluster import training


def row(seed, arm, seconds, ppl, curve, delivered=1.0):
    return {"condition": "background 100/400:1", "seed": seed, "arm": arm,
            "reduce": ("mpi", "mpilossy")[arm], "train_seconds": seconds,
            "val_perplexity": ppl, "delivered": delivered, "curve": curve}


def test_pairs_by_seed_and_time_to_the_same_perplexity():
    rows = []
    for seed, (slow, fast) in enumerate([(100.0, 60.0), (120.0, 66.0), (110.0, 66.0)]):
        # MPI ends at 9.0; mpilossy at 9.1, which MPI passed at half its time
        rows.append(row(seed, 0, slow, 9.0, [[150, slow / 2, 9.1], [300, slow, 9.0]]))
        rows.append(row(seed, 1, fast, 9.1, [[150, fast / 2, 9.5], [300, fast, 9.1]], 0.98))
    pairs = training.paired(rows)["background 100/400:1"]
    assert [round(p["time"], 3) for p in pairs] == [-0.4, -0.45, -0.4]
    assert all(p["perplexity"] == pytest.approx(0.1 / 9.0) for p in pairs)
    # mpilossy needs all its time to reach 9.1, MPI half of its own
    assert [round(p["time_to_perplexity"], 3) for p in pairs] == [0.2, 0.1, 0.2]
    line, = training.summary(rows)
    assert "mpilossy against mpi, 3 seed(s): time -41.67% ±" in line, line
    assert "delivered 0.980-0.980" in line


def test_a_seed_without_its_pair_is_left_out():
    rows = [row(0, 0, 100.0, 9.0, []), row(0, 1, 60.0, 9.1, []), row(1, 0, 100.0, 9.0, [])]
    pairs = training.paired(rows)["background 100/400:1"]
    assert len(pairs) == 1 and "time_to_perplexity" not in pairs[0]


def test_arms():
    assert training.parse_arms("mpi,mpilossy") == ["mpi", "mpilossy"]
    assert training.parse_arms("mpilossy,mpilossy") == ["mpilossy", "mpilossy"]
    for bad in ("mpi", "mpi,gloo", "mpi,mpi,mpi"):
        with pytest.raises(ValueError):
            training.parse_arms(bad)
