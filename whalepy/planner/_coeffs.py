"""The cost coefficients of one outer candidate (split from :mod:`whalepy.planner.costing`, which builds
them and re-exports these names): per ``(stage, device group, batch share)`` cell
(:class:`CellCoeffs`), per stage (:class:`StageCoeffs`), per node share (:class:`NodeShare`) and for
the whole candidate (:class:`CandidateCoeffs`), and the questions every solver asks of them (which
segments may keep activations or checkpointed inputs in host memory, whether the nodes hold the
offloaded bytes). :mod:`whalepy.planner.costing`'s docstring says what each coefficient prices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from whalepy.planner.space import Candidate, GroupView, Segment, StateOption


@dataclass(slots=True)
class CellCoeffs:
    """One ``(stage, device group, batch share)`` cell: the replicas of a stage that cost the same."""

    group: GroupView
    share: int
    micro_batch: float
    replicas: tuple[int, ...]
    capacity: float
    """Usable device memory, bytes."""
    cpu_capacity: float | None
    """Host memory per GPU for offloaded states, bytes (None: no CPU offload possible); the constraint
    is the node's (:class:`NodeShare`), this is the even share shown in plans."""
    nvme_capacity: float | None
    seg_time: list[float]
    """Per block of each segment: forward + backward + TP all-reduces, seconds per micro-batch."""
    seg_recompute: list[float]
    """Per block: extra time when checkpointed (forward again + its TP all-reduce)."""
    seg_fwd: list[float]
    seg_bwd: list[float]
    seg_comm: list[float]
    """Per block: TP all-reduce time included in seg_time."""
    seg_saved: list[float]
    seg_input: list[float]
    p2p: float
    chunk_p2p: list[float]
    """Per chunk ``k`` of the stage (virtual stage ``s + k S``): its own sends; they sum to ``p2p``."""
    inflight: int
    opt_beta: dict[StateOption, float]
    """Optimizer step seconds per local parameter of the stage that nothing hides (after the last
    backward)."""
    opt_overlap: dict[StateOption, float]
    """Optimizer-step seconds per local parameter that run beside the last micro-batch's backward
    (ZeRO-Offload's gradient copies, and its CPU step unless it comes after the backward): exposed only
    past the backward's length."""
    fetch_beta: dict[StateOption, float]
    """Parameter fetch seconds per micro-batch per local parameter (parameters off the GPU)."""
    seg_exposed: dict[StateOption, list[float]]
    """Per option, per block of each segment: exposed data-parallel communication per micro-batch
    (FSDP2 all-gathers beside the block's forward and backward), see :func:`~whalepy.planner.runtime_costs.exposed_dp`."""
    edge: dict[StateOption, float]
    """Per option: the exposed all-gathers of a chunk's first block per micro-batch (nothing to hide
    behind)."""
    seg_tail: dict[StateOption, list[float]]
    """Per option, per block: extra exposed time of the last micro-batch's backward, where the block's
    gradient reduction joins its gathers."""
    tail_edge: dict[StateOption, float]
    """Per option: the last block's gradient reduction, exposed after the last backward."""
    loss_bytes: float
    """Last stage only: the loss's fp32 tensors of the logits' size in its backward, and the logits where
    a pipeline keeps them (:func:`~whalepy.planner._cost_context.loss_peak_bytes`)."""
    seg_amp_saved: dict[StateOption, list[float]]
    """Per option and segment: bytes one block keeps for backward under autocast beyond its 16-bit
    figure (:meth:`CostContext.autocast_saved_extra`: fp32 tensors autocast keeps, cast copies), zero
    where the option's runtime does not use autocast. Kept like the block's own saved tensors: per
    micro-batch in flight, not while the block is checkpointed or its activations are offloaded, and
    once more for the block being recomputed."""
    seg_autocast: dict[StateOption, list[float]] | None = None
    """Per option, per block: the part of ``seg_exposed`` that is autocast's compute (fp32 tensors and
    casts, ``CostContext.autocast_extra``), not communication: reported as compute."""
    seg_offload: list[float] | None = None
    """Per block: exposed seconds per micro-batch of keeping its saved activations in host memory
    (:func:`~whalepy.cost_models.offload.estimate_activation_offload_time`); None where the group has
    no host memory given (activation offload not possible)."""
    seg_host: list[float] | None = None
    """Per block: host bytes per rank of its offloaded activations over the micro-batches in flight
    (:func:`~whalepy.cost_models.memory.estimate_stage_activation_host_bytes`)."""
    seg_ckoff: list[float] | None = None
    """Per block: seconds per micro-batch of keeping its checkpointed input in host memory, on top of
    the recompute (:func:`~whalepy.planner._offload_costs.checkpoint_offload_coefficients`); None where
    the group has no host memory given."""
    seg_ckhost: list[float] | None = None
    """Per block: host bytes per rank of its checkpointed input over the micro-batches in flight."""
    margin: float = 0.0
    """Device bytes left unplanned (``PlannerOptions.memory_margin``), already taken from ``capacity``."""
    loss_held_bytes: float = 0.0
    """GPipe's last stage only: the outputs and log-probabilities of the micro-batches in flight besides
    the one in its loss's backward (:func:`~whalepy.planner._cost_context.loss_kept_bytes`), held with
    the activations."""


