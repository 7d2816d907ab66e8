"""Crash-safe checkpoint directories: write beside, checksum, commit by rename.

``ParallelModel.save(path)`` never writes into ``path`` itself. Every rank writes its DCP files into a
sibling, ``.<name>.whalepy-partial``; once all of them are written and ``fsync``-ed (DCP's
``FileSystemWriter`` syncs each file and its ``.metadata``), every file is hashed (SHA-256, streamed,
the files shared out over the ranks) and rank 0 writes :data:`MANIFEST` (names, sizes, digests) last,
``fsync``-ed. The manifest is what makes a directory *complete*. Rank 0 then commits:

- ``path`` absent: rename the partial directory to ``path``;
- ``path`` holds a checkpoint: rename it to ``.<name>.whalepy-previous``, rename the partial one to
  ``path``, ``fsync`` the parent, then remove the previous one.

A crash at any moment therefore leaves a complete checkpoint to load: before the manifest, ``path``
(if it existed) is untouched; between the two renames, both siblings are complete and
:func:`resolve` reads the new one; after, ``path`` is the new one. :func:`resolve` is what every reader
goes through (``pm.load``, ``parallelize(checkpoint=...)``, ``whalepy export``): it refuses an incomplete
directory with one line naming the last complete checkpoint beside it (:func:`last_complete`), and
:func:`verify` compares every file with its digest, so a corrupted file is an error, not a wrong
tensor. A DCP directory without a manifest (written by ``torch.distributed.checkpoint`` itself or by
whalepy before manifests) still loads, unchecked: DCP writes its ``.metadata`` last, so it is complete.

Fault injection for the crash test (tests/test_checkpoint_faults.py): with ``WHALEPY_FAULT_KILL`` set to
``POINT`` or ``POINT@RANK`` a rank ``SIGKILL``-s itself on reaching that point of the commit
(:data:`KILL_POINTS`); unset, :func:`_fault` does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from whalepy.errors import WhalepyError

__all__ = ["MANIFEST", "KILL_POINTS", "begin_commit", "finish_commit", "last_complete", "resolve", "save_committed",
           "verify"]

MANIFEST = "whalepy-checkpoint.json"
VERSION = 1
PARTIAL = ".whalepy-partial"
PREVIOUS = ".whalepy-previous"
KILL_POINTS = ("start", "written", "hashed", "aside", "swapped")
"""Where the crash test kills a rank: the partial directory made; the DCP files written; the digests
taken (manifest not yet written); the old checkpoint renamed aside; the new one renamed in place (the
old not yet removed)."""
_CHUNK = 4 << 20


def _fault(point: str) -> None:
    wanted = os.environ.get("WHALEPY_FAULT_KILL")
    if not wanted:
        return
    name, _, rank = wanted.partition("@")
    if name == point and (not rank or rank == os.environ.get("RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _share(items: list[Any], fn: Callable[[Any], Any], *, distributed: bool) -> list[Any]:
    """``[fn(x) for x in items]``, each rank computing every world-size-th one (all ranks get all)."""
    dist = _dist() if distributed else None
    if dist is None:
        return [fn(x) for x in items]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: fn(items[i]) for i in range(rank, len(items), world)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    merged = {i: v for part in everyone for i, v in part.items()}
    return [merged[i] for i in range(len(items))]


def _is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def _is_checkpoint(directory: Path) -> bool:
    return _is_complete(directory) or (directory / ".metadata").is_file()


def last_complete(parent: Path, *, besides: Path | None = None) -> Path | None:
    """The most recently committed complete checkpoint directly under ``parent`` (a directory with a
    manifest, hidden partial ones included), other than ``besides``; None when there is none."""
    best: tuple[float, Path] | None = None
    try:
        entries = list(parent.iterdir())
    except OSError:
        return None
    for d in entries:
        if d == besides or not d.is_dir() or not _is_complete(d):
            continue
        try:
            when = float(json.loads((d / MANIFEST).read_text()).get("committed", 0.0))
        except (OSError, ValueError, AttributeError):
            continue
        if best is None or when > best[0]:
            best = (when, d)
    return None if best is None else best[1]


def _shown(path: Path) -> str:
    """A hidden sibling is named by the checkpoint path it stands for."""
    for suffix in (PARTIAL, PREVIOUS):
        if path.name.startswith(".") and path.name.endswith(suffix):
            return f"{path.with_name(path.name[1:-len(suffix)])} (kept as {path.name})"
    return str(path)


def _incomplete(path: Path, why: str) -> WhalepyError:
    last = last_complete(path.parent, besides=path)
    hint = (f"the last complete checkpoint there is {_shown(last)}: load that one" if last is not None
            else f"no complete checkpoint is in {path.parent}: start from scratch or give another directory")
    return WhalepyError(f"{path} is not a complete checkpoint ({why}); {hint}")


def resolve(path: str | os.PathLike[str]) -> Path:
    """The directory to read for the checkpoint ``path``: ``path`` itself, or, after a crash between
    the two renames of a commit, its complete hidden sibling; :class:`WhalepyError` naming the last
    complete checkpoint when there is none."""
    path = Path(path)
    if _is_complete(path):
        return path
    partial, previous = _sibling(path, PARTIAL), _sibling(path, PREVIOUS)
    if path.name.endswith(PARTIAL):
        raise _incomplete(path, "a save interrupted before its commit; it is removed by the next save "
                                "to the same path")
    if (path / ".metadata").is_file():
        return path  # a DCP directory without a manifest (older whalepy, dcp.save): complete, unchecked
    for candidate in (partial, previous):  # a crash between the commit's renames: both are complete
        if _is_complete(candidate):
            return candidate
    if partial.is_dir():
        raise _incomplete(path, f"its save was interrupted before its commit ({partial.name} is incomplete)")
    if not path.exists() and last_complete(path.parent) is not None:
        raise _incomplete(path, "it does not exist")
    raise WhalepyError(f"{path} is not a checkpoint directory written by ParallelModel.save (no .metadata); "
                       "give the directory pm.save() wrote")


def verify(directory: Path, *, distributed: bool = True) -> None:
    """Compare every file of a complete checkpoint with its manifest (size and SHA-256; the files shared
    out over the ranks when a process group is up and ``distributed``): one line naming the first file
    that differs. A directory without a manifest is not checked."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return
    try:
        files = json.loads(manifest.read_text())["files"]
        assert isinstance(files, Mapping)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise WhalepyError(f"the checkpoint {directory} is damaged: its {MANIFEST} cannot be read; it was "
                           "overwritten or truncated: use an earlier checkpoint") from None
    names = sorted(files)

    def check(name: str) -> str | None:
        file, want = directory / name, files[name]
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want.get("size"):
            return f"{name} has {file.stat().st_size} bytes, {want.get('size')} were written"
        if _digest(file) != want.get("sha256"):
            return f"{name} does not match its SHA-256 checksum"
        return None

    bad = next((r for r in _share(names, check, distributed=distributed) if r), None)
    if bad is not None:
        raise WhalepyError(f"the checkpoint {directory} is corrupted: {bad} (changed after it was saved: a disk "
                           "or copy fault); use an earlier checkpoint")


