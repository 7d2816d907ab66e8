"""``benchmarks/bench_gpu_step.py`` cannot rot: its CPU smoke mode runs the whole script (both models,
whalepy and the plain loop, the report) on tiny models in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_step.py"


def test_smoke_mode_runs_and_reports_both_models():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True,
                         timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("gpt", "llama"):
        assert f"{name}: plan pp=" in out.stdout, out.stdout
    assert out.stdout.count("median ") == 2 and "predicted/measured time" in out.stdout


def test_kernel_table_script_runs_on_the_cpu(tmp_path):
    """``benchmarks/profile_gpu_step.py`` (the kernels of the step whalepy runs, on a GPU) in its CPU
    smoke mode: the lowered step profiled, a table whose rows sum to the total it prints."""
    import json

    script = SCRIPT.parent / "profile_gpu_step.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(script), "--smoke", "--model", "gpt", "--warmup", "1", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln.split("\t") for ln in (tmp_path / "gpt_kernels.txt").read_text().splitlines()
            if not ln.startswith("#")]
    summary = json.loads((tmp_path / "gpt_summary.json").read_text())
    assert rows  # each row's microseconds printed to 0.1: the sum within half of that per row
    assert abs(summary["kernel_total_us"] - sum(float(r[0]) for r in rows)) <= 0.05 * len(rows) + 1e-6
    assert any(r[3] == "gemm" for r in rows) and summary["predicted_step_s"] > 0
