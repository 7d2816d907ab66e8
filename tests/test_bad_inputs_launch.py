"""A user error inside a real ``whalepy run`` (torchrun) launch of 2 gloo processes: one line, printed
once, every rank exits promptly with a non-zero code (whalepy/runtime/launch_errors.py, whalepy/tools/torchrun.py).

Two launches: every rank makes the same mistake (a loss that is not a scalar: the message must appear
once, not once per rank), and one rank makes a mistake while the other waits for it in a collective (the
waiting rank must exit too, quietly, instead of hanging or printing a gloo traceback).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "bad_launch_script.py"
TIMEOUT_S = 240
"""Generous: two interpreters importing torch on a loaded 2-core CI machine take 10-40 s; a hang (the
failure this guards against) would last the gloo timeout, 30 minutes."""


@pytest.mark.parametrize("case, needle", [
    ("nonscalar_loss", "loss_fn returned a tensor of shape (16,), not a scalar; reduce it to the mean loss"),
    ("one_rank_batch", "(rank 1): train_step got a tensor of shape (3, 8); every rank passes the whole global batch"),
])
def test_user_error_in_launch_is_one_line(case: str, needle: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "whalepy.tools.cli", "run", "-n", "2", str(SCRIPT), case],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode != 0, out
    errors = [line for line in lines if line.startswith("whalepy: error")]
    assert len(errors) == 1 and needle in errors[0], out
    assert "Traceback" not in out, out
    assert "whalepy-test: trained" not in out, out
    summary = [line for line in lines if line.startswith("whalepy run:")]
    assert len(summary) == 1 and "failed on rank 0" in summary[0] and "rank 1" in summary[0], out
    # the error and the launcher's summary; nothing per rank beyond rank 0's log of the plan it lowered
    # (with the one line saying which optimizer implementation steps)
    plan_log = [line for line in lines if line.startswith(("whalepy: lowering a plan", "whalepy:   stage ",
                                                           "whalepy: optimizer "))]
    assert len(lines) - len(plan_log) == 2, out
    assert elapsed < TIMEOUT_S
