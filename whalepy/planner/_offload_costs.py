"""The offload side of a candidate's coefficients and of its plan: what each state option's optimizer
step and parameter fetches cost per local parameter (priced by :mod:`whalepy.cost_models.offload`,
bytes from :func:`~whalepy.planner._cost_context.stage_model_states`), and the prefetch depth a stage with
parameters off the device is given."""

from __future__ import annotations

from typing import TYPE_CHECKING

from whalepy.ir.rules import LoweringKind, host_steps_after_backward
from whalepy.cost_models.compute import adamw_step_time, precision_bytes
from whalepy.cost_models.memory import MASTER_GRAD_BYTES, MASTER_PARAM_BYTES
from whalepy.cost_models.offload import (
    OffloadRates,
    choose_prefetch_depth,
    device_step_nvme,
    fetch_hops,
    fetch_seconds_per_byte,
    host_step,
    nvme_io,
    resolve_offload_rates,
    zero_offload_step,
)
from whalepy.ir.plan import Tier, ZeroStage
from whalepy.ir.types import OptimizerImpl
from whalepy.ir.rules import tp_local_params
from whalepy.planner._cost_context import stage_model_states
from whalepy.planner.runtime_costs import lowering_kind
from whalepy.planner.space import Candidate, GroupView, StateOption

if TYPE_CHECKING:
    from whalepy.planner.costing import CellEval, CostContext, StageEval

def device_optimizer_implementation(impl: OptimizerImpl) -> str:
    """The AdamW implementation a stage's device optimizer runs under the plan's ``optimizer_impl``
    (:mod:`whalepy.runtime.optimizer_impl`): ``fused`` as planned; ``as_given`` the user's optimizer as
    built, which for ``torch.optim.AdamW`` on CUDA is its ``foreach`` implementation (torch never picks
    ``fused`` by itself: ``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``)."""
    return "fused" if impl is OptimizerImpl.FUSED else "foreach"


def group_rates(g: GroupView) -> OffloadRates:
    return resolve_offload_rates(g.device, gpus_per_node=g.gpus_per_node, nvme_read=g.nvme_read_bandwidth,
                                 nvme_write=g.nvme_write_bandwidth)


def offload_coefficients(ctx: CostContext, cand: Candidate, g: GroupView, allowed: tuple[StateOption, ...]
                          ) -> tuple[dict[StateOption, float], dict[StateOption, float], dict[StateOption, float]]:
    """Per option, seconds per local parameter of the stage: the optimizer step after the last backward,
    the part of it that runs beside that backward, and the parameter fetches per micro-batch
    (:mod:`whalepy.cost_models.offload`; bytes from :func:`stage_model_states`)."""
    d, low = cand.dp, precision_bytes(ctx.precision)
    n = 1e9
    gpu_step = ctx.optimizer_s_per_param(g.device.name)  # measured on this device type, if it was
    if gpu_step is None:
        # the device step of the implementation the runtime builds (the profile's measured rate)
        gpu_step = adamw_step_time(n, g.device, implementation=device_optimizer_implementation(ctx.optimizer_impl)) / n
    rates = None
    if any(o.param_tier is not Tier.GPU or o.optimizer_tier is not Tier.GPU for o in allowed):
        rates = group_rates(g)
    opt, overlap, fetch = {}, {}, {}
    for o in allowed:
        kind = lowering_kind(o, cand)
        # parameters whose optimizer states this rank steps: its shard under FSDP2 and ZeRO-1, else all
        share = 1.0 / d if kind == LoweringKind.FSDP or o.zero >= ZeroStage.OPTIMIZER else 1.0
        fetch[o], overlap[o] = 0.0, 0.0
        if rates is None or (o.param_tier is Tier.GPU and o.optimizer_tier is Tier.GPU):
            opt[o] = gpu_step * share
            continue
        # per local parameter, already a shard: what one generation holds, read and written once a step
        # (``nvme`` is the peak while a step writes: two generations)
        nvme_bytes = _states(ctx, cand, o).nvme_between_steps
        if o.param_tier is Tier.GPU and o.optimizer_tier is Tier.CPU:
            traffic = zero_offload_step(rates, grad_bytes=low, param_bytes=low,
                                        after_backward=host_steps_after_backward(ctx.precision, ctx.clip_gradients))
            opt[o], overlap[o] = traffic.serial * share, traffic.overlap * share
        elif o.param_tier is Tier.GPU:  # optimizer states in files, stepped on the device
            opt[o] = gpu_step * share + device_step_nvme(rates, state_bytes=nvme_bytes).serial
        else:  # parameters off the device: stepped on the host (FSDP2 CPUOffloadPolicy)
            # nvme parameters: their gradient shards live in files too (runtime/_grad_files.py),
            # written as FSDP2 reduces them and read back by the step
            grad_files = MASTER_GRAD_BYTES * share if o.param_tier is Tier.NVME else 0.0
            opt[o] = (host_step(rates, grad_bytes=MASTER_GRAD_BYTES).serial * share
                      + nvme_io(rates, nvme_bytes) + nvme_io(rates, grad_files))
            passes = 2 if o.zero is ZeroStage.PARAMETERS else 1  # re-gathered for backward under ZeRO-3
            fetch[o] = passes * MASTER_PARAM_BYTES * share * fetch_seconds_per_byte(
                rates, from_nvme=o.param_tier is Tier.NVME)
    return opt, overlap, fetch


