#!/usr/bin/env bash
# Device calls (each under ~9.5 minutes) that check and measure whalepy's CUDA paths on a GPU machine:
# the carried wheels and the project installed, the CUDA tests of the memory tiers
# (tests/test_cuda_tiers.py), the ZeRO-Offload vs GPU-only benchmark (bench_gpu_offload.py) at the
# issue's batch and at a batch where the cost model predicts the CPU step hidden, the host's AdamW
# kernels (bench_cpu_adamw.py, into env.txt: the rate the offload predictions rest on), and the
# whalepy vs plain-PyTorch benchmark (bench_gpu_step.py). Logs and JSON go to $OUT (default
# /tmp/whalepy-gpu-out), at most 8 files a call, as the device tool returns: env.txt, summary.txt,
# cuda_tiers.log, offload.log, offload_large.log, gpu_step.log, calibrate.log, and results.tgz (every JSON
# file and --dump folder: offload.json, offload_large.json, profile.json, the plans and measured tables).
# docs/benchmarks.md, "A GPU session", says how to run it.
#
#     bash benchmarks/gpu_session.sh                 # first call: adamw tiers offload offload_large
#     bash benchmarks/gpu_session.sh step            # second call
#
# offload: the issue's configuration, global batch 4 (predicted ZeRO-Offload / GPU-only: 4.4x, the host
# AdamW over 1.4B parameters against a 0.08 s step); offload_large: global batch 32 in one micro-batch,
# every block checkpointed (predicted 1.06x: the backward hides the host step).
# bench_gpu_step.py runs with STEP_ARGS (default "--model gpt --plan-time-limit 20"). Each part has its
# own time limit (TIERS_S, OFFLOAD_S, OFFLOAD_LARGE_S, STEP_S, CALIBRATE_S seconds; defaults 150, 180, 180,
# 300, 120) so a call ends inside the device tool's 10-minute limit even when one part hangs; with
# TOTAL_S set, no part runs past TOTAL_S seconds from the start (its limit is cut to what is left, and a
# part with less than 10 s left is not started). A part that fails or times out is recorded in
# summary.txt and the next one still runs; the script exits 1 when any part failed.
# The part `calibrate` runs `whalepy calibrate --out $OUT/profile.json` (the device profile);
# benchmarks/gpu_check.sh runs every part once within 8 minutes.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/whalepy-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(adamw tiers offload offload_large)
summary="$OUT/summary.txt"
: >"$summary"
start=$(date +%s)

note() { echo "$*" | tee -a "$summary"; }
failed=0

# 1. the carried wheels (highspy, pulp: not on the GPU image) and the project, without dependencies
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || note "wheels: install failed"
else
    note "wheels: no .whl/ folder carried (the planner needs highspy or pulp; bench_gpu_step.py plans)"
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/env.txt" 2>&1; then
    note "install: pip install -e . failed (env.txt); trying a regular install"
    "$PY" -m pip install -q --no-deps --no-build-isolation . >>"$OUT/env.txt" 2>&1 || note "install: failed too"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
    "$PY" -c "import whalepy, highspy; print('whalepy', whalepy.__file__, 'highspy ok')" 2>&1
    nproc
    free -g | head -2
} >>"$OUT/env.txt" 2>&1
note "setup: $(( $(date +%s) - start )) s"

run_part() {  # name, limit (s), log file, command...
    local name=$1 limit=$2 log=$3
    shift 3
    if [ -n "${TOTAL_S:-}" ]; then
        local left=$(( TOTAL_S - ($(date +%s) - start) - 10 ))
        if [ "$left" -lt 10 ]; then
            note "$name: NOT RUN, ${TOTAL_S} s total budget spent"
            failed=$((failed + 1))
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$log"
    local rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    note "$name: exit $rc after $(( $(date +%s) - t0 )) s (limit $limit s; exit 124: it timed out) -> $log"
}

for part in "${parts[@]}"; do
    case "$part" in
        tiers) run_part tiers "${TIERS_S:-150}" cuda_tiers.log "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_cuda_tiers.py tests/test_cuda_measure.py ;;
        offload) run_part offload "${OFFLOAD_S:-180}" offload.log "$PY" benchmarks/bench_gpu_offload.py --json "$OUT/offload.json" ;;
        offload_large) run_part offload_large "${OFFLOAD_LARGE_S:-180}" offload_large.log "$PY" benchmarks/bench_gpu_offload.py \
            --batch 32 --json "$OUT/offload_large.json" ;;
        adamw) { echo "== bench_cpu_adamw.py ($(nproc) threads)"; timeout 60 "$PY" benchmarks/bench_cpu_adamw.py \
            --threads "$(nproc)" --params 1e8; } >>"$OUT/env.txt" 2>&1; note "adamw: exit $? -> env.txt" ;;
        step) run_part step "${STEP_S:-300}" gpu_step.log "$PY" benchmarks/bench_gpu_step.py ${STEP_ARGS:---model gpt --plan-time-limit 20} ;;
        calibrate) run_part calibrate "${CALIBRATE_S:-120}" calibrate.log "$PY" -m whalepy.tools.cli calibrate \
            --out "$OUT/profile.json" ;;
        *) note "unknown part $part (adamw, tiers, offload, offload_large, step, calibrate)"; failed=$((failed + 1)) ;;
    esac
done
note "total: $(( $(date +%s) - start )) s; parts failed or not run: $failed"
# the device tool returns at most 8 files: the logs and summary stay, the JSON and --dump folders go in one archive
extra=$(cd "$OUT" && ls -d -- *.json */ 2>/dev/null)
if [ -n "$extra" ]; then
    (cd "$OUT" && tar czf results.tgz $extra && rm -rf $extra) && echo "JSON and dumps: $OUT/results.tgz"
fi
[ "$failed" -eq 0 ]
