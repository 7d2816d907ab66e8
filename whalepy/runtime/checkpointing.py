"""Distributed state dicts (model + optimizer); the activation side (checkpointing, activation and
checkpoint offload) lives in :mod:`whalepy.runtime._activations` and is re-exported here.

State dicts go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict``: keys are the ORIGINAL module paths (FSDP and TP leave names alone; pipeline
stages keep the original names), values are DTensors sharded as this plan shards them, and
``torch.distributed.checkpoint`` (DCP) re-shards on load. So a checkpoint written under one plan
(DP x TP) loads under another (PP x DP) on the same number or a different number of ranks. A tiled
linear or embedding (``BlockPlan.tiles``) keeps its original name and shape too:
:mod:`whalepy.runtime._tile_state` merges its tiles' entries into one (``merge_state``) and splits
them back on load (``split_state``), so checkpoints move between tiled and untiled plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from whalepy.errors import ArgumentError, WhalepyError
from whalepy.runtime._activations import (
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_checkpoint_offload,
)
from whalepy.runtime.dcp_files import load_files, read_metadata
from whalepy.runtime._tile_state import merge_state, split_state
from whalepy.runtime.host_optimizer import KERNEL_FLAGS, MASTER_KEY, HostStateView, full_tensor
from whalepy.runtime.tiling import tiled_layout

__all__ = ["apply_activation_checkpointing", "apply_activation_offload", "apply_checkpoint_offload",
           "gather_full_state_dict", "get_train_state", "load_model_state",
           "load_train_state", "master_weights", "save_train_state", "set_train_state"]


Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def _zero1(optimizer: Optimizers) -> Any:
    """The ``ZeroRedundancyOptimizer`` (ZeRO-1 on DDP) among ``optimizer``, or None."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    found = [o for o in (optimizer if isinstance(optimizer, Sequence) else [optimizer])
             if isinstance(o, ZeroRedundancyOptimizer)]
    if found and (isinstance(optimizer, Sequence) and len(optimizer) > 1):
        raise WhalepyError("state_dict()/save(): a ZeroRedundancyOptimizer beside other optimizers is not "
                           "supported; use one optimizer for the stage")
    return found[0] if found else None


class _TensorMeta(NamedTuple):
    """A state tensor's layout, as the rank owning it tells the others (:func:`_gathered`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


def _gathered(zero: Any) -> torch.optim.Optimizer:
    """A plain optimizer of ``zero``'s class over every parameter ``zero`` steps, holding each parameter's
    state gathered from the rank that owns it (ZeRO-1 shards the optimizer state by parameter): what
    ZeRO-0 would hold, so ``get_state_dict`` / ``set_state_dict`` write and read the same files as for
    any other plan (a ZeRO-1 checkpoint loads under every plan and back). Every rank holds the whole
    optimizer state while the state dict lives (ZeRO-0's memory, for the save or load only)."""
    import torch.distributed as dist

    group = zero.process_group
    comm = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
            else torch.device("cpu"))
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in zero.param_groups]
    full = zero._optim_constructor(groups, **zero._optim_defaults)
    owner = zero._param_to_rank
    mine = {i: {k: (_TensorMeta(tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else v)
                for k, v in zero.optim.state.get(p, {}).items()}
            for i, p in enumerate(zero._all_params) if owner[p] == zero.rank}
    layouts: list[Any] = [None] * zero.world_size
    dist.all_gather_object(layouts, mine, group=group)
    for i, p in enumerate(zero._all_params):
        r = owner[p]
        layout = layouts[r].get(i)
        if not layout:
            continue
        st = {}
        for k, v in layout.items():
            if not isinstance(v, _TensorMeta):
                st[k] = v
                continue
            t = (zero.optim.state[p][k].to(comm) if r == zero.rank
                 else torch.empty(v.shape, dtype=v.dtype, device=comm))
            dist.broadcast(t, src=dist.get_global_rank(group, r), group=group)
            st[k] = t.to(p.device if v.device_type != "cpu" else "cpu")
        full.state[p] = st
    return full


def _scatter_back(full: torch.optim.Optimizer, zero: Any) -> None:
    """After a load into :func:`_gathered`'s optimizer: each rank keeps the states of the parameters it
    owns, and every group's hyper-parameters (learning rate, betas...) go to ``zero`` and its inner one."""
    owner = zero._param_to_rank
    for p in zero._all_params:
        if owner[p] == zero.rank and p in full.state:
            zero.optim.state[p] = full.state[p]
    zero._sync_param_groups(full.param_groups, zero.param_groups)
    zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)


