"""What the runtime can lower, in one place: the planner's enumeration, ``whalepy.estimate``, the memory
model and the runtime's refusals all ask these functions, so the planner never proposes what the runtime
cannot run and the memory model charges what the runtime really holds.

Data parallelism, state tiers and precision:

- :func:`choose_lowering_kind`: which data-parallel wrapper a stage is lowered onto (DDP, DDP +
  ``ZeroRedundancyOptimizer``, FSDP2, or none).
- :func:`check_state_option`: whether a (ZeRO stage, parameter tier, optimizer tier) combination is
  lowered, and why not.
- :func:`stage_tiers_error`: whether one stage's blocks, with their own tiers, are lowered together
  (checked when a :class:`~whalepy.ir.plan.StagePlan` is made, and by the disk tier).
- :func:`shared_unit_tiers_error`: whether parameters of blocks with different tiers can be sharded as
  one FSDP2 unit (a stage's root: weights tied between blocks), in a stage whose blocks have different
  tiers (granular offloading).

Pipeline shape:

- :func:`schedule_error`: a schedule with its virtual stages (chunks per rank).
- :func:`microbatch_error`: the micro-batch counts ``torch.distributed.pipelining``'s schedules accept.
- :func:`sequence_parallel_error`: sequence parallelism together with pipeline stages.
- :func:`check_pipeline`: all three, raising :class:`~whalepy.PlanError`.

Tensor parallelism: :func:`tp_splits`: whether a block is split across a TP group of a given degree or
runs whole on every rank of it (the planner's costs, the plan it writes and the plan check all ask it);
:func:`tp_shards_parameter`: which parameters of a ruled module the runtime shards (the rest stay whole
on every TP rank); :func:`tp_local_params`: a block's parameters per TP rank, what the memory model and
the data-parallel traffic charge. FSDP2's uneven first dimensions: :func:`fsdp_rows` (a replica's rows),
:func:`fsdp_row_excess` (what a replica holds beyond an even ``1 / dp`` share of a block).

Memory-centric tiling: :func:`tiling_error` (``BlockPlan.tiles``). Gradient reduction every
micro-batch: :func:`reduce_every_microbatch_error` (``StagePlan.reduce_every_microbatch``).

Each ``*_error`` returns why not (one line that names the fix), or None when the runtime lowers it.
Kept free of ``torch.distributed`` imports so the planner and the cost models can consult it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from whalepy.errors import PlanError
from whalepy.ir.types import LoweringKind, Precision, Schedule, Tier, TPStyle, ZeroStage

__all__ = [
    "DiskTierFileBytes",
    "FILE_GENERATIONS",
    "reduce_every_microbatch_error",
    "tiling_error",
    "tp_local_params",
    "tp_shards_parameter",
    "tp_splits",
    "tied_copy_local_params",
    "fsdp_rows",
    "fsdp_row_excess",
    "tied_copy_row_excess",
    "tp_shard_dim",
    "LoweringKind",
    "check_pipeline",
    "check_state_option",
    "choose_lowering_kind",
    "microbatch_error",
    "offloads_to_host",
    "schedule_error",
    "sequence_parallel_error",
    "disk_tier_file_bytes",
    "host_steps_after_backward",
    "staging_slots",
    "shared_unit_tiers_error",
    "stage_tiers_error",
    "state_option_error",
    "steps_on_host",
    "uses_cpu_offload_policy",
]


def choose_lowering_kind(zero: ZeroStage | int, dp: int, *, tp: int, pp: int, offload: bool) -> LoweringKind:
    """The wrapper a stage with ZeRO stage ``zero`` on ``dp`` replicas is lowered onto.

    FSDP2 for ZeRO-2/3, and for ZeRO-0/1 whenever DDP cannot be used: DDP does not compose with DTensor
    tensor parallelism, a pipeline stage is kept under one wrapper, and host offload is FSDP2's
    ``CPUOffloadPolicy`` or whalepy's host optimizer over FSDP2's sharded parameters (ZeRO-Offload
    partitions what the host holds over the replicas, as FSDP2 shards). ``offload`` is whether any
    block of the stage has a ``cpu`` tier (:func:`offloads_to_host`)."""
    zero = ZeroStage(zero)
    if dp == 1 and not offload:
        return LoweringKind.NONE
    if zero >= ZeroStage.GRADIENTS or tp > 1 or pp > 1 or offload:
        return LoweringKind.FSDP
    return LoweringKind.ZERO1 if zero == ZeroStage.OPTIMIZER else LoweringKind.DDP


def lowering_label(zero: ZeroStage | int, dp: int, *, tp: int, pp: int, offload: bool) -> str:
    """What a plan table shows for a stage's data parallelism: the wrapper that runs
    (:func:`choose_lowering_kind`) and the ZeRO stage it behaves as. ZeRO-0/1 lowered to FSDP2 (under
    TP, PP or offload) runs with ``reshard_after_forward=False``, as ZeRO-2, its states sharded over the
    replicas; a ``*`` marks that it differs from the planned stage."""
    kind = choose_lowering_kind(zero, dp, tp=tp, pp=pp, offload=offload)
    zero = ZeroStage(zero)
    if kind is LoweringKind.NONE:
        return "none"
    if kind is LoweringKind.DDP:
        return "DDP"
    if kind is LoweringKind.ZERO1:
        return "DDP+ZeRO-1"
    if zero >= ZeroStage.GRADIENTS:
        return f"FSDP2 ZeRO-{int(zero)}"
    return "FSDP2 ZeRO-2*"


LOWERED_NOTE = ("* planned as ZeRO-0/1, but DDP does not compose with TP, PP or host offload: runs as FSDP2 "
                "with sharded states (reshard_after_forward=False)")
"""The plan table's footnote for :func:`lowering_label`'s ``*``."""


def offloads_to_host(param_tier: Tier | str, optimizer_tier: Tier | str) -> bool:
    """Whether a block with these tiers keeps model states off the device through the host: a ``cpu``
    tier (FSDP2's ``CPUOffloadPolicy`` or whalepy's host optimizer) or parameters on ``nvme`` (host shards
    whose home is a file); such a stage is lowered to FSDP2 (:func:`choose_lowering_kind`). ``nvme``
    optimizer states alone are kept in files around the optimizer instead."""
    return Tier.CPU in (Tier(param_tier), Tier(optimizer_tier)) or Tier(param_tier) is Tier.NVME


FILE_GENERATIONS = 2
"""Generations of the disk tier's parameter / state files while a step writes: the last committed
step's and the one being written (:mod:`whalepy.runtime._durable`), so a crash mid-write leaves the
committed one whole. Between steps only the committed one is kept (:func:`disk_tier_file_bytes`)."""


class DiskTierFileBytes(NamedTuple):
    """A rank's disk-tier file bytes: ``at_rest`` between steps, ``peak`` while a step writes."""

    at_rest: float
    peak: float


