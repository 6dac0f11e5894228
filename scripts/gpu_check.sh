#!/usr/bin/env bash
# Build mpilossy on a GPU machine and run its GPU tests and figures in one
# command (docs/gpu.md, "Checking on a GPU machine").  The machine needs
# Python with CuPy, torch, mpi4py's build needs and a C compiler; what is
# missing there (no network) travels as wheels that scripts/gpu_wheels.sh
# downloads into .whl/ beforehand, and is installed into that Python's
# environment (the machine is meant to be a throwaway one).
#
#   bash scripts/gpu_check.sh [STAGE...]    (default: env setup tests)
#     env      what the machine is: GPUs, driver, Python, torch, CuPy, cores
#     setup    install .whl/*, build mpilossy (editable, build/gpu)
#     tests    tests/call/test_gpu.py and tests/call/test_device.py at 1, 2, 3 and 4 ranks
#     figures  python -m mpilossy.bench device at 1, 2 and 4 ranks (DEVICE=cpu:
#              host buffers, to try the script where there is no GPU)
#     cpu16    python -m mpilossy.bench allreduce at 4, 8 and 16 ranks
#              (direct, ring, tree, 1-64 MiB): CPU ratios on 16 cores
#     train    the example (python -m mpilossy.examples.lm --device $DEVICE) on a
#              model of about 25M parameters, at $TRAIN_RANKS ranks, each seed of
#              $SEEDS with each loss of $TRAIN_LOSSES in turn (paired runs), and
#              over MPI_Allreduce (TRAIN_BASELINE=1, the default)
#
# Everything goes to $OUT (default build/gpu-check): check.log (all output),
# tests.log, device.json, cpu16.json and train.json.  Exit status: the first
# failing stage's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
OUT=${OUT:-build/gpu-check}
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SIZES=${SIZES:-1M,4M,16M,64M,256M}
RANKS=${RANKS:-1,2,4}
CPU_RANKS=${CPU_RANKS:-4,8,16}
LOSSES=${LOSSES:-none,bernoulli:0.1}
BENCH_ARGS=${BENCH_ARGS:-}            # more options of the figures' benchmark
TEST_SIZES=${TEST_SIZES:-1,2,3,4}
TEST_K=${TEST_K:-gpu or device or pipeline}
TRAIN_RANKS=${TRAIN_RANKS:-4}
SEEDS=${SEEDS:-0,1,2}
TRAIN_LOSSES=${TRAIN_LOSSES:-0,0.1}
TRAIN_BASELINE=${TRAIN_BASELINE:-1}  # also each seed over MPI_Allreduce (--reduce mpi)
TRAIN_ARGS=${TRAIN_ARGS:---width 512 --layers 8 --heads 8 --lr 1e-3 --steps 200 --eval-every 50}
# Bounds, so that one stuck stage leaves time to the others in a short lease:
# seconds per benchmark run, per test size (tests/run.py --timeout) and per test.
STAGE_TIMEOUT=${STAGE_TIMEOUT:-400}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}
PER_TEST=${PER_TEST:-180}
mkdir -p "$OUT"
LOG="$OUT/check.log"
status=0

say() { echo "== gpu_check: $*" | tee -a "$LOG"; }
bindir() { "$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))'; }
# Run a command, its output to the log too; remember the first failure.
step() {
    "$@" 2>&1 | tee -a "$LOG"
    local code=${PIPESTATUS[0]}
    if [ "$code" != 0 ]; then
        say "FAILED (exit $code): $*"
        [ "$status" = 0 ] && status=$code
    fi
    return "$code"
}
# JSON files of one benchmark per rank count, merged into one (8 files come
# back from a device run at most).
merge() {
    local into=$1
    shift
    "$PYTHON" - "$into" "$@" <<'EOF'
import json, sys
into, parts = sys.argv[1], sys.argv[2:]
runs = []
for p in parts:
    try:
        with open(p) as fh:
            runs.append(json.load(fh))
    except OSError:
        pass
with open(into, "w") as fh:
    json.dump(runs, fh, indent=1)
EOF
    rm -f "$@"
}

stage_env() {
    say "env"
    # (what is missing here is reported, not a failure: the stages below say what it costs)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
    echo "cores: $(nproc)" | tee -a "$LOG"
    step "$PYTHON" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], sys.executable, platform.machine())
for name in ("numpy", "mpi4py", "cupy", "torch", "Cython", "mesonpy"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    print("cupy devices:", n, [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode()
                               for i in range(n)])
except Exception as exc:
    print("cupy devices: none:", exc)
try:
    import torch
    print("torch cuda:", torch.cuda.is_available(), torch.version.cuda)
except Exception as exc:
    print("torch cuda: no:", exc)
EOF
}

