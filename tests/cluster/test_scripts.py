"""The shell scripts and job templates: every one parses (`bash -n`) and
passes ShellCheck at its default severity (style included).  A warning that
is wrong for a line is silenced there with `# shellcheck disable=SCxxxx` and
the reason.  Skipped with the reason where shellcheck is not installed
(scripts/system-packages.sh installs it).  Runs in the single-rank session
only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import is_singleton, ROOT

pytestmark = [pytest.mark.skipif(not is_singleton(), reason="lints files, no MPI: runs at size 1"),
              pytest.mark.timeout(120)]

SCRIPTS = sorted([*ROOT.glob("jobs/*.sbatch"), ROOT / "run.sh", ROOT / "test.sh",
                  *ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"])
IDS = [str(p.relative_to(ROOT)) for p in SCRIPTS]


def test_the_list_is_complete():
    """Every shell script of the repository is in SCRIPTS (a new one is
    linted too), and each says it is bash, which ShellCheck checks for."""
    others = set()
    for folder, dirs, files in os.walk(ROOT):
        # not into virtual environments, build folders, .git and the like
        dirs[:] = [d for d in dirs if d == ".ci" or not (d.startswith(".") or d == "build"
                                                         or d == "__pycache__")]
        others |= {Path(folder) / f for f in files if f.endswith(".sh")}
    assert others <= set(SCRIPTS), sorted(str(p) for p in others - set(SCRIPTS))
    for path in SCRIPTS:
        assert path.is_file(), path
        first = path.read_text().splitlines()[0]
        assert first in ("#!/bin/bash", "#!/usr/bin/env bash"), (path, first)


@pytest.mark.parametrize("path", SCRIPTS, ids=IDS)
def test_bash_parses(path):
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=IDS)
def test_shellcheck(path):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or "
                    "scripts/system-packages.sh as root)")
    done = subprocess.run([shellcheck, str(path)], capture_output=True, text=True,
                          timeout=60, cwd=path.parent)
    assert done.returncode == 0, done.stdout + done.stderr
