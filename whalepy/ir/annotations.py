"""Module-path globs and annotation resolution, below the public primitives in ``whalepy.primitives``.

Annotations attached to a module live in ``module.__dict__["_whalepy_annotations"]`` as a tuple,
outermost first. This module never imports the annotation classes: it reads their ``kind``
(``"cluster"``, ``"stage"``, ``"replicate"``, ``"split"``), ``level`` (nesting rank, outer first) and
fields, so ``whalepy.primitives`` can import it without a cycle.

Glob syntax (docs/annotations.md): dot-separated segments; ``*`` is one segment, ``**`` any number of
segments (zero included), ``A-B`` the integer segments A..B, ``?``/``*`` inside a longer segment match
as in ``fnmatch``, and ``{a,b.c,0-3}`` expands to alternatives (shell-style, may span dots).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Collection, Iterable
from typing import Any

from whalepy.errors import AnnotationError
from whalepy.ir.profile import BlockAnnotations

ANNOTATIONS_ATTR = "_whalepy_annotations"
_NESTING = "cluster > stage > replicate > split"
_SYNTAX = "glob syntax in docs/annotations.md"
_RANGE = re.compile(r"(\d+)-(\d+)\Z")


def where(path: str) -> str:
    return path or "<root>"


# --------------------------------------------------------------------------------------------- globs


def _malformed(pattern: str, why: str, fix: str) -> AnnotationError:
    return AnnotationError(f"annotate(): pattern {pattern!r} is malformed: {why}. Fix: {fix} ({_SYNTAX})")


def expand_braces(pattern: Any) -> list[str]:
    """``"t.{wte,h.0-1}"`` -> ``["t.wte", "t.h.0-1"]`` (shell-style, one level, may span dots)."""
    if not isinstance(pattern, str):
        raise AnnotationError(
            f"annotate(): spec key {pattern!r} is a {type(pattern).__name__}, not a module-path pattern. "
            f"Fix: key the spec by strings such as 'transformer.h.*.mlp' ({_SYNTAX})"
        )
    done, todo = [], [pattern]
    while todo:
        text = todo.pop()
        start, end = text.find("{"), text.find("}")
        if start < 0 and end < 0:
            done.append(text)
            continue
        if start < 0 or 0 <= end < start:
            raise _malformed(pattern, "a '}' without its '{'", "balance the braces: {a,b}")
        end = text.find("}", start)
        if end < 0:
            raise _malformed(pattern, "a '{' without its '}'", "balance the braces: {a,b}")
        inner = text[start + 1 : end]
        if "{" in inner:
            raise _malformed(pattern, "nested braces", "use one level of braces, {a,b}")
        if inner == "":
            raise _malformed(pattern, "empty braces {}", "list alternatives inside: {a,b}")
        todo.extend(text[:start] + alt + text[end + 1 :] for alt in reversed(inner.split(",")))
    return done


def parse_pattern(pattern: str, shown: str | None = None) -> tuple[tuple, ...]:
    """Segments of a brace-free glob, each ``("many",)`` (``**``), ``("any",)``, ``("lit", s)``,
    ``("glob", s)`` or ``("range", a, b)``; ``""`` is the root module."""
    shown = pattern if shown is None else shown
    if pattern == "":
        return ()
    segments: list[tuple] = []
    for text in pattern.split("."):
        m = _RANGE.match(text)
        if text == "":
            raise _malformed(shown, "empty segment", "remove the doubled, leading or trailing dot")
        elif text == "**":
            segments.append(("many",))
        elif text == "*":
            segments.append(("any",))
        elif m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise _malformed(shown, f"range {text} runs backwards", f"write {hi}-{lo}")
            segments.append(("range", lo, hi))
        elif any(c in text for c in "*?["):
            segments.append(("glob", text))
        else:
            segments.append(("lit", text))
    return tuple(segments)


def _segment_match(seg: tuple, part: str) -> bool:
    if seg[0] == "any":
        return True
    if seg[0] == "lit":
        return part == seg[1]
    if seg[0] == "glob":
        return fnmatch.fnmatchcase(part, seg[1])
    return part.isdigit() and seg[1] <= int(part) <= seg[2]


def _match(segs: tuple[tuple, ...], parts: list[str], i: int, j: int, hits: list) -> bool:
    """Whether ``segs[i:]`` matches ``parts[j:]``; range hits along the successful path go to ``hits``."""
    if i == len(segs):
        return j == len(parts)
    seg = segs[i]
    if seg[0] == "many":
        return any(_match(segs, parts, i + 1, k, hits) for k in range(j, len(parts) + 1))
    if j == len(parts) or not _segment_match(seg, parts[j]):
        return False
    if _match(segs, parts, i + 1, j + 1, hits):
        if seg[0] == "range":
            hits.append((i, int(parts[j])))
        return True
    return False


def _spans(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for n in sorted(set(numbers)):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def closest_paths(pattern: str, names: list[str], n: int = 3) -> list[str]:
    """Module paths (and their forms with ``*`` for numeric segments) closest to ``pattern``."""
    general = [".".join("*" if p.isdigit() else p for p in name.split(".")) for name in names if name]
    candidates = list(dict.fromkeys([*general, *(name for name in names if name)]))
    close = difflib.get_close_matches(pattern, candidates, n=n, cutoff=0.5)
    return close or [name for name in names if name and "." not in name][:5]


def match_modules(pattern: str, names: list[str], model_name: str = "the model") -> list[str]:
    """The module paths among ``names`` that ``pattern`` matches, in the order of ``names``.

    Raises AnnotationError when the pattern (or one of its brace alternatives) matches nothing, naming
    the closest paths, and when an integer range names indices that no matching path has (``h.0-11``
    on a 4-layer model).
    """
    matched: set[str] = set()
    for alt in expand_braces(pattern):
        shown = repr(pattern) if alt == pattern else f"{alt!r} (from {pattern!r})"
        segs = parse_pattern(alt, pattern)
        hits: list[tuple[int, int]] = []
        found = [name for name in names if _match(segs, name.split(".") if name else [], 0, 0, hits)]
        if not found:
            close = ", ".join(closest_paths(alt, names)) or "none (the model has no submodules)"
            raise AnnotationError(
                f"annotate(): pattern {shown} matches no module of {model_name}; closest module paths: "
                f"{close}. Fix the pattern ({_SYNTAX}; list paths with model.named_modules())"
            )
        for i, seg in enumerate(segs):
            if seg[0] != "range":
                continue
            seen = {number for k, number in hits if k == i}
            missing = set(range(seg[1], seg[2] + 1)) - seen
            if missing:
                raise AnnotationError(
                    f"annotate(): pattern {shown}: range {seg[1]}-{seg[2]} names indices "
                    f"{_spans(missing)} that match no module of {model_name} (matched: "
                    f"{_spans(seen) or 'none'}). Fix the range to cover existing modules only"
                )
        matched.update(found)
    return [name for name in names if name in matched]


# ---------------------------------------------------------------------------------------- resolution


def _nesting_error(outer: Any, outer_path: str, inner: Any, path: str) -> AnnotationError | None:
    head = f"{inner} on {where(path)} is nested inside {outer} on {where(outer_path)}"
    if outer.level > inner.level:
        return AnnotationError(
            f"{head}, but a {inner.kind} must enclose a {outer.kind}, not sit inside one (allowed "
            f"nesting: {_NESTING}). Fix: put {inner.kind}() outside {outer.kind}(), or annotate "
            f"{where(path)} differently"
        )
    if outer.kind != inner.kind:
        return None
    if inner.kind == "stage":
        return AnnotationError(
            f"{head}; stages cannot nest. Fix: remove one of the two stage() annotations, or make the "
            f"stages siblings"
        )
    if inner.kind in ("split", "replicate"):
        if outer.n is not None and inner.n is not None and outer.n != inner.n:
            return AnnotationError(
                f"{head}; nested {inner.kind}() annotations must agree on the degree. Fix: use "
                f"{outer} for both, or leave the inner one without a degree: {inner.kind}()"
            )
        return None
    for name in ("gpu", "group", "nodes", "count"):
        a, b = getattr(outer, name), getattr(inner, name)
        if a is not None and b is not None and a != b:
            return AnnotationError(
                f"{head}; nested cluster() annotations name a different {name} ({a!r} vs {b!r}). "
                f"Fix: give both the same {name}=, or drop it from the inner cluster()"
            )
    return None


class _StageOrder:
    """Numbers stages 0..k-1 by first appearance and checks that each covers contiguous modules."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.first_path: dict[Any, str] = {}
        self.current: Any = None
        self.current_path = ""

    def visit(self, stage: Any, path: str) -> None:
        if stage == self.current:
            return
        if stage in self.index:
            raise AnnotationError(
                f"{stage} on {where(path)} comes after {self.current} on {where(self.current_path)} in "
                f"module order, but {stage} already covers {where(self.first_path[stage])}; a stage's "
                f"modules must be contiguous in model.named_modules() order. Fix: give "
                f"{where(path)} its own stage(), or regroup the stage annotations into consecutive "
                f"modules"
            )
        self.index[stage] = len(self.index)
        self.first_path[stage] = path
        self.current, self.current_path = stage, path


