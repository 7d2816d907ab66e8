"""whalepy: annotate a PyTorch model, describe a (possibly mixed-GPU) cluster, get a hybrid-parallel plan
found by an ILP over a hardware-aware cost model, and train it on PyTorch's native distributed stack.

``import whalepy`` is cheap: the public names below are imported from their modules on first use
(PEP 562), so the ``whalepy`` command answers ``--help`` without importing torch.
"""

import importlib

import whalepy.log  # noqa: F401  (whalepy's default log handler; logging only, no torch)
import os as _os

from whalepy.errors import (
    AnnotationError,
    ArgumentError,
    CaptureError,
    ClusterSpecError,
    DiskSpaceError,
    InfeasibleError,
    LaunchError,
    PlanError,
    WhalepyError,
)

__version__ = "0.1.0"

from whalepy.ir.extensions import register_block_compiler as _register_block_compiler  # noqa: E402
from whalepy.ir.extensions import register_lowered_measure as _register_lowered_measure  # noqa: E402

# measured planning also times blocks as the runtime lowers them (whalepy/runtime/measure_lowered.py) and
# compiles them as it does (whalepy/runtime/compile_blocks.py)
_register_lowered_measure(lambda: importlib.import_module("whalepy.runtime.measure_lowered").measure_lowered)
_register_block_compiler(lambda: importlib.import_module("whalepy.runtime.compile_blocks").compile_blocks)

if "RANK" in _os.environ and "WORLD_SIZE" in _os.environ:
    # under torchrun / whalepy run: a whalepy error anywhere in the script is one line, printed once
    from whalepy.runtime.launch_errors import install_error_hook as _install_error_hook

    _install_error_hook()

_LAZY = {
    "ClusterSpec": "whalepy.hardware.cluster",
    "Plan": "whalepy.ir.plan",
    **dict.fromkeys(("Precision", "Schedule", "Tier", "ZeroStage"), "whalepy.ir.types"),
    **dict.fromkeys(("Cluster", "Replicate", "Split", "Stage", "annotate", "clear_annotations", "cluster",
                     "replicate", "resolve_annotations", "split", "stage"), "whalepy.primitives"),
    **dict.fromkeys(("Estimate", "ParallelConfig", "estimate"), "whalepy.planner.estimate"),
    **dict.fromkeys(("homogeneous_baseline", "plan", "plan_from_profile"), "whalepy.planner"),
    "ModelProfile": "whalepy.ir.profile", "profile": "whalepy.frontend.profile",
    "parallelize": "whalepy.runtime", "ParallelModel": "whalepy.runtime", "calibrate": "whalepy.tools.calibrate",
    "materialize": "whalepy.runtime.materialize", "export_safetensors": "whalepy.tools.export",
    **dict.fromkeys(("plan_html", "plan_timeline_svg", "plan_diff"), "whalepy.tools.show"),
    **dict.fromkeys(("trace_memory", "MemoryTrace"), "whalepy.frontend.trace"),
    **dict.fromkeys(("study_zero", "ZeroStudyRow"), "whalepy.tools.study"),
    **dict.fromkeys(("delink", "pseudo_to_real"), "whalepy.tools.pseudo_to_real"),
}
"""Public name -> the module defining it, imported on first use."""


def __getattr__(name: str):  # noqa: ANN202 - module-level lazy attributes (PEP 562)
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet (``whalepy.cost_models`` after a bare ``import whalepy``)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'whalepy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AnnotationError",
    "MemoryTrace",
    "ZeroStudyRow",
    "delink",
    "plan_diff",
    "plan_html",
    "plan_timeline_svg",
    "pseudo_to_real",
    "study_zero",
    "trace_memory",
    "ArgumentError",
    "Cluster",
    "DiskSpaceError",
    "Replicate",
    "Split",
    "Stage",
    "annotate",
    "calibrate",
    "clear_annotations",
    "estimate",
    "export_safetensors",
    "homogeneous_baseline",
    "materialize",
    "parallelize",
    "plan",
    "plan_from_profile",
    "cluster",
    "replicate",
    "resolve_annotations",
    "split",
    "stage",
    "CaptureError",
    "ClusterSpec",
    "ClusterSpecError",
    "InfeasibleError",
    "LaunchError",
    "Estimate",
    "ModelProfile",
    "ParallelConfig",
    "ParallelModel",
    "Plan",
    "PlanError",
    "Precision",
    "Schedule",
    "Tier",
    "WhalepyError",
    "ZeroStage",
    "profile",
]
