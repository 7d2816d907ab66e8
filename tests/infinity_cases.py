"""Per-rank workers for the disk-tier tests (no tests here): ZeRO-Infinity layouts (parameters and / or
optimizer states in files) against the single-process run, and the bytes they hold against the memory
model.

Held bytes, measured in the third step (the staging pool is in its steady state):

- files: what the tier's files take on disk, read from the OS: the sizes (``stat``) of the named
  files in its directory plus those of the unlinked files still mapped by this process (the gradient
  files: ``/proc/self/maps`` entries under the directory marked ``(deleted)``, sized through
  ``/proc/self/map_files``). ``files`` is the peak over the step: sampled when the step starts (all
  gradients written) and after each block's write-back has landed (the I/O thread drained), the last
  sample being the end of the step (old and new generation, before the manifest commits);
  ``files_between`` after the step, once the manifest and the removal of the generation it superseded
  are done;
- host: the staging pool's buffers (:attr:`SwapEngine.staging_bytes`), plus every parameter,
  gradient and optimizer-state storage FSDP2 offloads to the host that is not homed in a file, and the
  host optimizer's fp32 masters, gradient buffers and states (ZeRO-Offload blocks, measured after its
  ``finish``);
- device: every other parameter / optimizer-state storage, and the gradients of device parameters.

Gradients are measured when the third step's optimizer step starts (they are freed during it);
parameters and states after it. On these CPU runs device and host are the same memory: the split
follows FSDP2's own record of what it offloaded, as in ``whalepy.runtime.held.held_state_bytes``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from whalepy.runtime.held import offloaded_params as _offloaded_params, storage_of as _storage
from runtime_cases import (
    Case, adamw, batches, build_model, case_profile, full_params, lm_loss, make_case_plan, reference_run)


_REFERENCES: dict[tuple, Any] = {}


def _reference(case: Case, data: list, max_grad_norm: float | None = None) -> Any:
    """The single-process run of ``case``'s model on ``data`` (cached: several cases share one); with
    ``max_grad_norm``, gradients clipped by ``torch.nn.utils.clip_grad_norm_`` before each step."""
    key = (case.kind, case.num_layers, case.global_batch, case.steps, max_grad_norm)
    if key not in _REFERENCES:
        if max_grad_norm is None:
            _REFERENCES[key] = reference_run(case.kind, data, case.num_layers)
        else:
            model = build_model(case.kind, case.num_layers)
            opt = adamw(model.parameters())
            losses = []
            for x, y in data:
                loss = lm_loss(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            _REFERENCES[key] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _REFERENCES[key]


def _mappings(directory: Any) -> list[tuple[int, int, int, int, bool]]:
    """``(start, end, inode, file size, shared)`` of this process's mappings of unlinked files under
    ``directory`` (read from ``/proc/self/maps`` and ``/proc/self/map_files``)."""
    prefix = os.fspath(directory) + "/"
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith(prefix) or not parts[5].rstrip().endswith("(deleted)"):
                continue
            st = os.stat(f"/proc/self/map_files/{parts[0]}")
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, st.st_ino, st.st_size, parts[1][3] == "s"))
    return out


def file_bytes(directory: Any) -> int:
    """Bytes the tier's files take: named files plus unlinked files still mapped (each inode once)."""
    from pathlib import Path

    named = sum(f.stat().st_size for f in Path(directory).glob("*.bin"))
    return named + sum({ino: size for _, _, ino, size, _ in _mappings(directory)}.values())


def grads_in_files(pm: Any) -> tuple[int, int]:
    """(gradients of the tier's file-homed parameters, how many of them lie in a shared mapping of a
    file under the tier's directory): read from the OS's maps, not from the tier's bookkeeping."""
    maps = [(lo, hi) for lo, hi, _, _, shared in _mappings(pm.nvme.directory) if shared]
    total = mapped = 0
    for fps in pm.nvme.grads._blocks.values():
        for fp in fps:
            g = fp.sharded_param.grad
            if g is None or g._local_tensor.numel() == 0:
                continue
            total += 1
            ptr = g._local_tensor.data_ptr()
            mapped += any(lo <= ptr < hi for lo, hi in maps)
    return total, mapped


def _held(pm: Any, grads: dict[str, int]) -> dict[str, int]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    modules = pm.module if isinstance(pm.module, list) else [pm.module]
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    offloaded = _offloaded_params(modules)
    opt = pm.optimizer.optim if isinstance(pm.optimizer, ZeroRedundancyOptimizer) else pm.optimizer
    nv = pm.nvme
    out = {"device": grads["device"], "host": grads["host"] + (nv.engine.staging_bytes if nv else 0),
           "files": grads.get("files_peak", 0), "files_between": file_bytes(nv.directory) if nv else 0}
    seen: set[int] = set()
    tensors = [(p, p) for p in params] + [(v, p) for p in params for v in opt.state.get(p, {}).values()
                                          if isinstance(v, torch.Tensor) and v.dim() > 0]
    for t, owner in tensors:
        ptr, nbytes = _storage(t)
        if ptr in seen or nbytes == 0:
            continue
        seen.add(ptr)
        if nv is not None and nv.is_mapped(t):
            continue  # homed in a file: counted by the files' sizes
        out["host" if id(owner) in offloaded else "device"] += nbytes
    # ZeRO-Offload blocks: fp32 masters, gradient buffers and optimizer states of the host optimizer
    for _, t in (pm.host_optimizer.held() if pm.host_optimizer is not None else ()):
        ptr, nbytes = _storage(t)
        if ptr not in seen and nbytes:
            seen.add(ptr)
            out["host"] += nbytes
    return out


