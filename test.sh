#!/usr/bin/env bash
# Set up (Debian packages when run as root, .venv, mpilossy), then run the
# test suite at 1, 2, 3 and 4 ranks (tests/run.py).
#   bash test.sh                 # everything
#   bash test.sh --sizes 2 -k ring
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/system-packages.sh   # Debian packages some tests use (as root; else they skip)
bash scripts/setup.sh
# shellcheck source=/dev/null  # made by scripts/setup.sh
. .venv/bin/activate
exec python tests/run.py "$@"