@dataclass(frozen=True, slots=True)
class TiedCopyCoeff:
    """One tied parameter for the stage coefficients: a stage holding a block of ``holders`` (segments)
    and no block of ``owner`` (the segment of the block the profile counts it in, one block long)
    keeps a copy of ``local_params`` parameters per device (after TP)."""

    owner: int
    holders: tuple[int, ...]
    local_params: float
    row_excess: float = 0.0
    """:func:`~whalepy.ir.rules.tied_copy_row_excess` of the copy on the first replica (FSDP2's uneven
    rows, charged where the holders' option lowers to FSDP2)."""


def tied_copy_params(copies: Sequence[TiedCopyCoeff], counts: Sequence[int]) -> float:
    """Local parameters of the tied copies a stage with ``counts`` blocks per segment holds."""
    return sum(c.local_params for c in copies if not counts[c.owner] and any(counts[h] for h in c.holders))


@dataclass(slots=True)
class StageCoeffs:
    index: int
    cells: list[CellCoeffs]
    seg_params: list[float]
    """Parameters per device (after TP) of one block of each segment."""
    options: tuple[StateOption, ...]
    """State options allowed on this stage (offload only where every cell's group has the tier)."""
    sync: dict[StateOption, tuple[float, float]]
    """Per option, exposed communication after the optimizer step, ``(alpha, beta)`` seconds per step,
    beta per local parameter: ZeroRedundancyOptimizer's parameter all-gather (ZeRO-1 lowered to DDP)."""
    mem_beta: dict[StateOption, float]
    """GPU bytes of model states per local parameter."""
    cpu_beta: dict[StateOption, float]
    nvme_beta: dict[StateOption, float]
    working_bytes: dict[StateOption, float]
    """Per option, GPU bytes of FSDP2's working set (:func:`estimate_fsdp_working_bytes`)."""
    state_split: dict[StateOption, tuple[float, float, float]]
    """Per option, GPU bytes per local parameter of ``(parameters, gradients, optimizer states)``."""
    grads_freed: dict[StateOption, bool]
    """Per option: the gradients do not exist at the activation peak (:func:`grads_at_activation_peak`),
    so the peak is ``max(states - grads + buffers + activations, states + buffers)``."""
    buffer_beta: dict[StateOption, float]
    """Per option, GPU bytes per local parameter of buffers beside the model states (FSDP2's unsharded
    gradient accumulation across micro-batches)."""
    dp_ranks: tuple[int, ...]
    buffer_split: dict[StateOption, tuple[float, float, float]] = field(default_factory=dict)
    """Per option, ``buffer_beta`` by what holds it, bytes per local parameter: FSDP2's parameters kept
    gathered below ZeRO-3, unsharded fp32 gradients accumulated over micro-batches, autocast's 16-bit
    weight copies (the plan's :class:`~whalepy.ir.plan.StageCost` buffer items)."""
    host_fixed: dict[StateOption, float] = field(default_factory=dict)
    """Per option, host bytes per rank it holds whatever its parameter count: the disk tier's staging
    buffers (:func:`~whalepy.ir.rules.staging_slots` at prefetch depth 1, each the file-homed
    bytes of the model's largest local block); 0 without NVMe."""
    tied_copies: tuple[TiedCopyCoeff, ...] = ()
    """Copies of tied weights a stage holds when it runs a block that holds one but not the block the
    profile counts it in (HF GPT-2's LM head on another pipeline stage than the embedding): empty
    without pipeline stages."""
    tied_sync: tuple[tuple[dict[StateOption, float], ...], ...] = ()
    """Per cell, per tied copy (:attr:`tied_copies`), per option: seconds per step of the all-reduce of
    the copy's gradient over the pipeline ranks holding it (``whalepy.runtime.tied.sync_tied_grads``,
    before the optimizer step), charged to the stage holding the copy."""
    tied_segments: tuple[int, ...] = ()
    """Segments whose blocks share parameters (:attr:`~whalepy.ir.profile.BlockProfile.shares_params`):
    in a mix, all of the stage's such blocks take one option (FSDP2 keeps tied weights in one unit)."""
    seg_excess: tuple[float, ...] = ()
    """Per segment, :func:`~whalepy.ir.rules.fsdp_row_excess` of one block on the first replica (the one
    that holds most where ``dp`` does not divide a parameter's first dimension); empty where every
    block's is 0. Charged as parameters, in the model-state coefficients (:attr:`mem_beta`,
    :attr:`cpu_beta`, :attr:`nvme_beta`, :attr:`state_split`) of the options in :attr:`row_options`."""
    row_options: frozenset[StateOption] = frozenset()
    """The options whose lowering is FSDP2 (the ones that split first dimensions): where
    :attr:`seg_excess` is charged."""
    grads_after_forwards: dict[StateOption, bool] = field(default_factory=dict)
    """Per option: every micro-batch's forward runs before the gradients exist (GPipe,
    :func:`~whalepy.planner.runtime_costs.grads_after_forwards`): besides the activation peak without
    gradients, the stage peaks after the first micro-batch's backward with every gradient and
    ``inflight - 1`` micro-batches' activations (plus the recomputed block and the loss)."""
    working_grad: dict[StateOption, float] = field(default_factory=dict)
    """Per option, of :attr:`working_bytes`, FSDP2's unsharded gradient buffer of the running block: not
    yet allocated at the loss's backward, the activation peak (the peak is the larger of that without
    it and the first block's backward with it, :attr:`block_grad`)."""
    block_grad: dict[StateOption, float] = field(default_factory=dict)
    """Per option, GPU bytes the first block's backward adds while every activation but the loss's is
    still held: its gradients (FSDP2's buffer, :attr:`working_grad`; or, where the gradients are freed at
    the activation peak, the block's own fp32 gradients, the largest block's); 0: none."""
    host_grads: dict[StateOption, float] = field(default_factory=dict)
    """Per option, host bytes per local parameter of gradients the step frees and the backward makes
    again (FSDP2's ``CPUOffloadPolicy`` gradient shards; :attr:`ModelStateBytes.cpu_grads`): part of
    ``cpu_beta``, not yet there at the device's activation peak when the gradients are freed."""
    families: tuple[tuple[StateOption, ...], ...] = ()
    """Groups of two or more of :attr:`options` whose blocks may share this stage, each block keeping
    its states where its option says (granular tiers, M6-10T; :data:`~whalepy.planner.space.StateMix`):
    the options of one lowering (FSDP2, per-block ``fully_shard`` with per-block offload policies), ZeRO
    stage, gradient reduction and tiling, whose per-stage costs (working set, first-block gathers, last
    reduction, post-step communication, autocast copies) are one value, so a mix pays them once.
    Empty: one option per stage (without interleaving only, and unless ``PlannerOptions.mixed_tiers`` is
    off)."""


