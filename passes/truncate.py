"""Fast capture of long runs of identical layers: trace a truncated model and extrapolate.

``torch.export`` costs about 2 ms per ATen op, so tracing 96 identical GPT-3 layers is almost all
of a profile's time. When a run of layers (``find_runs``) is provably uniform, ``build_profile``
traces the model with the run cut down to its first ``P + K`` members, analyses that graph, and
copies the last traced layer's figures to the members it did not trace.

- ``K = TRACED_REPEATS = 2`` identical members are traced, so the truncated run is still a run
  (``find_runs`` needs two members) and the two traced copies can be compared with each other.
- ``P`` is the length of a heterogeneous prefix: T5's first block owns the relative-position bias,
  so T5 traces blocks 0, 1, 2 of each stack; the rest are copies of block 2.

A run is truncated only when all of this holds (else the model is captured in full):

1. the run is every child of one ``nn.ModuleList`` / ``nn.Sequential`` and ``N >= P + K + 2``;
2. members ``P..N-1`` have equal module-class trees, parameter names/shapes/dtypes/requires_grad,
   buffer names/shapes/dtypes, hooks and plain attribute values (ints, floats, strings, flags: a
   per-layer ``scale = i`` or a sliding window set on some layers differs). HF's ``layer_idx``
   (a KV-cache slot) is ignored on ``transformers`` models; those are refused instead when the
   config has a per-layer list (``layer_types``, ``no_rope_layers``, ...) with more than one
   distinct value, or GPT-2's ``scale_attn_by_inverse_layer_idx`` / ``reorder_and_upcast_attn``;
3. no parameter of those members is shared with another module;
4. after tracing, the ``K`` traced copies have identical graphs (ops, scalar arguments, dataflow,
   shapes, module paths relative to the layer, parameters read) and identical figures (FLOPs,
   bytes, activations, boundary bytes, parameters, TP pattern). A forward that uses the layer
   index (``x * i`` in the container's loop) shows up here as different scalar arguments.

The truncation swaps the container's ``_modules`` for one holding the first ``P + K`` members
(every reference to the container sees it) and restores it in a ``finally``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from whalepy.passes.grouping import Run, find_runs
from whalepy.passes.shapes import op_name

TRACED_REPEATS = 2
"""K: identical members of a run that are traced (the last one is the template for the rest)."""

_SIMPLE = (int, float, bool, str, type(None), torch.dtype)
_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
               "_whalepy_annotations", "_is_hf_initialized"}
_HF_FLAGS = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")


@dataclass(frozen=True, slots=True)
class TruncatedRun:
    container: str
    members: tuple[str, ...]
    prefix: int
    """P: leading members that differ from the uniform tail (traced, never extrapolated)."""

    @property
    def keep(self) -> int:
        return self.prefix + TRACED_REPEATS

    @property
    def template(self) -> str:
        return self.members[self.keep - 1]


def plan_truncation(model: torch.nn.Module) -> tuple[list[TruncatedRun], list[str]]:
    """The runs of ``model`` that may be traced truncated, and why the others may not."""
    reasons: list[str] = []
    hf_reason = _config_reason(model)
    runs: list[TruncatedRun] = []
    for run in find_runs(model):
        why = _run_reason(model, run, hf_reason)
        if isinstance(why, str):
            reasons.append(f"{run.container}: {why}")
        else:
            runs.append(why)
    return runs, reasons


def _config_items(config: object) -> Any:
    """The config's fields as ``(key, value)`` pairs: HF configs, dataclasses (slotted too), plain objects."""
    if callable(getattr(config, "to_dict", None)):
        try:
            return config.to_dict().items()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an odd config: try the generic forms below
            pass
    if dataclasses.is_dataclass(config):
        return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    if hasattr(config, "__dict__"):
        return vars(config).items()
    return None


def _config_reason(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    for flag in _HF_FLAGS:
        if getattr(config, flag, False):
            return f"config.{flag} is set (the layers' forward depends on the layer index)"
    n = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
              if isinstance(getattr(config, k, None), int)), None)
    items = _config_items(config)
    if items is None:
        return f"config of type {type(config).__name__} cannot be read to check per-layer settings"
    for key, value in items:
        if isinstance(value, (list, tuple)) and len(value) > 1 and (
                key == "layer_types" or key.endswith("_layers") or len(value) == n):
            try:
                distinct = len({repr(v) for v in value})
            except Exception:  # noqa: BLE001
                distinct = 2
            if distinct > 1:
                return f"config.{key} differs between layers"
    return None


