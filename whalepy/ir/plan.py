"""The Plan: what the planner decides and the runtime lowers, as frozen, validated dataclasses.

A plan lays the world's ranks out as a 3-D grid ``[stage][replica][tp]``. Each pipeline stage owns a
``[dp][tp]`` block of global ranks, so stages may sit on different device types, and a data-parallel
replica (one index along the dp axis, across all stages) may sit on a different device type from its
neighbours and carry its own share of the global batch (Whale's hardware-aware balancing). Per block
the plan records activation checkpointing and the memory tier of parameters and optimizer states; per
stage the ZeRO stage. Everything the runtime needs is here; the predicted costs are for the user.

Serialised as JSON with a ``"version"`` field; loading refuses versions it does not know.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from whalepy.errors import PlanError
from whalepy.ir.types import OptimizerImpl, Precision, Schedule, Tier, TPStyle, ZeroStage

PLAN_VERSION = 6
"""Version 6 added :attr:`Plan.optimizer_impl` and :attr:`Plan.compile`; version 5 :attr:`BlockPlan.checkpoint_offload`; version 4 :attr:`BlockPlan.tiles` and :attr:`StagePlan.reduce_every_microbatch`; version 3 :attr:`BlockPlan.activation_offload` and
:attr:`BlockPlan.prefetch_depth`; version 2 :attr:`Plan.precision`. Older plans still load (see
:meth:`Plan.from_dict`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TPRule:
    """One module and the way tensor parallelism splits it, as found by the pattern pass."""

    module: str
    """Qualified module name, e.g. ``"transformer.h.3.mlp.c_fc"``."""
    style: TPStyle
    parts: int = 1
    """A fused COLWISE projection: its output features are ``parts`` equal pieces side by side (GPT-2's
    ``c_attn`` is ``[q | k | v]``, 3; Phi-3's ``gate_up_proj`` ``[gate | up]``, 2), which the model
    splits apart (``chunk`` / ``split`` in its graph); each piece is sharded on its own, so every rank
    holds ``[q_r | k_r | v_r]``."""
    feeds_rowwise: bool = False
    """A COLWISE module whose sharded output reaches a ROWWISE module (the pattern pass saw the pair in the
    graph): its output stays sharded, wherever the two sit in the module tree (BERT's ``query`` in
    ``attention.self``, its row-parallel ``dense`` in ``attention.output``). Without it the runtime pairs
    a COLWISE module with a ROWWISE sibling under the same parent (plans made before this field)."""
    copy_output: bool = False
    """The model modifies this module's output in place (Falcon's ``mlp_output += attention_output``),
    seen in the captured graph; DTensor hands on the output as a view autograd refuses to modify in
    place, so the runtime hands on a copy."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "style", TPStyle(self.style))
        if not isinstance(self.parts, int) or isinstance(self.parts, bool) or self.parts < 1:
            raise PlanError(f"TP rule on {self.module!r}: parts = {self.parts!r}, expected an integer >= 1 "
                            "(the number of fused pieces of its output)")


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockPlan:
    """One partitioning unit (a transformer layer, the embeddings, the head) inside a stage."""

    name: str
    """Block name from the profile: the module path of a repeated block, or a synthetic name."""
    checkpoint: bool = False
    """Recompute this block's activations in backward instead of keeping them."""
    param_tier: Tier = Tier.GPU
    """Where parameters (and, under ZeRO-3, their shards) rest between uses."""
    optimizer_tier: Tier = Tier.GPU
    """Where optimizer states and fp32 master weights live."""
    activation_offload: bool = False
    """Keep this block's saved activations in host memory between its forward and its backward
    (instead of on the device, or recomputing them); excludes :attr:`checkpoint`."""
    prefetch_depth: int = 1
    """For parameters off the device (``param_tier`` cpu / nvme): how many blocks ahead they are
    fetched. Kept 1 otherwise."""
    tiles: int = 1
    """Memory-centric tiling (ZeRO-Infinity, Rajbhandari et al. SC'21, sec. 5.1.3): every ``nn.Linear``
    and ``nn.Embedding`` of the block is split along its rows (output features, vocabulary) into
    ``tiles`` modules, each its own FSDP2 unit, so ZeRO-3 gathers (and reduce-scatters) one tile at a
    time and the working set is one tile, not the block. 1: not tiled. Only with ZeRO-3 and tp 1, and
    not on a block that shares a tied parameter with another (:func:`whalepy.ir.rules.tiling_error`)."""
    checkpoint_offload: bool = False
    """A checkpointed block keeps its input (the activation checkpoint) in host memory between its
    forward and its backward, which brings it back for the recompute (ZeRO-Infinity, Rajbhandari et al.
    SC'21, sec. 5.1.2); only with :attr:`checkpoint`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_tier", Tier(self.param_tier))
        object.__setattr__(self, "optimizer_tier", Tier(self.optimizer_tier))
        if self.activation_offload and self.checkpoint:
            raise PlanError(f"block {self.name!r}: activation_offload and checkpoint are both set; a block "
                            "either recomputes its activations or keeps them in host memory: set one of them")
        if self.checkpoint_offload and not self.checkpoint:
            raise PlanError(f"block {self.name!r}: checkpoint_offload is set without checkpoint; it keeps a "
                            "checkpointed block's input in host memory: set checkpoint too, or unset it")
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) \
                or self.prefetch_depth < 1:
            raise PlanError(f"block {self.name!r}: prefetch_depth must be an integer >= 1, got "
                            f"{self.prefetch_depth!r}; e.g. prefetch_depth=1 (the next block)")
        if isinstance(self.tiles, bool) or not isinstance(self.tiles, int) or self.tiles < 1:
            raise PlanError(f"block {self.name!r}: tiles must be an integer >= 1, got {self.tiles!r}; use "
                            "tiles=1 (not tiled) or a whole number of tiles, e.g. tiles=4")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """Predicted per-step figures for one stage (the slowest replica of it)."""

    compute_s: float = 0.0
    """Forward + backward (+ recompute) time per micro-batch."""
    comm_s: float = 0.0
    """Tensor-parallel and point-to-point time per micro-batch that is not hidden."""
    grad_sync_s: float = 0.0
    """Data-parallel / ZeRO gradient synchronisation per step."""
    offload_s: float = 0.0
    """Exposed transfer time to and from CPU / NVMe per step (parameter fetches, the offloaded optimizer
    step, activations kept in host memory)."""
    bubble_s: float = 0.0
    """Idle time in the pipeline per step."""
    memory_bytes: int = 0
    """Peak memory per device."""
    capacity_bytes: int = 0
    """Usable memory per device."""
    params_bytes: int = 0
    """GPU bytes of parameters at the peak (the tightest replica; these and the next five sum to
    ``memory_bytes``)."""
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    buffer_bytes: int = 0
    """FSDP2 working set and gradient buffers, autocast weight copies: the next four items' sum (plans
    written before they existed have them 0)."""
    working_set_bytes: int = 0
    """Of the buffers, FSDP2's working set: the running block's unsharded gradient before its
    reduce-scatter and, under ZeRO-3, the running block's gathered 16-bit parameters and the next
    block's, gathered ahead (``estimate_fsdp_working_bytes``, the largest block)."""
    gathered_params_bytes: int = 0
    """Of the buffers, FSDP2 below ZeRO-3: the stage's parameters kept gathered in the compute dtype
    from forward to backward (``reshard_after_forward=False``), 2 bytes per local parameter in bf16."""
    grad_accum_bytes: int = 0
    """Of the buffers, FSDP2 with several micro-batches: unsharded fp32 gradients accumulated until the
    last micro-batch reduces them (4 bytes per local parameter less the sharded gradients' bytes)."""
    autocast_copy_bytes: int = 0
    """Of the buffers, autocast's 16-bit copies of the fp32 weights, saved for backward (2 bytes per
    local parameter) on the DDP / single-device path."""
    inflight_microbatches: int = 0
    """Micro-batches whose saved activations the stage holds at once (1F1B on stage ``s`` of ``S``:
    ``S - s``; interleaving counts chunks); the activations item is this many times one micro-batch's
    saved tensors, plus one recomputed block and ``loss_bytes``."""
    loss_bytes: int = 0
    """Of the activations, last stage only: the logits and the loss's fp32 log-probabilities alive from
    the end of the forward into the loss's backward."""
    reserve_bytes: int = 0
    """Device memory kept back: CUDA context, NCCL buffers, allocator fragmentation."""
    margin_bytes: int = 0
    """Device memory left unplanned (``PlannerOptions.memory_margin``): device memory = ``capacity_bytes``
    + ``reserve_bytes`` + ``margin_bytes``."""
    cpu_bytes: int = 0
    """Host memory per GPU of offloaded states and activations."""
    cpu_grads_bytes: int = 0
    """Of ``cpu_bytes``, the gradient shards FSDP2's ``CPUOffloadPolicy`` reduces into the host during
    the backward and the step frees, when the device's peak comes before them (its activation peak,
    ``grads_bytes`` 0): the host holds ``cpu_bytes - cpu_grads_bytes`` at the device's peak, so a
    rank whose device memory is the host's (a CPU run) peaks at ``memory_bytes + cpu_bytes -
    cpu_grads_bytes``."""
    nvme_bytes: int = 0
    tp_comm_s: float = 0.0
    """Exposed tensor-parallel collectives per micro-batch."""
    p2p_s: float = 0.0
    """Pipeline sends per micro-batch."""
    dp_comm_s: float = 0.0
    """Exposed data-parallel collectives (FSDP2 gathers) per micro-batch."""
    model_state_bytes: int = 0
    """Of the peak, the parameters, gradients and optimizer states each device holds between uses
    (not the transiently gathered or cast parameters, not activations): what the runtime holds at
    the optimizer step."""
    host_state_bytes: int = 0
    """Model states each device keeps in host memory (``cpu`` tiers)."""
    nvme_state_bytes: int = 0
    """Optimizer states each device keeps in files (``nvme`` tier)."""
    chunk_forward_s: tuple[float, ...] = ()
    """Per chunk (one without interleaving; virtual stage ``index + k S`` for chunk ``k``), forward
    seconds per micro-batch: its blocks' forward passes and their TP all-reduces. Drawn by
    ``whalepy show`` as the pipeline timeline; empty in plans written before it existed."""
    chunk_backward_s: tuple[float, ...] = ()
    """Per chunk, backward seconds per micro-batch: backward passes, recompute of checkpointed blocks,
    TP all-reduces and exposed data-parallel communication (forward + backward = the chunk's busy time,
    :func:`whalepy.planner.costing.chunk_busy_s`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """A pipeline stage: consecutive blocks and the ``[dp][tp]`` grid of global ranks that run them."""

    index: int
    blocks: tuple[BlockPlan, ...]
    ranks: tuple[tuple[int, ...], ...]
    """``ranks[d][t]``: global rank of data-parallel replica ``d``, tensor-parallel shard ``t``."""
    device_types: tuple[str, ...]
    """Device type of each replica ``d`` (every rank of a TP group has the same type)."""
    zero_stage: ZeroStage = ZeroStage.NONE
    chunk_sizes: tuple[int, ...] = ()
    """Interleaved schedule only: blocks per virtual stage held by these ranks, in order. With ``v``
    virtual stages over ``S`` ranks groups, chunk ``j`` of stage ``s`` is pipeline stage ``s + j*S``.
    Empty means one chunk holding every block."""
    cost: StageCost = field(default_factory=StageCost)
    reduce_every_microbatch: bool = False
    """FSDP2 reduce-scatters each micro-batch's gradients into the sharded gradients (as ZeRO-3 does in
    DeepSpeed) instead of accumulating unsharded gradients over the micro-batches and reducing once
    (``set_requires_gradient_sync(False)`` until the last one): ``M`` times the reduce-scatters, no
    unsharded fp32 gradient of the whole stage on the device. FSDP2 lowering without pipeline stages
    only (:func:`whalepy.ir.rules.reduce_every_microbatch_error`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero_stage", ZeroStage(self.zero_stage))
        if not self.blocks:
            raise PlanError(f"stage {self.index} has no blocks; every stage needs at least one")
        if not isinstance(self.reduce_every_microbatch, bool):
            raise PlanError(f"stage {self.index}: reduce_every_microbatch must be true or false, got "
                            f"{self.reduce_every_microbatch!r}")
        from whalepy.ir.rules import stage_tiers_error

        reason = stage_tiers_error(self.blocks)
        if reason is not None:
            raise PlanError(f"stage {self.index}: {reason}")
        if any(b.tiles > 1 for b in self.blocks):
            from whalepy.ir.rules import tiling_error

            tp = len(self.ranks[0]) if self.ranks else 1
            for b in self.blocks:
                reason = tiling_error(b.tiles, zero=self.zero_stage, tp=tp)
                if reason is not None:
                    raise PlanError(f"stage {self.index}, block {b.name!r}: {reason}")
        if self.chunk_sizes and (sum(self.chunk_sizes) != len(self.blocks) or min(self.chunk_sizes) < 1):
            raise PlanError(
                f"stage {self.index}: chunk sizes {list(self.chunk_sizes)} must be positive and sum to its "
                f"{len(self.blocks)} blocks"
            )
        widths = {len(row) for row in self.ranks}
        if len(widths) != 1:
            raise PlanError(f"stage {self.index}: TP groups of unequal size {sorted(widths)}")
        if len(self.device_types) != len(self.ranks):
            raise PlanError(
                f"stage {self.index}: {len(self.device_types)} device types for "
                f"{len(self.ranks)} data-parallel replicas"
            )

    @property
    def dp_degree(self) -> int:
        return len(self.ranks)

    @property
    def tp_degree(self) -> int:
        return len(self.ranks[0])

    @property
    def all_ranks(self) -> tuple[int, ...]:
        return tuple(r for row in self.ranks for r in row)

    @property
    def block_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanCost:
    """Predicted whole-step figures."""

    step_time_s: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    model_tflops_per_gpu: float = 0.0
    """Model FLOPs (6 * params * tokens style, no recompute) per second per GPU, in TFLOP/s."""
    mfu: float = 0.0
    """Model FLOPs utilisation against the peak of each GPU's type."""
    busy_by_device_type: tuple[tuple[str, float], ...] = ()
    """``(device type, seconds)``: how long per step the busiest device of each type computes and
    communicates (its slowest stage cell, all micro-batches, plus its tail); the rest it idles."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """How the plan was found."""

    solver: str = "none"
    """``"highs"``, ``"cbc"``, ``"exhaustive"`` or ``"given"`` (a configuration the user fixed)."""
    status: str = "unsolved"
    objective: float = 0.0
    mip_gap: float = 0.0
    solve_time_s: float = 0.0
    """Wall time of the whole search, model capture excluded."""
    num_candidates: int = 0
    """Outer configurations (degrees, micro-batches, schedule) considered."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """A configuration the planner considered and rejected, with the reason."""

    description: str
    step_time_s: float
    """``math.inf`` if it did not fit."""
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete hybrid-parallel training plan for one model on one cluster."""

    model_name: str
    model_fingerprint: str
    """Hash of the model's structure (module paths, parameter shapes); guards against loading a plan
    made for another model."""
    world_size: int
    rank_device_types: tuple[str, ...]
    """Device type of each global rank, from the cluster spec."""
    global_batch: int
    seq_len: int | None = None
    num_microbatches: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    """Stages per rank; more than 1 only for the interleaved schedule."""
    batch_shares: tuple[int, ...]
    """Samples per step of each data-parallel replica; they sum to ``global_batch``."""
    stages: tuple[StagePlan, ...]
    tensor_parallel: tuple[TPRule, ...] = ()
    """How TP splits each module, for every stage whose ``tp_degree`` is above 1."""
    cost: PlanCost = field(default_factory=PlanCost)
    solver: SolverReport = field(default_factory=SolverReport)
    alternatives: tuple[Alternative, ...] = ()
    notes: tuple[str, ...] = ()
    """Decisions the user should know about (forced by annotations, relaxed constraints, ...)."""
    precision: Precision = Precision.FP32
    """What the runtime trains in: ``bf16`` / ``fp16`` (low-precision compute, fp32 master weights,
    gradient reduction and optimizer states; fp16 with dynamic loss scaling) or ``fp32``. The planner
    sets it from the cluster (``whalepy.hardware.cluster.resolve_precision``); a hand-made plan trains in
    fp32 unless it says otherwise."""
    optimizer_impl: OptimizerImpl = OptimizerImpl.AS_GIVEN
    """The optimizer implementation the runtime steps the device parameters with, and the cost model charged:
    ``fused`` (torch's fused kernel of the user's optimizer class where it has one for the device and
    dtype; the planner's choice by default) or ``as_given`` (the factory's optimizer exactly; what a
    hand-made plan and every plan before version 6 lowered)."""
    compile: bool = False
    """Each block's modules run under ``torch.compile`` (regional compilation; ``runtime/compile_blocks.py``).
    The planner turns it on where the devices and torch support it (CUDA), off on CPU unless asked."""
    costs_for: str = ""
    """:meth:`decision_hash` of the decisions the predicted costs (``cost``, stage costs, alternatives) were
    computed for; set on construction. A plan file edited by hand keeps the old hash, so
    :attr:`costs_stale` tells that its costs no longer describe it."""
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "optimizer_impl", OptimizerImpl(self.optimizer_impl))
        if not isinstance(self.compile, bool):
            raise PlanError(f"plan field compile must be true or false, got {self.compile!r}")
        self._validate()
        if not self.costs_for:
            object.__setattr__(self, "costs_for", self.decision_hash())

    def decision_hash(self) -> str:
        """16 hex digits over what the runtime lowers (ranks, stages, blocks, degrees, batch shares, TP
        rules, schedule, precision), not over the predictions."""
        import hashlib

        data = {k: v for k, v in _to_jsonable(self).items() if k not in _NOT_DECISIONS}
        for k, before in _ADDED_IN_6.items():  # a plan file older than them keeps its hash
            if data.get(k) == before:
                del data[k]
        for st in data["stages"]:
            st.pop("cost", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def costs_stale(self) -> bool:
        """True when the plan's decisions changed after its costs were computed (a hand-edited file)."""
        return self.costs_for != self.decision_hash()

    def _validate(self) -> None:
        for name in ("world_size", "global_batch", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan field {name} must be a positive integer, got {value!r}")
        if self.version != PLAN_VERSION:
            raise PlanError(
                f"plan version {self.version} is not supported by this whalepy (knows {PLAN_VERSION}); "
                "re-run whalepy.plan() to make a plan for this version"
            )
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        if len(self.rank_device_types) != self.world_size:
            raise PlanError(
                f"rank_device_types has {len(self.rank_device_types)} entries, world_size is "
                f"{self.world_size}"
            )
        dp = self.stages[0].dp_degree
        for s in self.stages:
            if s.dp_degree != dp:
                raise PlanError(
                    f"stage {s.index} has data-parallel degree {s.dp_degree}, stage 0 has {dp}; "
                    "every stage must have the same number of replicas"
                )
        used = [r for s in self.stages for r in s.all_ranks]
        if sorted(used) != list(range(self.world_size)):
            raise PlanError(
                f"stages use ranks {sorted(used)}, expected each of 0..{self.world_size - 1} exactly once"
            )
        for s in self.stages:
            for d, row in enumerate(s.ranks):
                types = {self.rank_device_types[r] for r in row}
                if types != {s.device_types[d]}:
                    raise PlanError(
                        f"stage {s.index} replica {d}: ranks {row} have device types {sorted(types)}, "
                        f"the plan says {s.device_types[d]!r}"
                    )
        if len(self.batch_shares) != dp:
            raise PlanError(f"{len(self.batch_shares)} batch shares for {dp} data-parallel replicas")
        if sum(self.batch_shares) != self.global_batch or min(self.batch_shares) < 1:
            raise PlanError(
                f"batch shares {list(self.batch_shares)} must be positive and sum to the global batch "
                f"{self.global_batch}"
            )
        for share in self.batch_shares:
            if share % self.num_microbatches:
                raise PlanError(
                    f"batch share {share} is not divisible by {self.num_microbatches} micro-batches; "
                    "every replica splits its share into equal micro-batches"
                )
        if self.virtual_stages > 1 and self.schedule is not Schedule.INTERLEAVED_1F1B:
            raise PlanError(f"virtual_stages={self.virtual_stages} needs the interleaved schedule")
        for s in self.stages:
            if self.virtual_stages == 1 and s.chunk_sizes:
                raise PlanError(
                    f"stage {s.index} has chunk_sizes {list(s.chunk_sizes)} but the plan has one virtual "
                    "stage per rank; chunk sizes belong to interleaved plans only"
                )
            if self.virtual_stages > 1 and len(s.chunk_sizes) != self.virtual_stages:
                raise PlanError(
                    f"stage {s.index} has {len(s.chunk_sizes)} chunks, the plan has "
                    f"virtual_stages={self.virtual_stages}; give chunk_sizes for every stage"
                )
        names = [b.name for s in self.stages for b in s.blocks]
        if len(set(names)) != len(names):
            raise PlanError("a block appears in more than one stage")

    # -- derived views -------------------------------------------------------------------------

    @property
    def pp_degree(self) -> int:
        return len(self.stages)

    @property
    def dp_degree(self) -> int:
        return self.stages[0].dp_degree

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(s.tp_degree for s in self.stages)

    @property
    def is_uniform_batch(self) -> bool:
        return len(set(self.batch_shares)) == 1

    def stage_of_rank(self, rank: int) -> tuple[StagePlan, int, int]:
        """Return ``(stage, replica index, tp index)`` of a global rank."""
        for s in self.stages:
            for d, row in enumerate(s.ranks):
                if rank in row:
                    return s, d, row.index(rank)
        raise PlanError(f"rank {rank} is not in this plan (world size {self.world_size})")

    def block_plan(self, name: str) -> BlockPlan:
        for s in self.stages:
            for b in s.blocks:
                if b.name == name:
                    return b
        raise PlanError(f"block {name!r} is not in this plan")

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise PlanError(f"Plan.save() takes a file path, got {type(path).__name__} {path!r:.60}; e.g. "
                            "plan.save('plan.json')")
        p = Path(path)
        if p.is_dir():
            raise PlanError(f"Plan.save({os.fspath(path)!r}): that is a directory; give a file name, e.g. "
                            f"{os.fspath(p / 'plan.json')!r}")
        if not p.parent.is_dir():
            raise PlanError(f"Plan.save({os.fspath(path)!r}): the directory {os.fspath(p.parent)!r} does not exist; "
                            "create it (mkdir -p) or save elsewhere")
        from whalepy.files import write_file

        write_file(p, self.to_json() + "\n", what=f"Plan.save({os.fspath(path)!r})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"a plan is a JSON object with a 'version' field, got {type(data).__name__}")
        version = data.get("version")
        if version == 1:
            # A version-1 plan has no precision: the runtime of that version trained in the model's own
            # dtype (fp32 for every model it was used with), whatever the planner had costed. It loads
            # as fp32 so that it keeps training, and resuming its checkpoints, exactly as it did.
            data = {**data, "version": 2, "precision": Precision.FP32.value}
            version = 2
        if version in (2, 3, 4, 5):
            # version 2 had no activation_offload / prefetch_depth, version 3 no tiles or
            # reduce_every_microbatch, version 4 no checkpoint_offload, version 5 no optimizer_impl or
            # compile: their defaults (absent fields take them) are what those runtimes did
            data = {**data, "version": PLAN_VERSION}
            version = PLAN_VERSION
        if version != PLAN_VERSION:
            raise PlanError(
                f"plan file has version {version!r}; this whalepy reads versions 1 to {PLAN_VERSION}. "
                "Re-create the plan with whalepy.plan() or `whalepy plan`."
            )
        try:
            plan = _from_jsonable(cls, data)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"plan data is malformed: {e}; fix the plan file or re-create it with `whalepy plan`") from None
        from whalepy.ir.rules import state_option_error

        for st in plan.stages:  # a tier pair edited into the file that the runtime does not lower
            for b in st.blocks:
                reason = state_option_error(st.zero_stage, b.param_tier, b.optimizer_tier, precision=plan.precision)
                if reason is not None:
                    raise PlanError(f"stage {st.index}, block {b.name!r}: {reason} (edit the plan file, or re-plan)")
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON ({e}); give a plan file written by `whalepy plan --out` or "
                            "Plan.save() (a truncated one: re-create it)") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path, *, model_fingerprint: str | None = None, model: Any = None,
             example_inputs: Any = None, profile: Any = None) -> Plan:
        """Load a plan; with ``model_fingerprint`` refuse a plan made for a different model. With ``model``
        (and its ``example_inputs``, default: token ids of the plan's ``seq_len`` for a model that starts
        with an embedding) or its ``profile``, check the plan against the model and its annotations
        (:func:`whalepy.planner.check.check_plan`): a hand-edited plan that cannot lower as written is a
        PlanError here, not a failure inside torch later."""
        if not isinstance(path, (str, os.PathLike)):
            raise PlanError(f"Plan.load() takes the path of a JSON plan, got {type(path).__name__} {path!r:.60}; "
                            "e.g. Plan.load('plan.json')")
        p = Path(path)
        if not p.exists():
            raise PlanError(f"no plan file at {p}; give the path of a JSON plan written by `whalepy plan --out` "
                            "or Plan.save()")
        if p.is_dir():
            raise PlanError(f"{p} is a directory, not a plan file; give the path of the JSON plan in it")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read plan file {p}: {e}; give a readable JSON plan file") from None
        try:
            plan = cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"{p}: {e}") from None
        if model_fingerprint is not None:
            plan.check_model(model_fingerprint)
        if model is not None or profile is not None:
            plan.check_against(model, example_inputs=example_inputs, profile=profile)
        return plan

    def check_against(self, model: Any = None, *, example_inputs: Any = None, profile: Any = None) -> None:
        """Raise :class:`PlanError` where this plan cannot lower ``model`` as written (blocks, TP rules,
        annotations, fingerprint); see :mod:`whalepy.planner.check`."""
        from whalepy.planner.check import check_against  # the one import up a layer (tests/test_layers.py)

        check_against(self, model, example_inputs=example_inputs, profile=profile)

    def check_model(self, model_fingerprint: str) -> None:
        if model_fingerprint != self.model_fingerprint:
            raise PlanError(
                f"this plan was made for model {self.model_name!r} with fingerprint "
                f"{self.model_fingerprint}, but the model given has fingerprint {model_fingerprint}; "
                "its module paths or parameter shapes differ. Re-plan for this model."
            )

    def __str__(self) -> str:
        return self.summary()

    def summary(self, *, batch_source: str | None = None) -> str:
        """``str(plan)``; ``batch_source``: where the global batch came from, said beside it (``whalepy
        plan`` without ``--global-batch``: "GPT-3's published batch; --global-batch to change")."""
        from whalepy.ir.plan_text import format_plan

        text = format_plan(self, batch_source=batch_source)
        if self.costs_stale:
            text = (f"STALE COSTS: this plan was edited after its costs were computed; the figures below describe "
                    f"the plan before the edit. Re-run `whalepy plan` or `whalepy estimate`.\n{text}")
        return text

    def explain(self) -> str:
        from whalepy.ir.plan_text import format_explanation

        return format_explanation(self)


