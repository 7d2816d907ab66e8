"""Per-rank worker of the checkpoint crash test (tests/test_checkpoint_faults.py; no tests here).

One job = 4 gloo ranks training the 2-layer GPT of ``runtime_cases`` (ZeRO-3, dp 4). A job resumes from
a checkpoint (or, when the test expects that checkpoint to be refused as incomplete, checks the refusal
names the last complete one and resumes from that), trains two steps and writes their losses, then
saves with ``WHALEPY_FAULT_KILL`` set, so one rank or every rank ``SIGKILL``-s itself at a point inside
``pm.save`` (whalepy/runtime/commit.py). The next job finds what that crash left. Step ``k`` always
trains on batch ``k``, so the losses of a resumed job equal those of the uninterrupted run only if it
loaded exactly the state saved at the step the test expects."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from runtime_cases import Case, adamw, batches, build_model, case_profile, lm_loss, make_case_plan

GLOBAL_BATCH = 8
STEPS = 8
CASE = Case("faults", dp=4, zero=3, global_batch=GLOBAL_BATCH)


def setup() -> tuple[Any, Any]:
    """The plan and the profile, made once in the test process and handed to every job (no rank
    captures the model)."""
    import dataclasses

    # without the captured graph, which does not survive pickling into a fresh interpreter
    return make_case_plan(CASE), dataclasses.replace(case_profile("gpt"), graph=None)


def _build(setup: tuple[Any, Any]) -> Any:
    from whalepy.runtime import parallelize

    plan, profile = setup
    data = batches(GLOBAL_BATCH, STEPS)
    pm = parallelize(build_model("gpt"), None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
                     optimizer=adamw, global_batch=GLOBAL_BATCH, plan=plan, profile=profile)
    return pm, data


def _write(root: str, name: str, value: Any) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(root, name).write_text(json.dumps(value))


def reference_then_crash(setup: tuple[Any, Any], root: str, target: str, kill: str) -> None:
    """The uninterrupted run: ``STEPS`` steps, their losses written; ``same`` is saved at step 2 (saving
    changes nothing); then a save into ``target`` dies at ``kill``."""
    pm, data = _build(setup)
    losses = []
    for step, (x, y) in enumerate(data):
        if step == 2:
            pm.save(Path(root, "same"))
        losses.append(pm.train_step(x, y).item())
    _write(root, "straight.json", losses)
    _crash(pm, root, target, kill)


def _crash(pm: Any, root: str, target: str, kill: str) -> None:
    os.environ["WHALEPY_FAULT_KILL"] = kill
    pm.save(Path(root, target))
    raise AssertionError(f"pm.save survived the kill at {kill}")


def resume_then_crash(setup: tuple[Any, Any], root: str, load: str, fallback: str | None, step: int, target: str,
                      kill: str, corrupt: bool = False) -> None:
    """Load ``load`` (expected to be refused naming ``fallback`` when that is given; then load
    ``fallback``), which holds the state after ``step`` steps; train steps ``step`` and ``step + 1``;
    write their losses (``corrupt``: then check that a corrupted copy of ``load`` is refused and that
    ``load`` loads again); save into ``target`` and die at ``kill`` (``POINT`` or ``POINT@RANK``)."""
    from whalepy import WhalepyError

    pm, data = _build(setup)
    if fallback is not None:
        try:
            pm.load(Path(root, load))
        except WhalepyError as e:
            refusal = str(e)
        else:
            raise AssertionError(f"{load} loaded, but the save into it was killed before its commit")
        assert "\n" not in refusal and "not a complete checkpoint" in refusal, refusal
        assert str(Path(root, fallback)) in refusal, refusal
        load = fallback
    pm.load(Path(root, load))
    _write(root, f"losses-{step}-{load}-{kill}.json", [pm.train_step(*data[k]).item() for k in (step, step + 1)])
    if corrupt:
        _check_corruption(pm, root, load)
    _crash(pm, root, target, kill)


def _check_corruption(pm: Any, root: str, load: str) -> None:
    """A copy of ``load`` with 64 KiB of one data file overwritten (same size) is refused; ``load``
    itself still loads."""
    import torch.distributed as dist

    from whalepy import WhalepyError

    from whalepy.runtime.commit import resolve

    bad = Path(root, "corrupted")
    if dist.get_rank() == 0:
        shutil.copytree(resolve(Path(root, load)), bad)
        data_file = sorted(bad.glob("*.distcp"))[-1]
        size = data_file.stat().st_size
        n = min(65536, size // 2)
        with open(data_file, "r+b") as f:
            f.seek(size // 4)
            f.write(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.uint8).numpy().tobytes())
    dist.barrier()
    try:
        pm.load(bad)
    except WhalepyError as e:
        assert "\n" not in str(e) and "corrupted" in str(e) and "SHA-256" in str(e), str(e)
    else:
        raise AssertionError("a corrupted checkpoint loaded")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(bad)
    pm.load(Path(root, load))
