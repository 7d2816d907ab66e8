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




class ArgumentError(WhalepyError, TypeError, ValueError):
    """An argument of a whalepy call has the wrong type, value or shape (a model that is not an
    ``nn.Module``, example inputs the model cannot take, a batch of the wrong size, a loss that is not a
    scalar). A ``TypeError`` and a ``ValueError`` too, so code catching either keeps working."""


def log_once(logger: logging.Logger, level: int, key: str, msg: str, *args: object) -> bool:
    """Log ``msg % args`` once per job (rank 0, once per ``key``): :func:`whalepy._log.warn_once`'s rule
    at any level. Returns whether it was logged."""
    from whalepy._log import log_once_at

    return log_once_at(level, key, msg, *args, log=logger)