# -- JSON helpers ----------------------------------------------------------------------------------

_NOT_DECISIONS = frozenset({"model_name", "cost", "solver", "alternatives", "notes", "costs_for", "version"})
"""Plan fields that describe or predict rather than decide (left out of :meth:`Plan.decision_hash`)."""

_ADDED_IN_6 = {"optimizer_impl": OptimizerImpl.AS_GIVEN.value, "compile": False}
"""Decisions version 6 added, with the value every older plan lowered: left out of the hash at that value,
so an older plan file's ``costs_for`` still matches it."""


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [_to_jsonable(x) for x in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    return obj


def _from_jsonable(cls: type, data: dict[str, Any], where: str = "plan") -> Any:
    import typing

    if not isinstance(data, dict):
        raise PlanError(f"{where} must be a JSON object (a {cls.__name__}), got {type(data).__name__} {data!r:.40}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{where}.{f.name}")
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise PlanError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**kwargs)


_JSON_KINDS = {str: (str,), bool: (bool,), int: (int, float), float: (int, float, str)}
"""The JSON values a plan field of each Python type may hold (a float may be "inf"; an int field written as
a float by an older whalepy still loads)."""


def _convert(tp: Any, value: Any, where: str = "plan") -> Any:
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise PlanError(f"{where} must be a JSON list, got {type(value).__name__} {value!r:.40}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _from_jsonable(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    kinds = _JSON_KINDS.get(tp)
    if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and tp is not bool)
                              or (isinstance(value, str) and tp is float and value != "inf")):
        want = {bool: "true or false", str: "a string"}.get(tp, "a number")
        raise PlanError(f"{where} must be {want}, got {type(value).__name__} {value!r:.40}; fix the plan file or "
                        "re-create it with `whalepy plan`")
    if tp is float:
        return math.inf if value == "inf" else float(value)
    return value