def _prepare(path: Path) -> Path:
    """Rank 0: finish a commit a crash interrupted, clear a stale partial directory, make a new one."""
    partial, previous = _sibling(path, PARTIAL), _sibling(path, PREVIOUS)
    if not path.exists() and _is_complete(partial):  # crashed between the renames: roll forward
        partial.rename(path)
        _fsync_dir(path.parent)
    if previous.exists() and _is_checkpoint(path):
        shutil.rmtree(previous)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def _commit(path: Path, partial: Path) -> None:
    """Rank 0: make the complete ``partial`` the checkpoint ``path`` (module docstring)."""
    previous = _sibling(path, PREVIOUS)
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    if path.exists():
        if previous.exists():
            shutil.rmtree(previous)
        path.rename(previous)
        _fault("aside")
        partial.rename(path)
        _fsync_dir(path.parent)
        _fault("swapped")
        shutil.rmtree(previous)
    else:
        partial.rename(path)
    _fsync_dir(path.parent)


def check_target(path: Path) -> None:
    """What ``save`` may replace: nothing, an empty directory or a checkpoint; never other files."""
    if path.is_dir() and not _is_checkpoint(path) and any(path.iterdir()):
        raise WhalepyError(f"save({str(path)!r}): the directory holds other files and no checkpoint; a save replaces "
                           "the directory it is given: give a new directory or an earlier checkpoint's")


def begin_commit(path: str | os.PathLike[str]) -> Path:
    """Collective: make the partial sibling of ``path`` that a save writes into (rank 0), and return it."""
    path = Path(path)
    dist = _dist()
    rank = dist.get_rank() if dist is not None else 0
    check_target(path)
    partial = _prepare(path) if rank == 0 else _sibling(path, PARTIAL)
    if dist is not None:
        dist.barrier()
    _fault("start")
    return partial


def finish_commit(path: str | os.PathLike[str], partial: Path, files: Mapping[str, bytes] | None = None) -> None:
    """Collective, after every rank wrote into ``partial``: rank 0 adds ``files`` (name -> bytes), then
    checksum and commit as the module docstring says."""
    path = Path(path)
    dist = _dist()
    rank = dist.get_rank() if dist is not None else 0
    if rank == 0:
        for name, data in (files or {}).items():
            with open(partial / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    if dist is not None:
        dist.barrier()
    _fault("written")
    names = sorted(p.name for p in partial.iterdir() if p.is_file())
    digests = _share(names, lambda n: (os.path.getsize(partial / n), _digest(partial / n)), distributed=True)
    _fault("hashed")
    if rank == 0:
        manifest = {"version": VERSION, "committed": time.time(),
                    "files": {n: {"size": s, "sha256": d} for n, (s, d) in zip(names, digests, strict=True)}}
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
        _commit(path, partial)
    if dist is not None:
        dist.barrier()


def save_committed(path: str | os.PathLike[str], write: Callable[[Path], None],
                   files: Mapping[str, bytes] | None = None) -> None:
    """Collective: ``write(directory)`` (every rank: DCP's ``save`` into a partial sibling of ``path``),
    rank 0 adds ``files`` (name -> bytes), then checksum and commit as the module docstring says."""
    partial = begin_commit(path)
    write(partial)
    finish_commit(path, partial, files)
