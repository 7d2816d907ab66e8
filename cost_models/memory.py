"""Memory per device: model states by ZeRO stage and tier, activations, pipeline in-flight micro-batches
(the time of moving offloaded states: :mod:`whalepy.cost_models.offload`). Formulas and sources are in docs/cost_model.md.

Units are bytes (floats: per-device shares such as ``K * Psi / N_d`` need not be whole numbers).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from whalepy.ir.types import Schedule, Tier, ZeroStage

HALF_PRECISION_BYTES = 2
"""Bytes of one fp16/bf16 parameter or gradient in mixed-precision training."""

ADAM_OPTIMIZER_BYTES_PER_PARAM = 12
"""``K`` of the ZeRO paper's mixed-precision Adam: fp32 master weight, momentum and variance, 4 bytes
each (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC'20). Used only by :func:`estimate_zero_paper_model_state_bytes`."""

MASTER_PARAM_BYTES = 4
"""Bytes per parameter of the parameters whalepy's runtime keeps: fp32 in every precision (autocast
and FSDP2's ``MixedPrecisionPolicy`` both keep fp32 parameters and cast copies for compute)."""

MASTER_GRAD_BYTES = 4
"""Bytes per parameter of the gradients the runtime keeps: fp32 (gradients of fp32 parameters under
autocast; FSDP2 ``reduce_dtype=float32`` reduce-scatters into fp32 shards)."""

ADAM_STATE_BYTES_PER_PARAM = 8
"""``torch.optim.Adam``/``AdamW`` state per parameter: ``exp_avg`` and ``exp_avg_sq`` in the fp32
parameter's dtype. No separate master copy: the fp32 parameter is the master weight. (The 0-dim
``step`` tensor per parameter tensor is not counted: 4 bytes per tensor, not per element.)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStateBytes:
    """Model-state bytes one device holds, by kind on the device and by tier off it."""

    params: float
    """Parameters resident on the device between steps (the local shard when sharded)."""
    grads: float
    """Gradients resident on the device at the optimizer step."""
    optimizer: float
    """Optimizer states (and, in the ZeRO paper's layout, fp32 master weights) on the device."""
    working_params: float = 0.0
    """Transient device bytes: parameters gathered or cast for compute (FSDP2's unsharded
    low-precision parameters, autocast's cast copies), alive only while blocks run."""
    cpu: float = 0.0
    """States offloaded to host memory."""
    cpu_grads: float = 0.0
    """Of :attr:`cpu`, the gradient shards FSDP2's ``CPUOffloadPolicy`` reduce-scatters into during the
    backward and the step frees (``zero_grad(set_to_none=True)``): on the host from the backward to the
    step only. ZeRO-Offload's host gradient buffers are kept (not counted here)."""
    nvme: float = 0.0
    """States offloaded to NVMe: the disk tier's peak file bytes, while a step writes
    (:func:`whalepy.ir.rules.disk_tier_file_bytes`)."""
    nvme_between_steps: float = 0.0
    """The disk tier's file bytes between steps (one generation)."""

    @property
    def resident(self) -> float:
        """Device bytes held between uses: parameters, gradients, optimizer states (no working set)."""
        return self.params + self.grads + self.optimizer

    @property
    def gpu(self) -> float:
        """Peak device bytes of model states: resident plus the working set."""
        return self.resident + self.working_params

    @property
    def total(self) -> float:
        return self.gpu + self.cpu + self.nvme


def _check_sizes(num_params: float, dp_degree: int, **nonneg: float) -> None:
    if num_params < 0 or any(v < 0 for v in nonneg.values()):
        raise ValueError(f"num_params ({num_params}) and {', '.join(f'{k} ({v})' for k, v in nonneg.items())} "
                         "must be non-negative")
    if dp_degree < 1:
        raise ValueError(f"dp_degree must be at least 1, got {dp_degree}")


def estimate_model_state_bytes(
    *,
    num_params: float,
    zero_stage: ZeroStage | int,
    dp_degree: int,
    tp_degree: int = 1,
    pp_degree: int = 1,
    precision: str = "bf16",
    param_tier: Tier | str = Tier.GPU,
    optimizer_tier: Tier | str = Tier.GPU,
    optimizer_bytes_per_param: float = ADAM_STATE_BYTES_PER_PARAM,
    working_param_bytes: float = 0.0,
    largest_block_params: float = 0.0,
    prefetch_depth: int = 1,
    num_blocks: int | None = None,
    stage_offloads: bool = False,
    row_excess: float = 0.0,
) -> ModelStateBytes:
    """Model-state bytes per device that whalepy's runtime holds for ``num_params`` (P) local parameters
    (this rank's, after tensor and pipeline parallelism) on ``dp_degree`` (d) replicas.

    The layout is that of the lowering :func:`whalepy.ir.rules.choose_lowering_kind` picks, the
    function the runtime calls too. Parameters and gradients are fp32 in every precision (4 + 4 bytes),
    optimizer states ``K = optimizer_bytes_per_param`` (8 for Adam); the low precision only changes the
    transient working set:

    - none / DDP: ``(4 + 4 + K) P`` (DDP's gradient buckets are the gradients,
      ``gradient_as_bucket_view=True``); bf16/fp16 add autocast's cast copies ``2 P`` as working set.
    - DDP + ZeroRedundancyOptimizer: ``(4 + 4) P + K P / d`` (it partitions whole tensors, so a rank's
      share differs from ``P / d`` by up to its largest tensor); working set as DDP.
    - FSDP2: ``(4 + 4 + K) P / d`` (fp32 shards of parameters and gradients, optimizer states of the
      shards). ZeRO-3 (``reshard_after_forward=True``) adds ``working_param_bytes`` (the caller's
      largest gathered block, in the compute dtype; ignored by every other lowering); below ZeRO-3 the stage's parameters stay gathered from forward to
      backward: ``b P`` working, ``b`` the bytes of the compute dtype.
    - Tiers: ``param_tier = optimizer_tier = cpu`` (FSDP2 ``CPUOffloadPolicy``) moves the parameter,
      gradient and optimizer shards to the host; ``optimizer_tier = nvme`` moves the optimizer part to
      files; ``param_tier = nvme`` (FSDP2 host shards homed in files) moves the parameter shards to
      files and its gradient shards to files too (shared mappings FSDP2 reduces into,
      :mod:`whalepy.runtime._grad_files`). ``param_tier = gpu, optimizer_tier = cpu``
      (ZeRO-Offload, lowered to FSDP2, :mod:`whalepy.runtime.host_optimizer`): the device keeps its
      parameter shard in the compute dtype, ``b P / d``, and no gradients (each shard's gradient leaves
      for the host when FSDP2 has reduced it); the host keeps an fp32 master copy, an fp32 gradient
      buffer and the optimizer states of that shard, ``(4 + 4 + K) P / d``. Combinations
      :func:`whalepy.ir.rules.state_option_error` refuses raise ValueError.
    - Disk tier (:mod:`whalepy.runtime.nvme`): with S the bytes of one generation of the parameter and
      state files and G the gradient files (``4 P / d`` for nvme parameters, else 0), ``nvme`` is the
      peak ``S + max(S, G)`` (= ``2 S``: old and new generation at the end of a step) and
      ``nvme_between_steps`` is ``S`` (:func:`whalepy.ir.rules.disk_tier_file_bytes`); the host
      holds ``staging_slots(prefetch_depth, num_blocks)`` staging buffers
      (``num_blocks``: the stage's blocks on the disk tier, when known), each the
      file-homed bytes of the largest block (``largest_block_params`` local parameters before the dp
      split: ``4`` bytes each for nvme parameters plus ``K`` for nvme optimizer states, divided by d
      where the lowering shards them). Device parameters with nvme optimizer states add the stepped
      block's states (``K`` times the largest block's share) to the working set: the step's device
      copy (none on CPU runs, where the device is the host).

    ``stage_offloads``: another block of the stage offloads through the host, so the stage is lowered
    to FSDP2 whatever these tiers are (:func:`estimate_stage_model_state_bytes`, a stage of blocks with
    different tiers).

    ``row_excess``: under FSDP2, the replica's shards are not ``P / d`` but ``(P + row_excess) / d``
    elements (:func:`whalepy.ir.rules.fsdp_row_excess`: FSDP2 splits each parameter's first dimension
    with ``torch.chunk``, so the first replica holds ``ceil(rows / d)`` rows of a parameter whose rows
    ``d`` does not divide, the last ones fewer). Every sharded figure above (parameter, gradient and
    optimizer shards, on whichever tier) uses that count; the whole-parameter figures (the working set,
    DDP's replicas) do not. Ignored by the other lowerings.
    """
    from whalepy.ir.rules import (
        LoweringKind,
        choose_lowering_kind,
        offloads_to_host,
        state_option_error,
        steps_on_host,
        uses_cpu_offload_policy,
    )
    from whalepy.cost_models.compute import precision_bytes

    zero_stage, param_tier, optimizer_tier = ZeroStage(zero_stage), Tier(param_tier), Tier(optimizer_tier)
    _check_sizes(num_params, dp_degree, optimizer_bytes_per_param=optimizer_bytes_per_param,
                 working_param_bytes=working_param_bytes)
    reason = state_option_error(zero_stage, param_tier, optimizer_tier, precision=precision)
    if reason is not None:
        raise ValueError(reason)
    offload = offloads_to_host(param_tier, optimizer_tier) or stage_offloads
    kind = choose_lowering_kind(zero_stage, dp_degree, tp=tp_degree, pp=pp_degree, offload=offload)
    psi, d, k = num_params, dp_degree, optimizer_bytes_per_param
    low = precision_bytes(precision)
    shard = psi + row_excess if kind is LoweringKind.FSDP else psi  # elements times d of the shards
    if kind is LoweringKind.FSDP:
        params, grads, optimizer = MASTER_PARAM_BYTES * shard / d, MASTER_GRAD_BYTES * shard / d, k * shard / d
        gathered = zero_stage >= ZeroStage.PARAMETERS
        working = working_param_bytes if gathered else low * psi
    else:
        params, grads = MASTER_PARAM_BYTES * psi, MASTER_GRAD_BYTES * psi
        optimizer = k * psi / d if kind is LoweringKind.ZERO1 else k * psi
        working = low * psi if low < MASTER_PARAM_BYTES else 0.0  # autocast's cast copies
    cpu = nvme = file_grads = cpu_grads = 0.0
    if steps_on_host(param_tier, optimizer_tier):
        # the device shard stays, in the compute dtype; its fp32 master copy, gradient and optimizer
        # states are on the host
        return ModelStateBytes(params=min(low, MASTER_PARAM_BYTES) * shard / d, grads=0.0, optimizer=0.0,
                               working_params=working, cpu=MASTER_PARAM_BYTES * shard / d + grads + optimizer)
    if param_tier is Tier.NVME:  # parameter and gradient shards in files
        nvme, file_grads, params, grads = params, grads, 0.0, 0.0
    elif uses_cpu_offload_policy(param_tier, optimizer_tier):
        cpu, cpu_grads, params, grads = params + grads, grads, 0.0, 0.0
    if optimizer_tier is Tier.CPU:
        cpu, optimizer = cpu + optimizer, 0.0
    elif optimizer_tier is Tier.NVME:
        nvme, optimizer = nvme + optimizer, 0.0
    rest = 0.0
    if nvme:
        from whalepy.ir.rules import disk_tier_file_bytes, staging_slots

        rest, nvme = disk_tier_file_bytes(nvme, file_grads)
        slot, step_copy = _disk_block_bytes(kind, param_tier, optimizer_tier, largest_block_params, d, k)
        cpu += staging_slots(prefetch_depth, num_blocks) * slot
        working += step_copy
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer, working_params=working,
                           cpu=cpu, cpu_grads=cpu_grads, nvme=nvme, nvme_between_steps=rest)


def _disk_block_bytes(kind: object, param_tier: Tier, optimizer_tier: Tier, block_params: float, d: int,
                     k: float) -> tuple[float, float]:
    """For a block of ``block_params`` local parameters (before the dp split) on the disk tier: the
    bytes of its file-homed tensors (a staging buffer holds one such block: 4 per nvme parameter plus
    ``k`` for nvme optimizer states, divided by ``d`` where the lowering shards them) and, for device
    parameters with nvme states, the device copy of its states during its step."""
    from whalepy.ir.types import LoweringKind

    share = block_params if kind is LoweringKind.DDP else block_params / d
    slot = ((MASTER_PARAM_BYTES if param_tier is Tier.NVME else 0.0)
            + (k if optimizer_tier is Tier.NVME else 0.0)) * share
    return slot, (k * share if param_tier is Tier.GPU else 0.0)


def estimate_stage_model_state_bytes(
    *,
    blocks: Sequence[tuple[float, Tier | str, Tier | str] | tuple[float, Tier | str, Tier | str, float]],
    zero_stage: ZeroStage | int,
    dp_degree: int,
    tp_degree: int = 1,
    pp_degree: int = 1,
    precision: str = "bf16",
    optimizer_bytes_per_param: float = ADAM_STATE_BYTES_PER_PARAM,
    working_param_bytes: float = 0.0,
    prefetch_depth: int = 1,
) -> ModelStateBytes:
    """Model-state bytes per device of a stage whose blocks may have different tiers (granular
    offloading, as M6-10T's): ``blocks`` gives each block's ``(local parameters, param_tier,
    optimizer_tier)``, or ``(..., row_excess)`` (:func:`estimate_model_state_bytes`: FSDP2's uneven
    first dimensions, this replica's).

    Each group of blocks with the same tiers holds what :func:`estimate_model_state_bytes` says for its
    parameters, in the lowering of the whole stage (FSDP2 as soon as one block offloads through the host,
    :func:`whalepy.ir.rules.choose_lowering_kind`), so parameters, gradients, optimizer states and
    file bytes add up over the groups. Shared by the stage, and so not a sum: the working set of ZeRO-3
    (``working_param_bytes``, the largest gathered block) and the disk tier's staging buffers, one pool
    for all its blocks (:func:`whalepy.ir.rules.staging_slots` of the stage's disk-tier blocks,
    ``prefetch_depth`` ahead, each the size of the largest block's file-homed bytes), plus the device
    copy of the largest stepped block's states (device parameters with nvme states). A stage of one
    tier pair gives what :func:`estimate_model_state_bytes` gives."""
    from whalepy.ir.rules import choose_lowering_kind, offloads_to_host, staging_slots

    zero_stage = ZeroStage(zero_stage)
    pairs = [(float(b[0]), Tier(b[1]), Tier(b[2])) for b in blocks]
    excess = [float(b[3]) if len(b) > 3 else 0.0 for b in blocks]  # type: ignore[misc]
    offload = any(offloads_to_host(p, o) for _, p, o in pairs)
    common = dict(zero_stage=zero_stage, dp_degree=dp_degree, tp_degree=tp_degree, pp_degree=pp_degree,
                  precision=precision, optimizer_bytes_per_param=optimizer_bytes_per_param,
                  stage_offloads=offload)
    groups: dict[tuple[Tier, Tier], tuple[float, float]] = {}
    for (n, p, o), e in zip(pairs, excess):
        n0, e0 = groups.get((p, o), (0.0, 0.0))
        groups[(p, o)] = (n0 + n, e0 + e)
    # the stage-wide working set of the lowering (ZeRO-3's gathered block): what a stage of no
    # parameters would hold with it
    total = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "cpu": 0.0, "cpu_grads": 0.0, "nvme": 0.0,
             "nvme_between_steps": 0.0,
             "working_params": estimate_model_state_bytes(num_params=0.0, working_param_bytes=working_param_bytes,
                                                          **common).working_params}
    for (p, o), (n, e) in groups.items():
        part = estimate_model_state_bytes(num_params=n, param_tier=p, optimizer_tier=o, row_excess=e, **common)
        for key in total:
            total[key] += getattr(part, key)
    disk = [(n, p, o) for n, p, o in pairs if Tier.NVME in (p, o)]
    if disk:
        kind = choose_lowering_kind(zero_stage, dp_degree, tp=tp_degree, pp=pp_degree, offload=offload)
        sizes = [_disk_block_bytes(kind, p, o, n, dp_degree, optimizer_bytes_per_param) for n, p, o in disk]
        total["cpu"] += staging_slots(prefetch_depth, len(disk)) * max(slot for slot, _ in sizes)
        total["working_params"] += max(copy for _, copy in sizes)
    return ModelStateBytes(**total)


