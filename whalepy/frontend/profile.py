"""``whalepy.profile(model, example_inputs)``: capture the model, run the analysis passes of
``whalepy.passes`` and return its :class:`~whalepy.ir.profile.ModelProfile` (the data lives in the data model,
the capture here, above the passes it runs)."""

from __future__ import annotations

from typing import Any

from whalepy.ir.profile import ModelProfile


def _check_profile_options(kwargs: dict[str, Any]) -> None:
    import inspect

    from whalepy.errors import ArgumentError
    from whalepy.passes.profile import build_profile

    params = {n: p for n, p in inspect.signature(build_profile).parameters.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ArgumentError(f"whalepy.profile(): unknown option(s) {unknown}; options are: {', '.join(params)}")
    for name, value in kwargs.items():
        if isinstance(params[name].default, bool) and not isinstance(value, bool):
            raise ArgumentError(f"whalepy.profile({name}={value!r:.60}): give True or False")


def profile(model: Any, example_inputs: Any, **kwargs: Any) -> ModelProfile:
    """Capture ``model`` on ``example_inputs`` (a tuple of tensors, or a dict of keyword inputs) and
    return its :class:`ModelProfile`. Weights are never materialised."""
    from whalepy.errors import CaptureError
    from whalepy.frontend.checks import check_example_inputs, check_model, token_dtype_hint
    from whalepy.passes.profile import build_profile

    check_model(model, "whalepy.profile()")
    _check_profile_options(kwargs)
    check_example_inputs(model, example_inputs, "whalepy.profile()")
    try:
        return build_profile(model, example_inputs, **kwargs)
    except CaptureError:
        hint = token_dtype_hint(model, example_inputs)
        if hint is None:
            raise
        raise hint from None