def _is_strided(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def _map_tensors(state: Any, fn: Any) -> Any:
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map_tensors(v, fn) for v in state]
    return fn(state)


def get_train_state(modules: Sequence[nn.Module], optimizer: Optimizers) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by original module paths.

    A parameter that ZeRO-Offload keeps in bf16 on the device has its fp32 master (the host tensor
    itself) as its ``model`` value, not the device copy (:func:`_masters_to_model`).

    DCP cannot describe ``_StridedShard`` chunks (fused projections under TP), so those tensors are
    gathered whole here; every rank of the group then holds the same full tensor and DCP writes it
    once. :func:`set_train_state` shards them back."""
    zero = _zero1(optimizer)
    if zero is not None:  # ZeRO-1 on DDP: the state each rank holds for its parameters, gathered
        optimizer = _gathered(zero)
    model_sd, optim_sd = get_state_dict(list(modules) if len(modules) > 1 else modules[0], optimizer)
    state = {"model": model_sd, "optim": _masters_to_model(model_sd, optim_sd)}
    strided: list[bool] = []
    _map_tensors(state, lambda t: strided.append(True) if _is_strided(t) else None)
    if strided:
        with _quiet_strided_gather():
            state = _map_tensors(state, lambda t: full_tensor(t) if _is_strided(t) else t)
    return merge_state(state, tiled_layout(modules))  # tiled modules under their original names


_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


@contextlib.contextmanager
def _quiet_strided_gather() -> Iterator[None]:
    """Gathering a ``_StridedShard`` tensor whole makes DTensor log, on every rank, that "2 sequential
    all_gather operations will be performed" and "may give inconsistent results between ranks due to
    different reduction orders". An all-gather reduces nothing, so every rank gets the same bytes; the
    cost is one extra collective per fused tensor, once per save. So the per-rank line is replaced by
    one note per job (rank 0)."""
    import logging
    import warnings

    from whalepy.log import info_once

    torch_log = logging.getLogger(_REDISTRIBUTE_LOGGER)
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*sequential all_gather.*")
            yield
    finally:
        torch_log.setLevel(level)
    info_once("strided-gather", "whalepy: note: fused tensor-parallel weights are gathered whole for the "
              "checkpoint (two all-gathers each, identical on every rank; DTensor's per-rank warning about it "
              "is silenced)")


def _masters_to_model(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Move each fp32 master the host optimizer's state view carries (under ``MASTER_KEY``, keyed by
    the parameter's name as ``get_state_dict`` names it) to the model state, in place of the
    low-precision device copy: the model's weights are the masters, and a load fills the host masters
    directly (the device copies then get them cast). The optimizer state is returned without them."""
    state = optim_sd.get("state", {})
    if not any(MASTER_KEY in v for v in state.values() if isinstance(v, dict)):
        return optim_sd
    out = {}
    for name, entries in state.items():
        if isinstance(entries, dict) and MASTER_KEY in entries:
            model_sd[name] = entries[MASTER_KEY]
            entries = {k: v for k, v in entries.items() if k != MASTER_KEY}
        out[name] = entries
    return {**optim_sd, "state": out}


