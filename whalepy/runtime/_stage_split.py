"""Cut a local model into pipeline stage modules at planned block boundaries.

``torch.distributed.pipelining.pipeline()`` re-traces the model and fails on HF Llama at torch 2.13, and
its stages hold traced copies of the submodules. whalepy instead:

1. exports the model once with ``torch.export.export(strict=False, preserve_module_call_signature=
   <every block path>)``; the module call graph then records, for each block, the graph nodes passed
   into its ``forward`` (with the pytree structure of its ``(args, kwargs)``) and the nodes it returned;
2. rebuilds the flat aten graph with every block's nodes (found through ``node.meta["nn_module_stack"]``)
   collapsed into one ``call_module`` of the ORIGINAL eager block, called with the recorded structure;
   what is left between blocks is glue (embedding sums, masks, position ids, reshapes) as aten ops;
3. gives every node a stage: a block the stage the plan put it in; a glue node that depends on no
   input, activation or parameter (masks, position ids, rotary tables from buffers) is "free" and is
   recomputed in each stage that needs it; any other glue node goes to the stage of its first consumer;
4. emits one ``GraphModule`` per stage whose inputs are the values live across the boundary before it
   (values needed two stages later are passed along through the stage in between) and whose
   parameters and buffers are the model's own objects under their original qualified names.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export.graph_signature import (
    ConstantArgument,
    InputKind,
    OutputKind,
    SymIntArgument,
    TensorArgument,
)

from whalepy.errors import CaptureError
from whalepy.models.hf_compat import export_compat, no_kv_cache

__all__ = ["TensorSpec", "retarget_device", "reuse_traces", "split_stages", "stage_io", "tied_parameters"]

_BLOCK = "whalepy.block"
_CONST_PREFIX = "_whalepy_constants"
_SUBGRAPH_PREFIX = "_whalepy_subgraphs"


def split_stages(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict | None,
    stage_blocks: Sequence[Sequence[str]],
) -> list[nn.Module]:
    """Return one ``GraphModule`` per stage; see the module docstring and docs/pipeline.md."""
    stage_blocks = [tuple(s) for s in stage_blocks]
    _check_stage_blocks(model, stage_blocks)
    block_stage = {p: k for k, paths in enumerate(stage_blocks) for p in paths}
    traces = _TRACES.get()
    key = None if traces is None else _trace_key(model, example_args, example_kwargs, stage_blocks)
    cached = None if traces is None else traces.get(key)
    ep = cached[0] if cached is not None else \
        _export(model, tuple(example_args), dict(example_kwargs or {}), tuple(block_stage))
    graph, attrs = _collapse_blocks(ep, model, block_stage)
    stage_of, free = _assign_stages(graph, attrs, block_stage, len(stage_blocks))
    stages = [
        _build_stage(graph, attrs, k, len(stage_blocks), stage_of, free) for k in range(len(stage_blocks))
    ]
    _attach_blocks(stages, stage_blocks, model)
    _attach_unused_state(stages, model)
    _order_like(stages, model)
    shapes = tuple(tuple(t.shape) for t in pytree.tree_leaves((example_args, example_kwargs or {}))
                   if isinstance(t, torch.Tensor))
    device = _trace_device(example_args, example_kwargs, model)
    for k, stage in enumerate(stages):
        stage.whalepy_device = device  # what factory ops in the glue were traced with
        stage.whalepy_stage_index = k
        stage.whalepy_blocks = stage_blocks[k]
        stage.whalepy_input_shapes = shapes  # the shapes the graph is specialised to
    ios = cached[1] if cached is not None else stage_io(stages)
    if traces is not None:
        traces[key] = (ep, ios)
    for k, stage in enumerate(stages):
        stage.whalepy_io = None if ios is None else ios[k]  # what it receives and sends per micro-batch
    return stages


_TRACES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("whalepy_split_traces", default=None)


@contextlib.contextmanager
def reuse_traces() -> Iterator[None]:
    """Inside this context, :func:`split_stages` traces a model once per structure: a later call for a
    model of the same class tree, parameter and buffer shapes, example inputs and stage blocks reuses the
    first call's export and stage shapes (:func:`stage_io`) and builds its stages from them around its
    own modules. ``whalepy check`` lowers one rank after another, each with a fresh copy of the same
    model, and every rank of a cluster traces the same graph: the trace of a 175B model (10 s) and its
    fake run of every stage (4 s) are then paid once per check, not once per rank. The key is the
    structure, not the code: values a module keeps outside its parameters, buffers and ``repr`` (a rotary
    base in a config) are not in it, so use it where the models are copies of one model (``whalepy
    check``'s ``build()``)."""
    token = _TRACES.set({})
    try:
        yield
    finally:
        _TRACES.reset(token)


def _trace_key(model: nn.Module, args: tuple, kwargs: dict | None, stage_blocks: Sequence[tuple[str, ...]]) -> tuple:
    """What the export and the stage shapes depend on: the module tree (``repr``: classes and their
    settings), every parameter's and buffer's name, shape and dtype, the inputs' shapes, dtypes and
    constants, and the stage blocks."""
    def leaf(x: Any) -> Any:
        return (tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else repr(x)

    state = tuple((n, tuple(t.shape), t.dtype) for n, t in
                  [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    return (type(model).__qualname__, repr(model), state, tuple(leaf(x) for x in pytree.tree_leaves((args, kwargs or {}))),
            str(pytree.tree_structure((args, kwargs or {}))), tuple(stage_blocks))


TensorSpec = tuple[tuple[int, ...], torch.dtype, bool]
"""``(shape, dtype, requires_grad)`` of a tensor a stage receives or sends."""


def stage_io(stages: Sequence[fx.GraphModule]) -> list[tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]] | None:
    """Per stage, ``(inputs, outputs)``: the tensors it takes and returns for the micro-batch it was
    traced with, each with whether it requires a gradient in training; None where that cannot be
    worked out (the stages then have their shapes inferred by torch on the first step).

    The stages are run one after the other on fake tensors (``FakeTensorMode``: shapes and dtypes,
    no data, no state of the model touched): stage ``k + 1`` gets stage ``k``'s outputs, those that
    require a gradient requiring one, and autograd itself says which outputs require a gradient (a
    hidden state does; a rotary table computed from buffers does not). A data-flow guess over the graph
    got this wrong where a block's output has no recorded value (Falcon's first stage: its hidden state
    was said to need no gradient, and the backward stopped). Stage ``k``'s outputs are stage ``k + 1``'s
    inputs, in order."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    import logging

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs an op without a fake kernel as an
    level = quiet.level                                          # error; here that only means: fall back
    quiet.setLevel(logging.CRITICAL)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        out: list[tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]] = []
        received: list[bool] | None = None
        with mode, torch.enable_grad():
            for stage in stages:
                state = {k: mode.from_tensor(v) for k, v in
                         [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]}
                placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
                args, ins = [], []
                for i, n in enumerate(placeholders):
                    val = n.meta["val"]
                    grad = bool(received[i]) if received is not None and i < len(received) else False
                    grad = grad and val.is_floating_point()
                    t = torch.empty(tuple(val.shape), dtype=val.dtype, device=val.device)
                    args.append(t.requires_grad_(True) if grad else t)
                    ins.append((tuple(val.shape), val.dtype, grad))
                result = functional_call(stage, state, tuple(args))
                leaves = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
                outs = tuple((tuple(x.shape), x.dtype, bool(x.requires_grad) and x.is_floating_point())
                             for x in leaves)
                received = [o[2] for o in outs]
                out.append((tuple(ins), outs))
        return out
    except Exception as e:  # noqa: BLE001 - torch infers the shapes on the first step instead
        logging.getLogger("whalepy.runtime").debug("stage shapes left to torch's inference: %s: %s",
                                                   type(e).__name__, e)
        return None
    finally:
        quiet.setLevel(level)


def retarget_device(stage: fx.GraphModule, device: torch.device | str) -> None:
    """Make the glue ops of ``stage`` create tensors on ``device`` instead of the device the model was
    traced on (``torch.arange(..., device=...)`` and friends are recorded with a constant device).
    Parameters are not moved; the caller moves or shards them."""
    device = torch.device(device)
    old = getattr(stage, "whalepy_device", None)
    if old is None or old == device:
        return

    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a == old else a

    subgraphs = getattr(stage, _SUBGRAPH_PREFIX, None)
    graphs = [stage] + (list(subgraphs.children()) if subgraphs is not None else [])
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                n.args = fx.node.map_aggregate(n.args, swap)
                n.kwargs = fx.node.map_aggregate(n.kwargs, swap)
        gm.recompile()
    stage.whalepy_device = device


def _trace_device(example_args: tuple, example_kwargs: dict | None, model: nn.Module) -> torch.device:
    for t in pytree.tree_leaves((example_args, example_kwargs or {})):
        if isinstance(t, torch.Tensor):
            return t.device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# -- 0. checks and capture ---------------------------------------------------------------------


def _check_stage_blocks(model: nn.Module, stage_blocks: list[tuple[str, ...]]) -> None:
    if not stage_blocks:
        raise CaptureError("stage_blocks is empty; a pipeline needs at least one stage")
    modules = dict(model.named_modules())
    seen: dict[str, int] = {}
    for k, paths in enumerate(stage_blocks):
        if not paths:
            raise CaptureError(f"stage {k} has no block modules; every stage needs at least one")
        for p in paths:
            if p not in modules or p == "":
                raise CaptureError(f"stage {k}: {p!r} is not a submodule path of {type(model).__name__}")
            if p in seen:
                raise CaptureError(f"block module {p!r} is listed in stages {seen[p]} and {k}")
            seen[p] = k
    for p in seen:
        for q in seen:
            if p != q and q.startswith(p + "."):
                raise CaptureError(
                    f"block modules {p!r} (stage {seen[p]}) and {q!r} (stage {seen[q]}) are nested; "
                    "list each module once, at one level"
                )


def _export(model: nn.Module, args: tuple, kwargs: dict, paths: tuple[str, ...]) -> Any:
    try:
        with export_compat(), no_kv_cache(model):  # transformers 4.x models; HF's KV cache (whalepy.models.hf_compat)
            return torch.export.export(
                model, args, kwargs, strict=False, preserve_module_call_signature=paths
            )
    except Exception as e:  # noqa: BLE001 - any trace failure is reported as a CaptureError
        raise CaptureError(
            f"torch.export could not trace {type(model).__name__} while preserving the call "
            f"signatures of its blocks ({len(paths)} modules): {type(e).__name__}: {e}. A block "
            "module must be called exactly once per forward, with tensors (or tuples/dicts of them) "
            "and constants."
        ) from e


# -- 1. collapse every block into a call of the eager module -----------------------------------


def _block_of(node: torch.fx.Node, blocks: dict[str, int]) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    for fqn, _ in stack.values():
        if fqn in blocks:
            return fqn
    return None


def _collapse_blocks(ep: Any, model: nn.Module, blocks: dict[str, int]) -> tuple[fx.Graph, dict]:
    """Rebuild ``ep.graph`` with one ``call_module`` per block; return it and its attribute table."""
    sig = ep.graph_signature
    signatures = {e.fqn: e.signature for e in ep.module_call_graph if e.fqn in blocks}
    for p in blocks:
        if signatures.get(p) is None:
            raise CaptureError(f"block {p!r} was not called during the trace, so it cannot be a stage block")
    old_by_name = {n.name: n for n in ep.graph.nodes}
    signature_inputs = {
        p: {old_by_name[a.name] for a in s.inputs if isinstance(a, (TensorArgument, SymIntArgument))}
        for p, s in signatures.items()
    }
    specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    members: dict[str, set[fx.Node]] = {p: set() for p in blocks}
    for n in ep.graph.nodes:
        if n.op not in ("placeholder", "output") and (path := _block_of(n, blocks)) is not None:
            members[path].add(n)
    graph = fx.Graph()
    attrs: dict[str, Any] = {}
    env: dict[fx.Node, Any] = {}
    inside: dict[fx.Node, str] = {}
    emitted: set[str] = set()

    def lookup(x: fx.Node, user: str) -> Any:
        if x in env:
            return env[x]
        if x in inside:
            raise CaptureError(
                f"{user} uses {x.name!r}, computed inside block {inside[x]!r} but not returned by it; "
                f"the block cannot run as a separate module"
            )
        raise CaptureError(f"{user} uses {x.name!r}, which is not defined before it")

    def emit_block(path: str) -> None:
        s = signatures[path]
        leaves = []
        for a in s.inputs:
            if isinstance(a, (TensorArgument, SymIntArgument)):
                leaves.append(lookup(old_by_name[a.name], f"block {path!r}"))
            elif isinstance(a, ConstantArgument):
                leaves.append(a.value)
            else:
                raise CaptureError(f"block {path!r} takes an input of kind {type(a).__name__}, "
                                   "which a stage graph cannot pass")
        args, kwargs = pytree.tree_unflatten(leaves, s.in_spec)
        _check_fx_arg(path, (args, kwargs))
        call = graph.call_module(path, tuple(args), dict(kwargs))
        call.meta[_BLOCK] = path
        attrs[path] = model.get_submodule(path)
        index_tree = pytree.tree_unflatten(list(range(len(s.outputs))), s.out_spec)
        for key_path, i in pytree.tree_flatten_with_path(index_tree)[0]:
            a = s.outputs[i]
            if not isinstance(a, TensorArgument) and not isinstance(a, SymIntArgument):
                continue
            old = old_by_name[a.name]
            if old not in members[path]:  # an argument handed back unchanged: users keep the original
                continue
            value = call
            for key in key_path:
                value = _access(graph, value, key, path)
            if value is not call:
                value.name = graph._graph_namespace.create_name(f"{_safe(path)}_out{i}", None)
            value.meta["val"] = old.meta.get("val")
            value.meta[_BLOCK] = path
            env[old] = value
        emitted.add(path)

    for n in ep.graph.nodes:
        if n.op == "placeholder":
            spec = specs[n.name]
            if spec.kind == InputKind.USER_INPUT:
                if isinstance(spec.arg, ConstantArgument):
                    env[n] = spec.arg.value
                else:
                    env[n] = graph.placeholder(n.name)
                    env[n].meta["val"] = n.meta.get("val")
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                getter = model.get_parameter if spec.kind == InputKind.PARAMETER else model.get_buffer
                attrs[spec.target] = getter(spec.target)
                env[n] = graph.get_attr(spec.target)
                env[n].meta["val"] = n.meta.get("val")
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                target = f"{_CONST_PREFIX}.{_safe(spec.target)}"
                attrs[target] = ep.constants[spec.target]
                env[n] = graph.get_attr(target)
                env[n].meta["val"] = n.meta.get("val")
            else:
                raise CaptureError(f"input {n.name!r} of kind {spec.kind.name} cannot be split into stages")
        elif n.op == "output":
            _emit_output(graph, ep, n, env, inside, lookup)
        else:
            path = _block_of(n, blocks)
            if path is not None:
                if path not in emitted:
                    emit_block(path)
                _check_block_inputs(n, path, inside, signature_inputs[path], specs)
                inside[n] = path
                continue
            if n.op == "get_attr":  # sub-graphs of higher-order ops such as wrap_with_set_grad_enabled
                target = f"{_SUBGRAPH_PREFIX}.{_safe(n.target)}"
                attrs[target] = getattr(ep.graph_module, n.target)
                env[n] = graph.get_attr(target)
                continue
            env[n] = graph.node_copy(n, lambda x, n=n: lookup(x, f"glue op {n.name!r}"))
    return graph, attrs


def _check_block_inputs(n: fx.Node, path: str, inside: dict, allowed: set, specs: dict) -> None:
    """A block's ops may read its own ops, its call arguments and the model's state; anything else
    reached the block behind its call signature (a Python attribute, a closure) and would be missing
    when the block runs in another process."""
    for x in n.all_input_nodes:
        if inside.get(x) == path or x in allowed:
            continue
        if x.op == "placeholder" and specs[x.name].kind != InputKind.USER_INPUT:
            continue
        source = f"in block {inside[x]!r}" if x in inside else "outside any block"
        raise CaptureError(
            f"block {path!r} reads {x.name!r}, computed {source}, without receiving it as an argument "
            f"(e.g. through a module attribute); the block cannot run as a separate pipeline stage"
        )


def _emit_output(graph: fx.Graph, ep: Any, n: fx.Node, env: dict, inside: dict, lookup: Any) -> None:
    """Keep the model's main output (``logits`` if it has one, else its first tensor)."""
    user_outputs = []
    for spec, value in zip(ep.graph_signature.output_specs, n.args[0]):
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(value)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            if isinstance(value, fx.Node) and value not in inside:
                raise CaptureError(
                    f"the model updates buffer {spec.target!r} outside every block; stage graphs "
                    "cannot carry that update; move the update into a block module"
                )
        elif spec.kind != OutputKind.LOSS_OUTPUT:
            raise CaptureError(f"the model's output {spec.arg} of kind {spec.kind.name} is not supported")
    tree = pytree.tree_unflatten(list(range(len(user_outputs))), ep.call_spec.out_spec)
    flat = pytree.tree_flatten_with_path(tree)[0]
    tensors = [(kp, i) for kp, i in flat if isinstance(user_outputs[i], fx.Node)]
    if not tensors:
        raise CaptureError("the model returns no tensor, so the last stage has nothing to return")
    logits = [(kp, i) for kp, i in tensors if "logits" in pytree.keystr(kp)]
    _, i = (logits or tensors)[0]
    graph.output(lookup(user_outputs[i], "the model's output"))


def _access(graph: fx.Graph, value: fx.Node, key: Any, path: str) -> fx.Node:
    if isinstance(key, pytree.SequenceKey):
        return graph.call_function(operator.getitem, (value, key.idx))
    if isinstance(key, pytree.MappingKey):
        return graph.call_function(operator.getitem, (value, key.key))
    if isinstance(key, pytree.GetAttrKey):
        return graph.call_function(getattr, (value, key.name))
    raise CaptureError(f"block {path!r} returns a structure indexed by {key!r}, which is not supported")


def _check_fx_arg(path: str, obj: Any) -> None:
    if isinstance(obj, (tuple, list)):
        for x in obj:
            _check_fx_arg(path, x)
    elif isinstance(obj, dict):
        for x in obj.values():
            _check_fx_arg(path, x)
    elif not isinstance(obj, (fx.Node, int, float, bool, str, type(None), torch.dtype, torch.device)):
        raise CaptureError(
            f"block {path!r} is called with a {type(obj).__name__} argument; a stage graph can only "
            "pass tensors, tuples/lists/dicts of them and plain constants into a block"
        )


def _safe(name: str) -> str:
    return name.replace(".", "_")


# -- 2. give every node a stage ----------------------------------------------------------------


def _assign_stages(
    graph: fx.Graph, attrs: dict[str, Any], block_stage: dict[str, int], num_stages: int
) -> tuple[dict[fx.Node, int], set[fx.Node]]:
    """Return the stage of every live non-free node, and the set of live free nodes."""
    out = next(n for n in graph.nodes if n.op == "output")
    live: set[fx.Node] = set()
    todo = [out]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)

    free: set[fx.Node] = set()
    for n in graph.nodes:
        if n not in live or n.op in ("placeholder", "output") or _BLOCK in n.meta:
            continue
        if n.op == "get_attr":
            if not isinstance(attrs[n.target], nn.Parameter):
                free.add(n)
        elif n.op == "call_function" and all(x in free for x in n.all_input_nodes):
            free.add(n)

    stage_of: dict[fx.Node, int] = {out: num_stages - 1}
    for n in reversed(graph.nodes):
        if n not in live or n in free or n is out:
            continue
        if n.op == "placeholder":
            stage_of[n] = 0
        elif n.op == "call_module":
            stage_of[n] = block_stage[n.target]
        elif _BLOCK in n.meta:  # getitem on a block call's result goes with the block
            stage_of[n] = block_stage[n.meta[_BLOCK]]
        else:
            users = sorted({stage_of[u] for u in n.users if u in stage_of})
            if n.op == "get_attr" and len(users) > 1:
                raise CaptureError(
                    f"parameter {n.target!r} is used by glue code outside every block in stages "
                    f"{users}; a parameter used outside the blocks must be used in one stage (a tied "
                    "parameter may be shared by blocks in different stages, not by glue)"
                )
            stage_of[n] = users[0]
    for n in graph.nodes:
        if n not in stage_of or n is out:
            continue
        for x in n.all_input_nodes:
            if x in stage_of and stage_of[x] > stage_of[n]:
                raise CaptureError(
                    f"{_describe(n)} is in stage {stage_of[n]} but uses {x.name!r} from "
                    f"{_describe(x)} in stage {stage_of[x]}; blocks must be listed in stage_blocks "
                    "in the order the model runs them"
                )
    return stage_of, free


def _describe(n: fx.Node) -> str:
    if _BLOCK in n.meta:
        return f"block {n.meta[_BLOCK]!r}"
    return f"glue op {n.name!r}"


# -- 3. one GraphModule per stage --------------------------------------------------------------


def _build_stage(
    graph: fx.Graph,
    attrs: dict[str, Any],
    k: int,
    num_stages: int,
    stage_of: dict[fx.Node, int],
    free: set[fx.Node],
) -> fx.GraphModule:
    nodes = list(graph.nodes)
    out = nodes[-1]

    def live_in(j: int) -> list[fx.Node]:
        if j == 0:
            return [n for n in nodes if n.op == "placeholder"]
        return [
            n for n in nodes
            if n in stage_of and n is not out and stage_of[n] < j
            and any(stage_of.get(u, -1) >= j for u in n.users)
        ]

    own = [n for n in nodes if stage_of.get(n) == k and n.op != "placeholder" and n is not out]
    needed_free: set[fx.Node] = set()
    todo = [x for n in own + ([out] if k == num_stages - 1 else []) for x in n.all_input_nodes]
    while todo:
        x = todo.pop()
        if x in free and x not in needed_free:
            needed_free.add(x)
            todo.extend(x.all_input_nodes)

    needed_free |= _vmap_brackets(nodes, needed_free | set(own))

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = live_in(k)
    for n in inputs:
        if k > 0 and not isinstance(n.meta.get("val"), torch.Tensor):
            raise CaptureError(
                f"stage {k} needs {n.name!r} from {_describe(n)} in stage {stage_of[n]}, which is not a "
                "tensor; only tensors can be sent between pipeline stages"
            )
        env[n] = g.placeholder(n.name)
        env[n].meta["val"] = n.meta.get("val")
    if k > 0 and not inputs:
        raise CaptureError(f"stage {k} receives nothing from stage {k - 1}; it does not depend on it")
    for n in nodes:
        if n in needed_free or n in own:
            env[n] = g.node_copy(n, lambda x: env[x])
    if k == num_stages - 1:
        g.output(env[out.args[0]])
    else:
        g.output(tuple(env[n] for n in live_in(k + 1)))
    g.lint()
    used = {n.target: attrs[n.target] for n in g.nodes if n.op in ("get_attr", "call_module")}
    for target, value in used.items():  # each stage gets its own (parameter-free) op sub-graphs
        if target.startswith(_SUBGRAPH_PREFIX):
            used[target] = copy.deepcopy(value)
    gm = fx.GraphModule(used, g, class_name=f"PipelineStage{k}")
    for target in used:
        if target.startswith(_CONST_PREFIX):  # lifted constants are not model state
            _set_persistent(gm, target, persistent=False)
    return gm


_VMAP_ENTER = "_vmap_increment_nesting"
_VMAP_EXIT = "_vmap_decrement_nesting"


def _vmap_brackets(nodes: list[fx.Node], selected: set[fx.Node]) -> set[fx.Node]:
    """The ``_vmap_increment_nesting`` / ``_vmap_decrement_nesting`` calls around selected nodes.

    ``torch.vmap`` in a forward (transformers 4.x builds its attention masks with it) is exported as
    level-numbered batching ops between these two calls. They return nothing anyone uses, so a stage
    built from the nodes its outputs depend on would drop them and run the batching ops outside any
    vmap level; a stage that keeps a node inside such a region keeps the region's brackets too.
    """
    kept: set[fx.Node] = set()
    open_regions: list[tuple[fx.Node, bool]] = []  # (enter node, does the region hold a selected node)
    for n in nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == _VMAP_ENTER:
            open_regions.append((n, False))
        elif name == _VMAP_EXIT and open_regions:
            enter, used = open_regions.pop()
            if used:
                kept |= {enter, n}
                if open_regions:  # the enclosing region holds what this one holds
                    open_regions[-1] = (open_regions[-1][0], True)
        elif n in selected and open_regions:
            open_regions[-1] = (open_regions[-1][0], True)
    return kept


# -- 4. state ownership ------------------------------------------------------------------------


def _attach_blocks(stages: list[fx.GraphModule], stage_blocks: list[tuple[str, ...]],
                   model: nn.Module) -> None:
    """Install every block at its path (also blocks whose output went unused) and copy each buffer's
    persistence flag from the model, so the stages' state dict keys are the model's."""
    non_persistent = _non_persistent_buffers(model)
    for stage, paths in zip(stages, stage_blocks):
        for p in paths:
            _set_path(stage, p, model.get_submodule(p))
        for name, _ in list(stage.named_buffers()):
            if name in non_persistent:
                _set_persistent(stage, name, persistent=False)


def _attach_unused_state(stages: list[fx.GraphModule], model: nn.Module) -> None:
    """Parameters and buffers no stage uses (unused modules) go to the last stage, so that the union of
    the stages' parameters and state dicts is the model's."""
    held = set()
    for s in stages:
        held.update(n for n, _ in s.named_parameters())
        held.update(n for n, _ in s.named_buffers())
    non_persistent = _non_persistent_buffers(model)
    for name, p in model.named_parameters():
        if name not in held:
            _set_path(stages[-1], name, p)
    for name, b in model.named_buffers():
        if name not in held:
            _set_path(stages[-1], name, b, persistent=name not in non_persistent)


def _order_like(stages: list[fx.GraphModule], model: nn.Module) -> None:
    """Order the children, parameters and buffers of each stage's container modules as in the model
    (GraphModule installs attributes by nesting depth), so per-stage iteration order is the model's."""
    originals = dict(model.named_modules())
    for stage in stages:
        for path, m in stage.named_modules():
            orig = originals.get(path)
            if orig is None or orig is m:
                continue
            for table in ("_modules", "_parameters", "_buffers"):
                have, rank = getattr(m, table), list(getattr(orig, table))
                ordered = sorted(have, key=lambda n: rank.index(n) if n in rank else len(rank))
                setattr(m, table, {n: have[n] for n in ordered})


def _non_persistent_buffers(model: nn.Module) -> set[str]:
    return {
        f"{mp}.{b}" if mp else b
        for mp, m in model.named_modules()
        for b in getattr(m, "_non_persistent_buffers_set", ())
    }


def tied_parameters(stages: Sequence[nn.Module]) -> list[list[tuple[int, str]]]:
    """Parameters held by more than one stage (tied weights such as HF's ``tie_word_embeddings``):
    one list per shared parameter of ``(stage index, name in that stage)``, in stage order; the lists
    are ordered by their first entry, so every process derives the same order from the same split."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for k, s in enumerate(stages):
        for name, p in s.named_parameters():  # first name per stage (duplicates removed)
            holders.setdefault(id(p), []).append((k, name))
    return sorted((h for h in holders.values() if len(h) > 1), key=lambda h: h[0])


def _set_path(root: nn.Module, path: str, value: Any, *, persistent: bool = True) -> None:
    *prefix, field = path.split(".")
    m = root
    for item in prefix:
        nxt = getattr(m, item, None)
        if nxt is None:
            nxt = nn.Module()
            m.add_module(item, nxt)
        m = nxt
    if isinstance(value, nn.Module):
        m.add_module(field, value)
    elif isinstance(value, nn.Parameter):
        m.register_parameter(field, value)
    else:
        m.register_buffer(field, value, persistent=persistent)


def _set_persistent(root: nn.Module, path: str, *, persistent: bool) -> None:
    owner_path, _, field = path.rpartition(".")
    owner = root.get_submodule(owner_path)
    if persistent:
        owner._non_persistent_buffers_set.discard(field)
    else:
        owner._non_persistent_buffers_set.add(field)
