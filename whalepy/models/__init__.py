"""Plain PyTorch models and compatibility shims: the small GPT (``from whalepy.models import GPT,
GPTConfig``), T5 v1.1 / mT5 (:mod:`whalepy.models.t5`), built-in models by name (:mod:`whalepy.models.zoo`)
and transformers 4.x workarounds (:mod:`whalepy.models.hf_compat`). Imports only torch and whalepy.errors,
and torch only when a model module is first used: ``whalepy.models.zoo``'s names, published batches and
defaults are read without it (the CLI plans from a stored profile without importing torch)."""

from __future__ import annotations

from typing import Any

__all__ = ["GPT", "GPTConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from whalepy.models import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module 'whalepy.models' has no attribute {name!r}")
