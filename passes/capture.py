"""Capture a model into an FX graph without materialising its weights.

``capture(model, example_inputs)`` tries ``torch.export.export(..., strict=False)`` first. Export
runs the model on fake tensors, so a meta-device model (a 175B GPT-3-shaped one included) traces
in seconds and nothing is allocated. Its graph is the ATen training IR: ``aten.linear``,
``aten.scaled_dot_product_attention`` and ``aten.layer_norm`` stay whole, parameters and buffers
are placeholders. When export fails, ``torch.fx.symbolic_trace`` (tracing through every module,
so that ``nn.Linear`` shows as ``F.linear``) plus fake-tensor shape propagation is the fallback.

What capture records, for every later pass:

- ``gm.meta["whalepy.capture_method"]``: ``"export"`` or ``"symbolic_trace"``;
  ``gm.meta["whalepy.capture_time_s"]``; ``gm.meta["whalepy.export_error"]`` when it fell back.
- placeholder / get_attr nodes: ``"whalepy.param"`` (parameter FQN; with tied weights each alias
  gets its own node), ``"whalepy.param_requires_grad"``, ``"whalepy.buffer"``,
  ``"whalepy.constant"``, ``"whalepy.input"`` (name of a user input).
- computing nodes: ``"whalepy.module_path"`` (innermost module, ``""`` for code in the root
  module's forward), ``"whalepy.module_stack"`` (enclosing module paths, outermost first) and
  ``"whalepy.module_class"`` (class name of the innermost module).
- ``node.meta["val"]``: a fake/meta tensor with the output's shape and dtype.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from whalepy.errors import CaptureError
from whalepy.models.hf_compat import export_compat, no_kv_cache

_FIXES = (
    "Usual fixes: for HuggingFace models pass the example inputs as a dict of keyword arguments, e.g. "
    "{'input_ids': ids}; replace data-dependent Python control flow (if on tensor values) with "
    "torch.where / torch.cond; keep example inputs on the model's device (meta is fine)."
)


def normalize_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from a tensor, a tuple/list of positional inputs or a dict of kwargs."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def capture(
    model: torch.nn.Module, example_inputs: Any, *, method: str = "auto"
) -> fx.GraphModule:
    """Trace ``model`` on ``example_inputs`` into a GraphModule annotated as described above.

    ``method`` is ``"auto"`` (export, then the fallback), ``"export"`` or ``"symbolic_trace"``.
    Raises :class:`whalepy.CaptureError` naming both tracers' errors when neither works.
    """
    if method not in ("auto", "export", "symbolic_trace"):
        raise CaptureError(f"unknown capture method {method!r}; use 'auto', 'export' or 'symbolic_trace'")
    args, kwargs = normalize_inputs(example_inputs)
    args, kwargs = _to_model_device(model, args, kwargs)
    start = time.perf_counter()
    try:
        if method == "symbolic_trace":
            raise _Skipped("symbolic_trace requested")
        with no_kv_cache(model):  # an HF model's KV cache output cannot be traced, and training never reads it
            gm = _capture_export(model, args, kwargs)
        gm.meta["whalepy.capture_method"] = "export"
    except Exception as export_error:  # noqa: BLE001 - any tracer failure means: try the fallback
        if method == "export":
            raise CaptureError(
                f"could not capture {type(model).__name__} with torch.export.export(strict=False): "
                f"{_short(export_error)}. {_FIXES}"
            ) from export_error
        try:
            with no_kv_cache(model):
                gm = _capture_symbolic(model, args, kwargs)
        except Exception as fx_error:  # noqa: BLE001
            if isinstance(export_error, _Skipped):
                raise CaptureError(
                    f"could not capture {type(model).__name__} with torch.fx.symbolic_trace: "
                    f"{_short(fx_error)}. {_FIXES}"
                ) from fx_error
            raise CaptureError(
                f"could not capture {type(model).__name__}: torch.export.export(strict=False) "
                f"failed with {_short(export_error)}; the fallback torch.fx.symbolic_trace "
                f"failed with {_short(fx_error)}. {_FIXES}"
            ) from export_error
        gm.meta["whalepy.capture_method"] = "symbolic_trace"
        if not isinstance(export_error, _Skipped):
            gm.meta["whalepy.export_error"] = _short(export_error)
    _check_embedding_indices(gm, type(model).__name__)
    gm.meta["whalepy.capture_time_s"] = time.perf_counter() - start
    return gm


class _Skipped(Exception):
    """Export was not attempted."""


def _check_embedding_indices(gm: fx.GraphModule, model_name: str) -> None:
    """An embedding looked up with floating-point indices is an error torch 2.13 raises while tracing
    and torch 2.11 traces through (its meta kernel does not check the dtype); raise it here on every
    release, so ``profile`` can name the fix (integer token ids) before the run fails inside torch."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.embedding.default and len(node.args) > 1:
            indices = node.args[1]
        elif node.target is torch.nn.functional.embedding and node.args:
            indices = node.args[0]
        else:
            continue
        val = getattr(indices, "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            raise CaptureError(f"could not capture {model_name}: embedding indices of dtype {val.dtype} at "
                               f"{node.name}, expected integer ids. {_FIXES}")


def _short(e: BaseException, limit: int = 300) -> str:
    """The error's first line (torch appends the FX node and a stack to it): messages stay one line."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    text = f"{type(e).__name__}: {first}".strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def _to_model_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Move example inputs to the meta device when the model lives there (shapes are all we need)."""
    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "meta":
        return args, kwargs

    def to_meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) and x.device.type != "meta" else x

    return tuple(to_meta(a) for a in args), {k: to_meta(v) for k, v in kwargs.items()}


# --- torch.export ----------------------------------------------------------------------------


