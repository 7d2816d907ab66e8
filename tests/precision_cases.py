"""Per-rank workers for the precision tests (no tests here): model-state bytes held vs predicted, and
bf16 / fp16 numerics against single-process runs with the same precision policy.

What "held" counts (measured at the optimizer step of the second training step, when parameters,
gradients and the optimizer states created by the first step are all alive):

- parameters: the storages of this rank's parameters (a DTensor's local shard; FSDP2's padded
  shard storage, so padding would be counted);
- gradients: the storages of ``p.grad`` (DDP's buckets, which the gradients view);
- optimizer states: every tensor state with at least one dimension (AdamW's ``exp_avg`` and
  ``exp_avg_sq``; under ZeRO-1 the wrapped per-rank optimizer's), not the 0-dim ``step`` counters
  (4 bytes per tensor, which the memory model does not charge either).

ZeRO-Offload blocks (``param_tier = gpu, optimizer_tier = cpu``) are measured after the host optimizer
has finished the step (its :meth:`~whalepy.runtime.host_optimizer.HostOptimizer.finish`): the device
shards, and on the host what :meth:`~whalepy.runtime.host_optimizer.HostOptimizer.held` yields (fp32
masters, gradient buffers, optimizer states).

Each storage is counted once. Where it lives: "files" when it is an NVMe-tier mapping of
:class:`~whalepy.runtime.nvme.NvmeOptimizerStates` (or a gradient file of an nvme parameter,
:mod:`whalepy.runtime._grad_files`); "host" when it belongs to a parameter FSDP2
offloads (``CPUOffloadPolicy``: its parameter, gradient and optimizer states), or is a CPU tensor of
a run whose compute device is not the CPU; "device" otherwise. On these CPU runs device and host are
the same memory, so the host / device split is read from FSDP2's own record of what it offloaded.

Not counted (transient, charged by the plan as the working set, not as model states): the
low-precision parameters FSDP2 gathers for compute and autocast's cast copies (both freed before the
optimizer step), buffers (the models here have none), activations.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from runtime_cases import adamw, batches, build_model, case_profile, lm_loss

GLOBAL_BATCH = 8


def cpu_cluster(world: int) -> Any:
    """``world`` CPU ranks on one node with host memory and an NVMe drive, so every tier is allowed."""
    from whalepy import ClusterSpec

    return ClusterSpec.from_dict({"groups": [{
        "gpu": "CPU", "gpus_per_node": world, "intra_node": "shm", "cpu_memory_gb": 16,
        "nvme": {"capacity_tb": 1, "read_gbs": 1, "write_gbs": 1}}]})


def measure_held(pm: Any) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer states this rank holds, by kind and place
    (:func:`whalepy.runtime.held.held_state_bytes`)."""
    from whalepy.runtime.held import held_state_bytes

    return held_state_bytes(pm)


