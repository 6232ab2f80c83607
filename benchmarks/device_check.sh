#!/usr/bin/env bash
# The GPU checks, in one run of a few minutes: the CUDA tests and the figures that need a GPU.
#
#   OUT=DIR bash benchmarks/device_check.sh                        # on a machine with a CUDA device
#   OUT=$(mktemp -d) DEVICE_CHECK_DRY=1 bash benchmarks/device_check.sh   # the same steps on the CPU, small
#
# Run from the repository root, with the project importable (PYTHONPATH=$PWD or an installed venv) and
# `python3` (or $PYTHON) the interpreter to use. Steps, each timed, each under a timeout, a failure recorded
# and the next step run all the same (the exit status is nonzero at the end if any failed):
#
#   env        the machine: GPU, driver, Python and the versions of the packages the checks import
#   warmup     python -m ckptdelta.delta.warmup: compile the codec's numba kernels once (numba caches them; without it
#              the first publish or hot-load of every process below compiles), beside
#   workload   the benchmarks' bf16 workload (benchmarks/workloads.py: a small transformer's AdamW steps,
#              generated on the CPU and cached under benchmarks/.cache)
#   pytest     tests/loader/test_cuda.py on the device (CKPTDELTA_TEST_DEVICE), log in $OUT/pytest.log
#   hostcopy   python -m benchmarks.publish_host_copy --device D: publish()'s host copy per GB, fresh and
#              reused pinned buffers, and Publisher(device_diff=True)'s capture (the device-side diff)
#   latency    python -m benchmarks.update_latency --device D --backends local: publish() -> swapped with the
#              replica's live weights on the device; the pause beside a full copy_ of the model there
#
# Files left in $OUT (8 at most): device_check.log (every step's output and wall time), pytest.log,
# publish_host_copy.{md,json,png}, update_latency-cuda.{md,json,png} (update_latency.* in a dry run).
# DEVICE_CHECK_DRY=1: device cpu and sizes scaled down, to check the script itself without a GPU.
# DEVICE_CHECK_BUDGET: seconds for the whole run (default 420); a step gets what is left of it at most.
# Expected on one H200 with 16 cores: about 5 minutes, most of it numba's compile and the 1 and 4 GB latency runs.

set -uo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the folder the results go to}"
PY=${PYTHON:-python3}
DRY=${DEVICE_CHECK_DRY:-0}
BUDGET=${DEVICE_CHECK_BUDGET:-420}

if [ "$DRY" = 1 ]; then
    DEVICE=cpu HOST_GB=0.05 HOST_REPEATS=2 LAT_SIZES=0.03 LAT_REPEATS=2 LAT_SWEEP=0.01,0.3
else
    DEVICE=cuda HOST_GB=2 HOST_REPEATS=3 LAT_SIZES=1,4 LAT_REPEATS=3 LAT_SWEEP=0.01,0.05,0.25
fi
# The workload's generation threads: one by default (a shared 2-core machine), 8 with 16 cores or more (the
# workload is generated there, its cache being that machine's own).
export CKPTDELTA_BENCH_THREADS=${CKPTDELTA_BENCH_THREADS:-$(( $(nproc) >= 16 ? 8 : 1 ))}