def estimate_zero_paper_model_state_bytes(
    *,
    num_params: float,
    zero_stage: ZeroStage | int,
    dp_degree: int,
    param_tier: Tier | str = Tier.GPU,
    optimizer_tier: Tier | str = Tier.GPU,
    optimizer_bytes_per_param: float = ADAM_OPTIMIZER_BYTES_PER_PARAM,
    working_param_bytes: float = 0.0,
) -> ModelStateBytes:
    """The ZeRO paper's accounting (DeepSpeed's layout), kept to check against published figures; the
    planner charges what whalepy's runtime holds instead (:func:`estimate_model_state_bytes`).

    Rajbhandari et al. (SC'20), with K = ``optimizer_bytes_per_param``: DP ``(2 + 2 + K) Psi``;
    ZeRO-1 ``4 Psi + K Psi / N_d``; ZeRO-2 ``2 Psi + (2 + K) Psi / N_d``; ZeRO-3 ``(4 + K) Psi / N_d``.

    ``optimizer_tier`` CPU or NVMe moves the optimizer part (fp32 master weights included) off the GPU,
    as ZeRO-Offload (Ren et al., ATC'21) and ZeRO-Infinity (Rajbhandari et al., SC'21) do; gradients
    are still counted on the GPU. ``param_tier`` CPU or NVMe (ZeRO-3 only) moves the parameter shard
    off the GPU. ``working_param_bytes`` (ZeRO-3: gathered blocks) is added to the GPU.
    """
    zero_stage, param_tier, optimizer_tier = ZeroStage(zero_stage), Tier(param_tier), Tier(optimizer_tier)
    _check_sizes(num_params, dp_degree, optimizer_bytes_per_param=optimizer_bytes_per_param,
                 working_param_bytes=working_param_bytes)
    if zero_stage < ZeroStage.PARAMETERS:
        if param_tier is not Tier.GPU:
            raise ValueError(
                f"param_tier={param_tier.value} needs ZeRO-3 (zero_stage=3), got zero_stage="
                f"{int(zero_stage)}: below stage 3 every device uses all parameters in place; "
                "set zero_stage=3 or keep param_tier=gpu"
            )
        if working_param_bytes:
            raise ValueError(
                f"working_param_bytes={working_param_bytes} only applies to ZeRO-3, which gathers "
                f"parameters per block; got zero_stage={int(zero_stage)}"
            )

    psi, nd, k = num_params, dp_degree, optimizer_bytes_per_param
    half = HALF_PRECISION_BYTES * psi
    params = half / nd if zero_stage >= ZeroStage.PARAMETERS else half
    grads = half / nd if zero_stage >= ZeroStage.GRADIENTS else half
    optimizer = k * psi / nd if zero_stage >= ZeroStage.OPTIMIZER else k * psi

    off = {Tier.CPU: 0.0, Tier.NVME: 0.0}
    if param_tier is not Tier.GPU:
        off[param_tier] += params
        params = 0.0
    if optimizer_tier is not Tier.GPU:
        off[optimizer_tier] += optimizer
        optimizer = 0.0
    return ModelStateBytes(
        params=params,
        grads=grads,
        optimizer=optimizer,
        working_params=working_param_bytes,
        cpu=off[Tier.CPU],
        nvme=off[Tier.NVME],
    )


