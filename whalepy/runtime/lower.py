"""``lower(model, plan, ctx) -> Lowered``: the lowering of a :class:`~whalepy.Plan` onto this rank, as a
sequence of steps (docs/architecture.md, "Lowering").

Each step is a plain function whose docstring says what it needs and what it gives; :func:`lower` calls
them in the one order that works, and :func:`parallelize_part` is applied alike to every pipeline stage
this rank holds (torchtitan's ``parallelize_fn``). Order that has to hold: the pipeline split before
tensor parallelism and FSDP2 (it traces the unsharded model); the device retargeted before them
(recompiling a GraphModule whose class FSDP2 has subclassed recurses without end); the tied weights'
process groups made at the split, by every rank in the same order; the weights of a meta-device model
allocated only after TP / FSDP2 (this rank's shards alone); the optimizers after that
(:mod:`whalepy.runtime.optimizers`); the pipeline schedule last.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.frontend.checks import max_positions, token_vocab
from whalepy.ir.plan import Plan, TPStyle
from whalepy.ir.rules import LoweringKind, check_pipeline, choose_lowering_kind
from whalepy.log import is_rank0, warn_once
from whalepy.runtime._pm_helpers import (
    _broadcast_weights,
    _check_reduce_every_microbatch,
    _pipeline_chunks,
    _resize_batch,
    _resolve_block_modules,
)
from whalepy.runtime._pm_setup import _explain_fsdp_view_warning
from whalepy.runtime._report import plan_log_lines
from whalepy.runtime.checkpointing import (
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_checkpoint_offload,
)
from whalepy.runtime.compile_blocks import CompileStats, compile_blocks
from whalepy.runtime.data_parallel import apply_data_parallel, check_root_tiers, offloads_any_block, wrap_ddp
from whalepy.runtime.materialize import MaterializeStats, Skeleton, has_meta_tensors, materialize_modules, snapshot
from whalepy.runtime.mesh import RankMeshes, build_meshes
from whalepy.runtime.optimizers import build_optimizers
from whalepy.runtime.parts import BatchContract, Blocks, LowerContext, Lowered, StagePart
from whalepy.runtime.pseudo_record import record_pseudo
from whalepy.runtime.tensor_parallel import apply_tensor_parallel
from whalepy.runtime.tied import TieGroup, tie_across_stages, tie_groups
from whalepy.runtime.tiling import plan_tiling, tile_model

__all__ = ["apply_activation_policy", "apply_tiling", "build_schedule", "check_lowerable", "choose_dp_kind",
           "lower", "materialize_parts", "parallelize_part", "place_weights", "read_batch_contract",
           "share_scale", "split_pipeline"]

log = logging.getLogger("whalepy.runtime")


def lower(model: nn.Module, plan: Plan, ctx: LowerContext) -> Lowered:
    """Lower ``plan`` onto this rank (collective: every rank calls it): ``model``'s part of it, sharded,
    with its optimizers and pipeline schedule. ``model`` is rewritten in place."""
    blocks = check_lowerable(model, plan, ctx)
    batch = read_batch_contract(model, ctx.example_inputs)
    config = getattr(model, "config", None), type(model)  # before FSDP2 subclasses the model's class
    if is_rank0():
        for line in plan_log_lines(plan):
            log.info("%s", line)
    # a pseudo model (layers tied by whalepy.pseudo_to_real): what whalepy.delink builds the real
    # model from (a meta copy made before lowering changes ``model``)
    pseudo = record_pseudo(model, cluster_spec=ctx.cluster_spec, example_inputs=ctx.example_inputs,
                           optimizer_factory=ctx.optimizer_factory, nvme_dir=ctx.nvme_dir)
    meshes = build_meshes(plan, ctx.device_type)
    skeleton = place_weights(model, meshes, ctx)
    kind = choose_dp_kind(plan, meshes)
    parts, ties = split_pipeline(model, plan, meshes, kind, blocks, on_meta=skeleton is not None, ctx=ctx)
    record: dict[nn.Module, int] = {}  # checkpoint_offload's host bytes, written by every part's hooks
    compiled = CompileStats()  # plan.compile: what compile_blocks did on this rank
    parts = [parallelize_part(p, plan, meshes, kind, blocks, ctx, on_meta=skeleton is not None, record=record,
                              compiled=compiled) for p in parts]
    parts, stats = materialize_parts(parts, skeleton, meshes, kind, ctx)
    tied = tie_across_stages(parts, ties)
    optim = build_optimizers(parts, plan, meshes, kind, tied, ctx)
    schedule = build_schedule(parts, plan, meshes, optim.amp, ctx)
    return Lowered(meshes=meshes, kind=kind, parts=parts, tied=tied, optim=optim, schedule=schedule,
                   stats=stats, blocks=blocks, batch=batch, pseudo=pseudo,
                   config=config, checkpoint_host_bytes=record, compiled=compiled if plan.compile else None)


def check_lowerable(model: nn.Module, plan: Plan, ctx: LowerContext) -> Blocks:
    """Needs: the model, the plan, ``ctx.profile``. Gives: the plan's blocks in this model, after the
    checks that refuse what cannot be lowered, before anything is built: the pipeline's shape,
    ``reduce_every_microbatch``, blocks of different tiers sharing a weight, the tiles."""
    check_pipeline(plan.schedule, num_stages=plan.pp_degree, virtual_stages=plan.virtual_stages,
                   num_microbatches=plan.num_microbatches,
                   sequence_parallel=any(r.style is TPStyle.SEQUENCE for r in plan.tensor_parallel),
                   where="the plan cannot be lowered (whalepy.plan never makes such a plan: re-plan)")
    _check_reduce_every_microbatch(plan)
    block_modules = _resolve_block_modules(model, plan, ctx.profile)
    if plan.pp_degree == 1:  # blocks of different tiers sharing a weight: refused before any work
        check_root_tiers(model, [(b, [model.get_submodule(p) for p in block_modules[b.name]])
                                 for b in plan.stages[0].blocks])
    tiling = plan_tiling(model, plan, block_modules)  # block -> {module: tiles}; checked here
    return Blocks(block_modules, tiling)


def read_batch_contract(model: nn.Module, example_inputs: tuple) -> BatchContract:
    """Needs: the unsharded model (before lowering shards the embedding). Gives: what ``train_step``
    checks a batch against; token ids are checked when the first input holds integers."""
    first = example_inputs[0] if example_inputs else None
    vocab = token_vocab(model) if isinstance(first, torch.Tensor) and not first.is_floating_point() else None
    return BatchContract(example_shapes=[tuple(x.shape[1:]) for x in example_inputs if isinstance(x, torch.Tensor)],
                         num_inputs=len(example_inputs), max_positions=max_positions(model), vocab=vocab)


def place_weights(model: nn.Module, meshes: RankMeshes, ctx: LowerContext) -> Skeleton | None:
    """Needs: the model and this rank's device. Gives: for a meta-device model, its skeleton (it is
    lowered as it is and materialised shard by shard afterwards); any other model is moved to the device
    and, with ``sync_initial_weights``, given rank 0's weights."""
    if has_meta_tensors(model):
        return snapshot(model)
    model.to(meshes.device)
    if ctx.sync_initial_weights:
        _broadcast_weights(model)
    return None


