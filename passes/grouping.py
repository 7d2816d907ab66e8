"""Blocks: the units of pipeline partitioning, found from the model's repeated structure.

1. **Runs.** A run is a sequence of two or more consecutive sibling modules of one class that
   have parameters (``transformer.h.0 .. h.N-1``, ``model.layers.*``, ``encoder.layer.*``), inside
   an ``nn.ModuleList`` / ``nn.Sequential`` or, elsewhere, with identical parameter shapes (so
   ``wte`` and ``wpe``, two ``nn.Embedding`` siblings of different shapes, are not a run). Only
   top-most runs count: a run inside a member of another run (experts inside a layer) is part of
   that member. A model may have several runs (T5: ``encoder.block.*`` and ``decoder.block.*``).
2. **Blocks.** Each run member is a ``LAYER`` block named by its module path. Everything executed
   before the first run is one ``EMBEDDING`` block ``"embed"``, everything after the last run one
   ``HEAD`` block ``"head"``, and what runs between two runs (T5's encoder final norm and decoder
   embedding) an ``OTHER`` block ``"glue.<k>"``. Empty ones are left out; a model without runs is
   one ``OTHER`` block ``"model"``. When one of these would hold modules of different ``stage()``
   scopes, each module opening a stage scope becomes an ``OTHER`` block of its own (named by its path).
3. **Nodes.** A node inside a run member (by its innermost module path) belongs to that member's
   block. Every other node (code of a container such as the attention-mask construction in
   ``GPT2Model.forward``, the loss in the root module, nodes without a module path) belongs to the
   block whose stretch of execution it falls in: the graph is in execution order, so this is the
   block of the nearest preceding producer in program order, which keeps every block's inputs
   produced by earlier blocks (what pipeline splitting needs).
4. **Repeat groups.** Layer blocks with equal signatures (class name, parameter names/shapes/dtypes,
   sequence of ops with output shapes) share a ``repeat_group`` id; T5's first block, which also
   owns the relative-position bias, gets a group of its own.

Writes ``node.meta["whalepy.block"]`` (block index) on computing nodes and the list of
:class:`BlockSpec` in ``gm.meta["whalepy.blocks"]``.
"""

from __future__ import annotations

import re

import hashlib
from dataclasses import dataclass

from collections.abc import Mapping

import torch
import torch.fx as fx

from whalepy.passes.manager import PassContext
from whalepy.passes.shapes import op_name
from whalepy.ir.profile import BlockAnnotations, BlockKind

_CALLS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True, slots=True)
class Run:
    container: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BlockSpec:
    name: str
    index: int
    kind: BlockKind
    modules: tuple[str, ...]
    repeat_group: int | None = None


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _param_signature(module: torch.nn.Module) -> tuple:
    return tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())


def _numbered(names: list[str]) -> bool:
    """Attribute names of one numbered series (``layer1, layer2``, ``block_0, block_1``): outside a
    ModuleList / Sequential only such siblings count as repeated layers, so look-alike siblings with
    different roles (a token and a position embedding of equal size) stay apart."""
    parsed = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if not all(parsed):
        return False
    prefixes = {m.group(1) for m in parsed}  # type: ignore[union-attr]
    numbers = [int(m.group(2)) for m in parsed]  # type: ignore[union-attr]
    return len(prefixes) == 1 and numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def find_runs(model: torch.nn.Module) -> list[Run]:
    """Top-most runs of structurally repeated sibling modules, in registration order."""
    candidates: list[Run] = []
    for path, module in model.named_modules(remove_duplicate=False):
        children = [(n, c) for n, c in module._modules.items() if c is not None]
        listlike = isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
        i = 0
        while i < len(children):
            cls = type(children[i][1])
            j = i + 1
            while j < len(children) and type(children[j][1]) is cls:
                j += 1
            members = children[i:j]
            if len(members) >= 2 and next(members[0][1].parameters(), None) is not None:
                if listlike or (_numbered([n for n, _ in members])
                                and len({_param_signature(c) for _, c in members}) == 1):
                    candidates.append(Run(path, tuple(_child(path, n) for n, _ in members)))
            i = j
    member_paths = {m for r in candidates for m in r.members}
    top = []
    for run in candidates:
        parts = run.container.split(".") if run.container else []
        nested = any(".".join(parts[:k]) in member_paths for k in range(1, len(parts) + 1))
        if not nested:
            top.append(run)
    return top


