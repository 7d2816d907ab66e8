"""Extension points a higher layer fills in (dependency inversion; no torch here).

Measured planning (``whalepy.frontend.measure``, layer 4) can also time blocks as the runtime lowers
them (``whalepy.runtime.measure_lowered``, layer 6), which it may not import. The package's ``__init__``
(the top layer) registers a loader for it here; code below asks :func:`lowered_measure` and goes on
without it when nothing is registered (a caller that imports a lower layer alone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_lowered_loader: Callable[[], Callable[..., Any]] | None = None


def register_lowered_measure(loader: Callable[[], Callable[..., Any]]) -> None:
    """Register ``loader() -> measure_lowered`` (called by ``whalepy/__init__``)."""
    global _lowered_loader
    _lowered_loader = loader


def lowered_measure() -> Callable[..., Any] | None:
    """The registered lowered-measurement function, or None."""
    return _lowered_loader() if _lowered_loader is not None else None
