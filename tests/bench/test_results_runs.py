"""docs/results/runs holds the example's sweep results and nothing else:
`python -m mpilossy.examples.lm.results` (the README quotes its main-10
row) reads every JSON file there.  Bench and emulated-cluster outputs
committed there broke it (KeyError: 'row') until 2026-12-01; they live in
docs/results/cluster now."""

from pathlib import Path

from mpilossy.examples.lm import results

RUNS = Path(__file__).resolve().parents[2] / "docs" / "results" / "runs"


def test_every_file_in_the_runs_folder_is_a_sweep_result():
    data = results.load(RUNS)
    known = {row.name for row in results.ROWS}
    assert set(data) <= known, sorted(set(data) - known)
    for name, runs in data.items():
        seeds = [r["config"]["seed"] for r in runs]
        assert len(seeds) == len(set(seeds)), (name, seeds)      # one result per seed


def test_the_readme_row_pairs_every_seed_with_its_baseline():
    data = results.load(RUNS)
    main = next(row for row in results.ROWS if row.name == "main-10")
    changes = results.paired(data, main)
    assert changes and len(changes) == len(data["main-10"]), changes
