"""Per-rank workers for the memory-centric tiling tests (no tests here): tiled ZeRO-3 plans against
the single-process untiled run, the FSDP2 units gathered during forward, checkpoints between tiled and
untiled plans, and the refusals."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from runtime_cases import (
    Case, adamw, batches, build_model, case_profile, lm_loss, make_case_plan, reference_run, train_single)


_REFERENCES: dict[tuple, Any] = {}


def _reference(case: Case, steps: int) -> Any:
    """The single-process untiled run of ``case``'s model on its first ``steps`` batches (cached: the
    cases of one launch share it)."""
    key = (case.kind, case.num_layers, case.global_batch, steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(case.kind, batches(case.global_batch, case.steps)[:steps],
                                         case.num_layers)
    return _REFERENCES[key]


def tiled_plan(case: Case, tiles: int, **fields: Any) -> Any:
    """``case``'s plan with ``tiles`` on every block with linears or embeddings (tied ones too: the
    runtime refuses those) and the other ``fields`` on every block (``dataclasses.replace`` of the
    BlockPlans)."""
    plan = make_case_plan(case)
    prof = case_profile(case.kind, case.num_layers)
    has = {b.name for b in prof.blocks if b.largest_linear_params}
    stages = tuple(dataclasses.replace(s, blocks=tuple(
        dataclasses.replace(b, tiles=tiles if b.name in has else 1, **fields) for b in s.blocks))
        for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def _launch(case: Case, plan: Any, data: list, *, model: Any = None, **kwargs: Any) -> Any:
    from whalepy.runtime import parallelize

    return parallelize(model if model is not None else build_model(case.kind, case.num_layers), None,
                       example_inputs=(data[0][0][:2],), loss_fn=lm_loss, optimizer=adamw,
                       global_batch=case.global_batch, plan=plan,
                       profile=case_profile(case.kind, case.num_layers), **kwargs)


def _errors(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    if set(full) != set(ref):  # the original names, every one of them
        raise AssertionError(f"state dict keys differ: {sorted(set(full) ^ set(ref))[:4]}")
    return max((full[k] - ref[k]).abs().max().item() for k in ref)


def _watch_units(module: Any) -> tuple[list, list]:
    """Record, at every FSDP2 unit's forward (after FSDP2's own pre-forward gathered it), the unit's
    name, its unsharded parameter count and the parameters of all units unsharded at that moment."""
    from torch.distributed.fsdp import FSDPModule

    roots = module if isinstance(module, list) else [module]  # pipeline stages
    units = [(n, m) for root in roots for n, m in root.named_modules() if isinstance(m, FSDPModule)]

    def group(m: Any) -> Any:
        return m._get_fsdp_state()._fsdp_param_group

    def numel(m: Any) -> int:
        g = group(m)
        return sum(fp._orig_size.numel() for fp in g.fsdp_params) if g is not None else 0

    records: list[tuple[str, int, int]] = []
    handles = []
    for name, m in units:
        def hook(mod: Any, args: Any, name: str = name) -> None:
            together = sum(numel(u) for _, u in units if group(u) is not None and group(u).is_unsharded)
            records.append((name, numel(mod), together))
        handles.append(m.register_forward_pre_hook(hook))
    return records, handles


def tiled_run(case: Case, tiles: int, fields: dict[str, Any], root: str = "") -> dict[str, Any]:
    """Train ``case`` tiled for ``case.steps`` steps; errors against the untiled single process run (on
    rank 0), the units gathered during the first forward."""
    data = batches(case.global_batch, case.steps)
    ref_losses, ref_params = _reference(case, case.steps)
    kwargs = {"nvme_dir": os.path.join(root, case.name.replace(" ", "_"))} if root else {}
    pm = _launch(case, tiled_plan(case, tiles, **fields), data, **kwargs)
    records, handles = _watch_units(pm.module)
    losses = [pm.train_step(x, y).item() for x, y in data]
    for h in handles:
        h.remove()
    full = pm.full_state_dict()
    out = {"name": case.name, "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
           "param_err": _errors(full, ref_params) if full else None, "units": records[:40],
           "kind": pm.dp_kind.value, "tiles_in_nvme": _tile_params_in_nvme(pm), "prefetch": _prefetch(pm)}
    pm.close()
    return out


def _prefetch(pm: Any) -> dict[str, tuple[list[str], list[str]]]:
    """Unit name -> (units it prefetches in forward, in backward), for the units that prefetch."""
    from torch.distributed.fsdp import FSDPModule

    roots = pm.module if isinstance(pm.module, list) else [pm.module]
    units = {id(m._get_fsdp_state()): n for r in roots for n, m in r.named_modules() if isinstance(m, FSDPModule)}
    out = {}
    for n, m in ((n, m) for r in roots for n, m in r.named_modules() if isinstance(m, FSDPModule)):
        st = m._get_fsdp_state()
        fwd = [units[id(x)] for x in st._states_to_forward_prefetch]
        bwd = [units[id(x)] for x in st._states_to_backward_prefetch]
        if fwd or bwd:
            out[n] = (fwd, bwd)
    return out


def _tile_params_in_nvme(pm: Any) -> int:
    """File-homed parameter shards of the disk tier that are tiles' (0 without a disk tier)."""
    if pm.nvme is None:
        return 0
    from whalepy.runtime.tiling import tile_modules

    tiles = {id(p._local_tensor) for root in (pm.module if isinstance(pm.module, list) else [pm.module])
             for t in tile_modules(root) for p in t.parameters()}
    return sum(1 for b in pm.nvme.engine.blocks for it in b.items if it.kind == "param"
               and any(id(v.tensor) in tiles for v in it.views))


