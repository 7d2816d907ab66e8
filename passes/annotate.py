"""Attach the user's annotations (replicate / split / stage / cluster) to graph nodes and blocks.

``whalepy.resolve_annotations(model)`` gives the effective annotations of every module
path; :func:`annotate_nodes` copies those of each node's innermost module to
``node.meta["whalepy.annotations"]``. :func:`merge_block_annotations` folds the annotations of
everything in one block into the block's, refusing a block that straddles two stages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch.fx as fx

from whalepy.errors import AnnotationError
from whalepy.passes.manager import PassContext
from whalepy.ir.profile import BlockAnnotations

_EMPTY = BlockAnnotations()
_FIELDS = ("split", "replicate", "stage", "cluster_gpu", "cluster_group", "cluster_count",
           "cluster_nodes")


def resolve_model_annotations(model: Any) -> dict[str, BlockAnnotations]:
    """Every module path of ``model`` mapped to its effective annotations."""
    from whalepy.ir.annotations import resolve_annotations

    return resolve_annotations(model)


def lookup(annotations: Mapping[str, BlockAnnotations], path: str) -> BlockAnnotations:
    """Annotations of module ``path``: its own entry, else its nearest ancestor's (annotations are
    inherited, so a sparse mapping such as ``{"h.0.mlp": split(2)}`` covers ``h.0.mlp.c_fc``)."""
    while True:
        found = annotations.get(path)
        if found is not None:
            return found
        if not path:
            return _EMPTY
        path = path.rsplit(".", 1)[0] if "." in path else ""


def annotate_nodes(
    gm: fx.GraphModule, ctx: PassContext, annotations: Mapping[str, BlockAnnotations]
) -> None:
    """Write ``node.meta["whalepy.annotations"]`` (those of the innermost module) on computing nodes."""
    cache: dict[str, BlockAnnotations] = {}
    for node in ctx.nodes(gm):
        path = node.meta.get("whalepy.module_path")
        if path is not None:
            found = cache.get(path)
            if found is None:
                found = cache[path] = lookup(annotations, path)
            node.meta["whalepy.annotations"] = found


def merge_block_annotations(
    block: str,
    items: Iterable[tuple[str, BlockAnnotations]],
    boundaries: Sequence[str],
) -> BlockAnnotations:
    """Merge the annotations of a block's modules (``(module path, annotations)`` pairs).

    A field set on some modules and unset on others takes the set value (a ``split(4)`` on the MLP
    makes the whole block run 4-way tensor parallel). Two different values of one field inside a
    block are an error: a block is placed, split and replicated as a unit.
    """
    values: dict[str, dict[Any, str]] = {f: {} for f in _FIELDS}
    sources: list[str] = []
    seen: set[int] = set()
    for path, ann in items:
        if ann.is_empty or id(ann) in seen:
            continue
        seen.add(id(ann))
        for f in _FIELDS:
            v = getattr(ann, f)
            if v is not None:
                values[f].setdefault(v, path or "<root>")
        for s in ann.sources:
            if s not in sources:
                sources.append(s)
    merged: dict[str, Any] = {}
    for f, found in values.items():
        if len(found) > 1:
            detail = ", ".join(f"{v!r} on {p}" for v, p in found.items())
            if f == "stage":
                raise AnnotationError(
                    f"block {block} contains modules of different stages ({detail}); a stage boundary "
                    f"must fall on a block boundary. Block boundaries are: {_describe(boundaries)}. "
                    f"Fix: move the stage() scope so that it starts and ends between blocks."
                )
            raise AnnotationError(
                f"block {block} has conflicting {f} annotations ({detail}); a block is parallelised "
                f"as a unit. Fix: annotate the whole block (e.g. its module path) with one value."
            )
        if found:
            merged[f] = next(iter(found))
    if not merged:
        return _EMPTY
    return BlockAnnotations(**merged, sources=tuple(sources))


def _describe(boundaries: Sequence[str]) -> str:
    """``"embed (a, b) | h.0 | ... | h.95 | head (c)"``, eliding long runs of layer blocks."""
    if len(boundaries) <= 12:
        return " | ".join(boundaries)
    return " | ".join([*boundaries[:5], "...", *boundaries[-5:]])