class _MemberIndex:
    """Module path -> run member containing it (or None), cached per distinct path."""

    def __init__(self, runs: list[Run]) -> None:
        self._member_run = {m: i for i, r in enumerate(runs) for m in r.members}
        self._cache: dict[str, tuple[str, int] | None] = {}

    def __call__(self, path: str) -> tuple[str, int] | None:
        hit = self._cache.get(path, False)
        if hit is not False:
            return hit  # type: ignore[return-value]
        found = None
        if path:
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                run = self._member_run.get(prefix)
                if run is not None:
                    found = (prefix, run)
                    break
        self._cache[path] = found
        return found


def _top_module(path: str, containers: set[str]) -> str | None:
    """The shallowest ancestor-or-self of ``path`` that contains no run (None for container code)."""
    if path in containers:
        return None
    parts = path.split(".")
    for k in range(1, len(parts) + 1):
        prefix = ".".join(parts[:k])
        if prefix not in containers:
            return prefix
    return None


def assign_blocks(gm: fx.GraphModule, ctx: PassContext, model: torch.nn.Module,
                  annotations: Mapping[str, BlockAnnotations] | None = None) -> None:
    """Find the blocks of ``model`` and assign every computing node of ``gm`` to one (see module doc)."""
    runs = find_runs(model)
    _assign(gm, ctx, model, runs, frozenset())
    if annotations:
        promoted = _stage_scopes_to_split(gm, ctx, model, runs, annotations)
        if promoted:
            _assign(gm, ctx, model, [*runs, *(Run(_parent(p), (p,)) for p in promoted)], frozenset(promoted))


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _stage_scopes_to_split(gm: fx.GraphModule, ctx: PassContext, model: torch.nn.Module, runs: list[Run],
                           annotations: Mapping[str, BlockAnnotations]) -> list[str]:
    """Modules that open a ``stage()`` scope inside a block that would otherwise hold several stages
    (a model without repeated layers, ``Net`` with a stage for its embedding and one for its MLP): each
    becomes a block of its own, so the user's stage boundaries are block boundaries."""
    from whalepy.passes.annotate import lookup

    stages: dict[int, set[int]] = {}
    for node in ctx.nodes(gm):
        b = node.meta.get("whalepy.block")
        path = node.meta.get("whalepy.module_path")
        if b is not None and path is not None:
            st = lookup(annotations, path).stage
            if st is not None:
                stages.setdefault(b, set()).add(st)
    specs = gm.meta["whalepy.blocks"]
    mixed = [specs[b] for b, v in stages.items() if len(v) > 1 and specs[b].kind is not BlockKind.LAYER]
    if not mixed:
        return []
    member_of = _MemberIndex(runs)
    out = []
    for path, _ in model.named_modules():
        if not path or member_of(path) is not None:
            continue
        st = lookup(annotations, path).stage
        if st is None or st == lookup(annotations, _parent(path)).stage:
            continue
        if any(path == m or path.startswith(m + ".") or m.startswith(path + ".") for spec in mixed
               for m in spec.modules) and not any(path.startswith(p + ".") for p in out):
            out.append(path)
    return out