def resume_run(first: tuple[Case, int], second: tuple[Case, int], path: str, split: int = 2) -> dict[str, Any]:
    """Train ``split`` steps under the first (case, tiles), save (DCP), resume under the second from a
    differently initialised model and train the rest; errors against the single process run."""
    case, tiles = first
    data = batches(case.global_batch, case.steps)
    ref_losses, ref_params = _reference(case, case.steps)
    _, mid_params = _reference(case, split)
    pm = _launch(case, tiled_plan(case, tiles), data)
    losses = [pm.train_step(x, y).item() for x, y in data[:split]]
    pm.save(path)
    keys = sorted(pm.state_dict()["model"])
    dist.barrier()
    torch.manual_seed(123)
    other = build_model(case.kind, case.num_layers)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    case2, tiles2 = second
    pm2 = _launch(case2, tiled_plan(case2, tiles2), data, model=other)
    pm2.load(path)
    loaded = pm2.full_state_dict()
    losses += [pm2.train_step(x, y).item() for x, y in data[split:]]
    full = pm2.full_state_dict()
    return {"name": f"{case.name}->{case2.name}", "keys": keys,
            "load_err": _errors(loaded, mid_params) if loaded else None,
            "param_err": _errors(full, ref_params) if full else None,
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses))}


def meta_run(case: Case, tiles: int, other_tiles: int, path: str) -> dict[str, Any]:
    """A model built on the meta device, lowered tiled and materialised shard by shard: its initial
    weights against ``whalepy.materialize`` of the untiled model (same seed) in one process; then
    trained against that model tiled alike in one process (so the comparison isolates the sharding:
    tiling's own numerics against the untiled run are :func:`tiled_run`'s); then saved and read into
    another meta model with ``other_tiles`` tiles (``parallelize(checkpoint=...)``)."""
    from whalepy.ir.tiling import tileable_modules
    from whalepy.runtime.materialize import materialize
    from whalepy.runtime._tile_state import merge_state
    from whalepy.runtime.tiling import tile_model, tiled_layout

    data = batches(case.global_batch, case.steps)
    with torch.device("meta"):
        ref = build_model(case.kind, case.num_layers)
        model = build_model(case.kind, case.num_layers)
    materialize(ref, seed=7)
    init = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    prof = case_profile(case.kind, case.num_layers)
    paths = [p for b in prof.blocks if b.largest_linear_params for p in b.modules]
    tile_model(ref, {n: tiles for n, _ in tileable_modules(ref, paths)})
    ref_losses, ref_state = train_single(ref, data)
    pm = _launch(case, tiled_plan(case, tiles), data, model=model, seed=7)
    first = pm.full_state_dict()
    losses = [pm.train_step(x, y).item() for x, y in data]
    full = pm.full_state_dict()
    # the trained weights through a DCP checkpoint into another meta model, tiled otherwise
    pm.save(path)
    dist.barrier()
    with torch.device("meta"):
        again = build_model(case.kind, case.num_layers)
    pm2 = _launch(case, tiled_plan(case, other_tiles), data, model=again, checkpoint=path)
    loaded = pm2.full_state_dict()
    return {"name": case.name, "init_err": _errors(first, init) if first else None,
            "checkpoint_err": _errors(loaded, full) if loaded else None,
            "param_err": _errors(full, merge_state(ref_state, tiled_layout([ref]))) if full else None,
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses))}


def refusal(case: Case, tiles: int) -> str:
    """The one-line error parallelize gives for ``tiles`` on ``case``'s layout."""
    from whalepy.errors import WhalepyError

    data = batches(case.global_batch, 1)
    try:
        _launch(case, tiled_plan(case, tiles), data)
    except WhalepyError as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def run_all(items: list[tuple]) -> list[Any]:
    """Run each ``(function name, *args)`` of this module in turn (one launch for many cases)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*sequential all_gather.*")
    return [globals()[name](*args) for name, *args in items]