def _states(ctx: CostContext, cand: Candidate, o: StateOption):  # type: ignore[no-untyped-def]
    return stage_model_states(ctx, cand, o, 1.0)


def stage_prefetch(ctx: CostContext, cand: Candidate, st: StageEval, cell: CellEval,
                   blocks: list[int], option: StateOption | None = None) -> tuple[int, float]:
    """Prefetch depth for a stage whose parameters are off the device, and the exposed seconds of its
    fetches per micro-batch at that depth (forward in block order, backward in reverse; the first fetch
    of each pass included): :func:`~whalepy.cost_models.offload.choose_prefetch_depth` over the stage's
    blocks (``(1, 0.0)`` for parameters on the device). ``option``: the option of ``blocks`` when the
    stage mixes several (default ``st.option``)."""
    o = option or st.option  # of a mix: one part's option, with its blocks
    if o.param_tier is Tier.GPU or not blocks:
        return 1, 0.0
    g = cell.cell.group
    rates = group_rates(g)
    mb, t, d = cell.cell.micro_batch, cand.tp, cand.dp
    prof = ctx.profile
    times = [ctx.block_time(i, g.device.name, t, mb) for i in blocks]
    hops = [fetch_hops(rates, MASTER_PARAM_BYTES * tp_local_params(prof.blocks[i], t) / d,
                       from_nvme=o.param_tier is Tier.NVME)
            for i in blocks]
    fwd = [f for f, _ in times]
    depth, exposed = choose_prefetch_depth(compute_s=fwd, hops_s=hops)
    if o.zero is ZeroStage.PARAMETERS:  # gathered again for backward, in reverse order
        from whalepy.cost_models.offload import estimate_prefetch_exposed

        exposed += estimate_prefetch_exposed(compute_s=[b for _, b in reversed(times)], hops_s=hops[::-1],
                                             prefetch_depth=depth)
    return depth, exposed


def activation_offload_coefficients(g: GroupView, *, saved: list[float], inflight: int, virtual_stages: int
                                    ) -> tuple[list[float] | None, list[float] | None]:
    """Per block of each segment of a cell on group ``g``: the seconds per micro-batch of keeping its
    saved activations in host memory instead of on the device (copied down in its forward, up in its
    backward, on the compute stream:
    :func:`~whalepy.cost_models.offload.estimate_activation_offload_time`), and the host bytes per rank
    they take with ``inflight`` micro-batches in flight
    (:func:`~whalepy.cost_models.memory.estimate_stage_activation_host_bytes`). ``(None, None)`` where
    the group has no host memory given."""
    from whalepy.cost_models.memory import BlockActivations, estimate_stage_activation_host_bytes
    from whalepy.cost_models.offload import estimate_activation_offload_time

    if g.cpu_memory_bytes is None:
        return None, None
    rates = group_rates(g)
    time_s = [estimate_activation_offload_time(rates, saved_bytes=a) for a in saved]
    host = [estimate_stage_activation_host_bytes(blocks=[BlockActivations(saved_bytes=a, input_bytes=0.0,
                                                                           offload=True)],
                                                 num_inflight=inflight, virtual_stages=virtual_stages)
            for a in saved]
    return time_s, host


def checkpoint_offload_coefficients(g: GroupView, *, inputs: list[float], inflight: int, virtual_stages: int
                                    ) -> tuple[list[float] | None, list[float] | None]:
    """Per block of each segment of a cell on group ``g`` (``inputs``: its input bytes per micro-batch,
    ``seg_input``): the seconds per micro-batch of keeping its input in host memory when it is
    checkpointed (:func:`~whalepy.cost_models.offload.estimate_checkpoint_offload_time`, on top of the
    recompute), and the host bytes per rank that takes with ``inflight`` micro-batches in flight
    (:func:`~whalepy.cost_models.memory.estimate_stage_activation_host_bytes`); the device then keeps
    none of it. ``(None, None)`` where the group has no host memory given."""
    from whalepy.cost_models.memory import BlockActivations, estimate_stage_activation_host_bytes
    from whalepy.cost_models.offload import estimate_checkpoint_offload_time

    if g.cpu_memory_bytes is None:
        return None, None
    rates = group_rates(g)
    time_s = [estimate_checkpoint_offload_time(rates, input_bytes=x) for x in inputs]
    host = [estimate_stage_activation_host_bytes(
        blocks=[BlockActivations(saved_bytes=0.0, input_bytes=x, checkpoint=True, checkpoint_offload=True)],
        num_inflight=inflight, virtual_stages=virtual_stages) for x in inputs]
    return time_s, host
