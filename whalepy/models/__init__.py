"""Plain PyTorch models and compatibility shims: the small GPT (``from whalepy.models import GPT,
GPTConfig``), T5 v1.1 / mT5 (:mod:`whalepy.models.t5`), built-in models by name (:mod:`whalepy.models.zoo`)
and transformers 4.x workarounds (:mod:`whalepy.models.hf_compat`). Imports only torch and whalepy.errors."""

from whalepy.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
