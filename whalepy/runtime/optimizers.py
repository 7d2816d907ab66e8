"""The optimizers of this rank's lowered parts, in the order that has to hold: the host optimizer
(ZeRO-Offload) after materialising, so its hooks sit on the final shards; the device optimizer after
the host optimizer has replaced its parameters (bf16 casts); the disk tier after the optimizer, so its
files hold this rank's shards; then mixed precision and the joint step."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from whalepy.ir.plan import Plan, Tier
from whalepy.ir.rules import LoweringKind, host_steps_after_backward, steps_on_host
from whalepy.log import info_once
from whalepy.runtime.optimizer_impl import optimizer_factory_for, split_mixed_groups
from whalepy.runtime._amp import AmpContext
from whalepy.runtime._joint_step import JointStep
from whalepy.runtime.data_parallel import build_optimizer, cast_sharded_params, compute_dtype
from whalepy.runtime.disk_space import check_disk_tier_space, plan_has_disk_tier
from whalepy.runtime.held import offloaded_params
from whalepy.runtime.host_optimizer import HostOptimizer, fused_variant
from whalepy.runtime.mesh import RankMeshes
from whalepy.runtime.nvme import NvmeTier, build_nvme_tier
from whalepy.runtime.parts import LowerContext, Optimizers, StagePart, Tied

__all__ = ["build_host_optimizer", "build_optimizers"]

log = logging.getLogger("whalepy.runtime")


def build_host_optimizer(parts: Sequence[StagePart], plan: Plan, meshes: RankMeshes, tied: Sequence[Tied],
                         ctx: LowerContext) -> HostOptimizer | None:
    """Needs: the materialised parts. Gives: the optimizer of the ZeRO-Offload blocks, which steps on the
    host during backward (or after it, under fp16 loss scaling or clipping), or None. Parameters tied
    across pipeline stages stay with the device optimizer: their gradients are summed over the stages
    only after the backward."""
    host_blocks = [(b, mods) for part in parts for b, mods in part.blocks
                   if steps_on_host(b.param_tier, b.optimizer_tier)]
    if not host_blocks:
        return None
    after_backward = host_steps_after_backward(plan.precision, ctx.max_grad_norm is not None)
    tied_ids = {id(p) for t in tied for p in t.params}
    low = compute_dtype(plan.precision)
    modules = [part.module for part in parts]
    host = HostOptimizer(
        ctx.optimizer_factory, [(b.name, [p for mod in mods for p in mod.parameters() if id(p) not in tied_ids])
                                for b, mods in host_blocks], meshes.device,
        cast=(lambda ps: cast_sharded_params(modules, ps, low)) if low is not None else None,
        step_in_backward=not after_backward)
    info_once("zero-offload",
              "whalepy: the optimizer of %d blocks steps on the host %s (ZeRO-Offload)",
              len(host.blocks),
              "after backward (fp16 loss scaling / gradient clipping)" if after_backward else "during backward",
              log=log)
    return host


def build_optimizers(parts: Sequence[StagePart], plan: Plan, meshes: RankMeshes, kind: LoweringKind,
                     tied: Sequence[Tied], ctx: LowerContext) -> Optimizers:
    """Needs: the materialised parts and the tied copies. Gives: host optimizer -> device optimizer
    (fused on host shards) -> NVMe tier -> AMP -> joint step."""
    host = build_host_optimizer(parts, plan, meshes, tied, ctx)
    modules = [part.module for part in parts]
    # read after the host optimizer, which under bf16 replaces its parameters on the modules by cast ones
    on_host = {id(p) for p in host.params} if host is not None else set()
    params = list({id(p): p for mod in modules for p in mod.parameters() if id(p) not in on_host}.values())
    optimizer = (build_optimizer(optimizer_factory_for(ctx.optimizer_factory, plan.optimizer_impl), params,
                                 kind=kind, dp_mesh=meshes.dp_mesh)  # fused or as given: optimizer_impl.py
                 if params or host is None else None)
    if optimizer is not None and offloaded_params(modules):
        # FSDP2 keeps these shards in host memory and the optimizer steps them there: its fused CPU
        # kernel, as the host optimizer does (cost_models/offload.py prices both at its rate)
        optimizer = fused_variant(optimizer)
    if optimizer is not None:  # the optimizer that steps, after every rebuild above
        split_mixed_groups(optimizer)
    nvme = build_disk_tier(parts, plan, optimizer, meshes, ctx)
    amp = AmpContext(plan.precision, meshes.device)
    # fp16, or ZeRO-Offload stepping after backward anywhere in the plan: every rank steps its
    # optimizers as one, with gradients on the same devices for the scaler (see _joint_step.py)
    joint = None
    after_backward = host_steps_after_backward(plan.precision, ctx.max_grad_norm is not None)
    if amp.scaler is not None or (after_backward and any(
            steps_on_host(b.param_tier, b.optimizer_tier) for st in plan.stages for b in st.blocks)):
        joint = JointStep(optimizer, host, meshes.device)
    return Optimizers(optimizer, host, nvme, amp, joint)


def build_disk_tier(parts: Sequence[StagePart], plan: Plan, optimizer: Any, meshes: RankMeshes,
                    ctx: LowerContext) -> NvmeTier | None:
    """Needs: the parts after TP / FSDP2 and materialising, and the device optimizer. Gives: the disk
    tier of the blocks with an ``nvme`` tier (its files hold this rank's shards), or None. Collective
    when the plan has a disk tier anywhere: every rank's files are summed per file system first."""
    nvme_blocks: list[tuple[Any, nn.Module, list[nn.Module]]] = [
        (b, part.module, mods) for part in parts for b, mods in part.blocks
        if Tier.NVME in (b.optimizer_tier, b.param_tier)]
    if not nvme_blocks:
        if plan_has_disk_tier(plan):  # this rank writes nothing, but its peers' check gathers from it
            check_disk_tier_space(ctx.nvme_dir, 0.0, rank=meshes.rank)
        return None
    nvme = build_nvme_tier(optimizer, nvme_blocks, rank=meshes.rank, nvme_dir=ctx.nvme_dir,
                           keep=ctx.nvme_keep, pin=ctx.device_type == "cuda",
                           planned_file_bytes=meshes.stage.cost.nvme_state_bytes)
    log.info("whalepy: %d blocks keep parameters and / or optimizer states in files under %s",
             len(nvme_blocks), nvme.directory)
    return nvme
