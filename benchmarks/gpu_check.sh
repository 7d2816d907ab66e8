#!/usr/bin/env bash
# The GPU acceptance check (issue 23), run as is by anyone with one or more GPUs: every part of
# benchmarks/gpu_session.sh once, in one call, within 9 minutes on one H100 / H200:
#
#   tiers          tests/test_cuda_tiers.py (the CUDA paths of the memory tiers; 5 tests)
#   step           bench_gpu_step.py --model both --measure --tuned (GPT and Llama planned from blocks
#                  measured there, against a plain loop and a compiled + fused hand loop; ~3.5 min)
#   offload        bench_gpu_offload.py at global batch 4 (ZeRO-Offload against the GPU-only step)
#   offload_large  bench_gpu_offload.py at global batch 32
#   calibrate      whalepy calibrate --out $OUT/profile.json
#
# Setup (carried wheels in .whl/ or an installed environment, the project installed editable) is
# gpu_session.sh's. Each part has its own limit (seconds: TIERS_S 60, STEP_S 240, OFFLOAD_S 120,
# OFFLOAD_LARGE_S 70, CALIBRATE_S 90) and no part runs past TOTAL_S (default 540 s from the start), so
# the whole call ends inside 9.5 minutes even when a part hangs. One summary: $OUT/summary.txt (OUT
# defaults to /tmp/whalepy-gpu-out), one line per part with its exit code and time, then the total;
# exit 0 only when every part passed. docs/benchmarks.md, "A GPU session", says how to run it and
# where its figures go.
#
#     bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export TOTAL_S="${TOTAL_S:-540}" TIERS_S="${TIERS_S:-60}" STEP_S="${STEP_S:-240}" OFFLOAD_S="${OFFLOAD_S:-120}" \
    OFFLOAD_LARGE_S="${OFFLOAD_LARGE_S:-70}" CALIBRATE_S="${CALIBRATE_S:-90}"
step_args="--model both --plan-time-limit 10 --steps 6 --warmup 2 --measure --tuned"
export STEP_ARGS="${STEP_ARGS:-$step_args}"
exec bash benchmarks/gpu_session.sh tiers step offload offload_large calibrate