def _assign(gm: fx.GraphModule, ctx: PassContext, model: torch.nn.Module, runs: list[Run],
            promoted: frozenset[str]) -> None:
    """Blocks from ``runs`` (``promoted``: single-module runs made of stage scopes, OTHER blocks)."""
    member_of = _MemberIndex(runs)
    calls = [n for n in gm.graph.nodes if n.op in _CALLS]
    owner = [member_of(n.meta.get("whalepy.module_path", "")) for n in calls]

    # Order runs by first execution and find each run's span.
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, o in enumerate(owner):
        if o is not None:
            first.setdefault(o[1], i)
            last[o[1]] = i
    run_order = sorted(first, key=first.__getitem__)
    containers = {""}
    for r in runs:
        parts = r.container.split(".") if r.container else []
        containers.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))

    # Walk the nodes in execution order, opening blocks as they start.
    specs: list[dict] = []
    by_member: dict[str, int] = {}
    segment: dict[str, int] = {}  # "embed" / "head" / "glue.k" -> block index

    def open_block(name: str, kind: BlockKind) -> int:
        specs.append({"name": name, "kind": kind, "modules": {}})
        return len(specs) - 1

    if not runs or not first:
        index = open_block("model", BlockKind.OTHER)
        for node in ctx.nodes(gm):
            if node.op in _CALLS:
                _place(node, specs[index], index, containers)
        gm.meta["whalepy.blocks"] = _finish(specs, {}, calls, model)
        return

    run_pos = {r: k for k, r in enumerate(run_order)}
    current: int | None = None
    call_index = 0
    for node in ctx.nodes(gm):
        if node.op not in _CALLS:
            continue
        i, o = call_index, owner[call_index]
        call_index += 1
        if o is not None:
            block = by_member.get(o[0])
            if block is None:
                kind = BlockKind.OTHER if o[0] in promoted else BlockKind.LAYER
                block = by_member[o[0]] = open_block(o[0], kind)
            current = block
        elif i < first[run_order[0]]:
            block = segment.get("embed")
            if block is None:
                block = segment["embed"] = open_block("embed", BlockKind.EMBEDDING)
        elif i > last[run_order[-1]]:
            block = segment.get("head")
            if block is None:
                block = segment["head"] = open_block("head", BlockKind.HEAD)
        else:
            k = _gap_before(i, run_order, first, last, run_pos)
            if k is None:  # inside a run's span: stays with the member that ran last
                block = current if current is not None else open_block("embed", BlockKind.EMBEDDING)
            else:
                key = f"glue.{k}"
                block = segment.get(key)
                if block is None:
                    block = segment[key] = open_block(key, BlockKind.OTHER)
        _place(node, specs[block], block, containers)
    gm.meta["whalepy.blocks"] = _finish(specs, by_member, calls, model)


def _gap_before(i: int, run_order: list[int], first: dict, last: dict, run_pos: dict) -> int | None:
    """Index k of the gap between run k and run k+1 that position ``i`` falls in, else None."""
    for k in range(len(run_order) - 1):
        if last[run_order[k]] < i < first[run_order[k + 1]]:
            return k
    return None


def _place(node: fx.Node, spec: dict, index: int, containers: set[str]) -> None:
    node.meta["whalepy.block"] = index
    path = node.meta.get("whalepy.module_path", "")
    if spec["kind"] is BlockKind.LAYER:
        return
    top = _top_module(path, containers) if path else None
    if top is not None:
        spec["modules"][top] = None


def _finish(
    specs: list[dict], by_member: dict[str, int], calls: list[fx.Node], model: torch.nn.Module
) -> list[BlockSpec]:
    """Freeze the block specs, giving structurally equal layer blocks one repeat group."""
    signatures: dict[int, list] = {i: [layer_param_signature(model, m)] for m, i in by_member.items()}
    for node in calls:
        b = node.meta.get("whalepy.block")
        if b in signatures:
            v = node.meta.get("val")
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
            signatures[b].append((op_name(node), shape, node.meta.get("whalepy.module_class")))
    # A parameterless module called from several blocks (T5's stack dropout, after the embedding and
    # after the last layer) belongs to none of them: its calls stay glue code of each, so no module is in
    # two blocks (two pipeline stages, two FSDP units). One with parameters stays with its first block.
    holders: dict[str, int] = {}
    for spec in specs:
        for m in spec["modules"]:
            holders[m] = holders.get(m, 0) + 1
    shared = {m for m, n in holders.items()
              if n > 1 and m and next(model.get_submodule(m).parameters(), None) is None}
    seen: set[str] = set()
    for spec in specs:
        for m in list(spec["modules"]):
            if m in shared or m in seen:
                del spec["modules"][m]
            seen.add(m)
    groups: dict[str, int] = {}
    out = []
    for i, spec in enumerate(specs):
        group = None
        modules = tuple(spec["modules"])
        if spec["kind"] is BlockKind.LAYER:
            modules = (spec["name"],)
            key = hashlib.sha256(repr(signatures[i]).encode()).hexdigest()
            group = groups.setdefault(key, len(groups))
        out.append(BlockSpec(name=spec["name"], index=i, kind=spec["kind"], modules=modules,
                             repeat_group=group))
    return out


def layer_param_signature(model: torch.nn.Module, path: str) -> tuple:
    """Class name and parameter shapes of the module at ``path`` (part of a block's signature)."""
    module = model.get_submodule(path)
    return (type(module).__name__, _param_signature(module))