@dataclass(frozen=True, slots=True)
class NodeShare:
    """Nodes whose ranks split the same way over the stages: host memory and NVMe are the node's, shared
    by its GPUs, whichever stages they run."""

    ranks_per_stage: tuple[int, ...]
    """Ranks of each stage on one such node."""
    cpu_capacity: float | None
    """Host bytes of the node for offloaded states (:func:`~whalepy.cost_models.offload.host_capacity_per_gpu`
    times its GPUs); None: not given."""
    nvme_capacity: float | None


@dataclass(slots=True)
class CandidateCoeffs:
    candidate: Candidate
    segments: tuple[Segment, ...]
    stages: list[StageCoeffs]
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    nodes: tuple[NodeShare, ...]
    """Distinct node shares (host memory and NVMe constraints, one per share); empty when no stage may
    keep states or activations off the device."""
    bubble: float
    """``M + (S - 1)/v``: the step's coefficient of ``T`` when chunks are balanced (the lower bound's)."""

    @property
    def num_blocks(self) -> int:
        return sum(s.length for s in self.segments)


def stage_offloadable(sc: StageCoeffs) -> list[int]:
    """Segments whose blocks may keep their activations in host memory on stage ``sc`` (the space the
    ILP, the exhaustive solver and the brute force share): every cell's group has host memory, the
    block saves something, and its exposed copies cost less than recomputing it on every cell (where
    they do not, checkpointing the block is as fast and needs no host memory)."""
    if not sc.cells or any(c.seg_offload is None for c in sc.cells):
        return []
    return [g for g in range(len(sc.seg_params))
            if any(c.seg_saved[g] > 0 for c in sc.cells)
            and all(c.seg_offload[g] < c.seg_recompute[g] for c in sc.cells)]  # type: ignore[index]