def disk_tier_file_bytes(generation: float, gradients: float = 0.0) -> DiskTierFileBytes:
    """File bytes of a rank's disk tier (:mod:`whalepy.runtime.nvme`), from ``generation`` (S: one
    generation of its parameter and optimizer-state files) and ``gradients`` (G: its file-homed
    gradient shards, blocks with ``param_tier = nvme``).

    Between steps the disk holds S (the superseded generation is removed once the next manifest is
    durable). Backward adds the gradient files: S + G when the step starts. The step then, block by
    block, drops the block's gradients (g_b) and writes its next generation (s_b); the old generation
    stays until the manifest commits, so after block i the files hold
    ``S + sum_{b <= i} s_b + sum_{b > i} g_b``. A block's gradient never outweighs its generation
    (``g_b <= s_b``: its parameter shard alone is as large), so the peak is the end of the step,
    ``2 S``, or the start, ``S + G``: ``S + max(S, G)``."""
    return DiskTierFileBytes(generation, generation + max((FILE_GENERATIONS - 1) * generation, gradients))


def staging_slots(prefetch_depth: int, num_blocks: int | None = None) -> int:
    """Staging buffers of a rank's disk tier (:mod:`whalepy.runtime._swap`), each the size of its largest
    block's file-homed tensors: the block in use, ``prefetch_depth`` blocks ahead, one being written back;
    never more than the ``num_blocks`` blocks of the tier (one buffer per block at most)."""
    n = max(1, prefetch_depth) + 2
    return n if num_blocks is None else max(1, min(n, num_blocks))