mkdir -p "$OUT"
LOG="$OUT/device_check.log"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")
T0=$(date +%s)
DEADLINE=$(( T0 + BUDGET ))
: > "$SCRATCH/steps"

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: run CMD under a timeout (LIMIT_S, or what is left of the budget), its output to
# the log (and to $SCRATCH/NAME.out), then record "NAME rc seconds" in $SCRATCH/steps.
step() {
    local name=$1 limit=$2 left rc t
    shift 2
    left=$(( DEADLINE - $(date +%s) - 5 ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        say "=== [$name] skipped: ${left}s left of the ${BUDGET}s budget"
        echo "$name skipped 0" >> "$SCRATCH/steps"
        return 1
    fi
    say "=== [$name] start at +$(( $(date +%s) - T0 ))s, timeout ${limit}s: $*"
    t=$(date +%s%N)
    timeout --kill-after=10 "$limit" "$@" > "$SCRATCH/$name.out" 2>&1
    rc=$?
    t=$(( ($(date +%s%N) - t) / 1000000 ))
    t="$(( t / 1000 )).$(( t % 1000 / 100 ))"
    [ -n "$(tail -c 1 "$SCRATCH/$name.out")" ] && echo >> "$SCRATCH/$name.out"   # a killed step's last line
    cat "$SCRATCH/$name.out" >> "$LOG"
    tail -n 25 "$SCRATCH/$name.out"
    say "=== [$name] rc=$rc in ${t}s$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo " (TIMED OUT)")"
    echo "$name $rc $t" >> "$SCRATCH/steps"
    return "$rc"
}

say "device check: device=$DEVICE dry=$DRY budget=${BUDGET}s python=$(command -v "$PY") $(date -u +%FT%TZ)"

step env 60 bash -c "nvidia-smi || echo 'no nvidia-smi'; nproc; free -g | head -2; $PY - <<'EOF'
import importlib, platform, sys
print('python', sys.version.split()[0], platform.machine())
for name in ('torch', 'numpy', 'numba', 'llvmlite', 'zstandard', 'xxhash', 'fsspec', 'safetensors', 'tqdm',
             'transformers', 'tokenizers', 'matplotlib', 'pytest'):
    try:
        m = importlib.import_module(name)
        print(f'{name:13s}', getattr(m, '__version__', '?'), m.__file__)
    except Exception as e:
        print(f'{name:13s} MISSING: {type(e).__name__}: {e}')
import torch
print('cuda available', torch.cuda.is_available(), 'torch.version.cuda', torch.version.cuda)
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF"

# numba's compile (one thread) and the workload's generation (CPU torch) side by side
step warmup 200 "$PY" -m ckptdelta.delta.warmup &
warm=$!
step workload 200 "$PY" -c "
import time; t = time.perf_counter()
from benchmarks.workloads import pair
w = pair('small', 1e-6)
print(f'workload small lr 1e-6: {sum(x.numel() for x in w.old.values()) / 1e6:.1f}M elements, {time.perf_counter() - t:.1f} s')"
wait "$warm"

# plugins off: the checks need none, and one whose own dependencies are missing there would stop pytest
step pytest 150 bash -o pipefail -c "CKPTDELTA_TEST_DEVICE=$DEVICE PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $PY -m pytest -q -rs -p no:cacheprovider --durations=12 \
    tests/loader/test_cuda.py 2>&1 | tee '$OUT/pytest.log'"

step hostcopy 120 "$PY" -m benchmarks.publish_host_copy --device "$DEVICE" --gb "$HOST_GB" \
    --repeats "$HOST_REPEATS" --out-dir "$SCRATCH/hostcopy"
cp "$SCRATCH"/hostcopy/publish_host_copy.* "$OUT"/ 2>/dev/null

step latency 240 "$PY" -m benchmarks.update_latency --device "$DEVICE" --backends local --sizes "$LAT_SIZES" \
    --repeats "$LAT_REPEATS" --sweep "$LAT_SWEEP" --out-dir "$SCRATCH/latency"
cp "$SCRATCH"/latency/update_latency* "$OUT"/ 2>/dev/null

say ""
say "=== summary (wall s; total $(( $(date +%s) - T0 ))s of a ${BUDGET}s budget)"
failed=""
while read -r name rc t; do
    say "$(printf '%-10s rc=%-8s %8.1f s' "$name" "$rc" "$t")"
    [ "$rc" = 0 ] || failed="$failed $name"
done < "$SCRATCH/steps"
say "files in OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
rm -rf "$SCRATCH"
if [ -n "$failed" ]; then
    say "FAILED:$failed"
    exit 1
fi
say "all steps passed"