def _host_state(modules: Sequence[nn.Module], optimizers: Optimizers) -> dict[str, dict[str, Any]]:
    """Name -> {state key: the host tensor itself, wrapped} of the host optimizer's state view among
    ``optimizers`` (:class:`HostStateView`); ``{}`` when there is none."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    view = next((o for o in ([optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers)
                 if isinstance(o, HostStateView)), None)
    if view is None:
        return {}
    return get_optimizer_state_dict(list(modules) if len(modules) > 1 else modules[0], view).get("state", {})


def master_weights(modules: Sequence[nn.Module], optimizers: Optimizers) -> dict[str, Any]:
    """Name -> fp32 master of each parameter that ZeRO-Offload keeps in another dtype on the device
    (the host optimizer's state view among ``optimizers``): what the model's weights are."""
    return {k: v[MASTER_KEY] for k, v in _host_state(modules, optimizers).items() if MASTER_KEY in v}


def _fill_host_state(live: dict[str, dict[str, Any]], state: dict[str, Any]) -> None:
    """Copy ``state``'s values into the host optimizer's own tensors (``live``, :func:`_host_state`):
    ``set_state_dict`` gives an optimizer new state tensors, which the host optimizer behind its
    state view would never see. A master comes from the model's entry. Values that already are the
    host tensors (a DCP load fills them in place) are skipped."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return getattr(t, "_local_tensor", t)

    with torch.no_grad():
        for name, entries in live.items():
            given = state["optim"].get("state", {}).get(name, {})
            for key, dst in entries.items():
                src = state["model"].get(name) if key == MASTER_KEY else given.get(key)
                if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and \
                        local(dst).untyped_storage().data_ptr() != local(src).untyped_storage().data_ptr():
                    dst.copy_(src)


def _reshard_like(state: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    def walk(value: Any, like: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, like.get(k) if isinstance(like, dict) else None) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, like[i] if isinstance(like, list) and i < len(like) else None)
                    for i, v in enumerate(value)]
        if _is_strided(like) and isinstance(value, torch.Tensor) and not _is_strided(value):
            return distribute_tensor(value.to(like.device), like.device_mesh, like.placements)
        return value

    return walk(state, template)