def uses_cpu_offload_policy(param_tier: Tier | str, optimizer_tier: Tier | str) -> bool:
    """Whether a block is lowered with FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and
    optimizer states on the host): its parameters are on the host, or on NVMe (host shards homed in
    files)."""
    return Tier(param_tier) in (Tier.CPU, Tier.NVME)


def steps_on_host(param_tier: Tier | str, optimizer_tier: Tier | str) -> bool:
    """Whether a block is lowered ZeRO-Offload style (:mod:`whalepy.runtime.host_optimizer`): parameters
    on the device, fp32 master weights, gradients and optimizer states on the host, stepped there."""
    return Tier(param_tier) is Tier.GPU and Tier(optimizer_tier) is Tier.CPU


def host_steps_after_backward(precision: Precision | str | None, clip_gradients: bool = False) -> bool:
    """Whether ZeRO-Offload's host optimizer (:func:`steps_on_host` blocks) steps after the whole backward
    rather than block by block during it: under fp16 (dynamic loss scaling skips the step when any
    gradient anywhere overflowed, known only after the backward) and with gradient clipping
    (``clip_gradients``: the global norm needs every gradient). The gradients still leave the device
    block by block during the backward; the host then unscales them, clips them with the device's, and
    steps (or skips) every block, as ZeRO-Offload's fp16 runs do (Ren et al., ATC'21, section 4.1, without
    the one-step delayed update). bf16 / fp32 without clipping keep the overlapped step. The runtime
    (:class:`whalepy.runtime.host_optimizer.HostOptimizer`) and the cost model
    (:func:`whalepy.cost_models.offload.zero_offload_step`) both ask this."""
    return clip_gradients or (precision is not None and Precision(precision) is Precision.FP16)


def state_option_error(zero: ZeroStage | int, param_tier: Tier | str, optimizer_tier: Tier | str, *,
                       precision: Precision | str | None = None, clip_gradients: bool = False) -> str | None:
    """Why the runtime cannot lower this state option, or None when it can.

    Lowered: any ZeRO stage with everything on the device; ``optimizer_tier = nvme`` with parameters
    on the device or the host (optimizer states in files, stepped block by block,
    :mod:`whalepy.runtime.nvme`); parameters AND optimizer states on the host (FSDP2
    ``CPUOffloadPolicy``, which moves parameters, gradients and optimizer states together; any ZeRO
    stage, lowered to FSDP2); parameters on the device with optimizer states on the host (ZeRO-Offload,
    :mod:`whalepy.runtime.host_optimizer`; any ZeRO stage, lowered to FSDP2, in every precision);
    parameters on NVMe with optimizer states on NVMe or the host (ZeRO-Infinity: FSDP2
    ``CPUOffloadPolicy`` host shards whose home is a file, staged ahead of use; any ZeRO stage, lowered
    to FSDP2). Not lowered: parameters on the host or NVMe with optimizer states on the device.

    ``precision`` and ``clip_gradients`` (``parallelize(max_grad_norm=...)``) refuse nothing today; they
    change how ZeRO-Offload is lowered (:func:`host_steps_after_backward`): under fp16 or with clipping
    its host optimizer steps after the whole backward, not during it, because whether to skip the step
    (fp16 loss scaling) and the global gradient norm are known only then."""
    ZeroStage(zero)
    pt, ot = Tier(param_tier), Tier(optimizer_tier)
    if pt is Tier.NVME and ot is Tier.GPU:
        return ("param_tier='nvme' with optimizer_tier='gpu' is not lowered: NVMe parameters are FSDP2 host "
                "shards, which keep their optimizer states on the host; set optimizer_tier to 'nvme' or 'cpu'")
    if pt is Tier.CPU and ot is Tier.GPU:
        return ("param_tier='cpu' with optimizer_tier='gpu' is not lowered: FSDP2's CPUOffloadPolicy keeps "
                "optimizer states with the parameters on the host; set optimizer_tier to 'cpu' or 'nvme'")
    return None


