"""Measured planning as the runtime lowers: blocks timed under FSDP2 and DTensor on a fake process group.

:func:`whalepy.frontend.measure.measure_costs` times each distinct block as plain PyTorch on this device.
What the runtime runs is not plain PyTorch: under ZeRO FSDP2 gathers each block's parameters into a
flat buffer and copies them out, registers hooks, casts and reduces gradients, and the optimizer steps
over DTensor shards (each element-wise operation of the update dispatched through DTensor); under
tensor parallelism every operation on a DTensor weight and every redistribution goes through DTensor's
dispatch. That host work is part of the step on every device (hidden only where the device runs far
behind the host) and was the largest error of the CPU validation (docs/benchmarks.md, issue 21).

This module measures it with the runtime's own lowering: for each wrapper the planner can choose
(FSDP2 keeping parameters gathered, ZeRO-1/2; FSDP2 resharding after forward, ZeRO-3; tensor
parallelism at each degree asked for), the (truncated) model is lowered by :func:`whalepy.parallelize`
with a one-stage plan (:func:`whalepy.runtime.mesh.make_plan`) on PyTorch's fake process group (backend
``"fake"``, this process as rank 0 of the degree's world: every DeviceMesh, FSDP2 hook, DTensor
dispatch and copy runs, and no collective moves data, so none waits) and each block is timed with the
same module hooks as the plain measurement, at each micro-batch size. Collectives are not in these
times; the planner adds them from the communication model. The optimizer step is timed per block over
the parameters as the runtime holds them (DTensor shards).

It needs a process without a ``torch.distributed`` job (the fake group is the default group while it
runs); inside one, :func:`measure_lowered` returns None and the caller says so.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from whalepy.runtime.collective_ops import collective_payload

log = logging.getLogger("whalepy.measure")

__all__ = ["FSDP_DEGREE", "fake_world", "measure_lowered"]

FSDP_DEGREE = 2
"""Data-parallel degree the FSDP2 wrappers are measured at. The host work FSDP2 adds per block (hooks,
the all-gather's copy-in and copy-out of the whole block, gradient casts) does not shrink with the
degree, and the shard each rank steps does; the optimizer's DTensor overhead is taken as the measured
step less the plain step's share at this degree (``MeasuredCosts.update_overhead``)."""


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a ``world``-rank job on PyTorch's fake process group (every group and
    mesh made as on the cluster, no collective moves data), the default group while inside."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _BlockCollectives:
    """Counts the collectives one step issues, per (block, phase, kind): the calls and the payload bytes
    in the cost model's convention (all-reduce the tensor, all-gather the gathered output,
    reduce-scatter the whole input). The current block and phase are the measurement's own block clock's
    last mark (``frontend.measure.BlockClock``: the last forward or backward pre-hook that fired)."""

    def __init__(self, root: nn.Module, by_index: dict[int, tuple[str, ...]], names: list[str]) -> None:
        from whalepy.frontend.measure import BlockClock

        self.names = names
        self.clock = BlockClock(root, by_index, lambda: None)
        self.rows: dict[tuple[str, str, str], list[float]] = {}

    def mode(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                got = collective_payload(func, args, strict=False)
                kind, nbytes = (got[0].value, got[1]) if got is not None else (None, 0)
                events = owner.clock.events
                if kind is not None and events and events[-1][1] is not None:
                    row = owner.rows.setdefault((owner.names[events[-1][1]], events[-1][2], kind), [0.0, 0.0])
                    row[0] += 1
                    row[1] += nbytes
                return func(*args, **(kwargs or {}))

        return _Mode()

    def remove(self) -> None:
        self.clock.remove()


def _count_collectives(root: nn.Module, inputs: tuple, by_index: dict[int, tuple[str, ...]], names: list[str],
                       loss_fn: Callable, autocast: Callable, samples: int) -> dict[str, dict[str, dict[str, tuple[float, float]]]]:
    """``name -> phase -> kind -> (calls, bytes per sample)`` of one forward and backward of ``root``."""
    import warnings

    counter = _BlockCollectives(root, by_index, names)
    try:
        with warnings.catch_warnings(), counter.mode():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with autocast():
                loss = loss_fn(root(*inputs), inputs)
            loss.backward()
    finally:
        counter.remove()
    for p in root.parameters():
        p.grad = None
    out: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}
    for (name, phase, kind), (calls, nbytes) in counter.rows.items():
        out.setdefault(name, {}).setdefault(phase, {})[kind] = (calls, nbytes / samples)
    return out