def choose_dp_kind(plan: Plan, meshes: RankMeshes) -> LoweringKind:
    """Needs: the plan and this rank's stage. Gives: how the ``dp`` axis is lowered
    (:func:`~whalepy.ir.rules.choose_lowering_kind`), saying so where FSDP2 shards more than planned."""
    stage = meshes.stage
    dp, tp, pp = plan.dp_degree, stage.tp_degree, plan.pp_degree
    kind = choose_lowering_kind(stage.zero_stage, dp, tp=tp, pp=pp, offload=offloads_any_block(stage.blocks))
    if kind == LoweringKind.FSDP and stage.zero_stage < 2 and dp > 1:
        # shards more than planned (less memory, the same gradient traffic): said, not silent; once
        # per job (rank 0), not once per stage or per call
        why = "tensor parallelism" if tp > 1 else "pipeline stages" if pp > 1 else "host offload"
        warn_once(f"fsdp-lowering-{why}",
                  "whalepy: ZeRO-0/1 stages lowered to FSDP2 (reshard_after_forward=False): DDP does not "
                  "compose with %s (same numerics; states sharded over the replicas)", why, log=log)
    if kind == LoweringKind.FSDP and tp > 1:
        _explain_fsdp_view_warning()
    return kind


def share_scale(plan: Plan, meshes: RankMeshes) -> float:
    """This replica's loss scale ``b_r * dp / B``: data-parallel averaging then gives the gradient of
    the global-batch mean, whatever the shares (module docstring of ``parallel_model``)."""
    return plan.batch_shares[meshes.replica] * plan.dp_degree / plan.global_batch


