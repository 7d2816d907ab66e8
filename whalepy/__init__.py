"""whalepy: annotate a PyTorch model, describe a (possibly mixed-GPU) cluster, get a hybrid-parallel plan
found by an ILP over a hardware-aware cost model, and train it on PyTorch's native distributed stack."""

from whalepy._errors import (
    AnnotationError,
    CaptureError,
    ClusterSpecError,
    InfeasibleError,
    LaunchError,
    PlanError,
    WhalepyError,
)
from whalepy.plan import Plan, Schedule, Tier, ZeroStage
from whalepy.profile import ModelProfile, profile

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "CaptureError",
    "ClusterSpecError",
    "InfeasibleError",
    "LaunchError",
    "ModelProfile",
    "Plan",
    "PlanError",
    "Schedule",
    "Tier",
    "WhalepyError",
    "ZeroStage",
    "profile",
]
