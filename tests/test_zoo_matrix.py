"""The Hugging Face zoo as a test matrix (issue 22; the worker and the SGD argument: tests/zoo_cases.py).

Sixteen architectures, tiny configs built here from their ``Config`` classes (no downloads), each under
DP 2 x TP 2, PP 2 x DP 2, ZeRO-3 on 4 ranks, TP 2 x PP 2 and the planner's own plan for 4 CPU ranks,
plus whalepy's GPT with GPT-2's 50257-token vocabulary under a planner-made plan whose TP stage holds that
embedding (50257 does not divide by 2: the block runs whole, the plan check accepts it). Every case must
train to the single-process losses (fp32, relative 1e-5) and parameters (SGD, 1e-5), or be refused
before training with the one-line whalepy error listed in ``REFUSED``: no silent mismatch, no raw error.
All cases share ONE group of 4 gloo processes.
"""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from zoo_cases import ARCHS, LAYOUTS, run_matrix

pytest.importorskip("transformers")

TOL = 1e-5

REFUSED: dict[tuple[str, str], str] = {}
"""``(arch, layout) -> text the refusal must contain``; every other case must match one process."""


def test_zoo_matrix() -> None:
    per_rank = run_distributed(run_matrix, 4, ARCHS, LAYOUTS, timeout=900)
    cases = per_rank[0]
    assert len(cases) == len(ARCHS) * len(LAYOUTS) + 1
    problems = []
    for i, case in enumerate(cases):
        key = (case["arch"], case["layout"])
        ranks = [r[i] for r in per_rank]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            problems.append(f"{key}: raw error {errors[0][:600]}")
            continue
        refusals = {r.get("refused") for r in ranks}
        if key in REFUSED:
            msg = refusals.pop() if len(refusals) == 1 else None
            if msg is None or REFUSED[key] not in msg or "\n" in msg:
                problems.append(f"{key}: expected the refusal {REFUSED[key]!r}, got {refusals}")
            continue
        if refusals != {None}:
            problems.append(f"{key}: refused {refusals}")
            continue
        loss_err = max(r["loss_err"] for r in ranks)
        param_err = max(r["param_err"] for r in ranks)
        covered = set().union(*(r["params"] for r in ranks))
        if loss_err > TOL or param_err > TOL:
            problems.append(f"{key}: loss error {loss_err:.2e}, parameter error {param_err:.2e}")
        if not set(case["reference_params"]) <= covered:
            problems.append(f"{key}: parameters never compared: {sorted(set(case['reference_params']) - covered)[:4]}")
    assert not problems, "\n".join(problems)
    vocab_case = cases[-1]
    assert vocab_case["arch"] == "gpt_v50257" and vocab_case["embed_tp"] == 2, vocab_case
