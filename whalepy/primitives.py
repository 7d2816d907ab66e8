"""The four annotation primitives: ``replicate``, ``split``, ``stage`` and ``cluster`` (Whale, ATC'22).

Each annotation marks a region of a model and is usable in three forms (docs/annotations.md):

- a scope around module construction: ``with whalepy.split(4): self.mlp = MLP(...)``;
- a class decorator, with or without arguments: ``@whalepy.split`` or ``@whalepy.split(4)``;
- an external spec for models you cannot edit: ``whalepy.annotate(model, {"h.*.mlp": split(4)})``.

Annotations on a module live in ``module.__dict__["_whalepy_annotations"]`` as a tuple, outermost
first; :func:`resolve_annotations` merges them with those inherited from ancestors into one
:class:`whalepy.ir.profile.BlockAnnotations` per module path. Nesting is cluster > stage > replicate >
split.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook

from whalepy.ir.annotations import (
    ANNOTATIONS_ATTR,
    check_cluster_annotations,
    match_modules,
    resolve_annotations,
)
from whalepy.errors import AnnotationError

__all__ = [
    "Annotation",
    "Cluster",
    "Replicate",
    "Split",
    "Stage",
    "annotate",
    "check_cluster_annotations",
    "clear_annotations",
    "cluster",
    "module_annotations",
    "replicate",
    "resolve_annotations",
    "split",
    "stage",
]

M = TypeVar("M", bound=nn.Module)


class Annotation:
    """Base of the four annotations: a scope (``with``) and a class decorator (``@``)."""

    kind: ClassVar[str]
    level: ClassVar[int]  # nesting rank: an annotation may only enclose those of a higher level

    def __enter__(self) -> Annotation:
        _push_scope(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _pop_scope(self)

    def __call__(self, cls: type[M]) -> type[M]:
        """Decorate an ``nn.Module`` subclass: every instance gets this annotation."""
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise AnnotationError(
                f"@{self} decorates nn.Module subclasses, got {cls!r}. Fix: decorate the module class, "
                f"or use `with whalepy.{self.kind}(...):` around module construction"
            )
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            original_init(module, *args, **kwargs)
            _attach(module, (self._per_instance(),))

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    def _per_instance(self) -> Annotation:
        return self

    # Immutable: copies of an annotated model share the annotation objects (and so the same stages).
    def __copy__(self) -> Annotation:
        return self

    def __deepcopy__(self, memo: dict) -> Annotation:
        return self


def _check_degree(kind: str, n: Any) -> int | None:
    if n is None:
        return None
    if isinstance(n, type):
        raise AnnotationError(
            f"{kind}({n.__name__}): a class is not a degree. Fix: decorate with @whalepy.{kind} or "
            f"@whalepy.{kind}(n)"
        )
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise AnnotationError(
            f"{kind}({n!r}): the degree must be a positive integer, got {type(n).__name__}. Fix: pass "
            f"an int, e.g. {kind}(4), or {kind}() to let the planner choose"
        )
    if n <= 0:
        raise AnnotationError(
            f"{kind}({n}): the degree must be a positive integer. Fix: pass e.g. {kind}(4), or "
            f"{kind}() to let the planner choose"
        )
    return int(n)


@dataclass(frozen=True)
class Replicate(Annotation):
    """Data parallelism over the region: ``n`` replicas, or ``None`` for the planner to choose."""

    n: int | None = None
    kind: ClassVar[str] = "replicate"
    level: ClassVar[int] = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _check_degree(self.kind, self.n))

    def __str__(self) -> str:
        return f"replicate({'' if self.n is None else self.n})"


@dataclass(frozen=True)
class Split(Annotation):
    """Tensor (intra-operator) parallelism over the region: degree ``n``, or ``None`` for the planner."""

    n: int | None = None
    kind: ClassVar[str] = "split"
    level: ClassVar[int] = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _check_degree(self.kind, self.n))

    def __str__(self) -> str:
        return f"split({'' if self.n is None else self.n})"


_stage_ordinals = itertools.count()


@dataclass(frozen=True)
class Stage(Annotation):
    """One pipeline stage. Each ``Stage()`` is a distinct stage, told apart by its creation ordinal;
    as a class decorator, each instance of the class forms its own stage."""

    ordinal: int = field(default_factory=lambda: next(_stage_ordinals))
    kind: ClassVar[str] = "stage"
    level: ClassVar[int] = 1

    def __str__(self) -> str:
        return f"stage#{self.ordinal}"

    def _per_instance(self) -> Stage:
        return Stage()


def _check_name(field_name: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise AnnotationError(
        f"cluster({field_name}={value!r}): {field_name} must be a non-empty string. Fix: name it as the "
        f"cluster spec does, e.g. cluster({field_name}='A100-80GB'), or leave it out"
    )


def _refuse_ambiguous_gpu(gpu: str | None) -> None:
    """``cluster(gpu="V100")`` names two memory sizes that plan differently: refused at once. An unknown
    name may be a type the cluster spec defines under ``devices:``; the planner checks it."""
    if gpu is None:
        return
    from whalepy.cost_models.devices import ambiguous_device_options

    options = ambiguous_device_options(gpu)
    if options:
        raise AnnotationError(
            f"cluster(gpu={gpu!r}): {gpu!r} is ambiguous, it comes in several memory sizes. Fix: write "
            f"{' or '.join(repr(o) for o in options)}")


def _check_count(field_name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise AnnotationError(
            f"cluster({field_name}={value!r}): {field_name} must be a positive integer. Fix: pass e.g. "
            f"cluster({field_name}=2), or leave it out"
        )
    return int(value)


@dataclass(frozen=True)
class Cluster(Annotation):
    """Pin the region to devices: a GPU type, a node group of the cluster spec, a number of nodes or
    of devices (each optional)."""

    gpu: str | None = None
    group: str | None = None
    nodes: int | None = None
    count: int | None = None
    kind: ClassVar[str] = "cluster"
    level: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if isinstance(self.gpu, type):
            raise AnnotationError(
                f"Cluster({self.gpu.__name__}): a class is not a GPU type. Fix: decorate with "
                f"@whalepy.cluster or @whalepy.cluster(gpu=...)"
            )
        object.__setattr__(self, "gpu", _check_name("gpu", self.gpu))
        _refuse_ambiguous_gpu(self.gpu)
        object.__setattr__(self, "group", _check_name("group", self.group))
        object.__setattr__(self, "nodes", _check_count("nodes", self.nodes))
        object.__setattr__(self, "count", _check_count("count", self.count))

    def __str__(self) -> str:
        parts = (f"{k}={getattr(self, k)}" for k in ("gpu", "group", "nodes", "count"))
        return f"cluster({', '.join(p for p in parts if not p.endswith('=None'))})"


# ------------------------------------------------------------------------------------ factories


def replicate(n: Any = None) -> Any:
    """``Replicate(n)``; ``@replicate`` without parentheses decorates the class it is given."""
    return Replicate()(n) if isinstance(n, type) else Replicate(n)


def split(n: Any = None) -> Any:
    """``Split(n)``; ``@split`` without parentheses decorates the class it is given."""
    return Split()(n) if isinstance(n, type) else Split(n)


def stage(cls: Any = None) -> Any:
    """A new ``Stage()``; ``@stage`` without parentheses decorates the class it is given."""
    if cls is None:
        return Stage()
    if isinstance(cls, type):
        return Stage()(cls)
    raise AnnotationError(
        f"stage({cls!r}): stage() takes no arguments. Fix: call whalepy.stage(); each call is a new stage"
    )


def cluster(gpu: Any = None, *, group: str | None = None, nodes: int | None = None,
            count: int | None = None) -> Any:
    """``Cluster(gpu, group, nodes, count)``; ``@cluster`` without parentheses decorates the class."""
    if isinstance(gpu, type):
        return Cluster(group=group, nodes=nodes, count=count)(gpu)
    return Cluster(gpu=gpu, group=group, nodes=nodes, count=count)


# ------------------------------------------------------------------------------- storage, scopes


def module_annotations(module: nn.Module) -> tuple[Annotation, ...]:
    """The annotations attached to ``module`` itself (not inherited), outermost first."""
    return module.__dict__.get(ANNOTATIONS_ATTR, ())


def _attach(module: nn.Module, outer: tuple[Annotation, ...]) -> None:
    """Put ``outer`` (outermost first) outside ``module``'s existing annotations, skipping repeats."""
    existing = module_annotations(module)
    new: list[Annotation] = []
    for ann in outer:
        if ann not in existing and ann not in new:
            new.append(ann)
    if new:
        module.__dict__[ANNOTATIONS_ATTR] = (*new, *existing)


