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
        return call_model_fn(spec)
    from whalepy.models.zoo import build

    return build(spec, batch=batch, seq_len=seq_len)


DEFAULT_SAMPLES_PER_DEVICE = 8
"""``--global-batch`` of a model without a published batch: samples per device."""


def default_global_batch(model: str, seq_len: int | None, world_size: int) -> tuple[int, str]:
    """``--global-batch`` when it is not given, and where it came from (said in the plan text): a built-in
    model's published batch at its published sequence length (:data:`whalepy.models.zoo.PUBLISHED_BATCHES`),
    else :data:`DEFAULT_SAMPLES_PER_DEVICE` per device."""
    from whalepy.models.zoo import published_batch

    pub = None if ":" in model else published_batch(model, seq_len)
    if pub is not None:
        return pub.sequences, f"{pub.family}'s published batch; --global-batch to change"
    return DEFAULT_SAMPLES_PER_DEVICE * world_size, (f"{DEFAULT_SAMPLES_PER_DEVICE} per device; "
                                                    "--global-batch to change")


def published_batches_text() -> str:
    """The published batches for ``--help``: ``gpt2, gpt2-xl 512 x 1024 tokens; ...``."""
    from whalepy.models.zoo import PUBLISHED_BATCHES

    names: dict[tuple[int, int], list[str]] = {}
    for name, p in PUBLISHED_BATCHES.items():
        names.setdefault((p.sequences, p.seq_len), []).append(name)
    return "; ".join(f"{', '.join(n)} {b} x {s} tokens" for (b, s), n in names.items())


def call_model_fn(spec: str, *, error: type[WhalepyError] = WhalepyError, flag: str = "") -> tuple[Any, Any]:
    """``package.module:function`` called with no arguments; it must return ``(model, example_inputs)``.
    Each way this fails (not importable, not a function, needs arguments, raises, returns something else)
    is one ``error`` line, prefixed by ``flag`` (e.g. ``"--model 'x:y': "``)."""
    import inspect

    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise error(f"{flag}cannot load {spec!r}: {e}; give package.module:function (the module must be "
                    "importable)") from None
    if not callable(fn):
        raise error(f"{flag}{spec} is a {type(fn).__name__}, not a function; give package.module:function "
                    "returning (model, example_inputs)")
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise error(f"{flag}{spec} needs arguments; give a function callable with none that returns "
                    "(model, example_inputs) (wrap yours: def build(): return my_fn(...))") from None
    except ValueError:
        pass  # no signature to inspect: let the call decide
    try:
        out = fn()
    except WhalepyError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's builder: its failure said in one line
        lines = str(e).strip().splitlines()
        raise error(f"{flag}{spec}() raised {type(e).__name__}" + (f": {lines[0][:200]}" if lines else "")
                    + "; fix the function (it is called with no arguments and returns (model, example_inputs))"
                    ) from None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise error(f"{flag}{spec} must return (model, example_inputs), got {type(out).__name__}"
                    + (f" of {len(out)}" if isinstance(out, tuple) else ""))
    return out
