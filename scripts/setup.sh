#!/usr/bin/env bash
# Create (or reuse) .venv and install mpilossy with everything it needs:
# the PyPI mpich and mpi4py wheels are the MPI, so no system MPI is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# shellcheck source=/dev/null  # made just above, not in the repository
. .venv/bin/activate
# (pip's own exit status is kept: pipefail, and grep may match nothing)
pip_install() { python -m pip install --disable-pip-version-check -q "$@" 2>&1 | { grep -v "WARNING: Location" || true; }; }
# Build requirements first, then the package without build isolation: faster,
# and the build sees the same mpich/mpi4py that will run it.
pip_install "meson-python>=0.15" "meson>=1.1" ninja "cython>=3.0" "mpi4py>=4.0" "mpich>=4.2" "numpy>=1.23"
# Editable (the development set-up of meson-python projects such as NumPy):
# the build lives in build/editable, and importing mpilossy re-runs ninja
# there, so edits to src_cython/ take effect at the next import and
# `python -m mpilossy ...` works from the checkout's root.
pip_install --no-build-isolation -Cbuild-dir=build/editable -e ".[test,mpich]"   # (tqdm, matplotlib: the examples' too)
# PyTorch for mpilossy.torch and its tests: 2.13.0 is a CPU wheel that pip
# finds locally here; an unpinned `torch` would download GBs of CUDA.
pip_install "torch==2.13.0" || echo "setup: torch not installed; mpilossy.torch tests will skip"
# Imported once here, before any mpiexec: an editable install rebuilds on
# import, and ranks starting together would otherwise all run ninja at once.
python -c "import mpilossy, mpi4py; print('mpilossy', mpilossy.__version__, 'on', ' '.join(mpi4py.MPI.Get_library_version().split()[:3]))"