# -- activations ----------------------------------------------------------------------------------


class Recompute(str, enum.Enum):
    """Activation recomputation policy (Korthikanti et al., 2022)."""

    NONE = "none"
    SELECTIVE = "selective"
    """Recompute only the attention core (QK^T, softmax, dropout, attention over V)."""
    FULL = "full"
    """Keep only each layer's input; recompute the whole layer in backward."""


def estimate_transformer_activation_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    num_heads: int,
    tp_degree: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute | str = Recompute.NONE,
) -> float:
    """Activation bytes one GPT-style transformer layer keeps for backward, per device, per micro-batch.

    Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys'23),
    with ``s, b, h, a, t`` = sequence, micro-batch, hidden, heads, TP degree (16-bit activations,
    1-byte dropout masks, 4h MLP):

    - no recompute: ``sbh(34 + 5as/h)``; with TP ``sbh(10 + 24/t + 5as/(ht))``; with TP and sequence
      parallelism ``sbh/t (34 + 5as/h)``;
    - selective recompute drops the attention-core term ``5as/(ht)``: ``sbh(10 + 24/t)``, or
      ``34 sbh/t`` with sequence parallelism;
    - full recompute keeps the layer input, ``2sbh``, sharded by ``t`` under sequence parallelism.
    """
    recompute = Recompute(recompute)
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden),
                        ("num_heads", num_heads), ("tp_degree", tp_degree)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    s, b, h, a, t = seq_len, micro_batch, hidden, num_heads, tp_degree
    sbh = s * b * h
    if recompute is Recompute.FULL:
        return 2 * sbh / (t if sequence_parallel else 1)
    # Plain TP replicates the layer norms' inputs/outputs and residual dropout masks (the "10") on every
    # rank; sequence parallelism shards them along the sequence as well.
    linear_terms = 34 / t if sequence_parallel else 10 + 24 / t
    attention_core = 5 * a * s / (h * t)
    if recompute is Recompute.SELECTIVE:
        return sbh * linear_terms
    return sbh * (linear_terms + attention_core)


