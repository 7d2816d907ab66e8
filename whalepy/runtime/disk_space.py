"""Room for the disk tier: the files of every rank that writes on one file system, summed, against its
free space, before anything is written; and a full disk met during a step as a clear error.

Each rank's disk tier (:mod:`whalepy.runtime.nvme`) writes its own directory under ``nvme_dir``, but the
ranks of a node usually point ``nvme_dir`` at the same drive, so a check of one rank's files against
the free space passes on every rank while their sum does not fit (the run then fails at its first
step with ``ENOSPC``). :func:`check_disk_tier_space` is collective: every rank gathers every rank's
``(host, st_dev of nvme_dir, bytes at the files' peak, free bytes, reserve)``
(``dist.all_gather_object``), groups the ranks whose directories lie on one file system of one host,
and compares each group's summed peak with the group's free space less the reserve
(:func:`whalepy.cost_models.offload.disk_reserve_bytes`, a share of the file system's size), and with
the budget ``WHALEPY_NVME_BUDGET_BYTES`` where it is set (the most the tier's files of all ranks may
take on one file system: a drive shared with other jobs). Every rank sees the same shares, so every
rank raises the same :class:`~whalepy.errors.DiskSpaceError` when a group does not fit.

A peer process may still fill the disk during the run: :func:`disk_full_error` turns the ``OSError``
(``ENOSPC`` / ``EDQUOT``) of a write into a :class:`~whalepy.errors.DiskSpaceError` naming the file; the
swap engine then removes the tier's files on its way out (:meth:`whalepy.runtime._swap.SwapEngine.abort`).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whalepy.cost_models.offload import DISK_RESERVE_FRACTION, disk_reserve_bytes
from whalepy.errors import ArgumentError, DiskSpaceError
from whalepy.ir.plan import Plan, StagePlan
from whalepy.ir.types import Tier

__all__ = ["BUDGET_ENV", "DiskShare", "check_disk_tier_space", "check_plan_disk_space", "disk_full_error",
           "is_disk_full", "local_share", "plan_has_disk_tier", "shortfall", "stage_has_disk_tier"]

BUDGET_ENV = "WHALEPY_NVME_BUDGET_BYTES"
"""Environment variable: the most bytes the disk tier's files of all ranks may take on one file system
(unset: its free space less the reserve is the only limit)."""

_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class DiskShare:
    """What one rank asks of the file system under its ``nvme_dir``."""

    rank: int
    host: str
    device: int
    """``st_dev`` of ``nvme_dir`` (of its nearest existing parent when not created yet)."""
    path: str
    needed: float
    """Bytes of the rank's disk-tier files at their peak (while a step writes)."""
    free: int
    reserve: float
    budget: float | None = None
    """:data:`BUDGET_ENV` on this rank, or None."""


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _budget() -> float | None:
    value = os.environ.get(BUDGET_ENV)
    if value is None:
        return None
    try:
        budget = int(value)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ArgumentError(f"{BUDGET_ENV}={value!r}: give the most bytes the disk tier's files may take on "
                            f"one file system as a whole number >= 0 (e.g. {BUDGET_ENV}={100 * 2**30} for 100 "
                            "GiB), or unset it to use the free space")
    return float(budget)


def local_share(nvme_dir: str | os.PathLike[str] | None, needed: float, *, rank: int = 0) -> DiskShare:
    """This rank's :class:`DiskShare` for ``needed`` bytes under ``nvme_dir`` (default: the temporary
    directory, as :func:`whalepy.runtime.nvme.default_nvme_dir`)."""
    path = Path(nvme_dir) if nvme_dir is not None else Path(tempfile.gettempdir())
    existing = _existing(path)
    usage = shutil.disk_usage(existing)
    return DiskShare(rank=rank, host=socket.gethostname(), device=os.stat(existing).st_dev, path=os.fspath(path),
                     needed=float(needed), free=int(usage.free), reserve=disk_reserve_bytes(usage.total),
                     budget=_budget())


