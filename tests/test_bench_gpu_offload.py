"""``benchmarks/bench_gpu_offload.py`` cannot rot: its CPU smoke mode runs the whole script (both plans
costed by ``whalepy.estimate``, lowered, trained, the table and the JSON) on a tiny GPT in one process.
On the way it checks what the script reports: the ZeRO-Offload plan really steps on the host (one host
optimizer block per model block), and the bytes it holds on the host and on the device are the plan's
(exactly: the memory model's figures for ``(gpu, cpu)``, docs/runtime.md "What each lowering holds")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_offload.py"


@pytest.mark.parametrize("microbatches", [1, 2])
def test_smoke_mode_runs_both_plans_and_reports_them(tmp_path, microbatches):
    """Both of gpu_session.sh's configurations: one micro-batch (the issue's) and gradient accumulation
    (the large-batch one), whose host optimizer steps once per step."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out_json = tmp_path / "offload.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out_json),
                          "--microbatches", str(microbatches)], capture_output=True,
                         text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| gpu |" in out.stdout and "| zero_offload |" in out.stdout, out.stdout
    assert "zero_offload / gpu step: measured" in out.stdout and "hidden behind the backward" in out.stdout
    report = json.loads(out_json.read_text())
    assert report["microbatches"] == microbatches
    modes = report["modes"]
    gpu, zo = modes["gpu"], modes["zero_offload"]
    assert gpu["host_bytes"] == gpu["predicted_host_bytes"] == 0
    assert zo["host_bytes"] == zo["predicted_host_bytes"] > 0
    assert zo["device_state_bytes"] == zo["predicted_device_state_bytes"] > 0
    assert zo["host_blocks"] == 4  # embed, 2 layers, head: every block steps on the host
    assert 0 <= zo["hidden_s"] <= zo["host_opt_s"] and zo["exposed_s"] >= 0
    assert gpu["microbatches"] == zo["microbatches"] == microbatches  # what the plans that ran say
    assert all(m["step_s"] > 0 and m["predicted_step_s"] > 0 for m in (gpu, zo))
