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


def _soak_run(row, seed, perplexity, worst=None):
    run = {"row": row, "config": {"seed": seed}, "val_perplexity": perplexity,
           "step_seconds": 0.1}
    if worst is not None:
        run["soak"] = {"failures": 100, "exits": 4, "costs": {
            "extra_seconds_p50_p90_max": [1.0, 1.2, worst],
            "steps_to_full_size_p50_p90_max": [0, 1, 17]}}
    return run


def test_the_soak_rows_pair_by_seed_and_show_the_worst_failure():
    data = {"soak-ref": [_soak_run("soak-ref", 1, 5.0), _soak_run("soak-ref", 0, 4.0)],
            "soak": [_soak_run("soak", 0, 4.04, worst=1.5), _soak_run("soak", 1, 5.1, worst=2.5)]}
    lines = results.soak_report(data)
    row = next(line for line in lines if line.startswith("| soak: 100 failures"))
    assert "(+1.00, +2.00)" in row, row          # seed 0 with seed 0, 1 with 1
    assert "1.00 / 1.20 / 2.50 s" in row and "100 (4) each" in row, row


def test_a_soak_command_gives_mpiexec_its_own_options_first():
    soak = next(row for row in results.ROWS if row.name == "soak")
    command = results.command(soak, 3, [])
    assert command[:4] == ["mpiexec", "-disable-auto-cleanup", "-n", "9"], command
    assert "--soak" in command and command[command.index("--seed") + 1] == "3"
    assert results.shown(soak).startswith("mpiexec -disable-auto-cleanup -n 9 python -m")