def _quiet() -> contextlib.AbstractContextManager:
    """The lowering's own log lines (plan summary, optimizer line) are not the user's job: silenced."""
    logger = logging.getLogger("whalepy")
    level = logger.level

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)

    return ctx()


def measure_lowered(model: nn.Module, example_inputs: tuple, blocks: dict[str, tuple[str, ...]], *,
                    device: torch.device, precision: str, micro_batches: Iterable[int], tp_rules: Iterable[Any],
                    tp_degrees: Iterable[int], repeats: int, loss_fn: Callable,
                    optimizer: Callable[[list], torch.optim.Optimizer],
                    time_step: Callable[..., dict[tuple[int, str], float]],
                    time_optimizer: Callable[..., float], compile: bool = False,
                    count_saved: Callable[..., dict[int, int]] | None = None) -> dict[str, Any] | None:
    """Time ``model`` (already truncated, on ``device``) lowered under each wrapper (module docstring).

    ``blocks``: block name -> module paths in ``model``; ``time_step(module, inputs, blocks_by_index,
    loss_fn, autocast)`` returns the median per-(block index, phase) seconds of ``repeats`` steps after
    warm-up (the plain measurement's own routine); ``time_optimizer(params, optimizer)`` a step's seconds.

    ``compile``: lower with ``Plan.compile`` (each block's modules compiled as the runtime compiles them,
    ``runtime.compile_blocks``), and also time the plain (one-rank) lowering, which then is the compiled
    blocks' own time (``"plain"``); there ``count_saved(module, mb, blocks_by_index, loss_fn, autocast)``
    (block index -> bytes, ``frontend.measure.saved_per_block``) counts, per size, what the compiled
    blocks save for backward (``"saved"``), one more forward and backward of the compiled code.

    Returns ``{"wrapped": {(wrapper, mb): {name: (f, b)}}, "tp": {(tp, mb): {name: (f, b)}},
    "updates": {key: {name: s}}, "plain": {mb: {name: (f, b)}}, "saved": {mb: {name: bytes}},
    "tp_collectives": {tp: {name: {phase: {kind: (calls, bytes per sample)}}}}}`` or None inside a
    distributed job."""
    import torch.distributed as dist

    from whalepy.runtime.mesh import make_plan

    if dist.is_initialized():
        return None
    import whalepy

    names = list(blocks)
    index = {n: i for i, n in enumerate(names)}
    rules = list(tp_rules)
    mbs = sorted({int(m) for m in micro_batches})
    configs = [("plain", 1, 1, 0)] if compile else []
    configs += [("fsdp", FSDP_DEGREE, 1, 2), ("fsdp_reshard", FSDP_DEGREE, 1, 3)]
    configs += [("tp", t, t, 0) for t in sorted({int(t) for t in tp_degrees}) if t > 1 and rules]
    out: dict[str, Any] = {"wrapped": {}, "tp": {}, "updates": {}, "plain": {}, "saved": {}, "tp_collectives": {},
                           "fsdp_units": {}}
    from whalepy.frontend.profile import profile as capture
    from whalepy.hardware.cluster import ClusterSpec

    prof = capture(model, example_inputs)  # the truncated model's own blocks, which the plan names
    names = [b.name for b in prof.blocks if b.name in blocks]
    if len(names) != len(blocks):
        log.warning("whalepy measure: the truncated model's blocks differ from the profile's; not timed as lowered")
        return None

    from whalepy.frontend.measure import block_parameters, local_device_type

    gpu = local_device_type(device)[0].name  # this GPU's catalog type: the runtime checks the plan's type against it
    for label, world, tp, zero in configs:
        cluster = ClusterSpec.from_dict({"groups": [{"name": "measure", "gpu": gpu, "gpus_per_node": world,
                                                     "nodes": 1, "intra_node": "shm"}]})
        try:
            with fake_world(world), _quiet():
                work = copy.deepcopy(model)
                plan = make_plan(names, dp=world // tp, tp=tp, global_batch=mbs[-1] * (world // tp),
                                 zero_stage=zero, tensor_parallel=rules if tp > 1 else (), precision=precision,
                                 device_type=cluster.groups[0].device.name, compile=compile)
                pm = whalepy.parallelize(work, cluster, plan=plan, example_inputs=example_inputs, profile=prof,
                                         loss_fn=lambda y, t: y.float().mean(), optimizer=optimizer,
                                         global_batch=plan.global_batch)
                root = pm._modules[0]
                by_index = {index[n]: tuple(pm.block_modules.get(n, blocks[n])) for n in names}

                @contextlib.contextmanager
                def autocast(pm: Any = pm) -> Iterator[None]:
                    with pm._loss_context(), pm.amp.autocast():
                        yield

                for mb in mbs:
                    if compile:  # each size compiled on its own, static, as the runtime's one size is: after a
                        torch._dynamo.reset()  # second size dynamo would go dynamic (other kernels, no mm padding)
                    med = time_step(root, mb, by_index, loss_fn, autocast)
                    row = {n: (med.get((index[n], "f"), 0.0), med.get((index[n], "b"), 0.0)) for n in names}
                    if label == "plain":
                        out["plain"][mb] = row
                        if count_saved is not None:  # the compiled blocks as they are now (this size's code)
                            kept = count_saved(root, mb, by_index, loss_fn, autocast)
                            out["saved"][mb] = {n: int(kept.get(index[n], 0)) for n in names}
                    elif label == "tp":
                        out["tp"][(tp, mb)] = row
                    else:
                        out["wrapped"][(label, mb)] = row
                if label == "fsdp_reshard" and not compile:  # FSDP2's units per block: its forward gathers
                    counted = _count_collectives(root, tuple(example_inputs), by_index, names, loss_fn, autocast,
                                                 int(example_inputs[0].shape[0]))
                    out["fsdp_units"] = {n: int(c.get("f", {}).get("all_gather", (0, 0))[0]) for n, c in counted.items()}
                if label == "tp" and not compile:  # the collectives each block issues at this degree
                    out["tp_collectives"][tp] = _count_collectives(
                        root, tuple(example_inputs), by_index, names, loss_fn, autocast,
                        int(example_inputs[0].shape[0]))
                key = f"tp/{tp}" if label == "tp" else f"fsdp/{world}"
                if label != "plain" and key not in out["updates"]:
                    # shared parameters once, in their first block: as the plain updates they are compared with
                    owned = block_parameters(root, {index[n]: by_index[index[n]] for n in names})
                    # stepped as the runtime steps it: a group of DTensor shards and plain parameters as two
                    out["updates"][key] = {n: time_optimizer(owned[index[n]], _split_groups(optimizer))
                                           for n in names}
                pm.close()
                del pm, work, root
        except Exception as e:  # noqa: BLE001 - a wrapper that cannot be measured keeps the modelled cost
            log.warning("whalepy measure: %s (degree %d) could not be measured as lowered (%s: %s); the planner "
                        "models it", label, world, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return out


def _split_groups(optimizer: Callable[[list], torch.optim.Optimizer]) -> Callable[[list], torch.optim.Optimizer]:
    """``optimizer`` whose optimizers step a param group mixing DTensor and plain parameters as two
    (:func:`whalepy.runtime.optimizer_impl.split_mixed_groups`, as the runtime builds them)."""
    from whalepy.runtime.optimizer_impl import split_mixed_groups

    def build(params: list) -> torch.optim.Optimizer:
        opt = optimizer(params)
        split_mixed_groups(opt)
        return opt

    return build