def _capture_export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    import torch.fx.config as fx_config

    # Stack traces cost a traceback per node (a third of export time on a 96-layer model) and
    # nothing here reads them.
    had = hasattr(fx_config, "do_not_emit_stack_traces")
    saved = getattr(fx_config, "do_not_emit_stack_traces", False)
    fx_config.do_not_emit_stack_traces = True
    try:
        with export_compat():  # models written for transformers 4.x (see whalepy.models.hf_compat)
            ep = torch.export.export(model, args, kwargs, strict=False)
    finally:
        if had:
            fx_config.do_not_emit_stack_traces = saved
        else:
            del fx_config.do_not_emit_stack_traces
    gm = ep.graph_module
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = _param_aliases(model)
    specs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    from torch.export.graph_signature import InputKind

    for node, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True):
        kind, target = spec.kind, spec.target
        if kind == InputKind.PARAMETER:
            node.meta["whalepy.param"] = target
            node.meta["whalepy.param_aliases"] = aliases.get(target, (target,))
            p = params.get(target)
            node.meta["whalepy.param_requires_grad"] = bool(p is None or p.requires_grad)
            specs.append(("param", target))
        elif kind == InputKind.BUFFER:
            node.meta["whalepy.buffer"] = target
            specs.append(("buffer", target))
        elif kind == InputKind.CONSTANT_TENSOR:
            node.meta["whalepy.constant"] = target
            specs.append(("constant", target))
        elif kind == InputKind.USER_INPUT:
            node.meta["whalepy.input"] = spec.arg.name
            specs.append(("input", spec.arg.name))
        else:
            specs.append((kind.name.lower(), target))
    gm.meta["whalepy.input_specs"] = specs
    gm.meta["whalepy.constants"] = dict(ep.constants)
    _record_module_stacks(gm)
    return gm


def _param_aliases(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter FQN -> all FQNs of the same tensor (tied weights have several; export may
    feed every use of a tied weight from one of them)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: tuple(names) for names in by_id.values() for name in names}


def _clean_path(path: str) -> str:
    for prefix in ("L['self'].", "L__self__.", "L__self__", "self."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    at = path.find("@")
    return path[:at] if at >= 0 else path


def _record_module_stacks(gm: fx.GraphModule) -> None:
    cache: dict[tuple, tuple[tuple[str, ...], str]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        entries = tuple(stack.values())
        key = tuple((p, c if isinstance(c, str) else id(c)) for p, c in entries)
        hit = cache.get(key)
        if hit is None:
            paths = tuple(p for p in (_clean_path(str(e[0])) for e in entries) if p)
            cls = entries[-1][1] if entries else None
            cls_name = getattr(cls, "__name__", None) or str(cls or "").rsplit(".", 1)[-1]
            hit = cache[key] = (paths, cls_name)
        node.meta["whalepy.module_stack"] = hit[0]
        node.meta["whalepy.module_path"] = hit[0][-1] if hit[0] else ""
        node.meta["whalepy.module_class"] = hit[1]


# --- torch.fx.symbolic_trace fallback --------------------------------------------------------


class _TraceThroughModules(fx.Tracer):
    """Trace into every module, so leaf layers show as functional calls on get_attr weights."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False


def _capture_symbolic(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    from whalepy.passes.shapes import propagate_fake_shapes

    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs).arguments
    concrete = {
        name: p.default
        for name, p in sig.parameters.items()
        if name not in bound
        and p.default is not inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    tracer = _TraceThroughModules()
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(model, graph)
    names = [n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs, specs = [], []
    for node, name in zip(placeholders, names):
        if name in bound:
            inputs.append(bound[name])
            node.meta["whalepy.input"] = name
            specs.append(("input", name))
        else:
            inputs.append(concrete.get(name))
            specs.append(("concrete", name))
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = _param_aliases(model)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if node.target in params:
                node.meta["whalepy.param"] = node.target
                node.meta["whalepy.param_aliases"] = aliases.get(node.target, (node.target,))
                node.meta["whalepy.param_requires_grad"] = params[node.target].requires_grad
            elif node.target in buffers:
                node.meta["whalepy.buffer"] = node.target
            else:
                node.meta["whalepy.constant"] = node.target
    propagate_fake_shapes(gm, inputs)
    gm.meta["whalepy.input_specs"] = specs
    _record_module_stacks(gm)
    return gm


# --- running a captured graph ----------------------------------------------------------------


def run_captured(gm: fx.GraphModule, model: torch.nn.Module, example_inputs: Any) -> Any:
    """Run a captured graph with ``model``'s current weights (for numerics checks on real models).

    Returns what the graph returns: the flat tuple of outputs for an exported graph, the model's
    own output structure for a symbolic_trace graph.
    """
    args, kwargs = normalize_inputs(example_inputs)
    if gm.meta.get("whalepy.capture_method") != "export":
        sig = inspect.signature(model.forward)
        bound = sig.bind_partial(*args, **kwargs).arguments
        values = [
            bound[name] if kind == "input" else sig.parameters[name].default
            for kind, name in gm.meta["whalepy.input_specs"]
        ]
        return gm(*values)
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if x is not None]
    constants = gm.meta.get("whalepy.constants", {})
    values, user_index = [], 0
    for kind, target in gm.meta["whalepy.input_specs"]:
        if kind == "param":
            values.append(model.get_parameter(target))
        elif kind == "buffer":
            values.append(model.get_buffer(target))
        elif kind == "constant":
            values.append(constants[target])
        elif kind == "input":
            values.append(bound[target] if target in bound else leaves[user_index])
            user_index += 1
        else:
            raise CaptureError(f"cannot run a graph with a {kind} input ({target})")
    return gm(*values)
