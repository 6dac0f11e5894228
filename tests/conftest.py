"""Shared fixtures.  The suite runs under `mpiexec -n K python -m pytest
--with-mpi` for K = 1..4 (tests/run.py); every expected value is computed
from rank and size, so each test runs at any size."""

import os

import pytest
from mpi4py import MPI

import mpilossy

# JUnit files per rank and each test's start and outcome, for tests/run.py.
pytest_plugins = ["run_plugin"]


def pytest_report_header(config):
    comm = MPI.COMM_WORLD
    version = MPI.Get_library_version().splitlines()[0].strip()
    return f"MPI: {version} | rank {comm.rank} of {comm.size} | mpilossy {mpilossy.__version__}"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # A child run against a build_package copy must really import that copy
    # (helpers.importing_from), or it would test the installed build instead.
    pkg = os.environ.get("MPILOSSY_TEST_PACKAGE")
    if pkg:
        from helpers import imported_from
        if not imported_from(pkg):
            raise pytest.UsageError(f"mpilossy was imported from {mpilossy.__file__}, not {pkg}")


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.fixture
def lc(comm):
    """A lossless communicator (no deadline, no injected loss)."""
    with mpilossy.Communicator(comm, timeout=None, loss=None) as c:
        yield c


@pytest.fixture
def clean_env(monkeypatch):
    """No MPILOSSY_* settings from the caller's environment."""
    for key in list(os.environ):
        if key.startswith("MPILOSSY_"):
            monkeypatch.delenv(key)
