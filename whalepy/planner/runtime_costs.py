"""How the runtime runs data parallelism, in the terms of the cost model: which wrapper a state option is
lowered to (the runtime's own :func:`~whalepy.ir.rules.choose_lowering_kind`), which of its
collectives overlap which compute (per block, with contention), what it holds beside the model states,
and how much device memory is left to the allocator. Used by :mod:`whalepy.planner.costing`; formulas
in docs/cost_model.md ("Overlap with compute", "Buffers and working sets", "Reserve").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from whalepy.cost_models.communication import OVERLAP_COMPUTE_LOSS, Collective, CommGroup, estimate_overlapped_time
from whalepy.cost_models.compute import precision_bytes
from whalepy.cost_models.memory import (
    ALLOCATOR_FRAGMENTATION,
    MASTER_GRAD_BYTES,
    estimate_fixed_device_bytes,
    estimate_usable_device_bytes,
)
from whalepy.ir.rules import LoweringKind, choose_lowering_kind, offloads_to_host
from whalepy.errors import InfeasibleError
from whalepy.planner.margin import MemoryMargin
from whalepy.planner.space import Candidate, GroupView, Segment, StateOption

CollectiveFn = Callable[[Collective, float, CommGroup], float]

_FIT_N1, _FIT_N2 = float(2**30), float(2**31)


def affine_fit(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """``(alpha, beta)`` with ``fn(n) = alpha + beta n`` for ``n > 0`` (alpha-beta costs are affine)."""
    f1, f2 = fn(_FIT_N1), fn(_FIT_N2)
    beta = (f2 - f1) / (_FIT_N2 - _FIT_N1)
    return max(0.0, f1 - beta * _FIT_N1), beta


def usable_device_bytes(g: GroupView, cand: Candidate, margin: MemoryMargin | None = None) -> float:
    """Peak allocated bytes one device of ``g`` may reach in ``cand``: its memory less the CUDA context
    and one NCCL communicator per parallel axis in use, less the allocator's fragmentation
    (:func:`~whalepy.cost_models.memory.estimate_usable_device_bytes`), less the ``margin`` the user
    leaves unplanned. CPU devices (gloo) have no CUDA context or NCCL buffers."""
    left = margin.bytes_for(g.device.memory_bytes) if margin is not None else 0.0
    if g.device.vendor == "cpu":
        return max(0.0, g.device.memory_bytes / (1 + ALLOCATOR_FRAGMENTATION) - left)
    comms = sum(1 for degree in (cand.dp, cand.tp, cand.num_stages) if degree > 1)
    return max(0.0, estimate_usable_device_bytes(memory_bytes=g.device.memory_bytes, num_communicators=comms) - left)


def check_device_reserve(groups: tuple[GroupView, ...], world_size: int) -> None:
    """Raise :class:`~whalepy.InfeasibleError` for a GPU whose memory does not exceed what every
    candidate reserves beside the allocator: the CUDA context, and one NCCL communicator when there is
    more than one device (every layout of several devices uses at least one parallel axis)."""
    reserve = estimate_fixed_device_bytes(1 if world_size > 1 else 0)
    for g in groups:
        if g.device.vendor != "cpu" and g.device.memory_bytes <= reserve:
            raise InfeasibleError(
                f"device {g.device.name!r} (group {g.name!r}) has {g.device.memory_bytes / 2**30:.3g} GiB of "
                f"memory, not more than the {reserve / 2**30:.3g} GiB reserved for the CUDA context"
                f"{' and an NCCL communicator' if world_size > 1 else ''} (cost_models/memory.py): give the "
                "device's real memory_gb in the cluster spec, or use larger devices")


def lowering_kind(o: StateOption, cand: Candidate) -> str:
    """How the runtime lowers data parallelism for state option ``o`` in candidate ``cand`` (the
    runtime's own :func:`~whalepy.ir.rules.choose_lowering_kind`: DDP, DDP + ZeroRedundancyOptimizer,
    FSDP2, or nothing)."""
    offload = offloads_to_host(o.param_tier, o.optimizer_tier) or o.beside_offload
    return choose_lowering_kind(o.zero, cand.dp, tp=cand.tp, pp=cand.num_stages, offload=offload)


def grads_at_activation_peak(kind: str, cand: Candidate) -> bool:
    """Whether gradients are held while the activations peak (the end of a forward). The runtime frees
    them after every step (``zero_grad(set_to_none=True)``), so with one micro-batch and no pipeline they
    are only created as backward frees activations; they are held through the forward when micro-batches
    accumulate into them and when a pipeline interleaves forwards and backwards. (DDP's persistent
    gradient buckets are a buffer, charged whatever this says.)"""
    del kind  # the same for every lowering
    return cand.num_microbatches > 1 or cand.num_stages > 1


def uses_autocast(kind: str, precision: str) -> bool:
    """Whether a 16-bit plan trains under ``torch.autocast`` over fp32 parameters (DDP and
    single-device paths) rather than FSDP2's ``MixedPrecisionPolicy`` with 16-bit parameters
    (design.md, Precision): autocast keeps 16-bit copies of the weights for backward."""
    return precision != "fp32" and kind in (LoweringKind.NONE, LoweringKind.DDP, LoweringKind.ZERO1)


LOSS_REPORT_BYTES = 4
"""Payload of the one collective of a step that is not data parallelism: ``ParallelModel.train_step``
all-reduces the step's mean loss, an fp32 scalar, over all ranks to return it."""