def _grads(pm: Any) -> dict[str, int]:
    modules = pm.module if isinstance(pm.module, list) else [pm.module]
    offloaded = _offloaded_params(modules)
    out = {"device": 0, "host": 0}
    seen: set[int] = set()
    nv = pm.nvme
    for p in {id(p): p for m in modules for p in m.parameters()}.values():
        if p.grad is None or (nv is not None and nv.grads.is_file_grad(p)):
            continue  # file-mapped gradients: counted in the files' bytes
        ptr, nbytes = _storage(p.grad)
        if ptr not in seen:
            seen.add(ptr)
            out["host" if id(p) in offloaded else "device"] += nbytes
    return out


def predicted(case: Case, stage: Any) -> dict[str, float] | None:
    """The memory model's bytes for a rank of plan stage ``stage``, block by block with each block's
    tiers (:func:`estimate_stage_model_state_bytes`; one tier pair: :func:`estimate_model_state_bytes`),
    the disk tier's prefetch depth being that of its file-homed parameter blocks (one per stage); under
    TP each block's parameters per TP rank (:func:`~whalepy.ir.rules.tp_local_params`: the split ones
    divided by the degree, norms, position embeddings and row-parallel biases whole)."""
    from whalepy.cost_models.memory import estimate_stage_model_state_bytes
    from whalepy.ir.rules import tp_local_params

    prof = case_profile(case.kind, case.num_layers)
    depth = max((b.prefetch_depth for b in stage.blocks if b.param_tier.value == "nvme"), default=1)
    est = estimate_stage_model_state_bytes(
        blocks=[(tp_local_params(prof.block(b.name), case.tp), b.param_tier, b.optimizer_tier) for b in stage.blocks],
        zero_stage=case.zero, dp_degree=case.dp, tp_degree=case.tp, pp_degree=case.pp, precision="fp32",
        prefetch_depth=depth)
    return {"device": est.resident, "host": est.cpu, "files": est.nvme, "files_between": est.nvme_between_steps}


def infinity_case(case: Case, root: str) -> dict[str, Any]:
    """Per rank: train the reference and the lowered plan for ``case.steps`` steps; compare; measure."""
    from whalepy.runtime import parallelize

    import dataclasses

    check_accumulation = case.extra.get("check_accumulation", False)
    max_grad_norm = case.extra.get("max_grad_norm")
    case = dataclasses.replace(case, extra={k: v for k, v in case.extra.items()
                                            if k not in ("check_accumulation", "max_grad_norm")})
    data = batches(case.global_batch, case.steps)
    ref_losses, ref_params = _reference(case, data, max_grad_norm)
    nvme_dir = os.path.join(root, case.name.replace(" ", "_"))
    pm = parallelize(build_model(case.kind, case.num_layers), None, example_inputs=(data[0][0][:2],),
                     loss_fn=lm_loss, optimizer=adamw, global_batch=case.global_batch,
                     plan=make_case_plan(case), profile=case_profile(case.kind, case.num_layers),
                     nvme_dir=nvme_dir, max_grad_norm=max_grad_norm)
    seen: list[dict[str, int]] = []
    inner = pm.optimizer.step
    nv = pm.nvme
    samples: list[int] = []

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        seen.append(_grads(pm))
        if nv is not None:
            samples.clear()
            nv.engine.drain()
            samples.append(file_bytes(nv.directory))
            seen[-1]["grads_in_files"] = grads_in_files(pm)
        out = inner(*args, **kwargs)
        if nv is not None:
            seen[-1]["files_peak"] = max(samples)
        return out

    pm.optimizer.step = measured_step
    if nv is not None:
        release = nv.engine.release

        def sampled_release(index: int, *, dirty: bool = False) -> None:
            release(index, dirty=dirty)
            if dirty:  # this block's gradients are gone and its next generation has landed
                nv.engine.drain()
                samples.append(file_bytes(nv.directory))

        nv.engine.release = sampled_release
    losses = [pm.train_step(x, y).item() for x, y in data]
    if nv is not None:
        nv.engine.flush()  # the last manifest and the removal of the generation it superseded
    held = _held(pm, seen[-1])
    params = full_params(pm)
    directory = pm.nvme.directory if pm.nvme is not None else None
    out = {"name": case.name, "kind": pm.dp_kind.value, "held": held, "predicted": predicted(case, pm.meshes.stage),
           "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
           "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in params),
           "param_files": pm.nvme.param_nbytes if pm.nvme is not None else 0,
           "grads_in_files": seen[-1].get("grads_in_files", (0, 0)),
           "grad_norm": pm.last_grad_norm if max_grad_norm is not None else None}
    if check_accumulation:
        out["accumulated"] = accumulates_in_files(pm, *data[0])
    pm.close()
    out["removed"] = directory is None or not directory.exists()
    return out