stage_setup() {
    say "setup ($PYTHON, wheels from $WHEELS)"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        # (--upgrade: the carried mpi4py replaces one built for another MPI)
        step "$PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps \
            --no-compile --upgrade "$WHEELS"/*.whl || return
    else
        say "no wheels in $WHEELS: using what $PYTHON has (bash scripts/gpu_wheels.sh makes them)"
    fi
    step "$PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps \
        --no-build-isolation -Cbuild-dir=build/gpu -e . || return
    # Imported once before any mpiexec (the editable install builds on import).
    step "$PYTHON" -c "import mpilossy._core, mpilossy._testing, mpi4py.MPI as M; \
print('mpilossy', mpilossy.__version__, 'on', M.Get_library_version().splitlines()[0])"
}

stage_tests() {
    say "tests ($TEST_K) at $TEST_SIZES ranks"
    "$PYTHON" tests/run.py --sizes "$TEST_SIZES" --timeout "$TEST_TIMEOUT" --per-test "$PER_TEST" -k "$TEST_K" -rs >"$OUT/tests.log" 2>&1
    local code=$?
    grep -E "^== |SKIPPED|FAILED|ERROR" "$OUT/tests.log" | tee -a "$LOG"
    if [ "$code" != 0 ]; then
        say "FAILED (exit $code): tests"
        [ "$status" = 0 ] && status=$code
    fi
}

stage_figures() {
    say "figures: bench device ($DEVICE) at $RANKS ranks, $SIZES"
    local mpiexec parts=() extra=()
    mpiexec="$(bindir)/mpiexec"
    read -ra extra <<<"$BENCH_ARGS"
    for n in ${RANKS//,/ }; do
        step timeout "$STAGE_TIMEOUT" "$mpiexec" -n "$n" "$PYTHON" -m mpilossy.bench device --device "$DEVICE" \
            --sizes "$SIZES" --loss "$LOSSES" -a ring "${extra[@]}" --json "$OUT/device-$n.json"
        parts+=("$OUT/device-$n.json")
    done
    merge "$OUT/device.json" "${parts[@]}"
}

stage_cpu16() {
    say "cpu16: bench allreduce at $CPU_RANKS ranks"
    local mpiexec parts=()
    mpiexec="$(bindir)/mpiexec"
    for n in ${CPU_RANKS//,/ }; do
        step timeout "$STAGE_TIMEOUT" "$mpiexec" -n "$n" "$PYTHON" -m mpilossy.bench allreduce \
            -a direct,ring,tree --sizes 1M,4M,16M,64M -n 10 -w 2 --json "$OUT/cpu-$n.json"
        parts+=("$OUT/cpu-$n.json")
    done
    merge "$OUT/cpu16.json" "${parts[@]}"
}

stage_train() {
    say "train: the example on $DEVICE at $TRAIN_RANKS ranks, seeds $SEEDS, losses $TRAIN_LOSSES"
    local mpiexec parts=() extra=() i=0
    mpiexec="$(bindir)/mpiexec"
    read -ra extra <<<"$TRAIN_ARGS"
    for seed in ${SEEDS//,/ }; do
        for loss in ${TRAIN_LOSSES//,/ }; do
            i=$((i + 1))
            step timeout "$STAGE_TIMEOUT" "$mpiexec" -n "$TRAIN_RANKS" "$PYTHON" -m mpilossy.examples.lm \
                --device "$DEVICE" --seed "$seed" --loss "$loss" --progress lines "${extra[@]}" \
                --json "$OUT/train-$i.json"
            if [ $? = 124 ]; then       # one run past its bound: the others would be too
                say "a run took over $STAGE_TIMEOUT s: the remaining runs are skipped"
                merge "$OUT/train.json" "${parts[@]}"
                return
            fi
            parts+=("$OUT/train-$i.json")
        done
        if [ "$TRAIN_BASELINE" = 1 ]; then       # the same seed over MPI_Allreduce (lossless)
            i=$((i + 1))
            step timeout "$STAGE_TIMEOUT" "$mpiexec" -n "$TRAIN_RANKS" "$PYTHON" -m mpilossy.examples.lm \
                --device "$DEVICE" --seed "$seed" --reduce mpi --progress lines "${extra[@]}" \
                --json "$OUT/train-$i.json"
            parts+=("$OUT/train-$i.json")
        fi
    done
    merge "$OUT/train.json" "${parts[@]}"
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env setup tests)
for s in "${stages[@]}"; do
    case "$s" in
        env) stage_env ;;
        setup) stage_setup ;;
        tests) stage_tests ;;
        figures) stage_figures ;;
        cpu16) stage_cpu16 ;;
        train) stage_train ;;
        *) echo "gpu_check: unknown stage '$s' (env setup tests figures cpu16 train)" >&2; exit 2 ;;
    esac
    if [ "$s" = setup ] && [ "$status" != 0 ]; then
        say "setup failed: stopping"
        break
    fi
done
say "done, exit $status; results in $OUT"
exit "$status"