def dp_payload_bytes_per_param(collective: Collective, precision: str) -> float:
    """Bytes per parameter of one data-parallel collective as the runtime issues it (the payload in
    :mod:`whalepy.cost_models.communication`'s size convention), in ``precision``:

    - FSDP2's all-gather: the compute dtype (``MixedPrecisionPolicy.param_dtype``; fp32 parameters in
      an fp32 plan);
    - FSDP2's reduce-scatter: fp32 (``reduce_dtype=float32``, the gradients are reduced in fp32 in
      every precision);
    - DDP's all-reduce: fp32 (the gradients of the fp32 parameters autocast trains);
    - ZeroRedundancyOptimizer's broadcast of the updated parameters after the step: fp32 parameters.

    Checked against the bytes counted at the process group on gloo (``whalepy study zero --measure``,
    tests/test_zero_study.py)."""
    if collective is Collective.ALL_GATHER:
        return float(precision_bytes(precision))
    if collective in (Collective.REDUCE_SCATTER, Collective.ALL_REDUCE, Collective.BROADCAST):
        return float(MASTER_GRAD_BYTES)
    raise ValueError(f"the runtime issues no data-parallel {collective.value}")


def dp_step_payload_bytes(kind: str, *, zero3: bool, num_params: float, num_microbatches: int,
                          precision: str) -> dict[Collective, float]:
    """Payload bytes of one rank's data-parallel collectives in one training step without pipeline
    stages (``num_params`` parameters on this rank, ``num_microbatches`` micro-batches accumulated by
    whalepy's own loop), by collective, as the runtime issues them:

    - FSDP2: every unit is all-gathered before its forward in every micro-batch (FSDP2 reshards after
      backward) and, under ZeRO-3 (``reshard_after_forward=True``), again before its backward; the root
      unit too (FSDP2 reshards it after forward as well, counted on torch 2.13). The gradients are
      reduce-scattered once, in the last micro-batch (``set_requires_gradient_sync``);
    - DDP: one all-reduce of the gradients, in the last micro-batch (``no_sync`` before); the
      bucketing splits it into calls but adds no bytes;
    - DDP + ZeroRedundancyOptimizer: that all-reduce, and each rank's updated partition broadcast
      to the others after the step.

    Not counted: FSDP2 pads every parameter's first dimension to a multiple of the dp degree (at most
    ``dp - 1`` rows per parameter; none for the T5 / GPT shapes of the study on 4 or 8 ranks), and
    one-time traffic (DDP's initial broadcast and its bucket rebuild in the second step)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    b = functools.partial(dp_payload_bytes_per_param, precision=precision)
    P = num_params
    if kind == LoweringKind.FSDP:
        gathers = num_microbatches * (2 if zero3 else 1)
        return {Collective.ALL_GATHER: gathers * b(Collective.ALL_GATHER) * P,
                Collective.REDUCE_SCATTER: b(Collective.REDUCE_SCATTER) * P}
    if kind == LoweringKind.DDP:
        return {Collective.ALL_REDUCE: b(Collective.ALL_REDUCE) * P}
    if kind == LoweringKind.ZERO1:
        return {Collective.ALL_REDUCE: b(Collective.ALL_REDUCE) * P, Collective.BROADCAST: b(Collective.BROADCAST) * P}
    return {}


@dataclass(frozen=True, slots=True)
class DPComm:
    """Seconds of one block's data-parallel collectives over the stage's DP group, per segment."""

    all_gather: tuple[float, ...]
    """All-gather of the block's parameters in the compute dtype."""
    reduce_scatter: tuple[float, ...]
    all_reduce: tuple[float, ...]
    rep: int
    """Segment of the stage's typical block (the longest segment): whose gather a chunk's first block
    exposes."""


