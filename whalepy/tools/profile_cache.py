"""The ``whalepy`` command's stored profiles of built-in models (``whalepy plan gpt3-175b ...``).

Capturing a built-in model costs about half of a plan's CPU time, most of it importing what
``torch.export`` needs (``torch._dynamo``); the profile it yields depends only on the inputs in
:func:`cache_key`. The command stores each profile it captured (without its ``GraphModule``, which does
not pickle) in :func:`cache_dir` and reads it back when every input is the same, so a later plan of the
same model imports neither ``torch.export`` nor torch itself (the planner does not need it).

Safety: a file is used only when the key stored inside it equals this run's key (the file name is its
hash), and only when this user owns it and no one else may write it (a pickle runs code as it loads);
anything else, or a file that does not read, is captured again and overwritten, with one line on
stderr. Files are written whole (a temporary file renamed), so a run stopped mid-write leaves no partial
file. Nothing is shipped or downloaded: the directory holds what this user's runs captured.
``--no-cache`` neither reads nor writes it. docs/planner.md, "Stored profiles".
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from whalepy.errors import WhalepyError
from whalepy.files import write_file

CACHE_FORMAT = 1
"""The stored entry's layout; raised when :class:`StoredProfile` or the pickled classes change in a way
the source digest would not show."""

CACHE_DIR_ENV = "WHALEPY_PROFILE_CACHE"
"""Environment variable naming the directory instead of :func:`cache_dir`'s default."""

_SOURCE_PACKAGES = ("whalepy.models", "whalepy.frontend", "whalepy.ir", "whalepy.passes", "whalepy.cost_models")
"""The packages whose code builds and captures a built-in model: a change to any of their files (or to
this module) is a new key."""


@dataclass(frozen=True, slots=True)
class StoredProfile:
    """What one file holds."""

    key: str
    """:func:`cache_key`'s text, compared whole on reading."""
    profile: Any
    """The :class:`~whalepy.ir.profile.ModelProfile`, ``graph=None``."""
    dynamo_supported: bool | None
    """``torch._dynamo.is_dynamo_supported()`` in the capturing process (the planner's ``compile="auto"``
    asks it; it depends on torch and Python, both in the key), None where dynamo was not loaded."""


def cache_dir() -> Path:
    """``$WHALEPY_PROFILE_CACHE``, else ``$XDG_CACHE_HOME/whalepy/profiles``, else
    ``~/.cache/whalepy/profiles`` (beside ``whalepy calibrate``'s device profiles)."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "whalepy" / "profiles"


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def source_digest() -> str:
    """SHA-256 over the files of :data:`_SOURCE_PACKAGES` and this module (paths and bytes)."""
    import importlib.util

    h = hashlib.sha256()
    roots = [Path(__file__)]
    for name in _SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        roots += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            h.update(f"{f.relative_to(root.parent) if root.is_dir() else f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(model: str, *, batch: int, seq_len: int | None) -> str:
    """Everything a built-in model's profile depends on, as JSON text: the name, batch and sequence length
    asked for (the model's defaults and configuration are in the source digest), torch's default dtype
    (the built-ins are built in it), the versions of whalepy, torch, transformers (the HF configs) and
    Python, and the capture code's own digest."""
    from whalepy import __version__

    torch = sys.modules.get("torch")  # a process that has not imported torch builds in its default, float32
    dtype = str(torch.get_default_dtype()).removeprefix("torch.") if torch is not None else "float32"
    return json.dumps({"format": CACHE_FORMAT, "model": model.strip().lower(), "batch": batch, "seq_len": seq_len,
                       "dtype": dtype, "whalepy": __version__, "torch": _version("torch"),
                       "transformers": _version("transformers"), "python": sys.version,
                       "source": source_digest()}, sort_keys=True)


def cache_path(key: str) -> Path:
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pkl"


def load_stored(key: str, note: Callable[[str], None]) -> StoredProfile | None:
    """The stored entry for ``key``, or None (absent, unreadable, or another key: ``note`` says why,
    and the caller captures again)."""
    from whalepy.ir.profile import ModelProfile

    path = cache_path(key)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
                # a pickle runs code as it loads: only a file this user wrote and no one else can change
                note(f"stored profile {path} is not yours alone (another owner, or writable by others); not "
                     "reading it, capturing again and replacing it")
                return None
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        note(f"stored profile {path} cannot be read ({e.strerror or e}); capturing again")
        return None
    try:
        entry = pickle.loads(data)
        ok = (isinstance(entry, StoredProfile) and entry.key == key and isinstance(entry.profile, ModelProfile))
    except Exception as e:  # noqa: BLE001 - any damage to the file (truncated, edited, an old class) is a miss
        note(f"stored profile {path} is damaged ({type(e).__name__}); capturing again and replacing it")
        return None
    if not ok:
        note(f"stored profile {path} holds another profile; capturing again and replacing it")
        return None
    return entry


def store(key: str, profile: Any, note: Callable[[str], None]) -> StoredProfile:
    """Write ``profile`` (without its graph) for ``key`` and return the entry; a directory that cannot be
    written is a note, not an error (the plan goes on)."""
    torch_dynamo = sys.modules.get("torch._dynamo")
    entry = StoredProfile(key=key, profile=replace(profile, graph=None),
                          dynamo_supported=bool(torch_dynamo.is_dynamo_supported()) if torch_dynamo else None)
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # only its owner may read or write it: a pickle runs code as it loads (load_stored checks the same)
        write_file(path, pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL), what="stored profile", mode=0o600)
    except (OSError, WhalepyError) as e:
        why = (e.strerror or e) if isinstance(e, OSError) else e
        note(f"could not store the profile in {path.parent} ({why}); the next run captures again "
             f"(set {CACHE_DIR_ENV} to a writable directory, or pass --no-cache)")
    return entry


__all__ = ["CACHE_DIR_ENV", "CACHE_FORMAT", "StoredProfile", "cache_dir", "cache_key", "cache_path", "load_stored",
           "source_digest", "store"]
