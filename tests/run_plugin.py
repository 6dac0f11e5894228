"""The pytest side of tests/run.py: one JUnit file per rank, and the ledger
that lets it resume a session that died.

A per-test timeout (pytest-timeout's thread method ends the process) or a
crash leaves no JUnit file.  With --ledger, rank 0 appends each test's
start and outcome as it goes, so the runner can count what finished, name
the test that was running, and start again after it (--ledger-done lists
the tests to leave out).
"""

import pytest
from mpi4py import MPI


@pytest.hookimpl(tryfirst=True)       # (before the JUnit plugin reads the path)
def pytest_configure(config):
    # One JUnit file per rank: --junitxml=DIR/rank-{rank}.xml
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and "{rank}" in xmlpath:
        config.option.xmlpath = xmlpath.replace("{rank}", str(MPI.COMM_WORLD.rank))


def pytest_addoption(parser):
    group = parser.getgroup("mpilossy")
    group.addoption("--ledger", default=None, help="append each test's start and outcome here")
    group.addoption("--ledger-done", default=None,
                    help="a file of test ids (one a line) to deselect: they ran already")


_sink = {"path": None}        # the ledger of this session, on rank 0 only


def pytest_sessionstart(session):
    path = session.config.getoption("ledger")
    _sink["path"] = path if path and MPI.COMM_WORLD.rank == 0 else None
    # (test ids are relative to it: the runner names a test to run again)
    _write("rootdir", str(session.config.rootpath))


def _write(*fields: str) -> None:
    if _sink["path"]:
        with open(_sink["path"], "a") as fh:
            fh.write("\t".join(fields) + "\n")


def pytest_collection_modifyitems(config, items):
    done_file = config.getoption("ledger_done")
    if not done_file:
        return
    with open(done_file) as fh:
        done = {line.strip() for line in fh if line.strip()}
    keep = [item for item in items if item.nodeid not in done]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    _write("start", nodeid)


def pytest_runtest_logreport(report):
    # Every phase that did not pass, and the call's outcome; "end" once the
    # test is over (tests/run.py's ledger_outcomes reads them).
    if report.when == "call" or report.outcome != "passed":
        _write(report.when, "skipped" if report.skipped else report.outcome, report.nodeid)
    if report.when == "teardown":
        _write("end", report.nodeid)