def example_microbatch(plan: Plan, meshes: RankMeshes, example_inputs: tuple) -> tuple:
    """The example inputs cut (or repeated) to one micro-batch of this replica's share."""
    mb = plan.batch_shares[meshes.replica] // plan.num_microbatches
    return tuple(_resize_batch(x, mb) for x in example_inputs)


def split_pipeline(model: nn.Module, plan: Plan, meshes: RankMeshes, kind: LoweringKind, blocks: Blocks, *,
                   on_meta: bool, ctx: LowerContext) -> tuple[list[StagePart], list[TieGroup]]:
    """Needs: the unsharded model on this rank's device (or the meta device). Gives: the pipeline stages
    this rank holds, original module paths kept, each retargeted to this rank's device; and the process
    groups of weights tied across stages (made here, by every rank in the same order; one tied weight
    in two virtual stages of a rank is refused). Without pipeline stages: one part, the model."""
    pp, v = plan.pp_degree, plan.virtual_stages
    if pp == 1:
        return [StagePart(0, model, list(meshes.stage.blocks))], []
    from whalepy.runtime.pipeline import retarget_device, split_stages, tied_parameters

    chunks = _pipeline_chunks(plan)  # BlockPlans of each pipeline stage, in model order
    stage_blocks = [[mod for b in c for mod in blocks.modules[b.name]] for c in chunks]
    example_mb = example_microbatch(plan, meshes, ctx.example_inputs)
    # a meta model is traced with meta inputs, so every device the glue records (HF's
    # arange(..., device=inputs_embeds.device)) is meta and is retargeted to this rank's
    trace_mb = example_mb if not on_meta else tuple(
        x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_mb)
    all_stages = split_stages(model, trace_mb, {}, stage_blocks)
    indices = [meshes.stage.index + j * pp for j in range(v)]
    for g in indices:
        # before TP / FSDP2: recompiling a GraphModule whose class FSDP2 has subclassed
        # recurses without end in torch.fx's call wrapper
        retarget_device(all_stages[g], meshes.device)
    ties = tie_groups(tied_parameters(all_stages), plan, meshes, stage_indices=indices, dp_kind=kind,
                      tp=meshes.stage.tp_degree)
    return [StagePart(g, all_stages[g], chunks[g]) for g in indices], ties


def parallelize_part(part: StagePart, plan: Plan, meshes: RankMeshes, kind: LoweringKind, blocks: Blocks,
                     ctx: LowerContext, *, on_meta: bool, record: dict[nn.Module, int],
                     compiled: CompileStats | None = None) -> StagePart:
    """Needs: one stage part, not yet parallelised. Gives: the part tiled, tensor parallel, with its
    activation policy, its blocks compiled (``plan.compile``; ``compiled`` gets the stats) and data
    parallel; the same for every stage (torchtitan's ``parallelize_fn``). A meta-device model's DDP is
    deferred to :func:`materialize_parts` (DDP reads its parameters)."""
    part = apply_tiling(part, blocks)
    if meshes.stage.tp_degree > 1:
        apply_tensor_parallel(part.module, plan.tensor_parallel, meshes.tp_mesh, loss_parallel=ctx.loss_parallel)
    apply_activation_policy(part, meshes.device, record)
    if plan.compile:  # each block's modules compiled, inside FSDP2 / DDP (compile_blocks.py)
        compile_blocks(part.blocks, stats=compiled)
    defer = on_meta and kind in (LoweringKind.DDP, LoweringKind.ZERO1)
    root = apply_data_parallel(part.module, part.blocks, meshes.dp_mesh, kind=LoweringKind.NONE if defer else kind,
                               zero=meshes.stage.zero_stage, device_type=ctx.device_type, precision=plan.precision)
    return replace(part, module=root)


