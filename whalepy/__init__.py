"""whalepy: annotate a PyTorch model, describe a (possibly mixed-GPU) cluster, get a hybrid-parallel plan
found by an ILP over a hardware-aware cost model, and train it on PyTorch's native distributed stack."""

import whalepy._log  # noqa: F401  (whalepy's default log handler)
from whalepy._errors import (
    AnnotationError,
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
from whalepy.study import ZeroStudyRow, study_zero
from whalepy._pseudo_to_real import delink, pseudo_to_real

__version__ = "0.1.0"

_LAZY = {"parallelize": "whalepy.runtime", "ParallelModel": "whalepy.runtime", "calibrate": "whalepy._calibrate",
         "materialize": "whalepy.runtime.materialize", "export_safetensors": "whalepy.export",
         "plan_html": "whalepy._show", "plan_timeline_svg": "whalepy._show", "plan_diff": "whalepy._show",
         "trace_memory": "whalepy.trace", "MemoryTrace": "whalepy.trace"}
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
    "MemoryTrace",
    "Cluster",
    "Replicate",
    "Split",
    "Stage",
    "annotate",
    "calibrate",
    "clear_annotations",
    "delink",
    "estimate",
    "export_safetensors",
    "homogeneous_baseline",
    "materialize",
    "trace_memory",
    "parallelize",
    "plan",
    "plan_from_profile",
    "plan_diff",
    "plan_html",
    "plan_timeline_svg",
    "pseudo_to_real",
    "cluster",
    "replicate",
    "resolve_annotations",
    "split",
    "stage",
    "study_zero",
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
    "ZeroStudyRow",
    "profile",
    "trace_memory",
    "MemoryTrace",
]
