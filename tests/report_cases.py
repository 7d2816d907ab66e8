"""Per-rank worker for tests/test_training_report.py (no tests here): gradient clipping and
``evaluate`` under a layout against one process, and what rank 0 logs."""

from __future__ import annotations

import logging
from typing import Any

import torch

from runtime_cases import (Case, adamw, batches, build_model, case_profile, full_params, lm_loss,
                           make_case_plan)

MAX_NORM = 0.05
"""Small enough that every step clips (the GPT's first gradient norms are ~1); asserted below."""


def reference(case: Case, data, held_out) -> dict[str, Any]:
    """One process: eval loss before training, then per step: grad norm (torch's clip_grad_norm_),
    loss; eval loss after; final parameters."""
    model = build_model(case.kind, case.num_layers)
    opt = adamw(model.parameters())

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            out = lm_loss(model(held_out[0]), held_out[1]).item()
        model.train()
        return out

    before = eval_loss()
    losses, norms = [], []
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"eval_before": before, "eval_after": eval_loss(), "losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_case(case: Case) -> dict[str, Any]:
    from whalepy.runtime import parallelize

    data = batches(case.global_batch, case.steps)
    held_out = batches(case.global_batch, 1, seed=7)[0]
    ref = reference(case, data, held_out)
    records = _Records()
    logging.getLogger("whalepy").addHandler(records)
    try:
        pm = parallelize(build_model(case.kind, case.num_layers), None, example_inputs=(data[0][0][:2],),
                         loss_fn=lm_loss, optimizer=adamw, global_batch=case.global_batch,
                         plan=make_case_plan(case), profile=case_profile(case.kind, case.num_layers),
                         max_grad_norm=MAX_NORM, log_every=1)
        before_params = full_params(pm)
        eval_before = pm.evaluate(*held_out).item()
        unchanged = max((full_params(pm)[k] - v).abs().max().item() for k, v in before_params.items())
        losses, norms = [], []
        for x, y in data:
            losses.append(pm.train_step(x, y).item())
            norms.append(pm.last_grad_norm)
        eval_after = pm.evaluate(*held_out).item()
        params = full_params(pm)
        traced = None
        if case.pp == 1 and case.tp == 1 and case.kind == "gpt":
            import whalepy

            # this rank's iteration: its share of the batch, whatever the data-parallel wrapper
            share = pm.plan.batch_shares[pm.meshes.replica] // pm.plan.num_microbatches  # one micro-batch
            local = whalepy.trace_memory(pm, data[0][0], data[0][1])
            single = whalepy.trace_memory(build_model(case.kind, case.num_layers), data[0][0][:share],
                                          data[0][1][:share], loss_fn=lm_loss)
            traced = (local.activation_bytes, single.activation_bytes,
                      sorted({e.phase for e in local.events}))
    finally:
        logging.getLogger("whalepy").removeHandler(records)
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    return {
        "name": case.name,
        "loss_err": max(rel(a, b) for a, b in zip(losses, ref["losses"])),
        "norm_err": max(rel(a, b) for a, b in zip(norms, ref["norms"])),
        "min_ref_norm": min(ref["norms"]),
        "eval_err": max(rel(eval_before, ref["eval_before"]), rel(eval_after, ref["eval_after"])),
        "eval_changed_params": unchanged,
        "param_err": max((params[k] - ref["params"][k]).abs().max().item() for k in params),
        "log": records.lines,
        "stages": len(pm.plan.stages),
        "traced": traced,
    }


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    import warnings

    warnings.filterwarnings("ignore", message=".*sequential all_gather.*")
    return [run_case(c) for c in cases]
