"""Helpers of :mod:`whalepy.runtime.parallel_model` and :mod:`whalepy.runtime.lower`: the loss
check, the data-parallel sync context of a micro-batch, batch and tensor utilities, block-to-module
resolution, and the plan checks made before anything is built."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.errors import ArgumentError, LaunchError, PlanError, WhalepyError
from whalepy.frontend.checks import check_scalar_loss
from whalepy.ir.plan import Plan, TPStyle
from whalepy.ir.rules import LoweringKind
from whalepy.runtime.data_parallel import offloads_any_block

log = logging.getLogger("whalepy.runtime")

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _checked_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` whose result is checked to be a scalar before anything differentiates it."""
    return CheckedLoss(loss_fn)


class CheckedLoss:
    """``loss_fn`` whose result is checked to be a scalar before anything differentiates it; while
    ``observer`` is set (the closed loop's sampled step, :mod:`whalepy.runtime._block_timing`), it is told
    when the loss starts and what it returned, so the loss is timed as the last block's."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.observer: Any = None

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        observer = self.observer
        if observer is not None:
            observer.loss_started()
        try:
            loss = self.loss_fn(outputs, targets)
        except (ValueError, RuntimeError, IndexError, TypeError) as e:
            if isinstance(e, WhalepyError):
                raise
            # e.g. targets of another length than the outputs: one line (printed once per job), not a
            # traceback from inside the loss on every rank
            out = getattr(outputs, "logits", outputs)
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            text = " ".join(str(e).split())[:200]
            raise ArgumentError(f"loss_fn(outputs, targets) raised {type(e).__name__}: {text} (this rank's outputs "
                                f"{shape}, targets {tuple(targets.shape)}); give targets that fit the model's "
                                "outputs (e.g. the same sequence length as the inputs)") from e
        check_scalar_loss(loss)
        if observer is not None:
            observer.loss_done(loss)
        return loss


def _check_reduce_every_microbatch(plan: Plan) -> None:
    """Refuse a stage's ``reduce_every_microbatch`` where the runtime cannot lower it (one rule,
    :func:`reduce_every_microbatch_error`), before anything is built."""
    from whalepy.ir.rules import choose_lowering_kind, reduce_every_microbatch_error

    for st in plan.stages:
        if not st.reduce_every_microbatch:
            continue
        kind = choose_lowering_kind(st.zero_stage, plan.dp_degree, tp=st.tp_degree, pp=plan.pp_degree,
                                    offload=offloads_any_block(st.blocks))
        for b in st.blocks:
            reason = reduce_every_microbatch_error(kind, pp=plan.pp_degree, param_tier=b.param_tier,
                                                   optimizer_tier=b.optimizer_tier)
            if reason is not None:
                raise PlanError(f"stage {st.index}: {reason}")


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _sync_context(module: nn.Module, kind: str, last: bool) -> Any:
    if kind == LoweringKind.FSDP:
        module.set_requires_gradient_sync(last)
        return _Null()
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1) and not last:
        return module.no_sync()
    return _Null()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _as_tuple(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    raise ArgumentError(f"inputs must be a tensor or a tuple of tensors (positional model inputs), got "
                        f"{type(x).__name__}; pass e.g. (tokens,)")


def _resize_batch(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[0] >= n:
        return x[:n]
    reps = (n + x.shape[0] - 1) // x.shape[0]
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:n]


def _broadcast_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type != "meta":
                dist.broadcast(t.data, src=0)


def _profile_or_none(model: nn.Module, example_inputs: Any, plan: Plan) -> Any:
    try:
        from whalepy.frontend.profile import profile
    except ImportError:
        return None
    try:
        return profile(model, example_inputs,
                       sequence_parallel=any(r.style is TPStyle.SEQUENCE for r in plan.tensor_parallel))
    except (ImportError, NotImplementedError) as e:
        log.warning("whalepy: cannot profile the model to check the plan's fingerprint (%s)", e)
        return None


def _pipeline_chunks(plan: Plan) -> list[list[Any]]:
    """The BlockPlans of every pipeline stage in execution order: chunk ``j`` of physical stage ``s``
    (``StagePlan.chunk_sizes``) is pipeline stage ``s + j * pp``."""
    pp, v = plan.pp_degree, plan.virtual_stages
    chunks: list[list[Any]] = [[] for _ in range(pp * v)]
    for s in plan.stages:
        sizes = s.chunk_sizes or (len(s.blocks),)
        if len(sizes) != v:
            raise PlanError(f"stage {s.index} has {len(sizes)} chunks, the plan has virtual_stages={v}")
        start = 0
        for j, n in enumerate(sizes):
            chunks[s.index + j * pp] = list(s.blocks[start:start + n])
            start += n
    return chunks


def _resolve_block_modules(model: nn.Module, plan: Plan, profile: Any) -> dict[str, tuple[str, ...]]:
    """Block name -> module paths: from the profile, or the block name itself when it is a path."""
    names = dict(model.named_modules())
    out: dict[str, tuple[str, ...]] = {}
    for s in plan.stages:
        for b in s.blocks:
            if profile is not None:
                try:
                    out[b.name] = tuple(profile.block(b.name).modules)
                    continue
                except KeyError:
                    pass
            if b.name in names:
                out[b.name] = (b.name,)
            else:
                raise PlanError(f"block {b.name!r} is not a module path of this model and no profile "
                                "maps it; pass profile=whalepy.profile(model, example_inputs)")
    return out


def _check_plan_cluster(plan: Plan, cluster_spec: Any) -> None:
    """A given plan was made for this cluster spec: as many ranks, each of the device type the plan put
    there (checked with or without a launch, before anything is lowered)."""
    if cluster_spec is None or not hasattr(cluster_spec, "rank_devices"):
        return
    spec_types = tuple(d.device.name for d in cluster_spec.rank_devices())
    if len(spec_types) != plan.world_size:
        raise PlanError(f"the plan is for {plan.world_size} devices but the cluster spec has {len(spec_types)}; "
                        "pass the cluster spec the plan was made for, or re-plan for this one")
    bad = next((r for r, (a, b) in enumerate(zip(spec_types, plan.rank_device_types)) if a != b), None)
    if bad is not None:
        raise PlanError(f"the plan puts a {plan.rank_device_types[bad]} on rank {bad}, the cluster spec has a "
                        f"{spec_types[bad]} there: the plan was made for another cluster; re-plan for this one")


def _check_device(plan: Plan, cluster_spec: Any, rank: int) -> None:
    planned = plan.rank_device_types[rank]  # the spec's type of this rank: _check_plan_cluster, earlier
    simulated = False
    if cluster_spec is not None and hasattr(cluster_spec, "rank_device_type"):
        group = cluster_spec.group(cluster_spec.rank_devices()[rank].group)
        simulated = bool(getattr(group, "runs_on_cpu", False))
    if simulated or planned.upper() == "CPU":
        return
    if not torch.cuda.is_available():
        raise LaunchError(
            f"rank {rank} has no GPU but the plan puts a {planned} there; run on the planned machines, "
            "or mark the cluster group simulated (simulated: true) to train on CPU"
        )
    from whalepy.cost_models.devices import match_device_name

    local = int(os.environ.get("LOCAL_RANK", "0"))
    name = torch.cuda.get_device_name(local)
    found = match_device_name(name, torch.cuda.get_device_properties(local).total_memory)
    if found is not None and found.name != planned:
        raise LaunchError(f"rank {rank} runs on a {found.name} ({name}) but the plan puts a {planned} "
                          "there; re-plan for this cluster or fix the rank order (rank_map)")