def accumulates_in_files(pm: Any, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Two backwards without ``zero_grad`` (FSDP2 reduce-scatters after each): the second adds into the
    file-mapped gradients in place, so they hold exactly twice the first (the same fp32 arithmetic)."""
    (x,), y = pm._local_batch("train_step", (inputs,), targets)
    params = [fp.sharded_param for fps in pm.nvme.grads._blocks.values() for fp in fps]

    def backward() -> None:
        lm_loss(pm.module(x), y).backward()

    backward()
    first = {id(p): p.grad._local_tensor.clone() for p in params}
    ptrs = {id(p): p.grad._local_tensor.data_ptr() for p in params}
    backward()
    out = {"in_place": all(p.grad._local_tensor.data_ptr() == ptrs[id(p)] for p in params),
           "doubled": all(torch.equal(p.grad._local_tensor, 2 * first[id(p)]) for p in params),
           "files": grads_in_files(pm), "params": len(params)}
    pm.optimizer.zero_grad(set_to_none=True)
    return out


def restart_case(case: Case, root: str, split: int = 2) -> dict[str, Any]:
    """Per rank: train ``split`` steps with ``nvme_keep=True``, abandon the run (as a crash would: no
    close), start again from a differently initialised model on the same ``nvme_dir`` and train the
    rest: parameters and optimizer states come from the files of the last committed step."""
    from whalepy.runtime import parallelize

    data = batches(case.global_batch, case.steps)
    ref_losses, ref_params = _reference(case, data)
    nvme_dir = os.path.join(root, "restart-" + case.name.replace(" ", "_"))

    def launch(model: torch.nn.Module) -> Any:
        return parallelize(model, None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss, optimizer=adamw,
                           global_batch=case.global_batch, plan=make_case_plan(case),
                           profile=case_profile(case.kind, case.num_layers), nvme_dir=nvme_dir, nvme_keep=True)

    first = launch(build_model(case.kind, case.num_layers))
    losses = [first.train_step(x, y).item() for x, y in data[:split]]
    first.nvme.engine.flush()  # the step is committed; the process "dies" here
    torch.manual_seed(123)
    other = build_model(case.kind, case.num_layers)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    second = launch(other)
    resumed_at = second.nvme.engine.step_count
    losses += [second.train_step(x, y).item() for x, y in data[split:]]
    params = full_params(second)
    second.close()
    return {"name": "restart " + case.name, "resumed_at": resumed_at, "kept": os.path.isdir(nvme_dir),
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in params)}


def disk_full_case(case: Case, root: str) -> dict[str, Any]:
    """Per rank: every rank's disk tier, alone, fits the budget its file system is given
    (``WHALEPY_NVME_BUDGET_BYTES``: 1.5 times one rank's files at their peak, as the memory model
    predicts them); the ranks' files together do not. ``parallelize`` must refuse on every rank, before
    a file is written (the plan carries no costs, so it is the disk tier's own check at lowering, with
    the bytes it would write), and leave nothing under ``nvme_dir``."""
    from whalepy.errors import DiskSpaceError
    from whalepy.runtime import parallelize
    from whalepy.runtime.disk_space import BUDGET_ENV

    data = batches(case.global_batch, case.steps)
    plan = make_case_plan(case)
    one_rank = predicted(case, plan.stages[0])["files"]
    nvme_dir = os.path.join(root, "disk-full")
    os.environ[BUDGET_ENV] = str(int(1.5 * one_rank))
    error = None
    try:
        parallelize(build_model(case.kind, case.num_layers), None, example_inputs=(data[0][0][:2],),
                    loss_fn=lm_loss, optimizer=adamw, global_batch=case.global_batch, plan=plan,
                    profile=case_profile(case.kind, case.num_layers), nvme_dir=nvme_dir)
    except DiskSpaceError as e:
        error = str(e)
    finally:
        del os.environ[BUDGET_ENV]
    left = sorted(str(p) for p in Path(nvme_dir).rglob("*")) if os.path.exists(nvme_dir) else []
    return {"name": "disk full", "error": error, "one_rank": one_rank, "left": left}


def infinity_cases(cases: list[Any], root: str) -> list[dict[str, Any]]:
    """Each item: a :class:`Case` (:func:`infinity_case`), ``("restart", case)`` (:func:`restart_case`) or
    ``("disk full", case)`` (:func:`disk_full_case`)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    special = {"restart": restart_case, "disk full": disk_full_case}
    return [special[c[0]](c[1], root) if isinstance(c, tuple) else infinity_case(c, root) for c in cases]