def inflight_microbatches(
    schedule: Schedule | str,
    *,
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> int:
    """Most micro-batches whose activations stage ``stage_index`` holds at once.

    - GPipe runs every forward before any backward: ``M``.
    - 1F1B runs ``S - i - 1`` warm-up forwards, then one more before its first backward:
      ``min(M, S - i)`` (PipeDream-Flush: Narayanan et al., "Memory-Efficient
      Pipeline-Parallel DNN Training", ICML'21).
    - Interleaved 1F1B (``v`` model chunks per rank) counts *chunk* activations, each about ``1/v`` of
      the rank's blocks: warm-up ``2(S - i - 1) + (v - 1) S`` chunk forwards plus one, capped at
      ``M v`` -- the warm-up of Megatron-LM's interleaved schedule and of torch.distributed.pipelining's
      ``ScheduleInterleaved1F1B``. On stage 0 that is ``S + (S - 1)/v`` stages' worth of activations,
      the ``(1 + (S-1)/(S v))`` factor of Narayanan et al. (SC'21) over plain 1F1B's ``S``.
    """
    schedule = Schedule(schedule)
    s, i, m, v = num_stages, stage_index, num_microbatches, virtual_stages
    if s < 1 or m < 1 or v < 1:
        raise ValueError(f"num_stages ({s}), num_microbatches ({m}) and virtual_stages ({v}) must be >= 1")
    if not 0 <= i < s:
        raise ValueError(f"stage_index {i} is outside 0..{s - 1}")
    if v > 1 and schedule is not Schedule.INTERLEAVED_1F1B:
        raise ValueError(f"virtual_stages={v} needs the interleaved schedule, got {schedule.value}")
    if schedule is Schedule.GPIPE:
        return m
    if schedule is Schedule.ONE_F_ONE_B:
        return min(m, s - i)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return min(m * v, 2 * (s - i - 1) + (v - 1) * s + 1)
    raise ValueError(f"unhandled schedule {schedule!r}")  # pragma: no cover


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockActivations:
    """Activation figures of one block for one micro-batch, from a profile."""

    saved_bytes: float
    """Bytes the block saves for backward when it is not checkpointed."""
    input_bytes: float
    """Bytes of the block's input, all a checkpointed block keeps."""
    checkpoint: bool = False
    offload: bool = False
    """Saved activations kept in host memory (``BlockPlan.activation_offload``; excludes checkpoint)."""
    checkpoint_offload: bool = False
    """Checkpointed, its input kept in host memory (``BlockPlan.checkpoint_offload``; with checkpoint)."""

    def __post_init__(self) -> None:
        if self.checkpoint_offload and not self.checkpoint:
            raise ValueError("checkpoint_offload needs checkpoint (it offloads a checkpointed block's input)")


def estimate_stage_activation_bytes(
    *,
    blocks: Sequence[BlockActivations],
    num_inflight: int,
    virtual_stages: int = 1,
) -> float:
    """Peak activation bytes of one pipeline stage (one device).

    Per micro-batch a stage keeps each block's ``saved_bytes``, or only its ``input_bytes`` when the
    block is checkpointed (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016). That is
    multiplied by ``num_inflight`` (from :func:`inflight_microbatches`; with ``virtual_stages = v`` it
    counts chunks, each holding ``1/v`` of the stage's blocks). While a checkpointed block runs its
    backward its full activations are recomputed, one block at a time, so the largest such block's
    ``saved_bytes`` is added once.

    An offloaded block (``offload``) keeps nothing on the device between its forward and its backward
    (:func:`whalepy.runtime.checkpointing.apply_activation_offload` moves every saved tensor but
    parameters, which are model states); in its backward its saved tensors come back, one block at a
    time, so the largest such block's ``saved_bytes`` is the transient peak, as for recomputation (the
    two never overlap: one block runs its backward at a time). Its host bytes:
    :func:`estimate_stage_activation_host_bytes`. A checkpointed block whose input is in host memory
    (``checkpoint_offload``) keeps nothing on the device either and recomputes like any checkpointed
    block (:func:`whalepy.runtime.checkpointing.apply_checkpoint_offload`).
    """
    if num_inflight < 0 or virtual_stages < 1:
        raise ValueError(
            f"num_inflight ({num_inflight}) must be >= 0 and virtual_stages ({virtual_stages}) >= 1"
        )
    kept = sum(0.0 if blk.offload or blk.checkpoint_offload else blk.input_bytes if blk.checkpoint
               else blk.saved_bytes for blk in blocks)
    transient = max((blk.saved_bytes for blk in blocks if blk.checkpoint or blk.offload), default=0.0)
    return num_inflight * kept / virtual_stages + transient


def estimate_stage_activation_host_bytes(*, blocks: Sequence[BlockActivations], num_inflight: int,
                                         virtual_stages: int = 1) -> float:
    """Host bytes of the activations a stage keeps in host memory at the peak: each offloaded block's
    ``saved_bytes`` and each checkpoint-offloaded block's ``input_bytes``, for every micro-batch in
    flight (the device side is :func:`estimate_stage_activation_bytes`)."""
    if num_inflight < 0 or virtual_stages < 1:
        raise ValueError(
            f"num_inflight ({num_inflight}) must be >= 0 and virtual_stages ({virtual_stages}) >= 1"
        )
    per_mb = sum(blk.saved_bytes if blk.offload else blk.input_bytes if blk.checkpoint_offload else 0.0
                 for blk in blocks)
    return num_inflight * per_mb / virtual_stages


# -- working sets, buffers and the allocator's reserve ------------------------------------------------

FSDP_PREFETCH_BLOCKS = 1
"""Blocks FSDP2 gathers ahead of the one running: its implicit prefetch issues the next block's
all-gather while the current block computes, in forward and in backward (``fully_shard`` defaults;
explicit ``set_modules_to_forward_prefetch`` is not used by whalepy's runtime)."""


def estimate_fsdp_working_bytes(*, block_params: float, zero3: bool, compute_bytes: float = HALF_PRECISION_BYTES,
                                prefetch_blocks: int = FSDP_PREFETCH_BLOCKS) -> float:
    """GPU bytes FSDP2 holds for one stage besides the model states, at its peak in backward.

    ZeRO-3 (``reshard_after_forward=True``): the running block's parameters gathered in the compute
    dtype (``compute_bytes`` per parameter) plus the ``prefetch_blocks`` gathered ahead,
    ``(1 + prefetch) c P_b``; and the running block's unsharded gradient waiting for its
    reduce-scatter: ``c P_b`` in the compute dtype plus, when that is not fp32, its copy in the fp32
    reduce dtype (``MixedPrecisionPolicy(reduce_dtype=float32)``: the reduce-scatter input).
    Below ZeRO-3 the stage's parameters stay gathered from forward to backward (the caller charges
    them); only the gradient buffer remains. ``block_params`` is the largest block's parameters per
    device (after TP).
    """
    if block_params < 0 or prefetch_blocks < 0 or compute_bytes <= 0:
        raise ValueError(f"block_params ({block_params}) and prefetch_blocks ({prefetch_blocks}) must be >= 0 "
                         f"and compute_bytes ({compute_bytes}) > 0")
    gathered = (1 + prefetch_blocks) * compute_bytes * block_params if zero3 else 0.0
    reduce_copy = MASTER_GRAD_BYTES if compute_bytes != MASTER_GRAD_BYTES else 0.0
    return gathered + (compute_bytes + reduce_copy) * block_params


AUTOCAST_WEIGHT_COPY_BYTES = 2
"""Bytes per parameter autocast keeps for backward: ``torch.autocast`` casts each fp32 weight to a
16-bit copy for the matmul, and autograd saves that copy. Measured on one H100
(../shared/calibration/h100-sxm_microbench.json, ``block`` rows): autocast saves ``24 h^2 + 2 sbh``
bytes per GPT block more than pure bf16, i.e. 2 bytes for each of the block's ``12 h^2`` weights plus
the fp32 residual input (``2 sbh``); every row of the table fits this within 0.1 sbh."""

CUDA_CONTEXT_BYTES = 0.5 * 2**30
"""NAMED CONSTANT: device memory outside PyTorch's allocator per process: the CUDA context with
PyTorch's kernels (lazily loaded, CUDA_MODULE_LOADING=LAZY is the default since CUDA 11.7 / PyTorch 2)
and cuBLAS / cuDNN workspaces. Not measured here: ``torch.cuda.mem_get_info`` against
``memory_reserved`` on the target, or ``whalepy calibrate``, should replace it."""

NCCL_BYTES_PER_COMMUNICATOR = 2 * 16 * 4 * 2**20
"""NCCL's buffers per communicator: a send and a receive buffer of ``NCCL_BUFFSIZE`` (4 MiB by
default, NCCL environment documentation) per channel, 16 channels (see ``OVERLAP_COMPUTE_LOSS``)."""

ALLOCATOR_FRAGMENTATION = 0.05
"""NAMED CONSTANT: share of the allocated peak PyTorch's caching allocator additionally reserves
(rounding of blocks to 512 bytes, whole 2 MiB / 20 MiB segments, split blocks that cannot be
returned). Not measured on this project's hardware: ``torch.cuda.max_memory_reserved`` /
``max_memory_allocated`` on a target run should replace it."""


def estimate_fixed_device_bytes(num_communicators: int) -> float:
    """Device memory outside the allocator's reach: the CUDA context and ``num_communicators`` NCCL
    communicators' buffers."""
    return CUDA_CONTEXT_BYTES + num_communicators * NCCL_BYTES_PER_COMMUNICATOR


def estimate_usable_device_bytes(*, memory_bytes: float, num_communicators: int) -> float:
    """Peak *allocated* bytes a device can hold: its memory less the CUDA context and NCCL buffers,
    divided by ``1 + ALLOCATOR_FRAGMENTATION`` (what the caching allocator reserves for what it hands
    out)."""
    if memory_bytes <= 0 or num_communicators < 0:
        raise ValueError(f"memory_bytes ({memory_bytes}) must be > 0 and num_communicators "
                         f"({num_communicators}) >= 0")
    return max(0.0, memory_bytes - estimate_fixed_device_bytes(num_communicators)) / (1 + ALLOCATOR_FRAGMENTATION)


def estimate_device_bytes_for_usable(usable_bytes: float, *, num_communicators: int = 3) -> float:
    """The inverse of :func:`estimate_usable_device_bytes`: device memory that leaves ``usable_bytes``
    for the allocator with ``num_communicators`` NCCL communicators (for sizing test devices)."""
    return usable_bytes * (1 + ALLOCATOR_FRAGMENTATION) + estimate_fixed_device_bytes(num_communicators)
