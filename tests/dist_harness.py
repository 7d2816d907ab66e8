"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters (the ``spawn``
start method, so ``fn`` and its arguments must be picklable: a module-level function), initialises the
default process group over a ``FileStore`` in a temporary directory (no ports to race for), sets the
torchrun environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) so code
under test sees an ordinary launch, calls ``fn(*args)`` and sends its return value back. The result is
the list of return values in rank order. If any rank raises, :class:`DistributedTestError` is raised
with that rank's traceback; if the run outlasts ``timeout`` seconds, every process is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(RuntimeError):
    """A rank raised, died or timed out; the message carries the rank's traceback."""


def _worker(rank: int, world_size: int, store_path: str, fn: Callable[..., Any], args: tuple,
            results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )
    import faulthandler

    faulthandler.enable(all_threads=True)  # a rank killed by a signal (a native crash) prints its stacks
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            value = fn(*args)
        finally:
            try:
                dist.barrier()
            except Exception:  # a peer already failed; its error is the one to report
                pass
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 180.0, preload: tuple[str, ...] = ()) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.
    ``preload``: modules imported once by a fork server that forks the ranks (for tests that start
    many short jobs: the ranks skip importing torch and whalepy); default a fresh interpreter each."""
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="whalepy-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        failure: tuple[int, str] | None = None
        try:
            while len(got) < world_size and failure is None:
                try:
                    rank, ok, value = results.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        failure = (-1, f"timed out after {timeout:.0f} s; finished ranks {sorted(got)}")
                    else:
                        dead = [i for i, p in enumerate(procs)
                                if p.exitcode not in (None, 0) and i not in got]
                        if dead:
                            # give a crashing rank's own report a moment to arrive first
                            try:
                                rank, ok, value = results.get(timeout=2.0)
                            except queue.Empty:
                                failure = (dead[0], f"exited with code {procs[dead[0]].exitcode}")
                                continue
                        else:
                            continue
                if failure is None:
                    if ok:
                        got[rank] = value
                    else:
                        failure = (rank, value)
        finally:
            for p in procs:
                p.join(timeout=5 if failure is None else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    if failure is not None:
        rank, text = failure
        raise DistributedTestError(f"rank {rank} failed:\n{text}")
    return [got[r] for r in range(world_size)]