def _summarise(entries: list[tuple[Any, str]], order: _StageOrder) -> BlockAnnotations:
    fields: dict[str, Any] = {}
    for ann, _ in entries:
        if ann.kind in ("split", "replicate"):
            if ann.n is not None:
                fields[ann.kind] = ann.n
            else:
                fields.setdefault(ann.kind, 0)
        elif ann.kind == "stage":
            fields["stage"] = order.index.setdefault(ann, len(order.index))
        else:
            for name in ("gpu", "group", "nodes", "count"):
                if getattr(ann, name) is not None:
                    fields[f"cluster_{name}"] = getattr(ann, name)
    sources = tuple(f"{ann} on {where(path)}" for ann, path in entries)
    return BlockAnnotations(**fields, sources=sources)


def resolve_annotations(model: Any) -> dict[str, BlockAnnotations]:
    """Effective annotations of every module path of ``model`` (root ``""``), in
    ``model.named_modules(remove_duplicate=False)`` order, inherited from ancestors and merged outer to
    inner. Stages are numbered 0..k-1 by first appearance. Raises AnnotationError (module path,
    annotations involved, fix) for contradictory nesting and for stages that interleave."""
    result: dict[str, BlockAnnotations] = {}
    order = _StageOrder()
    visited: set[int] = set()
    empty = BlockAnnotations()

    def visit(module: Any, path: str, inherited: tuple[tuple[Any, str], ...]) -> None:
        entries = list(inherited)
        for ann in module.__dict__.get(ANNOTATIONS_ATTR, ()):
            if any(ann == seen for seen, _ in entries):
                continue  # the same scope seen again (a module and its children both carry it)
            for outer, outer_path in entries:
                error = _nesting_error(outer, outer_path, ann, path)
                if error is not None:
                    raise error
            entries.append((ann, path))
        stage = next((ann for ann, _ in entries if ann.kind == "stage"), None)
        if id(module) not in visited:
            visited.add(id(module))
            if stage is not None:
                order.visit(stage, path)
        result[path] = _summarise(entries, order) if entries else empty
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name, tuple(entries))

    visit(model, "", ())
    return result


