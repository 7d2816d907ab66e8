"""Durable files for the disk tier: atomic writes, a step manifest, directory and free-space checks.

Every file the ``nvme`` tier writes goes through :func:`atomic_write`: the bytes go to a temporary name
in the same directory, are ``fsync``-ed, and the temporary file is renamed over the final name
(``os.replace``, atomic on POSIX file systems), then the directory is ``fsync``-ed so the rename itself
survives a crash. A reader therefore sees either the old complete file or the new complete file, never
a torn one. What makes a whole *step* durable is the manifest (:func:`write_manifest`): the swap engine
writes a step's files under the other generation's names and only then replaces ``manifest.json``, so
after a crash the manifest names a complete set of files; once it is durable the superseded
generation is removed (:func:`remove_files`), so between steps the disk holds one generation
(docs/runtime.md, "Disk tier").
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
from pathlib import Path
from typing import Any

from whalepy.errors import WhalepyError

__all__ = ["MANIFEST", "TMP_SUFFIX", "atomic_write", "check_free_space", "prepare_dir", "read_manifest",
           "remove_files", "remove_temporaries", "write_manifest"]

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
_CHUNK = 8 << 20
"""Bytes per ``write`` call: large states are written in pieces (no second copy of a whole state)."""


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: memoryview | bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: temporary name, ``fsync``, rename, ``fsync`` of the
    directory (``fsync=False`` skips both syncs: still never torn for readers, not crash-safe)."""
    view = memoryview(data).cast("B")
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb", buffering=0) as f:
        for start in range(0, len(view), _CHUNK):
            f.write(view[start:start + _CHUNK])
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def write_manifest(directory: Path, content: dict[str, Any], *, fsync: bool = True) -> None:
    """Replace ``directory/manifest.json`` atomically (the commit point of a step)."""
    atomic_write(directory / MANIFEST, json.dumps(content, sort_keys=True).encode(), fsync=fsync)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The last committed manifest, or None when the directory has none."""
    try:
        return json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None


def remove_files(directory: Path, paths: list[Path], *, fsync: bool = True) -> None:
    """Remove ``paths`` (missing ones are fine): the generation a durable manifest superseded. The
    directory is ``fsync``-ed after, so a crash cannot bring them back."""
    for p in paths:
        p.unlink(missing_ok=True)
    if fsync and paths:
        _fsync_dir(directory)


def remove_temporaries(directory: Path) -> int:
    """Delete leftover temporary files of writes a crash interrupted; how many there were."""
    n = 0
    for tmp in directory.glob(f"*{TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)
        n += 1
    return n


def prepare_dir(path: Path, *, user_dir: str | os.PathLike[str] | None = None, keep: bool = False) -> Path:
    """Create ``path`` and check that files can be written there; :class:`WhalepyError` naming the
    directory otherwise. Unless ``keep``, registers its removal at interpreter exit."""
    shown = os.fspath(user_dir) if user_dir is not None else os.fspath(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".whalepy-probe"
        with open(probe, "wb") as f:
            f.write(b"\0" * 8)
        probe.unlink()
    except OSError as e:
        raise WhalepyError(
            f"nvme_dir {shown!r} is not writable ({e.strerror or e}); parameters and optimizer states of "
            "blocks with an 'nvme' tier are kept in files there. Pass parallelize(..., nvme_dir=...) a "
            "writable directory on the node's NVMe drive") from None
    if not keep:
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def check_free_space(directory: Path, needed: float, *, user_dir: str | os.PathLike[str] | None = None) -> None:
    """:class:`WhalepyError` when the file system of ``directory`` has less than ``needed`` bytes free
    (checked before training starts, so a full disk is not found in the middle of a step)."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        shown = os.fspath(user_dir) if user_dir is not None else os.fspath(directory)
        raise WhalepyError(
            f"nvme_dir {shown!r} has {free / 2**30:.2f} GiB free but this rank's disk tier needs "
            f"{needed / 2**30:.2f} GiB (its files at their peak, while a step writes); free space there or pass "
            "parallelize(..., nvme_dir=...) a larger drive")
