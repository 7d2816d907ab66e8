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
