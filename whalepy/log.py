"""whalepy's logger: messages a user should see by default, printed once per job.

- :data:`logger` is ``logging.getLogger("whalepy")``. Unless the application configures logging itself
  (a handler on the root logger or on ``"whalepy"``), whalepy's INFO and above go to stderr, one plain
  line each, so a script that never touches :mod:`logging` still sees the plan it runs and its step
  reports. Once the root logger has a handler, the records go there instead (no line twice). Quiet
  it with ``logging.getLogger("whalepy").setLevel(logging.WARNING)``.
- :func:`warn_once` emits a warning once per job: only on global rank 0 of a distributed launch (every
  rank would print the same line; before the process group exists, the launcher's ``RANK``), and only
  the first time its key is seen in the process (a warning
  about a layout is raised per block, per stage or per step otherwise).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["info_once", "is_rank0", "log_once_at", "logger", "warn_once"]

logger = logging.getLogger("whalepy")


class _DefaultHandler(logging.StreamHandler):
    """stderr, used only while the application has configured no handler of its own."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application logs: the record propagates to its handlers
        self.stream = sys.stderr  # follow redirections (pytest's capture, contextlib.redirect_stderr)
        super().emit(record)


if not any(isinstance(h, _DefaultHandler) for h in logger.handlers):
    logger.addHandler(_DefaultHandler())
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)

_seen: set[str] = set()


def is_rank0() -> bool:
    """True outside a distributed run, and on global rank 0 inside one."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a core dependency
        return True
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    # inside a launch whose process group is not made yet (a script's set-up): the launcher's rank
    return os.environ.get("RANK", "0") == "0"


def _once(level: int, key: str, msg: str, *args: object, log: logging.Logger | None = None) -> bool:
    if key in _seen or not is_rank0():
        return False
    _seen.add(key)
    (log or logger).log(level, msg, *args)
    return True


def log_once_at(level: int, key: str, msg: str, *args: object, log: logging.Logger | None = None) -> bool:
    """As :func:`warn_once`, at ``level``."""
    return _once(level, key, msg, *args, log=log)


def warn_once(key: str, msg: str, *args: object, log: logging.Logger | None = None) -> bool:
    """Log ``msg % args`` as a warning the first time ``key`` is seen, on rank 0 only; True if it was
    logged."""
    return _once(logging.WARNING, key, msg, *args, log=log)


def info_once(key: str, msg: str, *args: object, log: logging.Logger | None = None) -> bool:
    """As :func:`warn_once`, at INFO level."""
    return _once(logging.INFO, key, msg, *args, log=log)