def _run_reason(model: torch.nn.Module, run: Run, hf_reason: str | None) -> TruncatedRun | str:
    container = model.get_submodule(run.container) if run.container else model
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
        return "not an nn.ModuleList / nn.Sequential"
    children = [k for k, v in container._modules.items() if v is not None]
    if len(children) != len(run.members) or len(container._modules) != len(children):
        return "the run is not the whole container"
    if hf_reason is not None:
        return hf_reason
    is_hf = getattr(model, "config", None) is not None
    mods = [model.get_submodule(m) for m in run.members]
    sigs = [_structure(m, is_hf) for m in mods]
    prefix = len(sigs) - 1
    while prefix > 0 and sigs[prefix - 1] == sigs[-1]:
        prefix -= 1
    n = len(mods)
    if n < prefix + TRACED_REPEATS + 2:
        return f"{n} members, {prefix} of them different: too few identical ones to extrapolate"
    # No parameter of the uniform tail may be shared with another module.
    owners: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name)
    for path, m in zip(run.members[prefix:], mods[prefix:]):
        for p in m.parameters():
            if any(not (f.startswith(path + ".")) for f in owners[id(p)]):
                return f"a parameter of {path} is shared with another module"
    return TruncatedRun(run.container, run.members, prefix)


def _structure(module: torch.nn.Module, is_hf: bool) -> str:
    """Hash of everything about a layer that could make its forward differ from its siblings'."""
    parts: list[Any] = []
    for path, m in module.named_modules(remove_duplicate=False):
        attrs = []
        for key, value in sorted(m.__dict__.items()):
            if key in _SKIP_ATTRS or (is_hf and key == "layer_idx"):
                continue
            if "hook" in key:
                hooks = value.values() if isinstance(value, dict) else ()
                attrs.append((key, tuple(getattr(getattr(h, "__func__", h), "__qualname__", repr(h))
                                         for h in hooks)))
            elif isinstance(value, _SIMPLE):
                attrs.append((key, repr(value)))
            elif isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
                attrs.append((key, repr(value)))
            elif isinstance(value, torch.Tensor):
                attrs.append((key, tuple(value.shape), str(value.dtype)))
            else:
                attrs.append((key, type(value).__qualname__))
        parts.append((path, type(m).__qualname__, tuple(attrs)))
        parts.append(tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                           for n, p in m._parameters.items() if p is not None))
        parts.append(tuple((n, tuple(b.shape), str(b.dtype))
                           for n, b in m._buffers.items() if b is not None))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@contextlib.contextmanager
def truncated(model: torch.nn.Module, runs: list[TruncatedRun]) -> Iterator[None]:
    """Cut every run's container down to its first ``keep`` members; restore on exit."""
    saved = []
    try:
        for run in runs:
            container = model.get_submodule(run.container) if run.container else model
            original = container._modules
            keep = type(original)(list(original.items())[: run.keep])
            saved.append((container, original))
            container._modules = keep
        yield
    finally:
        for container, original in reversed(saved):
            container._modules = original


def rename(path: str, old: str, new: str) -> str:
    """``path`` with the module prefix ``old`` replaced by ``new``."""
    if path == old:
        return new
    if path.startswith(old + "."):
        return new + path[len(old):]
    return path


def graph_signature(gm: fx.GraphModule, block: int, member: str) -> list[tuple]:
    """The traced ops of ``block`` with arguments, dataflow and paths relative to ``member``."""
    local: dict[fx.Node, int] = {}
    out = []

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in local:
                return ("n", local[a])
            v = a.meta.get("val")
            p = a.meta.get("whalepy.param") or a.meta.get("whalepy.buffer")
            shape = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
            return ("x", rename(p, member, "<L>") if p else None, shape)
        if isinstance(a, (list, tuple)):
            return tuple(enc(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, enc(v)) for k, v in sorted(a.items()))
        return repr(a)

    for node in gm.graph.nodes:
        if node.meta.get("whalepy.block") != block:
            continue
        v = node.meta.get("val")
        shape = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
        path = rename(node.meta.get("whalepy.module_path", ""), member, "<L>")
        out.append((op_name(node) or str(node.target), enc(node.args), enc(node.kwargs), shape,
                    path))
        local[node] = len(local)
    return out
