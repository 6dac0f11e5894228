#!/usr/bin/env bash
# Set up, then run the test suite at 1, 2, 3 and 4 ranks (tests/run.py).
#   bash test.sh                 # everything
#   bash test.sh --sizes 2 -k ring
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
. .venv/bin/activate
exec python tests/run.py "$@"