def set_train_state(modules: Sequence[nn.Module], optimizer: Optimizers,
                    state: dict[str, Any]) -> None:
    if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping) \
            or not isinstance(state.get("optim", {}), Mapping):
        keys = sorted(map(str, state))[:5] if isinstance(state, Mapping) else type(state).__name__
        raise ArgumentError(f"load_state_dict() takes what ParallelModel.state_dict() returned (a dict with 'model' "
                            f"and 'optim' entries), got {keys}; to load weights alone, use pm.load(path) or "
                            "parallelize(checkpoint=...)")
    zero = _zero1(optimizer)
    if zero is not None:  # ZeRO-1 on DDP: loaded whole, then each rank keeps its parameters' states
        optimizer = _gathered(zero)
    target = list(modules) if len(modules) > 1 else modules[0]
    template_model, template_optim = get_state_dict(target, optimizer)
    template = {"model": template_model, "optim": template_optim}
    state = split_state(state, template, tiled_layout(modules))  # original names -> this plan's tiles
    state = _reshard_like(state, template)
    _fill_host_state(_host_state(modules, optimizer), state)
    # a load writes the saved param groups' entries over the optimizer's, its kernel flags included: keep
    # this plan's (``fused`` where FSDP2 steps shards in host memory, whatever the saving plan used)
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    kernels = [[{k: g[k] for k in KERNEL_FLAGS if k in g} for g in o.param_groups] for o in opts]
    set_state_dict(list(modules) if len(modules) > 1 else modules[0], optimizer,
                   model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    for o, flags in zip(opts, kernels, strict=True):
        for g, f in zip(o.param_groups, flags, strict=True):
            g.update(f)
    if zero is not None:
        _scatter_back(opts[0], zero)


def tied_aliases(modules: Sequence[nn.Module]) -> list[list[str]]:
    """Names of each parameter a module holds under several names (tied weights)."""
    out = []
    for m in modules:
        by_id: dict[int, list[str]] = {}
        for name, p in m.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        out += [names for names in by_id.values() if len(names) > 1]
    return out


def _add_aliases(state: dict[str, Any], aliases: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Write a tied parameter's optimizer state under every name of it. ``get_state_dict`` keys it by
    one name, chosen per module; a plan that splits the tie over pipeline stages asks for each
    stage's own name, so the checkpoint carries all of them (model keys already are)."""
    optim_state = state.get("optim", {}).get("state", {})
    for names in aliases:
        have = next((n for n in names if n in optim_state), None)
        if have is None:
            continue
        for n in names:
            optim_state.setdefault(n, optim_state[have])
    return state


def save_train_state(path: str | Path, modules: Sequence[nn.Module],
                     optimizer: Optimizers,
                     aliases: Sequence[Sequence[str]] = (), extra: dict[str, Any] | None = None,
                     async_save: bool = False) -> Any:
    """Write model and optimizer state, plus ``extra`` top-level entries (the fp16 loss scaler's
    state: Python numbers, which DCP writes once, from one rank), as a DCP directory. ``async_save``:
    ``dcp.async_save`` (the state is copied to host memory before it returns, then written by a
    background thread over a gloo group of its own, so its collectives never interleave with
    training's); returns its future, else None."""
    state = get_train_state(modules, optimizer)
    state.update(extra or {})
    state = _add_aliases(state, list(aliases) + tied_aliases(modules))
    if async_save:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=_async_group())
    dcp.save(state, checkpoint_id=str(path))
    return None


_ASYNC_GROUP: tuple[Any, Any] = (None, None)


def _async_group() -> Any:
    """The gloo group asynchronous saves coordinate over (made by every rank's first async save under
    the current default group)."""
    global _ASYNC_GROUP
    import torch.distributed as dist

    world = dist.group.WORLD
    if _ASYNC_GROUP[0] is not world:
        _ASYNC_GROUP = (world, dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[1]


def check_checkpoint_fits(path: str | Path, model_state: dict[str, Any]) -> None:
    """A DCP directory written by :func:`save_train_state` for this model (same tensor names and global
    shapes; any plan): otherwise one line naming the first tensor that differs, before DCP reads a byte."""
    saved = read_metadata(path).state_dict_metadata
    for name, t in model_state.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise WhalepyError(f"the checkpoint {path} has no tensor 'model.{name}': it was saved from another "
                               "model; load a checkpoint of this model (under any plan)")
        size = tuple(getattr(meta, "size", ()))
        if isinstance(t, torch.Tensor) and size and size != tuple(t.shape):
            raise WhalepyError(f"the checkpoint {path} holds {name} with shape {list(size)}, this model has "
                               f"{list(t.shape)}: it was saved from a model of other sizes")


def load_train_state(path: str | Path, modules: Sequence[nn.Module],
                     optimizer: Optimizers, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill model and optimizer state from ``path`` (written under any plan). ``extra``: top-level
    entries to read as well, shaped as they were saved; returns those the checkpoint holds (every
    rank reads the same copy), leaving out the ones it lacks (older checkpoints)."""
    # the template carries this plan's shardings; DCP fills it from whatever plan wrote the files
    state = get_train_state(modules, optimizer)
    own = [list(g["params"]) for g in state["optim"].get("param_groups", [])]
    check_checkpoint_fits(path, state["model"])
    if extra:
        saved = read_metadata(path).state_dict_metadata
        extra = {k: v for k, v in extra.items() if any(n == k or n.startswith(f"{k}.") for n in saved)}
        state.update(extra)
    load_files(state, path)
    # each param group's list of parameter names is one object in the files, written by one rank;
    # under another plan (other pipeline stages, layers delinked) this rank's names are its own
    for group, names in zip(state["optim"].get("param_groups", []), own):
        group["params"] = names
    set_train_state(modules, optimizer, state)
    return {k: state[k] for k in extra or {}}


def _model_state(modules: Sequence[nn.Module]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in modules:
        out.update(get_model_state_dict(m))
    return out


def load_model_state(path: str | Path, modules: Sequence[nn.Module]) -> None:
    """Fill the modules' weights (not the optimizer's state) from a DCP directory written under any
    plan: by :func:`save_train_state` (keys ``model.<name>``) or from a bare model state dict."""
    keys = read_metadata(path).state_dict_metadata
    nested = any(k.startswith("model.") for k in keys)
    state = _map_tensors(_model_state(modules), lambda t: full_tensor(t) if _is_strided(t) else t)
    state = merge_state(state, tiled_layout(modules))
    flat = {(f"model.{k}" if nested else k) for k in state}
    missing = sorted(flat - set(keys))
    if missing:
        raise WhalepyError(f"the checkpoint {path} has no tensor {missing[0]!r} ({len(missing)} missing); "
                           "it is of another model")
    load_files({"model": state} if nested else state, path)
    for m in modules:
        template = get_model_state_dict(m)
        split = split_state(state, template, tiled_layout([m]))
        own = _reshard_like({k: v for k, v in split.items() if k in template}, template)
        set_model_state_dict(m, own, options=StateDictOptions(strict=False))


def gather_full_state_dict(modules: Sequence[nn.Module], *, stage_ranks: Sequence[Sequence[int]],
                           cpu_offload: bool = True,
                           masters: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict, original names, on global rank 0; ``{}`` elsewhere.

    ``stage_ranks[s]`` lists the ranks of physical pipeline stage ``s`` (its first one sends). One
    stage: ``get_model_state_dict``'s own ``full_state_dict`` + ``cpu_offload`` gather (tensor by
    tensor, kept on rank 0 only). Several: each stage gathers its tensors one at a time inside its
    own mesh (``DTensor.full_tensor``) and its first rank sends each to rank 0. ``masters``
    (:func:`master_weights`, the same names on every rank of a stage) replace the device copies
    of those parameters."""
    import torch.distributed as dist

    rank = dist.get_rank()
    masters = masters or {}
    if len(stage_ranks) == 1:
        out: dict[str, torch.Tensor] = {}
        for m in modules:
            out.update(get_model_state_dict(
                m, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)))
        for key in sorted(masters):  # the same order on every rank: each gather is collective
            value = full_tensor(masters[key])
            if rank == 0:
                out[key] = value.cpu() if cpu_offload else value
        return merge_state(out, tiled_layout(modules)) if rank == 0 else {}
    local = _model_state(modules)
    local.update(masters)
    meta = {k: (tuple(v.shape), v.dtype) for k, v in local.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (meta, tiled_layout(modules)))
    layout = {k: v for _, lay in everyone for k, v in lay.items()}
    everyone = [m for m, _ in everyone]
    out = {}
    done: set[str] = set()  # the same on every rank, so every rank skips the same keys
    for ranks in stage_ranks:
        leader = ranks[0]
        for key, (shape, dtype) in everyone[leader].items():
            if key in done:  # a tied parameter already sent by an earlier stage
                continue
            done.add(key)
            if rank in ranks:
                # a host shard (ZeRO-Offload master, FSDP2 CPUOffloadPolicy parameter) is gathered on
                # the mesh's device, one tensor at a time: NCCL has no CPU tensors
                value = full_tensor(local[key])
                if rank == leader and leader != 0:
                    dist.send(value.contiguous(), dst=0)
                if rank == 0:
                    out[key] = value.cpu() if cpu_offload else value
            elif rank == 0:
                buf = torch.empty(shape, dtype=dtype, device=_device_of(local))
                dist.recv(buf, src=leader)
                out[key] = buf.cpu() if cpu_offload else buf
    return merge_state(out, layout) if rank == 0 else {}  # tiles gathered one at a time, joined here


def _device_of(state: dict[str, Any]) -> torch.device:
    """The device the stage's collectives run on: a DTensor's mesh device (its local tensor may be a
    host shard), else the first tensor's."""
    from torch.distributed.tensor import DTensor

    for v in state.values():
        if isinstance(v, DTensor):
            t = v.device_mesh.device_type
            return torch.device(t, torch.cuda.current_device()) if t == "cuda" else torch.device(t)
        return v.device
    return torch.device("cpu")
