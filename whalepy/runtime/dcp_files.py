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
from whalepy.runtime.commit import check_target, resolve, verify

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
    directory = resolve(path)  # an incomplete directory is refused here, naming the last complete one
    try:
        return dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # noqa: BLE001 - pickle, EOF, OS errors: all mean an unreadable file
        raise WhalepyError(f"the checkpoint {path} is damaged: its .metadata cannot be read ({_cause(e)}); it was "
                           "truncated or overwritten (an interrupted save?): use an earlier checkpoint") from None


def load_files(state: dict[str, Any], path: str | os.PathLike[str], *, verified: bool = False,
               **kwargs: Any) -> None:
    """``dcp.load(state, checkpoint_id=path, **kwargs)`` after checking every file against the checkpoint's
    checksums (:func:`whalepy.runtime.commit.verify`; ``verified``: the caller already did); a missing,
    damaged or corrupted data file is one line. Collective, like ``dcp.load``, unless ``no_dist``."""
    directory = resolve(path)
    if not verified:
        verify(directory, distributed=not kwargs.get("no_dist", False))
    try:
        dcp.load(state, checkpoint_id=str(directory), **kwargs)
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
    parent = Path(path).absolute().parent  # the new checkpoint is written beside it, then renamed
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArgumentError(f"save({os.fspath(path)!r}): {os.fspath(parent)!r} is not writable (a save writes the "
                            "new checkpoint beside the path, then renames it): give a directory this process can write")
    check_target(Path(path))
