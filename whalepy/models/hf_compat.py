"""Workarounds for models written for transformers 4.x (checked: 4.57.6); each is a no-op under 5.x.

whalepy traces with ``torch.export.export(strict=False)`` (capture, the pipeline stage split).
transformers 5.x is written with that in mind; transformers 4.x (checked: 4.57.6) trips it twice, and
:func:`export_compat` works around both, each only where it is needed:

- **Autocast on the meta device.** 4.x rotary embeddings (Llama and most decoder families) force fp32
  with ``torch.autocast(device_type=x.device.type, enabled=False)``. On a meta-device model (how
  whalepy captures a model too large to build) that is ``torch.autocast("meta")``, which torch
  rejects (``RuntimeError: unsupported scalarType``). Meta tensors have no autocast behaviour, so
  inside :func:`export_compat` ``torch.autocast("meta", ...)`` is a no-op context, which is what
  transformers 5.x's own ``maybe_autocast`` does for meta. Other device types get torch's autocast
  unchanged. Nothing is replaced when this torch accepts ``torch.autocast("meta")``.
- **Keyed pytree flattening of ``ModelOutput``.** 4.x registers every ``ModelOutput`` subclass as a
  pytree node without ``flatten_with_keys_fn``, and ``torch.export`` needs key paths to describe
  the outputs (``CausalLMOutputWithPast`` of GPT-2, Llama). :func:`export_compat` adds a keyed
  flattening (``MappingKey(field)``, the same order and context as the registered flatten) to such
  registrations that lack one; transformers 5.x registers its own, which is kept.

Deferred initialisation (whalepy.runtime.materialize) relies on the root model's ``_init_weights``
recomputing HF's rotary tables, which 5.x does and 4.x does not: :func:`init_rotary_tables` does it for
4.x rotary embeddings (the constructor's ``rope_init_fn(config, device)``), and
:func:`relink_original_inv_freq` points their ``original_inv_freq`` attribute (a plain tensor in 4.x,
a buffer in 5.x; dynamic RoPE variants reset ``inv_freq`` to it) at the materialised table.

transformers is never imported here: only types already registered and modules given are looked at.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


@contextlib.contextmanager
def no_kv_cache(model: Any) -> Iterator[None]:
    """HuggingFace models with ``config.use_cache=True`` (the default of their configs) return a
    ``DynamicCache`` / ``EncoderDecoderCache`` from a training forward, which ``torch.export`` cannot
    flatten ("Found <class 'transformers.cache_utils.DynamicCache'> in output") and a training step
    never reads. Inside this context every config of ``model``'s modules says ``use_cache=False``; the
    user's settings are restored after. (transformers 5.x builds the cache whenever ``use_cache`` is
    set, in training mode too.)"""
    changed = []
    seen: set[int] = set()
    for m in model.modules() if isinstance(model, torch.nn.Module) else ():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        if getattr(cfg, "use_cache", None) is True:
            try:
                cfg.use_cache = False
            except Exception:  # noqa: BLE001 - a frozen or foreign config: left as it is
                continue
            changed.append(cfg)
    try:
        yield
    finally:
        for cfg in changed:
            cfg.use_cache = True


@contextlib.contextmanager
def export_compat() -> Iterator[None]:
    """Context for a ``torch.export`` trace of a model that may be written for transformers 4.x."""
    add_model_output_key_paths()
    if _meta_autocast_supported():
        yield
        return
    original = torch.autocast
    torch.autocast = _meta_tolerant_autocast(original)  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast = original  # type: ignore[misc]


@functools.cache
def _meta_autocast_supported() -> bool:
    try:
        with torch.autocast("meta", enabled=False):
            pass
    except RuntimeError:
        return False
    return True


def _meta_tolerant_autocast(original: type) -> type:
    class autocast(original):  # type: ignore[misc, valid-type]  # noqa: N801 - stands in for torch.autocast
        """``torch.autocast``, with ``device_type="meta"`` a no-op context (see the module docstring)."""

        def __new__(cls, device_type: str, *args: Any, **kwargs: Any) -> Any:
            if device_type == "meta":
                return contextlib.nullcontext()
            return super().__new__(cls)

    return autocast


def add_model_output_key_paths() -> None:
    """Give registered transformers ``ModelOutput`` pytree nodes a keyed flattening where they have
    none (transformers 4.x); idempotent, and nothing to do under transformers 5.x."""
    for cls, node in list(pytree.SUPPORTED_NODES.items()):
        if node.flatten_with_keys_fn is not None or not _is_model_output(cls):
            continue
        pytree.SUPPORTED_NODES[cls] = node._replace(
            flatten_with_keys_fn=functools.partial(_flatten_with_keys, node.flatten_fn)
        )


def _is_model_output(cls: type) -> bool:
    return any(
        base.__name__ == "ModelOutput" and base.__module__.startswith("transformers.")
        for base in getattr(cls, "__mro__", ())
    )


def _flatten_with_keys(flatten_fn: Any, output: Any) -> tuple[list[tuple[Any, Any]], Any]:
    values, context = flatten_fn(output)  # transformers: (list(values()), list(keys()))
    return [(pytree.MappingKey(k), v) for k, v in zip(context, values, strict=True)], context


def _is_4x_rotary(module: torch.nn.Module) -> bool:
    """A transformers 4.x rotary embedding: ``inv_freq`` buffer, ``rope_init_fn``, and
    ``original_inv_freq`` an attribute rather than a buffer (5.x registers it as one)."""
    return ("inv_freq" in module._buffers and callable(getattr(module, "rope_init_fn", None))
            and hasattr(module, "config") and "original_inv_freq" not in module._buffers)


def init_rotary_tables(module: torch.nn.Module) -> None:
    """Recompute a 4.x rotary embedding's ``inv_freq`` in place, as its constructor does."""
    if _is_4x_rotary(module) and module.inv_freq is not None and not module.inv_freq.is_meta:
        inv_freq, _ = module.rope_init_fn(module.config, module.inv_freq.device)
        module.inv_freq.copy_(inv_freq)


def relink_original_inv_freq(modules: Sequence[torch.nn.Module]) -> None:
    """After materialisation: a 4.x rotary embedding's ``original_inv_freq`` is its ``inv_freq``
    (as its constructor leaves it), not the meta tensor it was built with."""
    for root in modules:
        for m in root.modules():
            original = getattr(m, "original_inv_freq", None) if _is_4x_rotary(m) else None
            if isinstance(original, torch.Tensor) and original.is_meta:
                m.original_inv_freq = m.inv_freq
