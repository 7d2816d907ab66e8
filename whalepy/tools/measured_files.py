"""Measured costs in device-profile files: ``whalepy calibrate --model MODULE:FN`` (measure a model's
blocks here) and ``whalepy calibrate --import FILE`` (a per-layer table measured elsewhere).

Both write the ``measured`` section of ``<device type>.json`` (docs/profiling.md, "Measured
planning"), merged into what the file holds (an existing calibration keeps its ``fit`` and ``rates``;
a file with only a ``measured`` section takes the datasheet transfer rule for what is not measured).

The per-layer table format ``--import`` reads (Sailor's simulator profiles, e.g.
``sailor_layer_profiles.json``)::

    {"profiles": {MODEL: {GPU: {MICRO_BATCH: {TP: {LAYER: [forward_s, backward_s, update_s]}}}}}}

times per micro-batch on one rank, layers numbered in execution order. Layer ``i`` is bound to block
``i`` of the whalepy profile of the model ``--model`` builds (their counts must be equal); the update
time at TP 1 (else at the smallest TP degree, times that degree) is the block's optimizer step. The
table does not say its precision: its times are used for whichever precision a plan trains in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from whalepy.files import write_file
from whalepy.errors import ArgumentError, WhalepyError
from whalepy.ir.measured import ANY_PRECISION, MeasuredCosts, block_signature

__all__ = ["import_layer_table", "load_model_fn", "write_measured"]


def load_model_fn(spec: str) -> tuple[Any, Any]:
    """``MODULE:FN`` -> ``FN()``, which returns ``(model, example_inputs)``."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ArgumentError(f"--model {spec!r}: give MODULE:FN, a function returning (model, example_inputs), "
                            "e.g. --model mypkg.models:build_gpt")
    import os
    import sys

    if os.getcwd() not in sys.path:  # as `python -m` does: modules of the working directory load
        sys.path.insert(0, os.getcwd())
    from whalepy.tools.model_arg import call_model_fn

    return call_model_fn(spec, error=ArgumentError, flag=f"--model {spec!r}: ")


def write_measured(measured: MeasuredCosts, path: Path) -> Path:
    """Merge ``measured`` into the device-profile file at ``path`` (created when missing)."""
    from whalepy.cost_models.device_profiles import PROFILE_VERSION, forget_resolved_profiles

    data: dict[str, Any] = {"version": PROFILE_VERSION, "device_type": measured.device_type,
                            "source": measured.source}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise WhalepyError(f"{path}: not JSON ({e}); remove it or give another --out") from None
        if data.get("version") != PROFILE_VERSION or data.get("device_type") != measured.device_type:
            raise WhalepyError(f"{path} is a version {data.get('version')!r} profile of "
                               f"{data.get('device_type')!r}; cannot add {measured.device_type} measurements "
                               "to it: give another --out")
        if data.get("measured"):
            measured = MeasuredCosts.from_dict(data["measured"], where=str(path)).merged(measured)
    data["measured"] = measured.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(data, indent=1) + "\n", what="calibrate --out")
    forget_resolved_profiles()
    return path


def import_layer_table(path: str | Path, profile: Any, *, table_model: str | None = None,
                       device_types: dict[str, str] | None = None) -> list[MeasuredCosts]:
    """One :class:`MeasuredCosts` per GPU of ``table_model`` in the table at ``path`` (module docstring),
    bound to ``profile``'s blocks. ``device_types`` renames the table's GPU names to device types."""
    try:
        raw = json.loads(Path(path).read_text())
        models = raw["profiles"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise WhalepyError(f"--import {path}: not a per-layer table ({type(e).__name__}: {e}); the format is "
                           "{'profiles': {model: {gpu: {micro_batch: {tp: {layer: [fwd, bwd, update]}}}}}}") from None
    if table_model is None:
        if len(models) != 1:
            raise ArgumentError(f"--import {path} holds models {sorted(models)}: name one with --table-model")
        table_model = next(iter(models))
    if table_model not in models:
        raise ArgumentError(f"--table-model {table_model!r} is not in {path}; it holds {sorted(models)}")
    sigs = [block_signature(profile, b) for b in profile.blocks]
    out = []
    for gpu, by_mb in models[table_model].items():
        times: dict[str, dict] = {}
        updates: dict[str, float] = {}
        update_tp: dict[str, int] = {}
        for mb, by_tp in by_mb.items():
            for tp, layers in by_tp.items():
                if len(layers) != len(sigs):
                    raise WhalepyError(f"--import {path}: {table_model} on {gpu} has {len(layers)} layers, the "
                                       f"model has {len(sigs)} blocks ({profile.blocks[0].name} .. "
                                       f"{profile.blocks[-1].name}); build the model the table was measured on")
                for layer, row in layers.items():
                    i = int(layer)
                    fwd, bwd, upd = (float(v) for v in row[:3])
                    times.setdefault(sigs[i], {})[(ANY_PRECISION, int(tp), float(mb))] = (fwd, bwd)
                    if int(tp) < update_tp.get(sigs[i], 1 << 30):
                        update_tp[sigs[i]], updates[sigs[i]] = int(tp), upd * int(tp)
        name = (device_types or {}).get(gpu, gpu)
        out.append(MeasuredCosts(device_type=name, device_name=gpu, source=f"imported from {Path(path).name} "
                                 f"({table_model} on {gpu}; {raw.get('source', '')[:120]})",
                                 optimizer="as measured by the table's system", times=times, updates=updates,
                                 names={sigs[b.index]: b.name for b in profile.blocks}))
    return out
