#!/usr/bin/env bash
# The main job: set up, then run it under mpiexec with 4 ranks.
#   bash run.sh                  # defaults
#   NP=2 bash run.sh             # other rank count
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
. .venv/bin/activate
cd "$(mktemp -d)"        # not the checkout: its mpilossy/ is the source, not the build
NP=${NP:-4}
echo "== lossless: mpilossy against MPI_Allreduce, $NP ranks"
mpiexec -n "$NP" python -m mpilossy.bench --sizes 64K,1M,16M -a ring,tree
echo "== 10% injected loss, 20 ms deadline"
mpiexec -n "$NP" python -m mpilossy.bench --sizes 64K,1M -a ring,tree --loss bernoulli:0.1 -t 0.02
