"""``build_profile``: capture a model, run the analysis passes, summarise the graph into blocks.

Per block the figures are sums over the block's nodes (see ``grouping`` for which node belongs
where, ``flops`` and ``memory`` for the per-node rules). Two rules decide the rest:

- **Parameters.** Every parameter belongs to exactly one block: the first block, in execution
  order, with a node that reads it. Tied weights (GPT-2's ``lm_head.weight`` is ``wte.weight``)
  are one parameter, counted once, in the embedding block. A parameter no node reads goes to the
  block listing its module (or an ancestor of it), else to the last block. So the blocks' counts
  add up to ``sum(p.numel() for p in model.parameters())`` exactly.
- **Block inputs and outputs.** ``input_bytes`` sums the distinct tensors a block reads from other
  blocks or from the model's inputs (not parameters or buffers); ``output_bytes`` the distinct
  tensors it produces that a later block or the graph output reads, except those that depend on no
  input and no parameter (a causal mask, rotary tables from buffers), which a pipeline stage
  recomputes instead of receiving.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.fx as fx

from whalepy.ir.tiling import linear_param_counts, linear_rows, parameter_users
from whalepy.passes.annotate import (
    annotate_nodes,
    lookup,
    merge_block_annotations,
    resolve_model_annotations,
)
from whalepy.passes.capture import capture
from whalepy.passes.flops import count_flops
from whalepy.passes.grouping import BlockSpec, assign_blocks
from whalepy.passes.kernels import block_kernels
from whalepy.passes.manager import Pass, run_passes
from whalepy.passes.memory import count_bytes
from whalepy.passes.shapes import mark_requires_grad, nbytes
from whalepy.passes.tp_patterns import BlockTP, check_split_degrees, find_tp_patterns
from whalepy.passes.truncate import TruncatedRun, graph_signature, plan_truncation, rename, truncated
from whalepy.ir.plan import TPRule, TPStyle
from whalepy.ir.profile import BlockAnnotations, BlockKind, BlockProfile, ModelProfile, TiedCopy
from whalepy.ir.rules import is_conv1d, tp_shard_dim


def analysis_passes(
    model: torch.nn.Module, annotations: Mapping[str, BlockAnnotations], *,
    sequence_parallel: bool = False,
) -> list[tuple[str, Pass]]:
    """The passes ``build_profile`` runs, in order."""
    return [
        ("requires_grad", mark_requires_grad),
        ("annotate", partial(annotate_nodes, annotations=annotations)),
        ("flops", count_flops),
        ("blocks", partial(assign_blocks, model=model, annotations=annotations)),
        ("memory", count_bytes),
        ("tp_patterns", partial(find_tp_patterns, sequence_parallel=sequence_parallel)),
    ]


def build_profile(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    model_name: str | None = None,
    annotations: Mapping[str, BlockAnnotations] | None = None,
    capture_method: str = "auto",
    truncate_repeated: bool = True,
    sequence_parallel: bool = False,
) -> ModelProfile:
    """Profile ``model`` on ``example_inputs`` (a tuple of tensors or a dict of keyword inputs).

    ``annotations`` (module path -> effective annotations) defaults to those attached to the model
    with ``whalepy.split`` & co. (``whalepy.primitives.resolve_annotations``). ``capture_method`` is
    passed to :func:`whalepy.passes.capture.capture`. Raises ``CaptureError`` when the model cannot
    be traced and ``AnnotationError`` for annotations the block structure cannot honour.

    ``truncate_repeated`` traces long runs of provably identical layers cut down to their first
    few members and extrapolates the rest (see :mod:`whalepy.passes.truncate`); the profile's
    ``capture_method`` then ends in ``"+truncated"`` and ``profile.graph`` is the truncated graph
    (``graph.meta["whalepy.truncation"]`` says what was done, or why it was not).

    ``sequence_parallel=True`` adds :attr:`~whalepy.ir.plan.TPStyle.SEQUENCE` rules (Korthikanti et
    al.) to the blocks' ``tp_rules``: one per pre-norm that feeds column-parallel layers, and one on
    the first TP layer's module, where the residual stream enters the sequence-sharded region. A plan
    holding them is lowered with sequence parallelism. Raises ``PlanError`` naming the module when a
    block after that entry cannot run sequence parallel. Off by default: plans stay unchanged.
    """
    ann = dict(resolve_model_annotations(model) if annotations is None else annotations)
    raw, gm, note = None, None, {"runs": [], "refused": []}
    if truncate_repeated:
        runs, note["refused"] = plan_truncation(model)
        if runs:
            try:
                raw, gm = _truncated_raw(model, example_inputs, capture_method, ann, runs,
                                         sequence_parallel)
                note["runs"] = [{"container": r.container, "layers": len(r.members),
                                 "traced": r.keep, "template": r.template} for r in runs]
            except _Fallback as e:
                note["fallback"] = str(e)
            except Exception as e:  # noqa: BLE001 - the full capture reports real failures
                note["fallback"] = f"truncated capture failed: {type(e).__name__}: {e}"[:600]
    if raw is None:
        gm = capture(model, example_inputs, method=capture_method)
        run_passes(gm, analysis_passes(model, ann, sequence_parallel=sequence_parallel))
        raw = _raw_blocks(gm, model)
    if sequence_parallel:
        _sequence_parallel_region(raw)
    method = gm.meta["whalepy.capture_method"] + ("+truncated" if note["runs"] else "")
    gm.meta["whalepy.truncation"] = note
    boundaries = [b.spec.name if b.spec.kind is BlockKind.LAYER
                  else f"{b.spec.name} ({', '.join(b.spec.modules)})" for b in raw]
    blocks = []
    # who uses which parameter: one walk of the model for all blocks (per block, these walks grew the
    # capture quadratically with the depth: 2-3 s each at 96 layers, docs/benchmarks.md)
    users = parameter_users(model)
    params = list(model.named_parameters(remove_duplicate=False))
    named = [(n, id(p)) for n, p in params]
    sharded = _tp_sharded(model, [r for b in raw for r in b.tp.rules])
    owner: dict[int, str] = {}
    for b in raw:
        for i in b.owned:
            owner.setdefault(i, b.spec.name)
    first = {id(p): (n, p.numel()) for n, p in model.named_parameters()}
    sizes = {i: k for i, (_, k) in first.items()}
    row_of = {id(p): _rows(p, sharded) for p in model.parameters()}
    for b in raw:
        spec, tp, fig = b.spec, b.tp, b.fig
        merged = merge_block_annotations(
            spec.name, [(p, lookup(ann, p)) for p in (*spec.modules, *fig["paths"])],
            boundaries)
        degrees = check_split_degrees(spec.name, merged, tp, spec.modules)
        rows = linear_rows(model, spec.modules, users)
        lin_sum, lin_max, lin_n = linear_param_counts(rows)
        blocks.append(BlockProfile(
            name=spec.name, index=spec.index, kind=spec.kind, modules=spec.modules,
            repeat_group=spec.repeat_group, num_params=b.num_params, param_bytes=b.param_bytes,
            fwd_flops=fig["fwd"], bwd_flops=fig["bwd"], bytes_moved=fig["bytes"],
            activation_bytes=int(fig["saved"]), input_bytes=int(fig["in"]),
            output_bytes=int(fig["out"]), tp_rules=tp.rules, tp_whole=tp.whole, tp_comm_bytes=int(tp.comm_bytes),
            tp_comm_backward_bytes=int(tp.backward_comm_bytes), tp_gather_bytes=int(tp.gather_bytes),
            tp_whole_params=sum(sizes[i] for i in b.owned if i not in sharded),
            param_rows=tuple(sorted(row_of[i] for i in b.owned)),
            tied_copies=_tied_copies(model, spec, owner, sharded, first),
            tp_degrees=degrees, annotations=merged, kernels=fig["kernels"],
            linear_params=lin_sum, largest_linear_params=lin_max, num_linears=lin_n,
            linear_rows=rows, shares_params=shares_params(model, spec.modules, named),
            shared_param_numel=shared_param_numel(model, spec.modules, params),
        ))
    unique = list(model.parameters())
    batch, seq = _batch_and_seq(gm)
    return ModelProfile(
        model_name=model_name or type(model).__name__,
        fingerprint=model_fingerprint(model),
        batch_size=batch,
        seq_len=seq,
        total_params=sum(p.numel() for p in unique),
        param_bytes=sum(p.numel() * p.element_size() for p in unique),
        dtype=_float_dtype_name(unique),
        blocks=tuple(blocks),
        capture_method=method,
        capture_time_s=float(gm.meta["whalepy.capture_time_s"]),
        graph=gm,
    )


def shares_params(model: torch.nn.Module, modules: tuple[str, ...],
                  named: list[tuple[str, int]] | None = None) -> bool:
    """Whether a module of ``modules`` (paths in ``model``) shares a parameter with a module outside it
    (:attr:`~whalepy.ir.profile.BlockProfile.shares_params`). ``named``: ``(name, id)`` of every parameter
    of ``model`` by every name (``named_parameters(remove_duplicate=False)``), where the caller has it."""
    if named is None:
        named = [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    for path in modules:
        prefix = path + "." if path else ""
        inside = {i for n, i in named if n.startswith(prefix)}
        if any(i in inside for n, i in named if not n.startswith(prefix)):
            return True
    return False


def shared_param_numel(model: torch.nn.Module, modules: tuple[str, ...],
                       named: list[tuple[str, torch.nn.Parameter]] | None = None) -> int:
    """Elements of the parameters a module of ``modules`` shares with a module outside them (each
    parameter once): :attr:`~whalepy.ir.profile.BlockProfile.shared_param_numel`. ``named``:
    ``model.named_parameters(remove_duplicate=False)`` as a list, where the caller has it (one walk of
    the model for all its blocks instead of one per block: 0.6 s of a 175B capture's 1.8 s)."""
    if named is None:
        named = list(model.named_parameters(remove_duplicate=False))
    prefixes = tuple(p + "." if p else "" for p in modules)
    inside = {id(p): p for n, p in named if n.startswith(prefixes)}
    outside = {id(p) for n, p in named if not n.startswith(prefixes)}
    return sum(p.numel() for i, p in inside.items() if i in outside)


@dataclass(slots=True)
class _Raw:
    """A block's figures before annotations are merged."""

    spec: BlockSpec
    tp: BlockTP
    fig: dict[str, Any]
    num_params: int
    param_bytes: int
    owned: frozenset[int] = frozenset()
    """``id`` of each parameter counted in this block."""


class _Fallback(Exception):
    """The truncated capture cannot be extrapolated safely: capture the model in full."""


def _raw_blocks(gm: fx.GraphModule, model: torch.nn.Module) -> list[_Raw]:
    specs: list[BlockSpec] = gm.meta["whalepy.blocks"]
    tps: list[BlockTP] = gm.meta["whalepy.tp"]
    sums = _block_sums(gm, len(specs))
    for fig, kernels in zip(sums, block_kernels(gm, len(specs), [t.rules for t in tps]), strict=True):
        fig["kernels"] = kernels
    params = _attribute_params(gm, model, specs)
    return [_Raw(s, t, f, c, b, o) for s, t, f, (c, b, o) in zip(specs, tps, sums, params, strict=True)]


def _truncated_raw(
    model: torch.nn.Module, example_inputs: Any, method: str,
    ann: Mapping[str, BlockAnnotations], runs: list[TruncatedRun], sequence_parallel: bool = False,
) -> tuple[list[_Raw], fx.GraphModule]:
    """Capture with every run in ``runs`` truncated; check the traced copies; extrapolate."""
    with truncated(model, runs):
        gm = capture(model, example_inputs, method=method)
        run_passes(gm, analysis_passes(model, ann, sequence_parallel=sequence_parallel))
        raw = _raw_blocks(gm, model)
    by_name = {b.spec.name: i for i, b in enumerate(raw)}
    copies: dict[int, list[_Raw]] = {}
    for run in runs:
        traced = run.members[run.prefix:run.keep]
        if any(m not in by_name for m in traced) or any(m in by_name for m in run.members[run.keep:]):
            raise _Fallback(f"{run.container}: the truncated graph does not show members "
                            f"{traced[0]} .. {traced[-1]} as blocks")
        first = traced[0]
        base = graph_signature(gm, by_name[first], first)
        ref = _figures(raw[by_name[first]], first)
        for m in traced[1:]:
            if graph_signature(gm, by_name[m], m) != base:
                raise _Fallback(f"{run.container}: traced layers {first} and {m} differ (the "
                                f"forward depends on the layer)")
            if _figures(raw[by_name[m]], m) != ref:
                raise _Fallback(f"{run.container}: traced layers {first} and {m} have different "
                                f"figures")
        template = raw[by_name[run.template]]
        own = _own_params(model.get_submodule(run.template))
        if own != (template.num_params, template.param_bytes):
            raise _Fallback(f"{run.template}'s block does not own exactly its parameters")
        extra = []
        for m in run.members[run.keep:]:
            counted = _own_params(model.get_submodule(m))
            assert counted == own, f"{m} has other parameters than {run.template}"
            extra.append(_copy(template, run.template, m, model))
        copies[by_name[run.template]] = extra
    out: list[_Raw] = []
    remap: dict[int, int] = {}
    for i, b in enumerate(raw):
        remap[i] = len(out)
        out.append(b)
        out.extend(copies.get(i, ()))
    for index, b in enumerate(out):
        b.spec = replace(b.spec, index=index)
    for node in gm.graph.nodes:
        old = node.meta.get("whalepy.block")
        if old is not None:
            node.meta["whalepy.block"] = remap[old]
    gm.meta["whalepy.blocks"] = [b.spec for b in out]
    gm.meta["whalepy.tp"] = [b.tp for b in out]
    return out, gm


def _sequence_parallel_region(raw: list[_Raw]) -> None:
    """Mark where the residual stream enters the sequence-sharded region (a SEQUENCE rule on the
    first block with a column-then-row pair) and check that every later block keeps it: each must
    run sequence parallel, and the last must end it (a SEQUENCE norm before a column-parallel head,
    whose input is then gathered). Raises ``PlanError`` naming the block and why otherwise."""
    from whalepy.errors import PlanError

    def paired(b: _Raw) -> bool:
        return any(r.style is TPStyle.ROWWISE for r in b.tp.rules)

    first = next((i for i, b in enumerate(raw) if paired(b)), None)
    if first is None:
        raise PlanError("sequence_parallel=True: no block has a column-then-row tensor-parallel "
                        "pair, so there is no residual stream to shard along the sequence")
    entry = raw[first]
    if entry.spec.kind is not BlockKind.LAYER or len(entry.spec.modules) != 1:
        raise PlanError(f"sequence_parallel=True: block {entry.spec.name} starts the tensor-parallel "
                        "layers but is not one module, so its input cannot be scattered along the "
                        "sequence by a module hook")
    for b in raw[first:]:
        if b.tp.sp_problem is not None or not any(r.style is TPStyle.SEQUENCE for r in b.tp.rules):
            why = b.tp.sp_problem or "it has no tensor-parallel pattern with a norm"
            raise PlanError(f"sequence_parallel=True: block {b.spec.name} receives the "
                            f"sequence-sharded residual stream but cannot run sequence parallel: {why}")
    if not raw[-1].tp.sp_exit:
        raise PlanError(f"sequence_parallel=True: the last block {raw[-1].spec.name} does not end the "
                        "sequence-sharded region (no norm feeding a column-parallel head, whose "
                        "input would be gathered)")
    entry.tp = replace(entry.tp, rules=(TPRule(module=entry.spec.modules[0], style=TPStyle.SEQUENCE),
                                        *entry.tp.rules))


def _tp_sharded(model: torch.nn.Module, rules: list[TPRule]) -> dict[int, int]:
    """``id`` of every parameter a tensor-parallel rule shards (:func:`tp_shards_parameter`, as the
    runtime applies the rules), with the dimension it shards (:func:`tp_shard_dim`); a parameter tied to
    a sharded one is sharded with it (the runtime re-ties the copies, ``tensor_parallel._retie``)."""
    modules = dict(model.named_modules())
    out: dict[int, int] = {}
    for r in rules:
        m = modules.get(r.module)
        if m is None:
            continue
        kind = "conv1d" if is_conv1d(m) else "embedding" if isinstance(m, torch.nn.Embedding) else "linear"
        for field, p in m.named_parameters(recurse=False):
            dim = tp_shard_dim(r.style, field, kind=kind, parts=r.parts)
            if dim is not None:
                out[id(p)] = dim
    return out


def _rows(p: torch.Tensor, sharded: dict[int, int]) -> tuple[int, int, int]:
    """``(rows, elements, tp)`` of a parameter (:attr:`~whalepy.ir.profile.BlockProfile.param_rows`)."""
    dim = sharded.get(id(p))
    return (p.shape[0] if p.dim() else 1, p.numel(), 0 if dim is None else 1 if dim == 0 else 2)


def _tied_copies(model: torch.nn.Module, spec: BlockSpec, owner: dict[int, str], sharded: dict[int, int],
                 first: dict[int, tuple[str, int]]) -> tuple[TiedCopy, ...]:
    """The parameters of ``spec``'s modules that another block counts (:attr:`BlockProfile.tied_copies`);
    ``first``: each parameter's first name and size."""
    out: dict[int, TiedCopy] = {}
    for path in spec.modules:
        m = model.get_submodule(path) if path else model
        for p in m.parameters():
            o = owner.get(id(p))
            if o is not None and o != spec.name and id(p) not in out:
                out[id(p)] = TiedCopy(owner=o, parameter=first[id(p)][0], num_params=first[id(p)][1],
                                      tp_split=id(p) in sharded, rows=_rows(p, sharded))
    return tuple(out.values())


def _own_params(module: torch.nn.Module) -> tuple[int, int]:
    ps = list(module.parameters())
    return sum(p.numel() for p in ps), sum(p.numel() * p.element_size() for p in ps)


def _rename_tp(tp: BlockTP, old: str, new: str) -> BlockTP:
    return replace(
        tp, rules=tuple(replace(r, module=rename(r.module, old, new)) for r in tp.rules),
        dims=tuple((rename(p, old, new), what, size) for p, what, size in tp.dims),
        whole=tuple((rename(p, old, new), why) for p, why in tp.whole))


def _figures(b: _Raw, member: str) -> tuple:
    """What must be equal between two traced copies, with paths relative to the member."""
    fig = {k: v for k, v in b.fig.items() if k != "paths"}
    paths = tuple(rename(p, member, "<L>") for p in b.fig["paths"])
    return (tuple(sorted(fig.items())), paths, b.num_params, b.param_bytes, b.spec.kind,
            b.spec.repeat_group, _rename_tp(b.tp, member, "<L>"))


def _copy(template: _Raw, old: str, new: str, model: torch.nn.Module) -> _Raw:
    fig = dict(template.fig)
    fig["paths"] = {rename(p, old, new): None for p in template.fig["paths"]}
    spec = replace(template.spec, name=new, modules=(new,))
    return _Raw(spec, _rename_tp(template.tp, old, new), fig, template.num_params,
                template.param_bytes, frozenset(id(p) for p in model.get_submodule(new).parameters()))


def _float_dtype_name(params: list[torch.nn.Parameter]) -> str:
    """The floating dtype holding most parameters: what the captured activations were measured in."""
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if not sizes:
        return "float32"
    return str(max(sizes, key=sizes.__getitem__)).removeprefix("torch.")


def model_fingerprint(model: torch.nn.Module) -> str:
    """Short sha256 of the sorted ``(parameter FQN, shape, dtype)`` and the module class names."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    for path, m in model.named_modules():
        h.update(f"{path}={type(m).__qualname__};".encode())
    return h.hexdigest()[:16]


def _block_sums(gm: fx.GraphModule, n: int) -> list[dict[str, Any]]:
    sums = [{"fwd": 0.0, "bwd": 0.0, "bytes": 0.0, "saved": 0, "in": 0, "out": 0, "paths": {}}
            for _ in range(n)]
    read: list[set[fx.Node]] = [set() for _ in range(n)]
    # values that depend on no input and no parameter (masks, position ids, rotary tables computed
    # from buffers) cross no stage boundary: the pipeline's stage split recomputes them in each stage
    # that needs them (runtime/_stage_split.py, "free" glue), so they are no block's output
    bound: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):  # get_attr: the symbolic-trace capture's parameters
            if "whalepy.input" in node.meta or "whalepy.param" in node.meta:
                bound.add(node)
        elif any(a in bound for a in node.all_input_nodes):
            bound.add(node)
    for node in gm.graph.nodes:
        b = node.meta.get("whalepy.block")
        if b is None:
            continue
        meta, s = node.meta, sums[b]
        s["fwd"] += meta.get("whalepy.flops_fwd", 0.0)
        s["bwd"] += meta.get("whalepy.flops_bwd", 0.0)
        s["bytes"] += meta.get("whalepy.bytes", 0)
        s["saved"] += meta.get("whalepy.saved_bytes", 0)
        s["paths"][meta.get("whalepy.module_path", "")] = None
        for a in node.all_input_nodes:
            ab = a.meta.get("whalepy.block")
            user_input = a.op == "placeholder" and "whalepy.input" in a.meta
            external = (ab is not None and ab != b) or user_input
            if external and a not in read[b]:
                read[b].add(a)
                s["in"] += nbytes(a.meta.get("val"))
        if node in bound and any(u.op == "output" or u.meta.get("whalepy.block", b) != b for u in node.users):
            s["out"] += nbytes(meta.get("val"))
    return sums


def _attribute_params(
    gm: fx.GraphModule, model: torch.nn.Module, specs: list[BlockSpec]
) -> list[tuple[int, int, frozenset[int]]]:
    """``(num_params, param_bytes, ids of its parameters)`` per block, each parameter in exactly one
    block (module doc)."""
    first_use: dict[str, int] = {}
    for node in gm.graph.nodes:
        fqn = node.meta.get("whalepy.param")
        if fqn is None:
            continue
        blocks = [_use_block(u) for u in node.users]
        blocks = [b for b in blocks if b is not None]
        if blocks:
            first_use[fqn] = min(blocks)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    owners = {m: s.index for s in specs for m in s.modules}
    out = [[0, 0] for _ in specs]
    owned: list[set[int]] = [set() for _ in specs]
    for p in model.parameters():
        names = aliases[id(p)]
        used = [first_use[f] for f in names if f in first_use]
        if used:
            b = min(used)
        else:
            b = next((owners[pre] for f in names for pre in _prefixes(f) if pre in owners),
                     len(specs) - 1)
        out[b][0] += p.numel()
        out[b][1] += p.numel() * p.element_size()
        owned[b].add(id(p))
    return [(c, by, frozenset(o)) for (c, by), o in zip(out, owned)]


def _use_block(node: fx.Node) -> int | None:
    b = node.meta.get("whalepy.block")
    if b is not None:
        return b
    found = [_use_block(u) for u in node.users]  # a get_attr read through a non-call node
    found = [x for x in found if x is not None]
    return min(found) if found else None


def _prefixes(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)]


def _batch_and_seq(gm: fx.GraphModule) -> tuple[int, int | None]:
    """Batch size from the first tensor input's dim 0; tokens per sample from the first integer
    input shaped ``[batch, seq]``."""
    batch, seq = None, None
    for node in gm.graph.nodes:
        if node.op != "placeholder" or "whalepy.input" not in node.meta:
            continue
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.ndim == 0:
            continue
        if batch is None:
            batch = int(v.shape[0])
        if v.ndim == 2 and not v.is_floating_point() and not v.is_complex():
            seq = int(v.shape[1])
            break
    return batch or 1, seq
