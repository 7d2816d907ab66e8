"""Exceptions raised for user mistakes, and :func:`log_once` for messages said once per job.

Each one carries a message that names the cause (module path, annotation, device group, the numbers
involved) and the fix, so a user never has to read a traceback from inside torch to learn what went
wrong.
"""

from __future__ import annotations

import logging


class WhalepyError(Exception):
    """Base class for every error whalepy raises on purpose."""


class AnnotationError(WhalepyError, ValueError):
    """An annotation (replicate / split / stage / cluster) is contradictory, malformed or unusable."""


class ClusterSpecError(WhalepyError, ValueError):
    """A cluster description is incomplete or inconsistent."""


class CaptureError(WhalepyError, RuntimeError):
    """The model could not be traced into an FX graph."""


class InfeasibleError(WhalepyError, RuntimeError):
    """No plan fits the cluster; the message says which device group runs short and what to relax."""


class PlanError(WhalepyError, ValueError):
    """A plan is malformed, of an unknown version, or made for another model or cluster."""


class LaunchError(WhalepyError, RuntimeError):
    """The distributed launch does not match the plan (world size, device types, model)."""


_logged: set[str] = set()


def log_once(logger: logging.Logger, level: int, key: str, msg: str, *args: object) -> bool:
    """Log ``msg % args`` once per job: on global rank 0 only (every rank when no process group is up),
    and once per process for each ``key`` (a message about a plan's lowering, say, is said once however
    many blocks, stages or ``parallelize`` calls repeat it). Returns whether it was logged."""
    if key in _logged:
        return False
    _logged.add(key)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return False
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    logger.log(level, msg, *args)
    return True
