"""A user error inside a distributed launch: one line, printed once, and every rank exits promptly.

Without this, a whalepy error raised on every rank prints a traceback per rank, and an error on one rank
leaves its peers blocked in a collective until they time out (or fail with a gloo / NCCL error of their
own, another traceback each). :func:`install_error_hook` (called when whalepy is imported
under a launch, and again by ``parallelize`` after ``init_process_group`` has wrapped it in torch's own
hook) sets a ``sys.excepthook`` that, for an uncaught :class:`~whalepy.WhalepyError`:

1. counts the failure in the job's c10d store (the store torchrun's agent or the user's
   ``init_process_group`` set up, which outlives any one rank);
2. prints ``whalepy: error (rank R): <message>`` only if it is the first failure of the job;
3. exits the process with code 1 at once (``os._exit``: no waiting on peers in ``destroy_process_group``
   or in atexit handlers), after removing the directories registered with :func:`remove_at_exit` (the
   disk tier's files, which an atexit handler would otherwise have removed).

A peer blocked in a collective then sees its connection close; its own exception, raised after the store
already records a failure, is the consequence of that failure and exits quietly with code 1. Any other
exception is printed by the previous hook as usual (a bug in user code keeps its traceback), and still
counted, so its peers exit quietly too.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any

from whalepy.errors import WhalepyError

__all__ = ["install_error_hook", "remove_at_exit", "report_failure"]

_KEY = "whalepy/failures"
_REMOVE: list[str] = []


def remove_at_exit(path: str | os.PathLike[str]) -> None:
    """Remove the directory ``path`` when the interpreter exits, and also when this hook ends the process
    with ``os._exit`` (which skips atexit handlers)."""
    import atexit
    import shutil

    _REMOVE.append(os.fspath(path))
    atexit.register(shutil.rmtree, os.fspath(path), ignore_errors=True)


def _store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no store: every failing rank prints (still one line each)
        return None


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def report_failure() -> int:
    """Count this rank's failure in the job's store; the number of failures so far (1: the first), or 1
    when there is no store to ask."""
    store = _store()
    if store is None:
        return 1
    try:
        return int(store.add(_KEY, 1))
    except Exception:  # noqa: BLE001 - the store's host is gone: report as if first
        return 1


def _failed_before() -> bool:
    store = _store()
    if store is None:
        return False
    try:
        return bool(store.check([_KEY]))
    except Exception:  # noqa: BLE001 - the store's host is gone: a rank has failed
        return True


def _exit(code: int) -> None:
    import shutil

    for path in _REMOVE:
        shutil.rmtree(path, ignore_errors=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
            pass
    os._exit(code)


_active = False
"""True while the outermost whalepy hook runs (an inner one, reached through torch's own hook, defers)."""


def _hook(previous: Any) -> Any:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        global _active
        if _active or issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
            return
        _active = True
        if issubclass(exc_type, WhalepyError):
            if report_failure() == 1:
                # sys.__stderr__: torch's own excepthook swaps sys.stderr for a buffer around its inner hook
                print(f"whalepy: error (rank {_rank()}): {exc}", file=sys.__stderr__)
            _exit(1)
        if _failed_before():
            _exit(1)  # a consequence of a peer's failure, which has been printed
        report_failure()
        previous(exc_type, exc, tb)
        if sys.excepthook is hook:
            _exit(1)
        # inside torch's hook (the user called init_process_group after importing whalepy): it prints
        # what ``previous`` wrote to its buffer once we return, so no os._exit here

    hook._whalepy = True  # type: ignore[attr-defined]
    return hook


def install_error_hook() -> None:
    """Make the whalepy hook the outermost ``sys.excepthook``. Call it again after
    ``init_process_group``, which wraps the hook in torch's own (that one prefixes each line with the
    rank and buffers stderr, which would swallow a traceback printed before ``os._exit``)."""
    if getattr(sys.excepthook, "_whalepy", False):
        return
    sys.excepthook = _hook(sys.excepthook)