def stage_host_activation(sc: StageCoeffs) -> list[float]:
    """Per block of each segment: host bytes per rank of the stage when offloaded (the largest over its
    cells, so every replica's host share is covered; 0 where not offloadable)."""
    ok = set(stage_offloadable(sc))
    return [max(c.seg_host[g] for c in sc.cells) if g in ok else 0.0  # type: ignore[index]
            for g in range(len(sc.seg_params))]


def stage_checkpoint_offloadable(sc: StageCoeffs) -> list[int]:
    """Segments whose checkpointed blocks may keep their input in host memory on stage ``sc``
    (``BlockPlan.checkpoint_offload``; the space the ILP and the exhaustive solver share): every cell's
    group has host memory and the block has an input."""
    if not sc.cells or any(c.seg_ckoff is None for c in sc.cells):
        return []
    return [g for g in range(len(sc.seg_params)) if any(c.seg_input[g] > 0 for c in sc.cells)]


def stage_host_checkpoint(sc: StageCoeffs) -> list[float]:
    """Per block of each segment: host bytes per rank of the stage when its checkpointed input is in host
    memory (the largest over its cells; 0 where not allowed)."""
    ok = set(stage_checkpoint_offloadable(sc))
    return [max(c.seg_ckhost[g] for c in sc.cells) if g in ok else 0.0  # type: ignore[index]
            for g in range(len(sc.seg_params))]


def node_fits(cc: CandidateCoeffs, cpu_bytes: Sequence[float], nvme_bytes: Sequence[float]) -> bool:
    """Whether every node holds its ranks' offloaded states: ``cpu_bytes[s]`` / ``nvme_bytes[s]`` per rank
    of stage ``s``, summed over the node's ranks, within its host memory and NVMe."""
    for n in cc.nodes:
        for per_rank, cap in ((cpu_bytes, n.cpu_capacity), (nvme_bytes, n.nvme_capacity)):
            need = sum(k * b for k, b in zip(n.ranks_per_stage, per_rank))
            if need > 0 and (cap is None or need > cap * (1 + 1e-6)):
                return False
    return True