def _suggestion(name: str, options: list[str]) -> str:
    """What goes between the facts and the fix: ``"; did you mean X? "`` or ``". "``."""
    low = name.lower()
    prefixed = [o for o in options if o.lower().startswith(low) or low.startswith(o.lower())]
    by_lower = {o.lower(): o for o in options}
    close = [by_lower[o] for o in difflib.get_close_matches(low, list(by_lower), n=3, cutoff=0.5)]
    picks = list(dict.fromkeys([*prefixed, *close]))[:3]
    return f"; did you mean {' or '.join(picks)}? " if picks else ". "


def _cluster_source(block: BlockAnnotations, path: str, needle: str) -> str:
    """The module path of the cluster() annotation whose text holds ``needle`` (``"gpu=T4"``)."""
    for source in block.sources:
        if source.startswith("cluster(") and needle in source.rsplit(" on ", 1)[0]:
            return source.rsplit(" on ", 1)[1]
    return where(path)


def check_cluster_annotations(
    annotations: dict[str, BlockAnnotations],
    available_gpu_types: Collection[str],
    available_groups: Collection[str],
) -> None:
    """Raise AnnotationError for a ``cluster(gpu=..., group=...)`` naming a GPU type or node group the
    cluster lacks; ``annotations`` is what :func:`resolve_annotations` returned."""
    gpus, groups = list(available_gpu_types), list(available_groups)
    for path, block in annotations.items():
        gpu, group = block.cluster_gpu, block.cluster_group
        if gpu is not None and gpu not in gpus:
            on = _cluster_source(block, path, f"gpu={gpu}")
            raise AnnotationError(
                f"cluster(gpu={gpu!r}) on {on}: the cluster has no GPU type {gpu!r} (it has "
                f"{', '.join(gpus) or 'none'}){_suggestion(gpu, gpus)}Fix the gpu= argument or add a "
                f"node group of that type to the cluster spec"
            )
        if group is not None and group not in groups:
            on = _cluster_source(block, path, f"group={group}")
            raise AnnotationError(
                f"cluster(group={group!r}) on {on}: the cluster has no node group {group!r} (it has "
                f"{', '.join(groups) or 'none'}){_suggestion(group, groups)}Fix the group= argument or "
                f"add a node group of that name to the cluster spec"
            )
