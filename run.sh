#!/usr/bin/env bash
# The main job: set up, then train the example language model under 10%
# injected loss with 4 ranks (about a minute on 2 cores; docs/results.md).
#   bash run.sh                  # the language model, 10% loss
#   LOSS=0 bash run.sh           # without loss
#   NP=2 bash run.sh             # other rank count
#   bash run.sh bench            # the all-reduce benchmark against MPI_Allreduce instead
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
# shellcheck source=/dev/null  # made by scripts/setup.sh
. .venv/bin/activate
NP=${NP:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "${1:-lm}" = bench ]; then
    echo "== lossless: mpilossy against MPI_Allreduce, $NP ranks"
    mpiexec -n "$NP" python -m mpilossy.bench allreduce --sizes 64K,1M,16M -a ring,tree
    echo "== 10% injected loss, 20 ms deadline"
    mpiexec -n "$NP" python -m mpilossy.bench allreduce --sizes 64K,1M -a ring,tree --loss bernoulli:0.1 -t 0.02
else
    echo "== byte-level transformer on the standard library's sources, $NP ranks, loss ${LOSS:-0.1}"
    mpiexec -n "$NP" python -m mpilossy.examples.lm --loss "${LOSS:-0.1}"
fi
