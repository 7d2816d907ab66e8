"""The rest of a training job's state, next to model and optimizer in a checkpoint: the step count, the
LR schedulers, the random number generators of every rank and the data loader's position.

It goes into the DCP directory under one top-level key, :data:`JOB_KEY`, as opaque byte entries (DCP
writes a non-tensor value with ``torch.save`` and reads it back with ``torch.load``):

- ``JOB_KEY.common``: what every rank holds alike (written once): the step and the first LR
  scheduler's ``state_dict()`` (every optimizer of the rank gets the same schedule from the same
  factory, so one state restores all of them, under any plan);
- ``JOB_KEY.rank<r>``: rank ``r``'s own: its CPU and device RNG states, Python's ``random`` state and
  its loader's ``state_dict()``.

A checkpoint loaded under another number of ranks gives a rank without its own entry rank 0's
(rank 0 runs the first pipeline stage, so it reads data; a :class:`~whalepy.runtime.data.ShardedBatchSampler`
position is the same on every rank); its RNG then continues from rank 0's, which is said once.
"""

from __future__ import annotations

import io
import logging
import random
from typing import Any

import torch
import torch.distributed as dist

from whalepy.errors import ArgumentError
from whalepy.log import warn_once

__all__ = ["JOB_KEY", "check_loader", "job_state", "job_template", "restore_job_state"]

JOB_KEY = "whalepy_job"

log = logging.getLogger("whalepy.runtime")


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def check_loader(loader: Any, where: str) -> None:
    """A loader whose position can be saved: it has ``state_dict()`` and ``load_state_dict()``."""
    if loader is None:
        return
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise ArgumentError(
            f"{where}(loader=...) got a {type(loader).__name__} without state_dict() / load_state_dict(), so its "
            "position cannot be saved; pass pm.batch_sampler(dataset) (or a DataLoader built on it: pass the "
            "sampler), torchdata's StatefulDataLoader, or any object with those two methods")


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def job_state(*, step: int, schedulers: list[Any], loader: Any, device: torch.device) -> dict[str, Any]:
    """``{JOB_KEY: {...}}`` of this rank, to save next to model and optimizer."""
    common = {"step": step, "scheduler": schedulers[0].state_dict() if schedulers else None}
    own = {"rng": rng_state(device), "loader": loader.state_dict() if loader is not None else None}
    return {JOB_KEY: {"common": _pack(common), f"rank{dist.get_rank()}": _pack(own)}}


def job_template(saved_keys: set[str]) -> dict[str, Any]:
    """What this rank reads of :data:`JOB_KEY` from a checkpoint with ``saved_keys`` (DCP's flattened
    names); ``{}`` for a checkpoint written before whalepy saved it."""
    if f"{JOB_KEY}.common" not in saved_keys:
        return {}
    mine = f"rank{dist.get_rank()}"
    own = mine if f"{JOB_KEY}.{mine}" in saved_keys else "rank0"
    return {JOB_KEY: {"common": b"", own: b""}}


def restore_job_state(loaded: dict[str, Any], *, schedulers: list[Any], loader: Any, device: torch.device,
                      source: str) -> int | None:
    """Apply what :func:`job_template` read; the saved step, or None when the checkpoint has no job
    state (then schedulers, RNG and loader keep theirs, said once)."""
    job = loaded.get(JOB_KEY)
    if not job:
        warn_once(f"no-job-state-{source}", "whalepy: %s holds no step, LR scheduler, RNG or data position "
                  "(written by an older whalepy): model and optimizer are restored, the rest starts afresh",
                  source, log=log)
        return None
    common = _unpack(job["common"])
    for s in schedulers:
        if common["scheduler"] is not None:
            s.load_state_dict(common["scheduler"])
    (key, blob), = ((k, v) for k, v in job.items() if k != "common")
    own = _unpack(blob)
    if key != f"rank{dist.get_rank()}":
        warn_once(f"rng-from-rank0-{source}", "whalepy: %s was written by fewer ranks; ranks without their own "
                  "RNG and loader state take rank 0's", source, log=log)
    set_rng_state(own["rng"], device)
    if loader is not None:
        if own["loader"] is None:
            warn_once(f"no-loader-state-{source}", "whalepy: %s holds no loader position (saved without "
                      "loader=...): the loader starts from its beginning", source, log=log)
        else:
            loader.load_state_dict(own["loader"])
    return int(common["step"])
