"""``--model``: a ``package.module:function``, a built-in model name or ``synthetic:NAME``, loaded the same
way by the ``whalepy`` command and by ``whalepy.study_zero``."""

from __future__ import annotations

import importlib
from typing import Any

from whalepy.errors import WhalepyError


def load_model(spec: str, *, batch: int, seq_len: int | None) -> tuple[Any, Any] | Any:
    """``package.module:function`` returning ``(model, example_inputs)``, a built-in name, or
    ``synthetic:NAME`` (an analytic profile, no capture; returned as a ModelProfile)."""
    if spec.startswith("synthetic:"):
        from whalepy.planner.synthetic import gpt_profile

        try:
            return gpt_profile(spec.split(":", 1)[1], seq_len=seq_len, batch=batch)
        except ValueError as e:
            raise WhalepyError(str(e)) from None
    if ":" in spec:
        mod_name, fn_name = spec.split(":", 1)
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise WhalepyError(f"cannot load {spec!r}: {e}; give package.module:function") from None
        if not callable(fn):
            raise WhalepyError(f"{spec} is a {type(fn).__name__}, not a function; give package.module:function "
                               "returning (model, example_inputs)")
        try:
            import inspect

            inspect.signature(fn).bind()
        except TypeError:
            raise WhalepyError(f"{spec} needs arguments; give a function callable with none that returns "
                               "(model, example_inputs) (wrap yours: def build(): return my_fn(...))") from None
        except ValueError:
            pass  # no signature to inspect: let the call decide
        out = fn()
        if not (isinstance(out, tuple) and len(out) == 2):
            raise WhalepyError(f"{spec} must return (model, example_inputs), got {type(out).__name__}")
        return out
    from whalepy.models.zoo import build

    return build(spec, batch=batch, seq_len=seq_len)
