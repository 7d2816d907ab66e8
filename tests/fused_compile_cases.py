"""Per-rank worker of tests/test_fused_compile.py (no tests here): the tiny GPT of runtime_cases.py trained
under plans that fuse the optimizer (``optimizer_impl="fused"``) or compile the blocks
(``compile=True``), each against the single-process eager run with the user's optimizer, all layouts in
the same two processes."""

from __future__ import annotations

import logging
from typing import Any

import torch

from runtime_cases import (Case, batches, build_model, case_profile, full_params, lm_loss, make_case_plan,
                           reference_run, run_resume, adamw)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_one(case: Case) -> dict[str, Any]:
    """Train ``case`` and the single-process reference; the errors, what ran, the compile stats."""
    from whalepy.runtime import parallelize

    data = batches(case.global_batch, case.steps)
    ref_losses, ref_params = reference_run(case.kind, data, case.num_layers)
    pm = parallelize(build_model(case.kind, case.num_layers), None, example_inputs=(data[0][0][:2],),
                     loss_fn=lm_loss, optimizer=adamw, global_batch=case.global_batch, plan=make_case_plan(case),
                     profile=case_profile(case.kind, case.num_layers))
    losses = [pm.train_step(x, y).item() for x, y in data]
    params = full_params(pm)
    opt = pm.optimizer
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local optimizer
    stats = pm.compile_stats
    return {"name": case.name,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in params),
            "fused": [bool(g.get("fused")) for g in inner.param_groups],
            "lr": [g["lr"] for g in inner.param_groups], "weight_decay": [g["weight_decay"] for g in inner.param_groups],
            "compiled": stats.modules if stats is not None else 0,
            "fell_back": list(stats.fell_back) if stats is not None else [],
            "first_step_s": pm.reporter.first_step_s}


def run_all(cases: list[Any], backend: str) -> dict[str, Any]:
    """Each item a :class:`Case` or ``("resume", first, second, path)``; compiled blocks use ``backend``."""
    import warnings

    import torch._dynamo

    import whalepy.runtime.compile_blocks as cb

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    cb.BACKEND = backend
    lines = _Lines()
    logging.getLogger("whalepy").addHandler(lines)
    logging.getLogger("whalepy").setLevel(logging.INFO)
    out = []
    for c in cases:
        torch._dynamo.reset()  # each layout compiles afresh (no recompile limit reached across layouts)
        out.append(run_resume(*c[1:]) if isinstance(c, tuple) else run_one(c))
    return {"results": out, "lines": lines.lines}
