"""The calibration's emulated side (mpilossy.sim.reference): every row reads
its two runs from the raw outputs committed in
docs/results/scale/emulated, and a missing run is a clear error."""

from pathlib import Path

import numpy as np
import pytest

from mpilossy.sim.reference import FIT, FIT_RTO, load, timer_share

RUNS = Path(__file__).resolve().parents[2] / "docs" / "results" / "scale" / "emulated"


def test_every_row_reads_both_runs_from_the_raw_outputs():
    rows = load(str(RUNS))
    assert len(rows) == 18
    for row in rows:
        assert len(row.runs) == 2, row.source
        s = row.scenario
        for run in row.runs:
            # every rank's time of every call, and the percentiles taken from them
            assert len(run.mpi_times) == len(run.ud_times) == s.calls * s.size, row.source
            assert run.mpi[0] == pytest.approx(np.percentile(run.mpi_times, 50))
            assert run.ud[1] == pytest.approx(np.percentile(run.ud_times, 99))
            assert 0.0 < run.delivered <= 1.0
        assert row.mpi[0] == pytest.approx((row.runs[0].mpi[0] + row.runs[1].mpi[0]) / 2)
    assert rows[FIT].scenario.drop == 0 and rows[FIT_RTO].scenario.drop == 0.05
    # the fit row's MPI waited for timers on some calls, the quiet row on none
    assert 0.05 < timer_share(rows[FIT_RTO], 0.15) < 0.6
    assert timer_share(rows[FIT], 0.15) == 0.0


def test_a_missing_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="4x1-200m.*calibration_runs.sh"):
        load(str(tmp_path))
