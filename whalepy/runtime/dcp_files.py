"""Reading and writing DCP checkpoint directories with one-line errors: a missing, truncated or corrupted
``.metadata`` or data file, and a save path that cannot be a directory, name the path and the fix instead
of surfacing as an ``UnpicklingError`` or a multi-rank ``CheckpointException`` traceback. Every reader of
a checkpoint (``ParallelModel.load``, ``parallelize(checkpoint=...)``, ``whalepy export``) goes through
here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from whalepy.errors import ArgumentError, WhalepyError

__all__ = ["check_save_path", "load_files", "read_metadata"]


def _cause(e: BaseException) -> str:
    """The first failure inside a ``CheckpointException`` (one per rank), else ``e`` itself, as one line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) and e else e  # (exception, its traceback frames)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def read_metadata(path: str | os.PathLike[str]) -> Any:
    """The DCP ``Metadata`` of ``path``: :class:`WhalepyError` if it is not a checkpoint directory or
    its ``.metadata`` cannot be read."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"a checkpoint is a directory path, got {type(path).__name__} {path!r:.60}")
    if not (Path(path) / ".metadata").is_file():
        raise WhalepyError(f"{path} is not a checkpoint directory written by ParallelModel.save (no .metadata); "
                           "give the directory pm.save() wrote")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - pickle, EOF, OS errors: all mean an unreadable file
        raise WhalepyError(f"the checkpoint {path} is damaged: its .metadata cannot be read ({_cause(e)}); it was "
                           "truncated or overwritten (an interrupted save?): use an earlier checkpoint") from None


def load_files(state: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``dcp.load(state, checkpoint_id=path, **kwargs)``; a missing or damaged data file is one line."""
    try:
        dcp.load(state, checkpoint_id=str(path), **kwargs)
    except dcp.api.CheckpointException as e:
        raise WhalepyError(f"the checkpoint {path} is damaged or incomplete: {_cause(e)}; a data file is missing "
                           "or truncated (an interrupted save or copy?): use an earlier checkpoint") from None


def check_save_path(path: Any) -> None:
    """``ParallelModel.save(path)``: a path that is or can become a directory (DCP writes one)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ArgumentError(f"save() takes a directory path, got {type(path).__name__} {path!r:.60}; e.g. "
                            "pm.save('checkpoints/step1000')")
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ArgumentError(f"save({os.fspath(path)!r}): {os.fspath(existing)!r} is a file, not a directory; a "
                            "checkpoint is a directory: give a new or existing directory path")
