"""Shared pieces of the Pseudo-to-Real tests (no tests here): the model, the single-process reference
of both phases, and the per-rank worker that runs them under DP x PP (tests/test_pseudo_to_real.py)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from runtime_cases import SEQ, adamw, batches, full_params, gpt_model, lm_loss

NUM_LAYERS = 4
PSEUDO_STEPS = 2
"""Steps of the pseudo phase before delinking (so the shared optimizer state is not empty)."""
GLOBAL_BATCH = 8


def pseudo_model() -> torch.nn.Module:
    import whalepy

    return whalepy.pseudo_to_real(gpt_model(NUM_LAYERS), layers="transformer.h")


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def reference(data: list) -> dict[str, Any]:
    """One process: ``PSEUDO_STEPS`` pseudo steps; the pseudo model's loss on the next batch; then the
    real model (delinked, optimizer state mapped) trains on the remaining batches."""
    import whalepy

    model = pseudo_model()
    opt = adamw(model.parameters())
    pseudo_losses = [step(model, opt, x, y) for x, y in data[:PSEUDO_STEPS]]
    shared = {k: v.detach().clone() for k, v in model.state_dict().items()}  # every layer's name
    with torch.no_grad():
        next_pseudo_loss = lm_loss(model(data[PSEUDO_STEPS][0]), data[PSEUDO_STEPS][1]).item()
    whalepy.delink(model, optimizer=opt)
    real_losses = []
    after_first = None
    for x, y in data[PSEUDO_STEPS:]:
        real_losses.append(step(model, opt, x, y))
        if after_first is None:
            after_first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"pseudo_losses": pseudo_losses, "shared": shared, "next_pseudo_loss": next_pseudo_loss,
            "real_losses": real_losses, "after_first": after_first}


def make_plans() -> tuple:
    """``(pseudo plan, pseudo profile, real plan, real profile, too big)`` for 4 ranks: the pseudo model on
    PP 2 x DP 2 under ZeRO-3 (layers h.0, h.1 on stage 0 and h.2, h.3 on stage 1, so both stages hold
    a copy of the shared weights), the real model on PP 2 x DP 2 under ZeRO-2 with another stage split
    (its checkpoint is resharded by DCP)."""
    import whalepy
    from whalepy.runtime import make_plan

    x = torch.zeros(2, SEQ, dtype=torch.long)
    out = []
    for model, zero, sizes in ((pseudo_model(), 3, (3, 3)), (gpt_model(NUM_LAYERS), 2, (2, 4))):
        prof = whalepy.profile(model, (x,))
        plan = make_plan([b.name for b in prof.blocks], model_fingerprint=prof.fingerprint, dp=2, pp=2,
                         global_batch=GLOBAL_BATCH, zero_stage=zero, num_microbatches=2,
                         stage_sizes=sizes)
        out += [plan, dataclasses.replace(prof, graph=None)]
    too_big = make_plan([b.name for b in prof.blocks], dp=4, pp=2, global_batch=GLOBAL_BATCH,
                        num_microbatches=2)
    return (*out, too_big)


def as_shared(key: str) -> str:
    """The pseudo model's name of what ``key`` starts from: layer k's tensors from layer 0's."""
    parts = key.split(".")
    if key.startswith("transformer.h."):
        parts[2] = "0"
    return ".".join(parts)


def max_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rename: Any = None) -> float:
    """Largest absolute difference over ``got``'s tensors against ``want[rename(key)]``."""
    rename = rename or (lambda k: k)
    return max((v.float() - want[rename(k)].float()).abs().max().item() for k, v in got.items())


def run_delink(pseudo_plan, pseudo_prof, real_plan, real_prof, too_big, ckpt: str) -> dict[str, Any]:
    """Per rank: pseudo phase under ``pseudo_plan``, save a checkpoint, delink onto ``real_plan``,
    train; then load the pre-delink checkpoint into the real model and take the first real step
    again. Every figure is compared with :func:`reference`."""
    import warnings

    import torch.distributed as dist

    import whalepy

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    data = batches(GLOBAL_BATCH, PSEUDO_STEPS + 2)
    ref = reference(data)
    pm = whalepy.parallelize(pseudo_model(), None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
                             optimizer=adamw, global_batch=GLOBAL_BATCH, plan=pseudo_plan,
                             profile=pseudo_prof)
    tied_copies = len(pm.tied_parameters)
    pseudo_losses = [pm.train_step(x, y).item() for x, y in data[:PSEUDO_STEPS]]
    pseudo_state_bytes = optimizer_state_bytes(pm.optimizer)
    pm.save(ckpt)
    dist.barrier()
    # a plan the job cannot run (8 ranks): a clear error naming where the state was saved
    try:
        whalepy.delink(pm, plan=too_big, profile=real_prof, checkpoint_dir=ckpt + "-big")
        too_big_error = None
    except whalepy.LaunchError as e:
        too_big_error = str(e)
    real = whalepy.delink(pm, plan=real_plan, profile=real_prof)
    delinked = full_params(real)
    real_losses = []
    after_first = None
    for x, y in data[PSEUDO_STEPS:]:
        real_losses.append(real.train_step(x, y).item())
        if after_first is None:
            after_first = full_params(real)
            real_state_bytes = optimizer_state_bytes(real.optimizer)
    # a checkpoint made before delinking loads into the real model: back to the shared weights and
    # state, and the first real step again
    real.load(ckpt)
    reloaded = full_params(real)
    again_loss = real.train_step(*data[PSEUDO_STEPS]).item()
    again = full_params(real)

    return {
        "tied_copies": tied_copies,
        "too_big_error": too_big_error,
        "pseudo_state_bytes": pseudo_state_bytes,
        "real_state_bytes": real_state_bytes,
        "pseudo_loss_err": max(abs(a - b) for a, b in zip(pseudo_losses, ref["pseudo_losses"])),
        "real_loss_err": max(abs(a - b) for a, b in zip(real_losses, ref["real_losses"])),
        "first_real_vs_pseudo_loss": abs(real_losses[0] - ref["next_pseudo_loss"]),
        "again_loss_err": abs(again_loss - ref["real_losses"][0]),
        "keys": sorted(delinked),
        "all_keys": sorted(ref["after_first"]),
        # this rank's tensors (its pipeline stage's), each against the reference
        "delinked_vs_shared": max_err(delinked, ref["shared"], as_shared),
        "first_step_err": max_err(after_first, ref["after_first"]),
        "reloaded_vs_shared": max_err(reloaded, ref["shared"], as_shared),
        "again_err": max_err(again, ref["after_first"]),
    }


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (local shards; not the scalar step counts)."""
    from torch.distributed.tensor import DTensor

    local = [v._local_tensor if isinstance(v, DTensor) else v
             for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local if t.dim() > 0)


def copy_model_and_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer,
                             factory: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A deep copy of ``model`` (ties kept) and an optimizer over it with ``opt``'s state."""
    twin = copy.deepcopy(model)
    twin_opt = factory(twin.parameters())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may alias tensors
    return twin, twin_opt
