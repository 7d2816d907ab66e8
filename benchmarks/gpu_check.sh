#!/usr/bin/env bash
# The GPU acceptance check (issue 23), run as is by anyone with one or more GPUs: every part of
# benchmarks/gpu_session.sh once, in one call, within 9 minutes on one H100 / H200:
#
#   tiers          tests/test_cuda_tiers.py (the CUDA paths of the memory tiers; 5 tests)
#   step           bench_gpu_step.py --model both --measure --dump (GPT and Llama planned from blocks
#                  measured there, against a plain loop; ~3 min; the measured tables, the plans and what
#                  the run measured on its 6th step go to dump/; --tuned, the compiled + fused hand
#                  loop, is left out: it does not fit 8 minutes beside the rest (STEP_ARGS to add it))
#   offload        bench_gpu_offload.py at global batch 4 (ZeRO-Offload against the GPU-only step)
#   offload_large  bench_gpu_offload.py at global batch 32
#   calibrate      whalepy calibrate --out $OUT/profile.json
#
# Setup (carried wheels in .whl/ or an installed environment, the project installed editable) is
# gpu_session.sh's. Each part has its own limit (seconds: TIERS_S 40, STEP_S 250, OFFLOAD_S 80,
# OFFLOAD_LARGE_S 100, CALIBRATE_S 60; on an H200, 2026-11-27, session 15, in one call: 27, 229, 74, 84 and
# 29 s, 454 s with the setup) and no
# part runs past TOTAL_S (default 500 s from the start), so the whole call ends inside 9 minutes even
# when a part hangs. One summary: $OUT/summary.txt (OUT
# defaults to /tmp/whalepy-gpu-out), one line per part with its exit code and time, then the total;
# exit 0 only when every part passed; the JSON files and dump/ come back packed in results.tgz. docs/benchmarks.md, "A GPU session", says how to run it and
# where its figures go.
#
#     bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export TOTAL_S="${TOTAL_S:-500}" TIERS_S="${TIERS_S:-40}" STEP_S="${STEP_S:-250}" OFFLOAD_S="${OFFLOAD_S:-90}" \
    OFFLOAD_LARGE_S="${OFFLOAD_LARGE_S:-100}" CALIBRATE_S="${CALIBRATE_S:-60}"
export OUT="${OUT:-/tmp/whalepy-gpu-out}"
step_args="--model both --plan-time-limit 10 --steps 4 --warmup 2 --measure --dump $OUT/dump"
export STEP_ARGS="${STEP_ARGS:-$step_args}"
exec bash benchmarks/gpu_session.sh tiers step offload offload_large calibrate