def held_vs_predicted(cases: list[tuple[int, str | None, str]], nvme_root: str) -> list[dict[str, Any]]:
    """For each ``(zero_stage, offload tier, precision)``: the plan ``whalepy.estimate`` makes for dp =
    world size, lowered by ``parallelize``; this rank's held bytes at the second step's optimizer step
    and the plan's prediction for its stage. Offload ``"cpu-optimizer"`` (ZeRO-Offload; also
    ``ParallelConfig(offload="cpu", zero_offload=True)`` now) is the device-only plan with every block's
    ``optimizer_tier`` set to cpu, predicted by the memory model's
    :func:`~whalepy.cost_models.memory.estimate_model_state_bytes` for that option."""
    import dataclasses
    import torch.distributed as dist

    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
    from whalepy.runtime import parallelize

    world = dist.get_world_size()
    cluster = cpu_cluster(world)
    prof = case_profile("gpt")
    data = batches(GLOBAL_BATCH, 2)
    results = []
    for zero, offload, precision in cases:
        host_opt = offload == "cpu-optimizer"
        est = estimate_from_profile(prof, cluster, ParallelConfig(dp=world, zero_stage=zero,
                                                                  offload=None if host_opt else offload),
                                    global_batch=GLOBAL_BATCH, precision=precision)
        plan = est.plan
        if host_opt:
            plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, blocks=tuple(
                dataclasses.replace(b, optimizer_tier="cpu") for b in s.blocks)) for s in plan.stages))
        pm = parallelize(build_model("gpt"), cluster, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
                         optimizer=adamw, global_batch=GLOBAL_BATCH, plan=plan, profile=prof,
                         nvme_dir=os.path.join(nvme_root, f"z{zero}-{offload}-{precision}"))
        seen: list[dict[str, dict[str, int]]] = []
        owner = pm.host_optimizer if host_opt else pm.optimizer
        name = "finish" if host_opt else "step"
        step = getattr(owner, name)

        def measured_step(*args: Any, _step: Any = step, _pm: Any = pm, _after: bool = host_opt,
                          **kwargs: Any) -> Any:
            if not _after:
                seen.append(measure_held(_pm))
            out = _step(*args, **kwargs)
            if _after:
                seen.append(measure_held(_pm))
            return out

        setattr(owner, name, measured_step)
        for x, y in data:
            pm.train_step(x, y)
        cost = plan.stages[0].cost
        predicted = {"device": cost.model_state_bytes, "host": cost.host_state_bytes, "files": cost.nvme_state_bytes}
        if host_opt:
            from whalepy.cost_models.memory import estimate_model_state_bytes

            held = estimate_model_state_bytes(num_params=sum(b.num_params for b in prof.blocks), zero_stage=zero,
                                              dp_degree=world, precision=precision, optimizer_tier="cpu")
            predicted = {"device": round(held.resident), "host": round(held.cpu), "files": 0}
        results.append({
            "case": (zero, offload, precision), "kind": str(pm.dp_kind.value), "held": seen[-1],
            "predicted": predicted,
            "num_params": sum(b.num_params for b in prof.blocks)})
        if pm.nvme is not None:
            pm.nvme.close()
    return results


# -- numerics ----------------------------------------------------------------------------------------


