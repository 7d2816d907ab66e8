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


MEASURE_OPTIONS = ("micro_batches", "tp_degrees", "precision", "loss_fn", "optimizer", "device", "repeats", "lowered", "compile",
                   "cpu_peers", "truncate")
"""Options of ``whalepy.profile(..., measure=True)``, passed to :func:`whalepy.frontend.measure.measure_costs`."""


def profile(model: Any, example_inputs: Any, *, measure: bool = False, **kwargs: Any) -> ModelProfile:
    """Capture ``model`` on ``example_inputs`` (a tuple of tensors, or a dict of keyword inputs) and
    return its :class:`ModelProfile`. Weights are never materialised, unless ``measure=True``: then each
    distinct block is also timed on the local device (forward, backward, optimizer step, saved
    activations; :mod:`whalepy.frontend.measure`, options :data:`MEASURE_OPTIONS`), the result is
    attached as ``profile.measured`` and the measured activation bytes replace the estimate."""
    from whalepy.errors import ArgumentError, CaptureError
    from whalepy.frontend.checks import check_example_inputs, check_model, token_dtype_hint
    from whalepy.passes.profile import build_profile

    check_model(model, "whalepy.profile()")
    if not isinstance(measure, bool):
        raise ArgumentError(f"whalepy.profile(measure={measure!r:.60}): give True or False")
    mopts = {k: kwargs.pop(k) for k in MEASURE_OPTIONS if k in kwargs}
    if mopts and not measure:
        raise ArgumentError(f"whalepy.profile(): {', '.join(mopts)} only apply with measure=True")
    _check_profile_options(kwargs)
    check_example_inputs(model, example_inputs, "whalepy.profile()")
    if measure:  # before the capture: a bad option or a meta-device model fails in a moment
        from whalepy.frontend.measure_checks import check_measurable_model, check_measure_options

        if isinstance(mopts.get("precision"), str):  # names in any case, as the planner takes them
            mopts["precision"] = mopts["precision"].strip().lower()
        check_measure_options(**mopts)
        check_measurable_model(model, "whalepy.profile(measure=True)")
    try:
        prof = build_profile(model, example_inputs, **kwargs)
    except CaptureError:
        hint = token_dtype_hint(model, example_inputs)
        if hint is None:
            raise
        raise hint from None
    if not measure:
        return prof
    from dataclasses import replace

    from whalepy.frontend.measure import apply_measured_activations, measure_costs

    measured = measure_costs(model, example_inputs, prof, **mopts)
    return replace(apply_measured_activations(prof, measured, mopts.get("precision", "fp32"),
                                              compiled=bool(mopts.get("compile", False))), measured=measured)
