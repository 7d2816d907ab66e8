"""Extension points a higher layer fills in (dependency inversion; no torch here).

Measured planning (``whalepy.frontend.measure``, layer 4) can also time blocks as the runtime lowers
them (``whalepy.runtime.measure_lowered``, layer 6) and compile them as the runtime does
(``whalepy.runtime.compile_blocks``), which it may not import. The package's ``__init__``
(the top layer) registers a loader for it here; code below asks :func:`lowered_measure` and goes on
without it when nothing is registered (a caller that imports a lower layer alone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_lowered_loader: Callable[[], Callable[..., Any]] | None = None
_compiler_loader: Callable[[], Callable[..., Any]] | None = None


def register_lowered_measure(loader: Callable[[], Callable[..., Any]]) -> None:
    """Register ``loader() -> measure_lowered`` (called by ``whalepy/__init__``)."""
    global _lowered_loader
    _lowered_loader = loader


def lowered_measure() -> Callable[..., Any] | None:
    """The registered lowered-measurement function, or None."""
    return _lowered_loader() if _lowered_loader is not None else None


def register_block_compiler(loader: Callable[[], Callable[..., Any]]) -> None:
    """Register ``loader() -> compile_blocks`` (``whalepy.runtime.compile_blocks``, layer 6: how the runtime
    compiles a plan's blocks), which measured planning uses to time compiled blocks in its own process."""
    global _compiler_loader
    _compiler_loader = loader


def block_compiler() -> Callable[..., Any] | None:
    """The registered block compiler, or None."""
    return _compiler_loader() if _compiler_loader is not None else None
