"""The one way whalepy writes a file: checked first, written atomically.

Every command and API that writes a file (``Plan.save``, ``MemoryTrace.save``, ``show --html/--svg``,
``study --csv/--plot``, ``calibrate --out``, ``export``) goes through here (tests/test_file_writes.py
audits it). :func:`check_output` refuses, as one line and before any work: a path that is a directory,
whose directory is missing or not writable, or that is one of the command's inputs (``show PLAN --html
PLAN`` would overwrite the plan with the page; ``export CKPT --to CKPT`` would write into the checkpoint
it reads). :func:`write_file` / :func:`atomic_path` write to a temporary name in the same directory and
rename it over the target (``os.replace``), so a crash or a full disk leaves the old file or the new
one, never a torn one, and a failure is one line. Checkpoint directories have their own commit
protocol (:mod:`whalepy.runtime.commit`); the disk tier's files theirs (:mod:`whalepy.runtime._durable`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from whalepy.errors import ArgumentError, WhalepyError

__all__ = ["atomic_path", "check_output", "same_or_inside", "write_file"]

Pathish = str | os.PathLike[str]


def same_or_inside(a: Pathish, b: Pathish) -> bool:
    """Whether ``a`` is ``b`` or lies inside the directory ``b`` (symbolic links resolved)."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or rb in ra.parents


def check_output(path: Pathish, *, inputs: Iterable[Pathish | None] = (), what: str = "output",
                 directory: bool = False) -> Path:
    """``path`` as a :class:`Path` if whalepy can write it there (a file, or with ``directory`` a
    directory): :class:`ArgumentError` naming ``what`` and the fix otherwise."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ArgumentError(f"{what}: give a {'directory' if directory else 'file'} path, got "
                            f"{type(path).__name__} {path!r:.60}")
    p = Path(path)
    for given in inputs:
        if given is None:
            continue
        if same_or_inside(p, given) or (directory and same_or_inside(given, p)):
            raise ArgumentError(f"{what} {os.fspath(p)}: that is {'inside ' if Path(given).resolve() != p.resolve() else ''}"
                                f"the input {os.fspath(given)} of the same command, which writing would destroy; "
                                "give another path")
    if not directory and p.is_dir():
        raise ArgumentError(f"{what} {os.fspath(p)}: is a directory; give a file name inside it")
    if directory and p.exists() and not p.is_dir():
        raise ArgumentError(f"{what} {os.fspath(p)}: is a file; give a new or existing directory")
    parent = p.absolute().parent
    if directory:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    elif not parent.is_dir():
        raise ArgumentError(f"{what} {os.fspath(p)}: the directory {os.fspath(parent)} does not exist; create it "
                            "(mkdir -p) or write elsewhere")
    target = p if directory and p.is_dir() else parent
    try:  # a probe, not os.access: root passes os.access on a read-only file system
        fd, probe = tempfile.mkstemp(prefix=".whalepy-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ArgumentError(f"{what} {os.fspath(p)}: the directory {os.fspath(target)} is not writable "
                            f"({e.strerror or e}); write elsewhere") from None
    return p


@contextlib.contextmanager
def atomic_path(path: Pathish, *, inputs: Iterable[Pathish | None] = (), what: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that takes a file name (``savefig``,
    ``safetensors``'s ``save_file``); on success it is renamed over ``path``, on failure removed."""
    p = check_output(path, inputs=inputs, what=what)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, p)
    except OSError as e:
        raise WhalepyError(f"cannot write {what} {os.fspath(p)}: {e.strerror or e}; free space or write "
                           "elsewhere") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_file(path: Pathish, data: str | bytes, *, inputs: Iterable[Pathish | None] = (),
               what: str = "output", fsync: bool = False, mode: int | None = None) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically, after :func:`check_output`; ``fsync``
    also makes it durable before the rename; ``mode``: the file's permission bits (e.g. ``0o600``, a
    file only its owner may read), set on the temporary file before anything is written to it."""
    with atomic_path(path, inputs=inputs, what=what) as tmp:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with (os.fdopen(os.open(tmp, flags, mode), "wb") if mode is not None else open(tmp, "wb")) as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # the umask may have cleared bits of it; the exact bits asked
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return Path(path)
