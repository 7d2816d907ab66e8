"""whalepy: annotate a PyTorch model, describe a (possibly mixed-GPU) cluster, get a hybrid-parallel plan
found by an ILP over a hardware-aware cost model, and train it on PyTorch's native distributed stack."""

import os as _os

from whalepy._errors import (
    AnnotationError,
    ArgumentError,
    CaptureError,
    ClusterSpecError,
    InfeasibleError,
    LaunchError,
    PlanError,
    WhalepyError,
)
from whalepy.cluster import ClusterSpec
from whalepy.plan import Plan, Precision, Schedule, Tier, ZeroStage
from whalepy.primitives import (
    Cluster,
    Replicate,
    Split,
    Stage,
    annotate,
    clear_annotations,
    cluster,
    replicate,
    resolve_annotations,
    split,
    stage,
)
from whalepy.estimate import Estimate, ParallelConfig, estimate
from whalepy.planner import homogeneous_baseline, plan, plan_from_profile
from whalepy.profile import ModelProfile, profile

__version__ = "0.1.0"

if "RANK" in _os.environ and "WORLD_SIZE" in _os.environ:
    # under torchrun / whalepy run: a whalepy error anywhere in the script is one line, printed once
    from whalepy._launch_errors import install_error_hook as _install_error_hook

    _install_error_hook()

_LAZY = {"parallelize": "whalepy.runtime", "ParallelModel": "whalepy.runtime", "calibrate": "whalepy._calibrate",
         "materialize": "whalepy.runtime.materialize", "export_safetensors": "whalepy.export"}
"""Names whose modules import torch.distributed's heavier parts; loaded on first use, so planning
from the command line does not pay for the runtime."""


def __getattr__(name: str):  # noqa: ANN202 - module-level lazy attributes (PEP 562)
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'whalepy' has no attribute {name!r}")

__all__ = [
    "AnnotationError",
    "ArgumentError",
    "Cluster",
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