def shared_unit_tiers_error(pairs: Iterable[tuple[Tier | str, Tier | str]], *, names: Iterable[str] = ()
                            ) -> str | None:
    """Why FSDP2 cannot shard, as ONE unit, parameters of blocks whose ``(param_tier, optimizer_tier)``
    are ``pairs`` (the blocks ``names``), or None.

    Blocks of one stage may have different tiers: each block is its own ``fully_shard`` unit with its
    own offload policy (:mod:`whalepy.runtime.data_parallel`). The stage's root unit holds what no block
    unit may: weights tied between blocks (FSDP2 keeps a shared parameter in one unit) and the
    parameters of a block that is the stage module itself. One unit has one ``CPUOffloadPolicy`` or
    none, and its parameters are all stepped on the host or all on the device, so these blocks must
    have the same tiers. Parameters in no block do not constrain the root (the plan places none)."""
    got = sorted({(Tier(p), Tier(o)) for p, o in pairs}, key=lambda t: (t[0].value, t[1].value))
    if len(got) <= 1:
        return None
    which = ", ".join(f"{p.value}/{o.value}" for p, o in got)
    blocks = sorted(set(names))
    return (f"blocks {blocks} share parameters (tied weights, sharded together with the stage's root by "
            f"FSDP2) but have different tiers ({which}); give them the same param_tier and optimizer_tier")


def stage_tiers_error(blocks: Iterable[Any]) -> str | None:
    """Why the runtime cannot lower these blocks of one stage (``BlockPlan``-like: ``name``,
    ``param_tier``, ``optimizer_tier``, ``prefetch_depth``) together, or None.

    Blocks of one stage may have any tiers :func:`state_option_error` lowers, each its own FSDP2 unit.
    What the stage shares: its disk tier (:mod:`whalepy.runtime.nvme`) is one staging pool read ahead
    by one depth, so its blocks with parameters on ``nvme`` need one ``prefetch_depth``
    (:func:`staging_slots`; blocks of a ``cpu`` parameter tier are prefetched by FSDP2, each its own)."""
    depths: dict[int, list[str]] = {}
    for b in blocks:
        if Tier(b.param_tier) is Tier.NVME:
            depths.setdefault(int(b.prefetch_depth), []).append(b.name)
    if len(depths) > 1:
        which = "; ".join(f"{d}: {', '.join(names)}" for d, names in sorted(depths.items()))
        return (f"blocks with param_tier='nvme' have different prefetch depths ({which}); a stage's disk tier "
                "reads ahead one depth for all its blocks: give them the same prefetch_depth")
    return None


def check_state_option(zero: ZeroStage | int, param_tier: Tier | str, optimizer_tier: Tier | str, *,
                       where: str = "", precision: Precision | str | None = None) -> None:
    """Raise :class:`PlanError` (prefixed by ``where``) when :func:`state_option_error` refuses."""
    reason = state_option_error(zero, param_tier, optimizer_tier, precision=precision)
    if reason is not None:
        raise PlanError(f"{where}{': ' if where else ''}{reason}")