def apply_tiling(part: StagePart, blocks: Blocks) -> StagePart:
    """Needs: a part and the checked tiling. Gives: the part with its ``tiles > 1`` modules split (each
    tile an FSDP2 unit of its own later) and each block's modules resolved in it."""
    tile_model(part.module, {p: t for b in part.chunk for p, t in blocks.tiling.get(b.name, {}).items()})
    resolved = [(b, [part.module.get_submodule(p) for p in blocks.modules[b.name]]) for b in part.chunk]
    return replace(part, blocks=resolved)


def apply_activation_policy(part: StagePart, device: torch.device, record: dict[nn.Module, int]) -> None:
    """Needs: a part with its blocks resolved. Gives (in place): per block the plan's activation policy:
    recompute, recompute with its input kept in host memory (``record`` gets the bytes), or offload."""
    ckpt = [x for b, mods in part.blocks if b.checkpoint and not b.checkpoint_offload for x in mods]
    if ckpt:
        apply_activation_checkpointing(ckpt)
    ckpt_host = [x for b, mods in part.blocks if b.checkpoint_offload for x in mods]
    if ckpt_host:
        apply_checkpoint_offload(ckpt_host, device, record=record)
    offloaded = [x for b, mods in part.blocks if b.activation_offload for x in mods]
    if offloaded:
        apply_activation_offload(offloaded, device)


def materialize_parts(parts: Sequence[StagePart], skeleton: Skeleton | None, meshes: RankMeshes,
                      kind: LoweringKind, ctx: LowerContext) -> tuple[list[StagePart], MaterializeStats | None]:
    """Needs: the parallelised parts and a meta model's skeleton (None: nothing to do). Gives: the parts
    holding this rank's shards, initialised or loaded from ``ctx.checkpoint``, DDP wrapped once they hold
    values, and what was allocated."""
    if skeleton is None:
        return list(parts), None
    stats = materialize_modules([p.module for p in parts], skeleton, meshes.device, seed=ctx.seed,
                                init_fn=ctx.init_fn, checkpoint=ctx.checkpoint)
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):  # DDP reads its parameters when built
        parts = [replace(p, module=wrap_ddp(p.module, meshes.dp_mesh)) for p in parts]
    return list(parts), stats


def build_schedule(parts: Sequence[StagePart], plan: Plan, meshes: RankMeshes, amp: Any,
                   ctx: LowerContext) -> Any:
    """Needs: the lowered parts and mixed precision. Gives: the pipeline schedule over this rank's
    stages, or None without pipeline stages."""
    if plan.pp_degree == 1:
        return None
    from whalepy.runtime.pipeline import build_pipeline_schedule, microbatch_mean_loss

    loss = microbatch_mean_loss(ctx.loss_fn, plan.num_microbatches, scale=share_scale(plan, meshes))
    pp = plan.pp_degree  # which rank of the pipeline group holds each (virtual) stage, from the plan alone
    owner = {g: dist.get_group_rank(meshes.pp_group, plan.stages[g % pp].ranks[meshes.replica][meshes.tp_index])
             for g in range(pp * plan.virtual_stages)}
    return build_pipeline_schedule(
        [p.module for p in parts], [p.index for p in parts], num_stages=plan.pp_degree * plan.virtual_stages,
        schedule=plan.schedule.value, num_microbatches=plan.num_microbatches, loss_fn=amp.scaled_loss(loss),
        group=meshes.pp_group, device=meshes.device, example_microbatch=example_microbatch(
            plan, meshes, ctx.example_inputs), compute_dtype=amp.dtype, stage_owner=owner)
