"""Durable files for the disk tier: atomic writes, a step manifest, directory checks (free space:
:mod:`whalepy.runtime.disk_space`).

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

import json
import os
from pathlib import Path
from typing import Any

from whalepy.errors import WhalepyError
from whalepy.runtime.disk_space import disk_full_error, is_disk_full
from whalepy.runtime.launch_errors import remove_at_exit

__all__ = ["MANIFEST", "TMP_SUFFIX", "atomic_write", "prepare_dir", "read_manifest",
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
    directory (``fsync=False`` skips both syncs: still never torn for readers, not crash-safe). A full
    file system is a :class:`~whalepy.errors.DiskSpaceError` naming ``path``, the temporary file removed."""
    view = memoryview(data).cast("B")
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb", buffering=0) as f:
            for start in range(0, len(view), _CHUNK):
                f.write(view[start:start + _CHUNK])
            if fsync:
                os.fsync(f.fileno())
    except OSError as e:
        if not is_disk_full(e):
            raise
        tmp.unlink(missing_ok=True)  # the partial file gives its space back at once
        raise disk_full_error(path, e, len(view)) from None
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
        remove_at_exit(path)  # at exit, also when a whalepy error ends the launch with os._exit
    return path