def schedule_error(schedule: Schedule | str, *, num_stages: int, virtual_stages: int) -> str | None:
    """Why the runtime cannot run ``schedule`` over ``num_stages`` pipeline ranks with ``virtual_stages``
    model chunks per rank, or None.

    GPipe and 1F1B run one stage per rank (``ScheduleGPipe`` / ``Schedule1F1B`` take one
    ``PipelineStage``); several chunks per rank need ``ScheduleInterleaved1F1B``. Without pipeline
    stages there is no schedule to run chunks with, so ``virtual_stages`` must be 1."""
    schedule = Schedule(schedule)
    if virtual_stages < 1 or num_stages < 1:
        return f"num_stages ({num_stages}) and virtual_stages ({virtual_stages}) must be at least 1"
    if virtual_stages > 1 and num_stages == 1:
        return (f"virtual_stages={virtual_stages} without pipeline stages: model chunks are interleaved over "
                "pipeline ranks; use virtual_stages=1 or pp > 1")
    if virtual_stages > 1 and schedule is not Schedule.INTERLEAVED_1F1B:
        return (f"schedule {schedule.value} runs one stage per rank, not {virtual_stages} chunks; use "
                f"{Schedule.INTERLEAVED_1F1B.value} or virtual_stages=1")
    return None


