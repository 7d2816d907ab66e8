"""What ``ParallelModel.save`` writes as a checkpoint's ``config.json``, and the model it describes.

An HF model's config is written as ``save_pretrained`` writes it (with ``architectures``), so
``whalepy export`` and ``from_pretrained`` can rebuild the model; a whalepy model (``whalepy.models.GPT``)
has its config dataclass written with :data:`WHALEPY_MODEL_KEY` naming the model class, which
:func:`build_whalepy_model` rebuilds."""

from __future__ import annotations

from typing import Any

import torch

from whalepy.errors import WhalepyError

__all__ = ["WHALEPY_MODEL_KEY", "build_whalepy_model", "saved_config"]


WHALEPY_MODEL_KEY = "whalepy_model"
"""In a checkpoint's ``config.json``: ``"module:Class"`` of a whalepy model (``whalepy.models.GPT``), whose
other entries are its config dataclass's fields (:func:`saved_config`)."""


def saved_config(config: Any, cls: type) -> dict[str, Any] | None:
    """What ``ParallelModel.save`` writes as ``config.json`` for a model of class ``cls``: an HF config as
    ``save_pretrained`` writes it (with ``architectures``), or a whalepy model's config dataclass
    with :data:`WHALEPY_MODEL_KEY` naming the class and ``whalepy_config`` the dataclass; None for
    other models (``whalepy export`` then needs ``--config``)."""
    import dataclasses

    if callable(getattr(config, "to_diff_dict", None)):
        return {**config.to_diff_dict(), "architectures": [cls.__name__]}
    if dataclasses.is_dataclass(config) and cls.__module__.split(".")[0] == "whalepy":
        return {WHALEPY_MODEL_KEY: f"{cls.__module__}:{cls.__qualname__}",
                "whalepy_config": f"{type(config).__module__}:{type(config).__qualname__}",
                **dataclasses.asdict(config)}
    return None


def build_whalepy_model(cfg: dict[str, Any], device: Any = None) -> Any:
    """The whalepy model a :func:`saved_config` dict describes (on ``device``, e.g. ``"meta"``)."""
    import importlib

    def load(ref: str) -> Any:
        module, _, name = ref.partition(":")
        if not module.startswith("whalepy"):
            raise WhalepyError(f"config.json names {ref!r}, not a whalepy model; give an HF config (--config)")
        return getattr(importlib.import_module(module), name)

    cls, config_cls = load(cfg[WHALEPY_MODEL_KEY]), load(cfg["whalepy_config"])
    fields = {k: v for k, v in cfg.items() if k not in (WHALEPY_MODEL_KEY, "whalepy_config")}
    with torch.device(device or "cpu"):
        return cls(config_cls(**fields))
