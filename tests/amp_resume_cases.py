"""Per-rank worker for the mixed-precision resume test (no tests here): a run of ``steps`` training steps
straight through against the same run cut in half by ``pm.save``, a fresh ``parallelize`` of a
differently initialised model and ``pm.load``; and cut in half by ``pm.state_dict()`` handed to a
fresh model's ``pm.load_state_dict``.

What is compared, per case: the losses of every step, the whole model as ``pm.full_state_dict()``
returns it (rank 0; under bf16 ZeRO-Offload these are the fp32 host masters) and the fp16 loss
scaler's state on every rank. fp16 cases train ``lm_loss`` times :data:`LOSS_FACTOR`: at the initial
scale (65536) that overflows fp16 gradients, so the scaler backs off and skips the first steps, as
an fp16 run does when it starts, and the scale at the cut is not the initial one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from report_cases import _Records
from runtime_cases import Case, adamw, batches, build_model, case_profile, lm_loss, make_case_plan

GLOBAL_BATCH = 8
LOSS_FACTOR = 8.0
"""Measured on the 2-layer GPT of ``runtime_cases`` (ZeRO-2, dp 2): the scale goes 65536 -> 32768 ->
16384 over the first two (skipped) steps, then stays and counts clean steps (growth tracker 1, 2, ...)."""


def _loss(precision: str) -> Any:
    if precision != "fp16":
        return lm_loss
    return lambda out, y: lm_loss(out, y) * LOSS_FACTOR


def _build(case: dict[str, Any], data: list, *, scrambled: bool = False) -> Any:
    from whalepy.runtime import parallelize

    model = build_model("gpt")
    if scrambled:  # everything the resumed run has must come from the checkpoint
        torch.manual_seed(123)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    extra = {"precision": case["precision"], **case.get("extra", {})}
    plan = make_case_plan(Case(case["name"], dp=case.get("dp", 1), pp=case.get("pp", 1), zero=case.get("zero", 0),
                               microbatches=case.get("microbatches", 1), schedule=case.get("schedule", "1f1b"),
                               global_batch=GLOBAL_BATCH, extra=extra))
    return parallelize(model, None, example_inputs=(data[0][0][:2],), loss_fn=_loss(case["precision"]),
                       optimizer=adamw, global_batch=GLOBAL_BATCH, plan=plan, profile=case_profile("gpt"))


def _scaler(pm: Any) -> dict[str, Any]:
    return pm.amp.scaler.state_dict() if pm.amp.scaler is not None else {}


def _err(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference (rank 0; the other ranks' full state dicts are empty)."""
    return max(((want[k].float() - got[k].float()).abs().max().item() for k in want), default=0.0)


def resume_cases(cases: list[dict[str, Any]], root: str, steps: int = 6) -> list[dict[str, Any]]:
    """For each case: straight vs resumed (see the module docstring). fp16 cases also load a checkpoint
    written without the scaler's state (as before checkpoints carried it): the scale stays at the
    initial 65536 and rank 0 warns once. A case with ``load_into`` (plan fields to change) also
    loads the checkpoint under that plan and compares the weights with those at the cut."""
    import torch.distributed as dist

    from whalepy.runtime.checkpointing import save_train_state

    data = batches(GLOBAL_BATCH, steps)
    half = steps // 2
    out = []
    for case in cases:
        path = os.path.join(root, case["name"].replace(" ", "-"))
        straight = _build(case, data)
        losses = [straight.train_step(x, y).item() for x, y in data]
        want, want_scaler = straight.full_state_dict(), _scaler(straight)

        first = _build(case, data)
        resumed = [first.train_step(x, y).item() for x, y in data[:half]]
        at_cut, cut_state, cut = _scaler(first), first.state_dict(), first.full_state_dict()
        first.save(path)
        if case["precision"] == "fp16":  # the format before the scaler's state was written
            save_train_state(path + "-old", first._modules, first._optimizers())
        dist.barrier()
        second = _build(case, data, scrambled=True)
        second.load(path)
        resumed += [second.train_step(x, y).item() for x, y in data[half:]]
        got = second.full_state_dict()
        r = {"name": case["name"], "precision": case["precision"], "losses": losses, "resumed": resumed,
             "keys": sorted(want) == sorted(got),
             "param_err": _err(want, got),
             "dtypes": sorted({str(v.dtype) for v in got.values()}),
             # how far the weights are from bf16 numbers: 0 if full_state_dict returned the bf16 copies
             "off_bf16": max(((v - v.bfloat16().float()).abs().max().item() for v in got.values()
                              if v.dtype == torch.float32), default=0.0),
             "scaler": want_scaler, "scaler_resumed": _scaler(second), "scaler_at_cut": at_cut}
        # the same resume through pm.state_dict() / pm.load_state_dict() in memory (first's tensors)
        third = _build(case, data, scrambled=True)
        third.load_state_dict(cut_state)
        r["in_memory"] = [third.train_step(x, y).item() for x, y in data[half:]]
        got = third.full_state_dict()
        r["in_memory_err"] = _err(want, got)
        if "load_into" in case:  # under another plan the checkpoint loads the weights saved, exactly
            other = _build({**case, **case["load_into"]}, data, scrambled=True)
            other.load(path)
            r["into_err"] = _err(cut, other.full_state_dict())
        r["scaler_in_memory"] = _scaler(third)
        if case["precision"] == "fp16":
            warned = _Records()  # what whalepy logs on this rank
            logging.getLogger("whalepy").addHandler(warned)
            old = _build(case, data)
            old.load(path + "-old")
            logging.getLogger("whalepy").removeHandler(warned)
            r["old_scale"] = _scaler(old)["scale"]
            r["old_warned"] = [line for line in warned.lines if "loss-scaler" in line]
        out.append(r)
    return out