def microbatch_error(schedule: Schedule | str, *, num_stages: int, num_microbatches: int) -> str | None:
    """Why ``torch.distributed.pipelining`` refuses ``num_microbatches`` for ``schedule`` over
    ``num_stages`` pipeline ranks, or None. Without pipeline stages any count runs (gradient
    accumulation).

    - ``Schedule1F1B`` needs at least as many micro-batches as stages (it raises otherwise).
    - ``ScheduleInterleaved1F1B`` runs ``max(1, M // S)`` rounds and needs ``M`` to be a multiple of
      them.
    - ``ScheduleGPipe`` takes any count."""
    schedule = Schedule(schedule)
    S, M = num_stages, num_microbatches
    if M < 1:
        return f"num_microbatches must be at least 1, got {M}"
    if S == 1:
        return None
    if schedule is Schedule.ONE_F_ONE_B and M < S:
        return (f"1F1B with {M} micro-batches over {S} pipeline stages: torch.distributed.pipelining's "
                f"Schedule1F1B needs at least as many micro-batches as stages; use num_microbatches >= {S} "
                "or schedule 'gpipe'")
    rounds = max(1, M // S)
    if schedule is Schedule.INTERLEAVED_1F1B and M % rounds:
        return (f"interleaved 1F1B with {M} micro-batches over {S} pipeline stages: "
                f"ScheduleInterleaved1F1B runs {rounds} rounds and needs a multiple of them; use a multiple "
                f"of {S} micro-batches")
    return None


def sequence_parallel_error(*, sequence_parallel: bool, num_stages: int) -> str | None:
    """Why sequence parallelism cannot run with ``num_stages`` pipeline stages, or None.

    Between sequence-parallel blocks the residual stream is a sequence shard (a local
    ``[batch, seq / t, hidden]`` tensor, :mod:`whalepy.runtime.tensor_parallel`); pipeline stages send
    and receive whole activations, so the shard cannot cross a stage boundary."""
    if sequence_parallel and num_stages > 1:
        return (f"sequence parallelism with {num_stages} pipeline stages: the sequence-sharded residual "
                "stream cannot cross pipeline stages; plan with pp=1, or profile and plan without "
                "sequence_parallel")
    return None


def check_pipeline(schedule: Schedule | str, *, num_stages: int, virtual_stages: int, num_microbatches: int,
                   sequence_parallel: bool, where: str = "") -> None:
    """Raise :class:`PlanError` (prefixed by ``where``) with the first reason the runtime cannot lower
    this pipeline shape."""
    for reason in (schedule_error(schedule, num_stages=num_stages, virtual_stages=virtual_stages),
                   microbatch_error(schedule, num_stages=num_stages, num_microbatches=num_microbatches),
                   sequence_parallel_error(sequence_parallel=sequence_parallel, num_stages=num_stages)):
        if reason is not None:
            raise PlanError(f"{where}{': ' if where else ''}{reason}")


def tiling_error(tiles: int, *, zero: ZeroStage | int, tp: int, shares_params: bool = False) -> str | None:
    """Why a block cannot be lowered with ``tiles`` tiles of its linears and embeddings
    (``BlockPlan.tiles``), or None.

    Tiles are FSDP2 units of their own (:mod:`whalepy.runtime.tiling`), which lowers tiling only where
    each unit's parameters are gathered for its own use: ZeRO-3. Tensor parallelism is refused: a
    tensor-parallel linear is already split (across devices), and a tile of a DTensor shard is not
    lowered. A block that shares a parameter with another block (``shares_params``: a tied weight, e.g.
    GPT-2's embedding and LM head) is refused: FSDP2 keeps a tied parameter in the stage's root unit,
    and splitting it into tiles would untie it."""
    if tiles == 1:
        return None
    if int(zero) != int(ZeroStage.PARAMETERS):
        return (f"tiles={tiles} needs ZeRO-3 (tiles are gathered one at a time), got ZeRO-{int(zero)}; "
                "set zero_stage=3 or tiles=1")
    if tp != 1:
        return f"tiles={tiles} with tensor parallelism (tp={tp}) is not lowered; use tp=1 or tiles=1"
    if shares_params:
        return (f"tiles={tiles} on a block that shares a parameter with another block (a tied weight, e.g. an "
                "embedding tied to the LM head) is not lowered: tiling would untie it; use tiles=1 on this block")
    return None


def reduce_every_microbatch_error(kind: LoweringKind | str, *, pp: int, param_tier: Tier | str,
                                  optimizer_tier: Tier | str) -> str | None:
    """Why a stage cannot reduce its gradients every micro-batch (``StagePlan.reduce_every_microbatch``),
    or None. Lowered where whalepy's own accumulation loop drives FSDP2
    (``set_requires_gradient_sync(True)`` for every micro-batch): FSDP2 lowering, no pipeline stages
    (``torch.distributed.pipelining`` decides when a stage's gradients are reduced), and not ZeRO-Offload
    (``(gpu, cpu)``: the host takes a block's gradients when they are reduced, and steps it then or
    after the backward, so they must be reduced once per step)."""
    if LoweringKind(kind) is not LoweringKind.FSDP:
        return ("reduce_every_microbatch needs the FSDP2 lowering (ZeRO-3, or ZeRO-1/2 with offload); "
                f"this stage lowers to {LoweringKind(kind).value}: drop it")
    if pp > 1:
        return ("reduce_every_microbatch with pipeline stages is not lowered: the pipeline schedule "
                "reduces each stage's gradients once, after its last backward; drop it or use pp=1")
    if steps_on_host(param_tier, optimizer_tier):
        return ("reduce_every_microbatch with ZeRO-Offload (parameters on the device, optimizer states on "
                "the host) is not lowered: the host copies (and may step) each block when its gradients "
                "are reduced, once a step; drop it, or set both tiers to 'cpu'")
    return None


def mixed_tiers_error(kind: LoweringKind | str, tiers: Sequence[tuple[Tier | str, Tier | str]]) -> str | None:
    """Why the blocks of one stage cannot keep their states in the given ``(param_tier,
    optimizer_tier)`` pairs side by side (granular tiers, M6-10T), or None when they can.

    Under FSDP2 any pairs :func:`state_option_error` lowers: every block is its own ``fully_shard`` unit
    with its own offload policy (``CPUOffloadPolicy`` or none), and the host optimizer (ZeRO-Offload) and
    the disk tier work block by block. Without FSDP2 (DDP, DDP with ``ZeroRedundancyOptimizer``, one
    replica) the stage is wrapped whole, so its parameters all live on the device: only pairs that keep
    them there and differ in where the optimizer states are, the device or files (the disk tier wraps
    the optimizer's step, block by block; ``tests/test_mixed_tiers.py`` runs such a DDP stage)."""
    pairs = {(Tier(p), Tier(o)) for p, o in tiers}
    if len(pairs) <= 1 or LoweringKind(kind) is LoweringKind.FSDP:
        return None
    if all(p is Tier.GPU and o in (Tier.GPU, Tier.NVME) for p, o in pairs):
        return None
    names = ", ".join(f"({p.value}, {o.value})" for p, o in sorted(pairs, key=str))
    return (f"blocks of one stage with different tiers {names} need the FSDP2 lowering, not "
            f"{LoweringKind(kind).value}: give the stage one (param_tier, optimizer_tier) pair, or a ZeRO "
            "stage and degrees that lower to FSDP2")


# -- tensor-parallel shapes (the runtime's lowering and measured planning's sharded shapes) ---------

LOCAL_COUNT_ATTRIBUTES = (
    "num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
    "split_size",
)
"""Integer attributes of an attention-like module that count heads or head-sharded features."""


def localize_counts(parent: Any, parent_name: str, tp: int) -> None:
    """Divide ``parent``'s :data:`LOCAL_COUNT_ATTRIBUTES` by the TP degree (the local head counts)."""
    for attr in LOCAL_COUNT_ATTRIBUTES:
        value = getattr(parent, attr, None)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value % tp:
            raise PlanError(
                f"{parent_name or 'model'}.{attr} = {value} is not divisible by the tensor-parallel "
                f"degree {tp}; choose a TP degree that divides it or mark the module replicated"
            )
        setattr(parent, attr, value // tp)


def is_conv1d(m: Any) -> bool:
    # HF transformers.pytorch_utils.Conv1D: weight [in, out], attribute nf = out features
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def tp_splits(block: Any, tp: int) -> bool:
    """Whether ``block`` (a :class:`~whalepy.BlockProfile`) is split across a tensor-parallel group of
    ``tp`` ranks: it has TP rules that shard something and every sharded dimension divides by ``tp``
    (``block.tp_degrees``). Otherwise it runs whole on every rank of the group (whole compute, whole
    parameters; GPT-2's 50257-token embedding under TP 2), which the costs charge, the plan carries no
    rule for, and the plan check accepts."""
    return (tp > 1 and any(r.style is not TPStyle.REPLICATE for r in block.tp_rules)
            and tp in block.tp_degrees)


def tp_shards_parameter(style: TPStyle, field: str, *, parts: int = 1, conv1d: bool = False) -> bool:
    """Whether the runtime (``whalepy.runtime.tensor_parallel``) shards the parameter ``field``
    (``"weight"``, ``"bias"``) of a module ruled ``style`` across the TP group; otherwise it stays whole
    on every TP rank. ``parts``: the rule's fused pieces; ``conv1d``: the module is HF ``Conv1D``.

    COLWISE shards weight and bias (``ColwiseParallel``: both ``Shard(0)``); a fused one (``parts > 1``)
    keeps its bias whole, and its weight too on an ``nn.Linear`` (each rank slices its pieces of the
    whole weight: ``_StridedShard`` does not compose with FSDP2), not on a ``Conv1D`` (strided shard).
    ROWWISE shards the weight and keeps the bias whole (added after the all-reduce); VOCAB shards the
    embedding table; SEQUENCE and REPLICATE keep everything whole (norms run replicated)."""
    if style is TPStyle.COLWISE:
        return parts == 1 or (conv1d and field == "weight")
    if style in (TPStyle.ROWWISE, TPStyle.VOCAB):
        return field == "weight"
    return False


def tp_shard_dim(style: TPStyle, field: str, *, kind: str = "linear", parts: int = 1) -> int | None:
    """The dimension of parameter ``field`` (``"weight"``, ``"bias"``) of a module ruled ``style`` that
    the runtime (``whalepy.runtime.tensor_parallel``) shards across the TP group, or None where it stays
    whole (:func:`tp_shards_parameter`). ``kind``: ``"linear"`` (``nn.Linear``, weight ``[out, in]``),
    ``"conv1d"`` (HF ``Conv1D``, weight ``[in, out]``) or ``"embedding"`` (``[vocab, width]``).

    Column-parallel shards the output features (a linear's dim 0, a Conv1D's dim 1, a fused Conv1D's
    strided dim 1) and a bias's dim 0; row-parallel shards the input features (a linear's dim 1, a
    Conv1D's dim 0); a vocabulary-parallel embedding its rows (dim 0). FSDP2 then splits the TP-local
    tensor's first dimension (checked by lowering: tests/test_rank_check.py)."""
    if not tp_shards_parameter(style, field, parts=parts, conv1d=kind == "conv1d"):
        return None
    if field != "weight":
        return 0
    out_dim = 1 if kind in ("conv1d", "embedding") else 0
    return out_dim if style is TPStyle.COLWISE else 1 - out_dim


def fsdp_rows(rows: int, dp: int, replica: int = 0) -> int:
    """Rows of a first dimension of ``rows`` that FSDP2 gives replica ``replica`` of ``dp``: it splits
    with ``torch.chunk``, ``c = ceil(rows / dp)`` rows each in order, so the last replicas get fewer
    (or none) where ``dp`` does not divide ``rows``."""
    per = -(-rows // dp)
    return max(0, min(per, rows - replica * per))


def _row_excess(rows: int, numel: int, code: int, split: bool, tp: int, dp: int, replica: int) -> int:
    if split and code:
        numel //= tp
        rows = rows // tp if code == 1 else rows
    if rows <= 0 or dp == 1:
        return 0
    return dp * fsdp_rows(rows, dp, replica) * (numel // rows) - numel


def fsdp_row_excess(block: Any, tp: int, dp: int, replica: int = 0) -> int:
    """Elements replica ``replica`` of ``dp`` holds of ``block``'s parameters under FSDP2, times ``dp``,
    beyond the block's local parameters (:func:`tp_local_params`): ``sum_p dp * fsdp_rows(rows_p) *
    (elements per row) - elements_p`` over its :attr:`~whalepy.ir.profile.BlockProfile.param_rows` at TP
    degree ``tp`` (TP-local first dimensions). So the replica holds ``(tp_local_params + excess) / dp``
    elements: 0 where ``dp`` divides every first dimension (or the rows are unknown), positive for the
    first replica, negative for the last ones; summed over the replicas, 0."""
    split = tp_splits(block, tp)
    return sum(_row_excess(r, n, c, split, tp, dp, replica) for r, n, c in getattr(block, "param_rows", ()))


def tied_copy_row_excess(copy: Any, holder: Any, tp: int, dp: int, replica: int = 0) -> int:
    """:func:`fsdp_row_excess` of a tied copy (:class:`~whalepy.ir.profile.TiedCopy`) block ``holder``
    keeps: its rows split by ``tp`` where the holder's rule shards them."""
    if not getattr(copy, "rows", ()):
        return 0
    r, n, c = copy.rows
    return _row_excess(r, n, c, copy.tp_split and tp_splits(holder, tp), tp, dp, replica)


def tp_local_params(block: Any, tp: int) -> float:
    """Parameters of ``block`` (a :class:`~whalepy.BlockProfile`) held per rank of a TP group of ``tp``:
    the split ones divided by ``tp``, plus those TP leaves whole (``block.tp_whole_params``); all of
    them where the block runs whole (:func:`tp_splits`). Every split dimension divides by ``tp``
    (``block.tp_degrees``), so this is exact."""
    if not tp_splits(block, tp):
        return float(block.num_params)
    whole = getattr(block, "tp_whole_params", 0)
    return (block.num_params - whole) / tp + whole


def tied_copy_local_params(copy: Any, holder: Any, tp: int) -> float:
    """Elements per TP rank of a :class:`~whalepy.ir.profile.TiedCopy` that block ``holder`` keeps:
    split by ``tp`` where the holder runs tensor-parallel and its rule shards the copy."""
    return copy.num_params / tp if copy.tp_split and tp_splits(holder, tp) else float(copy.num_params)