def _gather(share: DiskShare) -> list[DiskShare]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [share]
    if dist.get_backend() == "fake":  # whalepy check: one process stands for one rank; nothing to gather
        return [share]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, share)
    return out


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ranks(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return "ranks " + ", ".join(map(str, rs[:8])) + (", ..." if len(rs) > 8 else "")


def shortfall(shares: Sequence[DiskShare]) -> str | None:
    """The message for the first file system (in rank order) whose ranks' files, summed, exceed its free
    space less the reserve, or the budget; None when every one holds them. Ranks needing nothing count
    for nothing."""
    groups: dict[tuple[str, int], list[DiskShare]] = {}
    for s in sorted(shares, key=lambda s: s.rank):
        groups.setdefault((s.host, s.device), []).append(s)
    short = []
    for (host, _), members in groups.items():
        writers = [s for s in members if s.needed > 0]
        need = sum(s.needed for s in writers)
        free = min(s.free for s in members)
        reserve = max(s.reserve for s in members)
        budget = min((s.budget for s in members if s.budget is not None), default=None)
        if writers and (need > free - reserve or (budget is not None and need > budget)):
            short.append((host, writers, need, free, reserve, budget))
    if not short:
        return None
    host, writers, need, free, reserve, budget = short[0]
    paths = sorted({s.path for s in writers})
    each = (f"{_size(writers[0].needed)} each" if all(s.needed == writers[0].needed for s in writers)
            else f"up to {_size(max(s.needed for s in writers))} per rank")
    others = f" (and {len(short) - 1} other file system(s) short as well)" if len(short) > 1 else ""
    fix = ""
    if budget is not None and budget < free - reserve:
        room = f"{BUDGET_ENV} allows {_size(budget)} there ({_size(free)} free)"
        fix = f"raise {BUDGET_ENV}, "
    else:
        room = (f"it has {_size(free)} free, less a reserve of {_size(reserve)} ({DISK_RESERVE_FRACTION:.0%} of "
                "the file system)")
    return (f"nvme_dir {paths[0]!r}{' and others' if len(paths) > 1 else ''} on host {host!r}: the disk tier's "
            f"files of {_ranks([s.rank for s in writers])} (one file system) need {_size(need)} at their peak "
            f"while a step writes ({each}), but {room}{others}. To fit: {fix}pass "
            "parallelize(..., nvme_dir=...) a directory on a drive with more room, run fewer ranks per node, or "
            "put fewer blocks on 'nvme' (their param_tier / optimizer_tier 'cpu')")


def check_disk_tier_space(nvme_dir: str | os.PathLike[str] | None, needed: float, *, rank: int = 0) -> None:
    """Collective (every rank of the default process group calls it, ``needed`` 0 where the rank has no
    disk tier): :class:`DiskSpaceError` on every rank when the ranks sharing a file system do not fit in
    it (:func:`shortfall`). Reads the file system only; creates nothing."""
    message = shortfall(_gather(local_share(nvme_dir, needed, rank=rank)))
    if message is not None:
        raise DiskSpaceError(message)


def stage_has_disk_tier(stage: StagePlan) -> bool:
    """Whether a block of ``stage`` keeps parameters or optimizer states in files."""
    return any(Tier.NVME in (b.param_tier, b.optimizer_tier) for b in stage.blocks)


def plan_has_disk_tier(plan: Plan) -> bool:
    return any(stage_has_disk_tier(st) for st in plan.stages)


def check_plan_disk_space(plan: Plan, rank: int, nvme_dir: str | os.PathLike[str] | None) -> None:
    """Before lowering (collective when the plan has a disk tier): :func:`check_disk_tier_space` with the
    plan's ``StageCost.nvme_state_bytes`` (the files' peak, which the runtime holds exactly: ``whalepy
    check``) of each rank's stage. The disk tier checks again with the bytes it is about to write."""
    if not plan_has_disk_tier(plan):
        return
    mine = next(st for st in plan.stages if rank in st.all_ranks)
    check_disk_tier_space(nvme_dir, mine.cost.nvme_state_bytes if stage_has_disk_tier(mine) else 0.0, rank=rank)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found the file system (or the user's quota) full."""
    return isinstance(exc, OSError) and not isinstance(exc, DiskSpaceError) and exc.errno in _FULL


def disk_full_error(path: str | os.PathLike[str], exc: OSError, nbytes: int | None = None) -> DiskSpaceError:
    """The :class:`DiskSpaceError` of a disk-tier write of ``path`` that failed with ``exc`` (``ENOSPC`` /
    ``EDQUOT``): another process filled the file system after the check before training."""
    what = f" ({_size(nbytes)})" if nbytes is not None else ""
    try:
        free = f"{_size(shutil.disk_usage(_existing(Path(path).parent)).free)} free now"
    except OSError:
        free = "its free space unknown"
    err = DiskSpaceError(f"the disk tier could not write {os.fspath(path)!r}{what}: {exc.strerror or exc} "
                         f"({free}); something else filled the file system after the check before "
                         "training. The tier's files are removed (with nvme_keep=True the last committed step stays); free "
                         "space there, or pass "
                         "parallelize(..., nvme_dir=...) a directory on a drive with more room, and start again")
    err.errno = exc.errno
    return err
