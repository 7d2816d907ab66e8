"""Periodic checkpoints of a training job, the last ``keep`` of them kept, and resuming from the newest.

::

    ckpt = Checkpointer(pm, "ckpt", every=100, keep=3, loader=loader)
    start = ckpt.resume()                 # the newest complete checkpoint's step, or 0
    for step in range(start, total_steps):
        pm.train_step(*next(batches))
        ckpt.step()                       # saves ckpt/step-00000100, ... every 100 steps

Each checkpoint is a :meth:`~whalepy.ParallelModel.save` directory ``step-<8 digits>`` (model, optimizer,
step, LR schedulers, RNG states, the loader's position). A directory counts once DCP has written its
``.metadata``, which DCP writes last, after every rank's data files; a job killed during a save leaves a
directory without it, which :meth:`Checkpointer.resume` skips and the next save of that step replaces.
Older complete directories beyond ``keep`` are removed by rank 0 once a newer one is complete (with
``async_save``, when the next save or :meth:`Checkpointer.close` has waited for it: while a save is
in flight, ``keep`` complete ones and it are on disk).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from whalepy.errors import ArgumentError

__all__ = ["Checkpointer", "complete_checkpoints"]

_NAME = re.compile(r"^step-(\d{8,})$")


def complete_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / ".metadata").is_file()]
    return sorted(found)


class Checkpointer:
    """Save ``pm`` every ``every`` steps under ``directory``, keeping the newest ``keep``."""

    def __init__(self, pm: Any, directory: str | os.PathLike[str], *, every: int, keep: int = 3,
                 loader: Any = None, async_save: bool = False) -> None:
        from whalepy.runtime._train_state import check_loader

        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"Checkpointer({name}={value!r:.40}): give an integer >= 1")
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ArgumentError(f"Checkpointer(directory={directory!r:.60}): give a directory path")
        check_loader(loader, "Checkpointer")
        self.pm, self.directory, self.every, self.keep = pm, Path(directory), every, keep
        self.loader, self.async_save = loader, async_save

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def resume(self) -> int:
        """Load the newest complete checkpoint (model, optimizer, step, schedulers, RNG, loader); its
        step, or 0 when there is none (the job starts afresh)."""
        found = complete_checkpoints(self.directory)
        if not found:
            return 0
        step, path = found[-1]
        self.pm.load(path, loader=self.loader)
        return step

    def step(self) -> Path | None:
        """After a training step: save when ``pm.step`` is a multiple of ``every``; the path, else None."""
        if self.pm.step % self.every:
            return None
        return self.save()

    def save(self) -> Path:
        """Save now (at ``pm.step``), then prune what earlier saves made obsolete."""
        path = self.path(self.pm.step)
        if self.async_save:
            self._prune()  # waits for the previous save, which then counts among the ones kept
        self.pm.save(path, loader=self.loader, async_save=self.async_save)
        if not self.async_save:
            self._prune()
        return path

    def close(self) -> None:
        """Wait for an asynchronous save, then prune."""
        self.pm.wait_for_save()
        self._prune()

    def _prune(self) -> None:
        """Remove complete checkpoints beyond the newest ``keep`` (rank 0, after every rank's files are
        written: the barrier), and nothing that is not complete."""
        self.pm.wait_for_save()
        dist.barrier()
        if dist.get_rank() == 0:
            for _, old in complete_checkpoints(self.directory)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()  # no rank looks at the directory while rank 0 removes
