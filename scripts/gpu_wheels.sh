#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), the wheels that a GPU machine with
# no network lacks for scripts/gpu_check.sh: the MPI (mpich), mpi4py built
# for it, pytest-mpi, ml_dtypes (bfloat16), and meson-python with its one
# missing requirement, and allpairspy (tests/core/test_matrix.py).
# Such a machine already has torch (CUDA), CuPy, numpy, meson, ninja,
# cython and pytest.
#   bash scripts/gpu_wheels.sh            # for Python 3.12 (the GPU machine's)
#   PYVER=3.11 bash scripts/gpu_wheels.sh # for another Python
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-python3}
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
args=(--disable-pip-version-check -q download --no-deps --only-binary=:all: -d "$WHEELS"
      --python-version "$PYVER" --implementation cp)
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
"$PYTHON" -m pip "${args[@]}" "mpich>=4.2" "mpi4py>=4.0" "pytest-mpi>=0.6" "ml_dtypes>=0.3" \
    "meson-python>=0.15" "pyproject-metadata>=0.9" allpairspy more-itertools 2>&1 | { grep -v "WARNING: Location" || true; }
ls -l "$WHEELS"
du -sh "$WHEELS"
