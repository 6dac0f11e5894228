#!/usr/bin/env bash
# The emulated cluster's runs the scale model is calibrated against
# (docs/scale.md, "Calibration"): every scenario twice (run 1 and run 2, back
# to back), so that the cluster's own run-to-run spread is known.  As root;
# about 10 minutes on the 2-core development machine.
#   bash scripts/calibration_runs.sh [OUT]     # OUT: docs/results/scale/emulated
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/scale/emulated}
mkdir -p "$out"
py=.venv/bin/python
bench() {   # NAME ARGS...
    local name=$1; shift
    for run in 1 2; do
        PATH=$PWD/.venv/bin:$PATH $py scripts/cluster.py bench --pace port "$@" \
            --json "$out/$name-run$run.json"
    done
}
# 200 Mbit/s ports, 4 x 1, direct, 0.25 s: quiet and beside on/off TCP flows
bench 4x1-200m --nodes 4 --ppn 1 --rate 200mbit --drops 0 --sizes 1M:0.25 --iters 40
for bg in 50/450:1 100/400:1 200/200:2; do
    bench "4x1-200m-bg${bg//[\/:]/-}" --nodes 4 --ppn 1 --rate 200mbit --drops "" \
        --background "$bg" --sizes 1M:0.25 --iters 40
done
# 1 Gbit/s ports, random drops on the switch
bench 4x1-1g --nodes 4 --ppn 1 --rate 1gbit --drops 0,0.001,0.01,0.05 --sizes 1M:0.3 --iters 40
bench 4x1-1g-fec --nodes 4 --ppn 1 --rate 1gbit --drops 0.01,0.05 --sizes 1M:0.3 --iters 40 \
    --redundancy 4,1
bench 4x1-1g-16m --nodes 4 --ppn 1 --rate 1gbit --drops 0 --sizes 16M:5 --iters 20
bench 2x2-1g-hier --nodes 2 --ppn 2 --rate 1gbit --drops 0,0.01 --sizes 1M:0.3 --iters 40 \
    --algorithm hierarchical
bench 2x2-1g-hier-16m --nodes 2 --ppn 2 --rate 1gbit --drops 0 --sizes 16M:5 --iters 20 \
    --algorithm hierarchical
bench 2x2-1g-direct --nodes 2 --ppn 2 --rate 1gbit --drops 0 --sizes 1M:0.3 --iters 40
bench 2x3-1g-hier --nodes 2 --ppn 3 --rate 1gbit --drops 0 --sizes 1M:0.3,16M:5 --iters 20 \
    --algorithm hierarchical
bench 2x3-1g-direct --nodes 2 --ppn 3 --rate 1gbit --drops 0 --sizes 1M:0.3 --iters 40