def _one_rank_mesh() -> Any:
    """A device mesh of this rank alone (``new_group`` is collective: every rank makes every group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return DeviceMesh.from_group(mine, "cpu")


def reference_run(precision: str, fsdp: bool, data: list, mesh: Any = None, *, loss_factor: float = 1.0,
                  max_grad_norm: float | None = None, skip: tuple[bool, ...] = (), device: str = "cpu") -> dict[str, Any]:
    """One process, the same precision policy as the runtime's lowering: forward and loss under
    ``torch.autocast`` (bf16 / fp16); with ``fsdp`` the model is also ``fully_shard``-ed per block and
    at the root on a one-rank mesh with the same ``MixedPrecisionPolicy`` (low-precision parameters for
    compute, fp32 reduction). fp16 scales the loss with a (one-rank) GradScaler, as the runtime does.

    The loss trained is ``lm_loss`` times ``loss_factor``; ``max_grad_norm``: gradients (unscaled)
    clipped by ``clip_grad_norm_`` before each step; ``skip``: steps not taken (as an fp16 run skips
    them); ``device``: where it trains (``"cuda"``: tests/test_cuda_tiers.py). Returns ``losses``, ``params``, per step the loss ``scales`` after it and whether it was
    ``skipped`` (fp16: the scale backed off), and the clipping's ``norms``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    model = build_model("gpt").to(device)
    if fsdp:
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
        for b in case_profile("gpt").blocks:
            mods = [model.get_submodule(p) for p in b.modules]
            for m in mods:
                if any(True for _ in m.parameters()):
                    fully_shard(m, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    opt = adamw(model.parameters())
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    out: dict[str, Any] = {"losses": [], "scales": [], "skipped": [], "norms": []}
    for i, (x, y) in enumerate(data):
        with torch.autocast(device, dtype=low, enabled=low is not None):
            loss = lm_loss(model(x.to(device)), y.to(device)) * loss_factor
        (scaler.scale(loss) if scaler else loss).backward()
        if max_grad_norm is not None:
            if scaler:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        before = scaler.get_scale() if scaler else 1.0
        if scaler:
            scaler.step(opt)
            scaler.update()
        elif not (skip and skip[i]):
            opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["scales"].append(scaler.get_scale() if scaler else 1.0)
        out["skipped"].append(out["scales"][-1] < before)
    from runtime_cases import full_params

    out["params"] = full_params(_Holder(model))
    return out


class _Holder:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


OFFLOAD_KEYS = ("param_tier", "optimizer_tier", "activation_offload", "tiers")
"""Case keys passed through to ``make_plan`` (for every block; ``tiers``: per block)."""


def numerics(cases: list[dict[str, Any]], steps: int = 3) -> list[dict[str, Any]]:
    """For each case (``name``, ``precision``, ``dp``/``tp``/``pp``/``zero``, optionally the
    :data:`OFFLOAD_KEYS`, a ``loss_factor`` the loss is multiplied by and a ``max_grad_norm``): losses
    and final parameters of the lowered plan against the single-process run with its precision policy
    (and the same loss factor and clipping), the loss scale after each step on both sides, the
    clipping's global norms on both sides.

    ``precision_noise`` is measured against the fp32 single-process run that takes the same steps (an
    fp16 run skips those whose gradients overflowed; the fp32 run then skips them too)."""
    from runtime_cases import Case, full_params, make_case_plan
    from whalepy.runtime import parallelize
    from whalepy.runtime.held import offloaded_params

    mesh = _one_rank_mesh()
    data = batches(GLOBAL_BATCH, steps)
    refs: dict[tuple, Any] = {}

    def reference(precision: str, fsdp: bool, factor: float, clip: float | None, skip: tuple = ()) -> Any:
        key = (precision, fsdp, factor, clip, skip)
        if key not in refs:
            refs[key] = reference_run(precision, fsdp, data, mesh, loss_factor=factor, max_grad_norm=clip, skip=skip)
        return refs[key]

    out = []
    for c in cases:
        case = Case(c["name"], dp=c.get("dp", 1), tp=c.get("tp", 1), pp=c.get("pp", 1), zero=c.get("zero", 0),
                    microbatches=c.get("microbatches", 1), schedule=c.get("schedule", "1f1b"),
                    global_batch=GLOBAL_BATCH, steps=steps,
                    extra={"precision": c["precision"], **{k: c[k] for k in OFFLOAD_KEYS if k in c}})
        plan = make_case_plan(case)
        factor, clip = c.get("loss_factor", 1.0), c.get("max_grad_norm")
        pm = parallelize(build_model("gpt"), None, example_inputs=(data[0][0][:2],),
                         loss_fn=(lambda out, y, _f=factor: lm_loss(out, y) * _f) if factor != 1.0 else lm_loss,
                         optimizer=adamw, global_batch=GLOBAL_BATCH, plan=plan, profile=case_profile("gpt"),
                         max_grad_norm=clip)
        fsdp = pm.dp_kind.value == "fsdp2"
        ref = reference(c["precision"], fsdp, factor, clip)
        ref_losses, ref_params = ref["losses"], ref["params"]
        losses, scales, norms = [], [], []
        for x, y in data:
            losses.append(pm.train_step(x, y).item())
            scales.append(pm.amp.loss_scale())
            norms.append(pm.last_grad_norm)
        params = full_params(pm)
        init = build_model("gpt").state_dict()
        skip = tuple(ref["skipped"]) if any(ref["skipped"]) else ()
        fp32_params = reference("fp32", False, factor, clip, skip)["params"]

        def distance(a: dict, b: dict) -> float:
            return sum(((a[k] - b[k]) ** 2).sum().item() for k in params) ** 0.5

        moved = distance(ref_params, init)
        out.append({
            "update_err": distance(params, ref_params) / moved,
            "precision_noise": distance(ref_params, fp32_params) / moved,
            "name": c["name"], "precision": c["precision"], "kind": pm.dp_kind.value,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in params),
            "losses": losses, "ref": ref_losses, "scales": scales, "ref_scales": ref["scales"],
            "skipped": ref["skipped"], "norms": norms, "ref_norms": ref["norms"],
            "host_blocks": (pm.host_optimizer.queued_in_backward, len(pm.host_optimizer.blocks))
            if pm.host_optimizer is not None else None,
            # FSDP2 shards in host memory, and whether the optimizer stepping them runs the fused kernel
            "host_shards": bool(offloaded_params(pm._modules)),
            "fused": None if pm.optimizer is None else all(g.get("fused") for g in pm.optimizer.param_groups)})
    return out
