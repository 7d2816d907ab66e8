"""Pseudo-to-Real training (M6-10T: Lin et al., "M6-10T: A Sharing-Delinking Paradigm for Efficient
Multi-Trillion Parameter Pretraining", 2021).

Phase 1, *pseudo*: :func:`pseudo_to_real` ties the parameters of every layer of one ``ModuleList`` /
``Sequential`` to the first layer's, so the model holds one set of layer weights (and its optimizer
one set of states) while it still runs all its layers. Nothing else changes: the profile attributes a
shared parameter to the first block that reads it (counted once; the other layers list it as a tied
copy), and the runtime keeps one ``Parameter`` per process; a pipeline stage that holds tied layers
holds one copy, whose gradient is summed over the stages holding copies (the tied-weights mechanism of
``ParallelModel``), so every copy takes the same step. The planner charges each stage the copies it
holds and their gradient all-reduce (docs/cost_model.md, "Local parameters under TP, and tied copies").

Phase 2, *real*: :func:`delink` unties the layers into per-layer parameters equal to the shared
weights, each with a copy of the shared optimizer state, and (for a :class:`ParallelModel`) re-plans
and lowers the larger model. What "the first real step equals a step of the pseudo model" means
exactly is in docs/pseudo_to_real.md: same loss, per-layer gradients that sum to the pseudo model's
gradient, and each layer stepped by the pseudo model's optimizer from the shared state.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from whalepy.errors import AnnotationError, ArgumentError, InfeasibleError, LaunchError, WhalepyError
from whalepy.runtime.pseudo_record import (  # noqa: F401  (PseudoBuild, record_pseudo: re-exported)
    PSEUDO_MARK, PseudoBuild, PseudoLayers, meta_copy, pseudo_layers, record_pseudo)

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan
    from whalepy.runtime.parallel_model import ParallelModel

__all__ = ["PseudoBuild", "PseudoLayers", "delink", "meta_copy", "pseudo_layers", "pseudo_to_real",
           "record_pseudo"]

log = logging.getLogger("whalepy.pseudo_to_real")

def pseudo_to_real(model: nn.Module, layers: str = "transformer.h") -> nn.Module:
    """Tie every layer of the ``ModuleList`` / ``Sequential`` at ``layers`` to the first layer's
    parameters (in place; returns ``model``). The layers must have the same structure: module classes,
    parameter names, shapes and dtypes. Works on a model built on the meta device too. Buffers are not
    tied. Call it before ``whalepy.profile`` / ``plan`` / ``parallelize``."""
    container = _layer_container(model, layers)
    if pseudo_layers(model) is not None:
        raise AnnotationError(f"pseudo_to_real: the model's layers {pseudo_layers(model).path!r} are "
                              "already tied; call it once (whalepy.delink(model) unties them)")
    first = container[0]
    expected = _structure(first)
    for k in range(1, len(container)):
        got = _structure(container[k])
        if got != expected:
            diff = next((a, b) for a, b in itertools.zip_longest(expected, got) if a != b)
            raise AnnotationError(
                f"pseudo_to_real: layer {layers}.{k} differs from {layers}.0 ({_describe(diff[1])} "
                f"where {layers}.0 has {_describe(diff[0])}); only layers of the same structure and "
                "shapes can share weights: pass layers= a list of identical layers")
    shared = {id(p) for p in first.parameters()}
    for k in range(1, len(container)):
        clash = [n for n, p in container[k].named_parameters() if id(p) in shared]
        if clash:
            raise AnnotationError(f"pseudo_to_real: {layers}.{k}.{clash[0]} already shares a parameter "
                                  f"with {layers}.0; pass an untied model")
        for path, mod in container[k].named_modules():
            src = first.get_submodule(path)
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = src._parameters[name]
    setattr(model, PSEUDO_MARK, PseudoLayers(path=layers, num_layers=len(container)))
    return model


def delink(
    target: nn.Module | ParallelModel,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    plan: Plan | None = None,
    profile: Any = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **planner_options: Any,
) -> Any:
    """Untie a pseudo model into the real one: every layer gets its own parameters, equal to the
    shared weights, and its own copy of the shared optimizer state.

    - ``delink(model, optimizer=opt)`` (one process, an ``nn.Module``): in place; ``opt``, if given,
      gets each new parameter in the shared one's param group with a copy of its state. Returns
      ``model``.
    - ``delink(pm)`` (a :class:`~whalepy.ParallelModel` of a pseudo model, every rank calls it):
      saves ``pm`` to ``checkpoint_dir`` (a DCP directory; default a temporary one, which every rank
      must see: pass a shared path on several nodes), builds the real model on the meta device,
      lowers it with ``plan`` (and the real model's ``profile``, as ``parallelize`` takes them) or
      a new plan from the planner (``planner_options``) on the same cluster, fills it and its
      optimizer from the checkpoint, and returns the new :class:`ParallelModel`. A checkpoint
      saved from the pseudo model holds every layer's weights and optimizer state under the layer's
      own names, so ``real_pm.load(path)`` also delinks a checkpoint made before delinking.
    """
    if isinstance(target, nn.Module):
        if plan is not None or profile is not None or checkpoint_dir is not None or planner_options:
            raise ArgumentError("delink(model) takes only optimizer=; plan, checkpoint_dir and planner options "
                            "are for delink(pm) on a ParallelModel")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentError(f"delink(model, optimizer=...) takes the model's torch.optim.Optimizer (to give each "
                                f"untied layer its state), got {type(optimizer).__name__}; or leave it out")
        if optimizer is None and not any(p.is_meta for p in target.parameters()):  # meta: nothing trained yet
            import warnings

            warnings.warn("delink(model) without optimizer=: the untied layers get new parameters that no "
                          "existing optimizer holds, so an optimizer built before delink trains only the first "
                          "layer's; pass delink(model, optimizer=opt), or build the optimizer after delink",
                          UserWarning, stacklevel=2)
        return _delink_module(target, optimizer)
    from whalepy.runtime.parallel_model import ParallelModel

    if not isinstance(target, ParallelModel):
        raise ArgumentError(f"delink() takes a pseudo model (nn.Module) or a ParallelModel of one, got "
                        f"{type(target).__name__}")
    if optimizer is not None:
        raise ArgumentError("delink(pm) maps pm's own optimizer; optimizer= is for delink(model)")
    return _delink_parallel(target, plan, profile, checkpoint_dir, planner_options)


# -- tying -------------------------------------------------------------------------------------------


def _layer_container(model: nn.Module, layers: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"pseudo_to_real() needs an nn.Module, got {type(model).__name__}; build the model "
                            "first and pass it")
    try:
        container = model.get_submodule(layers)
    except AttributeError:
        lists = [n for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
        raise AnnotationError(
            f"pseudo_to_real: {type(model).__name__} has no module {layers!r}; pass layers= the path of "
            f"its list of repeated layers (module lists here: {lists[:6] or 'none'})") from None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise AnnotationError(
            f"pseudo_to_real: {layers!r} is a {type(container).__name__}, not an nn.ModuleList or "
            "nn.Sequential; pass layers= the path of the list of repeated layers")
    if len(container) < 2:
        raise AnnotationError(f"pseudo_to_real: {layers!r} has {len(container)} layer(s); sharing needs at "
                              "least 2")
    return container


def _structure(layer: nn.Module) -> list[tuple]:
    mods = [("module", path, type(m).__qualname__) for path, m in layer.named_modules()]
    params = [("parameter", name, tuple(p.shape), p.dtype, p.requires_grad)
              for name, p in layer.named_parameters(remove_duplicate=False)]
    return mods + params


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "nothing"
    if entry[0] == "module":
        return f"module {entry[1] or '(the layer)'} of class {entry[2]}"
    return f"parameter {entry[1]} of shape {list(entry[2])}, {entry[3]}" + (
        "" if entry[4] else ", frozen")


# -- delinking ---------------------------------------------------------------------------------------


def _delink_module(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
    info = _require_pseudo(model)
    container = model.get_submodule(info.path)
    first = container[0]
    copies: dict[int, list[nn.Parameter]] = {}
    for k in range(1, len(container)):
        for path, mod in container[k].named_modules():
            src = first.get_submodule(path)
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                new = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                mod._parameters[name] = new
                copies.setdefault(id(src._parameters[name]), []).append(new)
    delattr(model, PSEUDO_MARK)
    if optimizer is not None:
        _map_optimizer(optimizer, first, copies)
    return model


def _map_optimizer(optimizer: torch.optim.Optimizer, first: nn.Module,
                   copies: dict[int, list[nn.Parameter]]) -> None:
    """Each copy joins its shared parameter's param group (same hyper-parameters) with a copy of its
    state (moments and step count), so no layer restarts its optimizer."""
    placed: set[int] = set()
    for group in optimizer.param_groups:
        for p in list(group["params"]):
            for new in copies.get(id(p), ()):
                group["params"].append(new)
                if p in optimizer.state:
                    optimizer.state[new] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                            for k, v in optimizer.state[p].items()}
            placed.add(id(p))
    missing = [n for n, p in first.named_parameters() if id(p) in copies and id(p) not in placed]
    if missing:
        raise WhalepyError(f"delink: the optimizer does not hold the shared parameter {missing[0]!r}; "
                           "pass the optimizer built over the pseudo model's parameters")


def _require_pseudo(model: nn.Module) -> PseudoLayers:
    info = pseudo_layers(model)
    if info is None:
        raise WhalepyError(f"delink: {type(model).__name__} is not a pseudo model (no layers tied by "
                           "whalepy.pseudo_to_real); nothing to untie")
    return info


def _delink_parallel(pm: ParallelModel, plan: Plan | None, profile: Any, checkpoint_dir: Any,
                     planner_options: dict[str, Any]) -> ParallelModel:
    import torch.distributed as dist

    from whalepy.runtime.parallel_model import parallelize

    if pm.pseudo is None:
        raise WhalepyError("delink: this ParallelModel was not built from a pseudo model; call "
                           "whalepy.pseudo_to_real(model, layers=...) before whalepy.parallelize")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(pm.optimizer, ZeroRedundancyOptimizer):  # refused before anything is written
        raise WhalepyError("delink: the pseudo model's plan runs ZeRO-1 as ZeroRedundancyOptimizer, whose "
                           "state cannot be checkpointed, so it cannot be handed to the real model; plan "
                           "the pseudo model without it (zero_stages=(0, 2, 3): ZeRO-2 has the same "
                           "numerics)")
    args = pm.pseudo
    real = _delink_module(copy.deepcopy(args.skeleton), None)
    box: list[Any] = [str(checkpoint_dir) if checkpoint_dir is not None else None]
    own_dir = checkpoint_dir is None
    if own_dir and dist.get_rank() == 0:
        box[0] = tempfile.mkdtemp(prefix="whalepy-delink-")
    dist.broadcast_object_list(box, src=0)
    path = box[0]
    pm.save(path)
    dist.barrier()
    total = sum(p.numel() for p in real.parameters())
    before = sum(p.numel() for p in args.skeleton.parameters())
    what = (f"the real model ({total:,} parameters; the pseudo model had {before:,}, its "
            f"{args.layers.num_layers} layers {args.layers.path} sharing one set)")
    try:
        new = parallelize(real, args.cluster_spec, example_inputs=args.example_inputs,
                          loss_fn=pm.loss_fn, optimizer=args.optimizer_factory,
                          global_batch=pm.plan.global_batch, plan=plan, profile=profile,
                          loss_parallel=pm.loss_parallel,
                          nvme_dir=args.nvme_dir, checkpoint=path, **planner_options)
    except (InfeasibleError, LaunchError) as e:
        raise type(e)(f"delink: {what} cannot run on this job: {e}. Its weights and optimizer state "
                      f"are saved in {path}: relaunch with the devices it needs and load them into the "
                      "real model (whalepy.delink(model) before parallelize, then pm.load(path))") from None
    new.load(path)  # the optimizer state (the weights came with checkpoint=)
    if dist.get_rank() == 0:
        old_p, new_p = pm.plan, new.plan
        layout = "the same layout" if _layout(old_p) == _layout(new_p) else "another layout"
        log.warning("whalepy.delink: %s now trains with %s: %s (the pseudo model: %s)", what, layout,
                    _layout(new_p), _layout(old_p))
    dist.barrier()
    if own_dir and dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return new


def _layout(plan: Plan) -> str:
    zero = sorted({int(s.zero_stage) for s in plan.stages})
    return (f"pp={plan.pp_degree} dp={plan.dp_degree} tp={plan.stages[0].tp_degree} "
            f"ZeRO-{'/'.join(map(str, zero))} on {plan.world_size} ranks")