def build_dp_block_comm(collective: CollectiveFn, segments: tuple[Segment, ...], seg_params: list[float],
                        group: CommGroup | None, precision: str, units: tuple[int, ...] | None = None) -> DPComm:
    """``units[g]``: the FSDP2 units (``fully_shard`` calls) a block of segment ``g`` is lowered as, each
    gathering and reducing its own share of the block's parameters in a call of its own (counted by
    measured planning, ``MeasuredCosts.fsdp_units``; 1 where not counted)."""
    rep = max(range(len(segments)), key=lambda g: segments[g].length) if segments else 0
    if group is None:
        zeros = tuple(0.0 for _ in seg_params)
        return DPComm(zeros, zeros, zeros, rep)
    calls = units or tuple(1 for _ in seg_params)

    def times(kind: Collective) -> tuple[float, ...]:
        per = dp_payload_bytes_per_param(kind, precision)
        if kind is Collective.ALL_REDUCE:  # DDP's buckets, not FSDP2's units
            return tuple(collective(kind, per * p, group) for p in seg_params)
        return tuple(k * collective(kind, per * p / k, group) for p, k in zip(seg_params, calls))

    return DPComm(times(Collective.ALL_GATHER), times(Collective.REDUCE_SCATTER), times(Collective.ALL_REDUCE), rep)


def post_step_affine(collective: CollectiveFn, kind: str, group: CommGroup | None, precision: str
                     ) -> tuple[float, float]:
    """ZeroRedundancyOptimizer broadcasts every rank's updated fp32 partition after the step, which
    nothing overlaps; timed as an all-gather of the stage's parameters (the same bytes reach every
    rank); other kinds send nothing after the step."""
    if group is None or kind != LoweringKind.ZERO1:
        return 0.0, 0.0
    per = dp_payload_bytes_per_param(Collective.BROADCAST, precision)
    return affine_fit(lambda n: collective(Collective.ALL_GATHER, per * n, group))


def exposed_dp(kind: str, zero3: bool, pipelined: bool, fwd: float, bwd: float, dp: DPComm, g: int,
               reduce_each: bool = False, loss: float = OVERLAP_COMPUTE_LOSS) -> tuple[float, float]:
    """``(exposed per micro-batch, exposed per step)`` seconds of the data-parallel collectives of one
    block of segment ``g`` (forward ``fwd`` and backward ``bwd`` seconds per micro-batch), as the
    runtime runs them; each overlapped by :func:`estimate_overlapped_time` (the compute they run
    beside is slowed while they do):

    - FSDP2, whalepy's own accumulation loop (no pipeline): the block's all-gather runs one block
      ahead, beside the previous block's forward, every micro-batch (FSDP2 reshards after backward),
      and under ZeRO-3 again beside the next block's backward; its reduce-scatter, in the last
      micro-batch only (``set_requires_gradient_sync``), beside the next block's backward; with
      ``reduce_each`` (``StagePlan.reduce_every_microbatch``) in every micro-batch;
    - FSDP2 under ``torch.distributed.pipelining``: the stage keeps parameters gathered after
      backward (``set_reshard_after_backward(False)``), so below ZeRO-3 each block is gathered once per
      step, beside the first forward, and under ZeRO-3 once per micro-batch beside the backward; all
      reduce-scatters run after the last backward (``PipelineStage``'s ``REDUCE_GRAD`` action), exposed;
    - DDP (with or without ZeroRedundancyOptimizer): the gradient's all-reduce, bucketed (about one
      block per 25 MiB bucket), beside the next block's backward in the last micro-batch (``no_sync``
      before).

    ``loss`` is the device's share of compute lost beside a collective (``overlap_loss``: 1 on CPU ranks,
    where nothing hides)."""

    def ov(compute: float, comm: float) -> float:
        return estimate_overlapped_time(compute, comm, loss=loss)

    ag, rs = dp.all_gather[g], dp.reduce_scatter[g]
    if kind == LoweringKind.FSDP and not pipelined:
        xb = ag if zero3 else 0.0
        if reduce_each:
            return ov(fwd, ag) - fwd + ov(bwd, xb + rs) - bwd, 0.0
        return ov(fwd, ag) - fwd + ov(bwd, xb) - bwd, ov(bwd, xb + rs) - ov(bwd, xb)
    if kind == LoweringKind.FSDP:
        if zero3:
            return ov(bwd, ag) - bwd, rs
        return 0.0, ov(fwd, ag) - fwd + rs
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):
        return 0.0, ov(bwd, dp.all_reduce[g]) - bwd
    return 0.0, 0.0


def dp_edges(kind: str, zero3: bool, pipelined: bool, dp: DPComm, reduce_each: bool = False
             ) -> tuple[float, float]:
    """``(per micro-batch, per step)`` collectives with nothing to hide behind: a chunk's first block's
    gathers, and the last block's gradient reduction (see :func:`exposed_dp`)."""
    ag, rs, ar = dp.all_gather[dp.rep], dp.reduce_scatter[dp.rep], dp.all_reduce[dp.rep]
    if kind == LoweringKind.FSDP and not pipelined:
        if reduce_each:
            return ag * (2 if zero3 else 1) + rs, 0.0
        return ag * (2 if zero3 else 1), rs
    if kind == LoweringKind.FSDP:
        return (ag, 0.0) if zero3 else (0.0, ag)
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):
        return 0.0, ar
    return 0.0, 0.0