_local = threading.local()  # .stack: this thread's active scopes, outermost first
_lock = threading.Lock()
_active_scopes = 0  # over all threads; the registration hook is installed while this is > 0
_hook_handle: Any = None


def _scope_stack() -> list[Annotation]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _on_register(parent: nn.Module, name: str, submodule: Any) -> None:
    stack = getattr(_local, "stack", None)
    if stack and isinstance(submodule, nn.Module):
        _attach(submodule, tuple(stack))


def _push_scope(ann: Annotation) -> None:
    global _active_scopes, _hook_handle
    _scope_stack().append(ann)
    with _lock:
        _active_scopes += 1
        if _hook_handle is None:
            _hook_handle = register_module_module_registration_hook(_on_register)


def _pop_scope(ann: Annotation) -> None:
    global _active_scopes, _hook_handle
    stack = _scope_stack()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is ann:
            del stack[i]
            break
    with _lock:
        _active_scopes -= 1
        if _active_scopes == 0 and _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None


def _hook_installed() -> bool:
    """Whether the module-registration hook is installed (for tests)."""
    return _hook_handle is not None


# ---------------------------------------------------------------------------------- external spec

_FACTORIES = {"replicate": replicate, "split": split, "stage": stage, "cluster": cluster}


def _spec_annotations(pattern: Any, value: Any) -> tuple[Annotation, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for v in values:
        if isinstance(v, Annotation):
            continue
        hint = ""
        if v in _FACTORIES.values() or (isinstance(v, type) and issubclass(v, Annotation)):
            hint = f" (call it: whalepy.{getattr(v, 'kind', getattr(v, '__name__', ''))}())"
        raise AnnotationError(
            f"annotate(): the value for pattern {pattern!r} is {v!r}, not an annotation{hint}. Fix: map "
            f"each pattern to whalepy.replicate(), split(), stage() or cluster(), or a list of them"
        )
    if not values:
        raise AnnotationError(
            f"annotate(): the value for pattern {pattern!r} is empty. Fix: give at least one annotation"
        )
    return values


def _insert_by_level(existing: tuple[Annotation, ...], ann: Annotation) -> tuple[Annotation, ...]:
    """Insert ``ann`` at its natural nesting place: before the first annotation it may enclose."""
    if ann in existing:
        return existing
    at = next((i for i, e in enumerate(existing) if e.level > ann.level), len(existing))
    return (*existing[:at], ann, *existing[at:])


def annotate(model: M, spec: Mapping[str, Any]) -> M:
    """Annotate ``model`` in place from ``{module-path glob: annotation or list of annotations}`` and
    return it. Every module a pattern matches gets the annotation; one ``stage()`` given to a pattern
    that matches several modules (``"h.0-11"``) is ONE stage containing all of them. Annotations take
    their natural nesting place among a module's existing ones, whatever the dict order. The result is
    validated with :func:`resolve_annotations`; on error the model is left as it was."""
    if not isinstance(model, nn.Module):
        raise AnnotationError(
            f"annotate(): expected an nn.Module, got {type(model).__name__}. Fix: pass the model itself"
        )
    if not isinstance(spec, Mapping):
        raise AnnotationError(
            f"annotate(): the spec must be a dict of module-path pattern -> annotation, got "
            f"{type(spec).__name__}. Fix: e.g. {{'transformer.h.*.mlp': whalepy.split(4)}}"
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    names = list(modules)
    additions: dict[int, tuple[nn.Module, list[Annotation]]] = {}
    for pattern, value in spec.items():
        anns = _spec_annotations(pattern, value)
        for name in match_modules(pattern, names, type(model).__name__):
            module = modules[name]
            additions.setdefault(id(module), (module, []))[1].extend(anns)

    saved = {key: module_annotations(module) for key, (module, _) in additions.items()}
    for module, anns in additions.values():
        current = module_annotations(module)
        for ann in sorted(anns, key=lambda a: a.level):
            current = _insert_by_level(current, ann)
        module.__dict__[ANNOTATIONS_ATTR] = current
    try:
        resolve_annotations(model)
    except AnnotationError:
        for key, (module, _) in additions.items():
            _restore(module, saved[key])
        raise
    return model


def _restore(module: nn.Module, annotations: tuple[Annotation, ...]) -> None:
    if annotations:
        module.__dict__[ANNOTATIONS_ATTR] = annotations
    else:
        module.__dict__.pop(ANNOTATIONS_ATTR, None)


def clear_annotations(model: M) -> M:
    """Remove every annotation attached to ``model`` and its submodules; return ``model``."""
    for module in model.modules():
        module.__dict__.pop(ANNOTATIONS_ATTR, None)
    return model
