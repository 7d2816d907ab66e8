"""Exceptions raised for user mistakes, and :func:`log_once` for messages said once per job.

Each one carries a message that names the cause (module path, annotation, device group, the numbers
involved) and the fix, so a user never has to read a traceback from inside torch to learn what went
wrong.
"""

from __future__ import annotations

import enum
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


class DiskSpaceError(WhalepyError, OSError):
    """The file system of the disk tier (``nvme_dir``) cannot hold its files: refused before training
    (the bytes of every rank writing there, summed, against its free space less a reserve), or found
    full during a step (``ENOSPC``). An ``OSError`` too, so code catching a full disk keeps working."""


def enum_member(cls: type[enum.Enum], value: object, what: str, hint: str = "") -> enum.Enum:
    """``_missing_`` of whalepy's string enums (tiers, schedules, precisions): ``value`` written in
    another case or with spaces is that member; anything else is a :class:`PlanError` naming the value,
    the closest name and every name (instead of enum's bare ``ValueError: 'x' is not a valid Tier``)."""
    import difflib

    names = [str(m.value) for m in cls]  # type: ignore[attr-defined]
    if isinstance(value, str):
        for m in cls:
            if m.value == value.strip().lower():
                return m
    close = difflib.get_close_matches(value.strip().lower(), names, n=1, cutoff=0.5) if isinstance(value, str) else []
    said = f"did you mean {close[0]!r}? " if close and not hint else ""
    raise PlanError(f"unknown {what} {value!r}: {hint}{said}use one of {', '.join(map(repr, names))}")


def log_once(logger: logging.Logger, level: int, key: str, msg: str, *args: object) -> bool:
    """Log ``msg % args`` once per job (rank 0, once per ``key``): :func:`whalepy.log.warn_once`'s rule
    at any level. Returns whether it was logged."""
    from whalepy.log import log_once_at

    return log_once_at(level, key, msg, *args, log=logger)
