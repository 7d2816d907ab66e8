"""The one cost model of a fully specified configuration, shared by the ILP, the exhaustive search and
``whalepy.estimate``.

For an outer :class:`~whalepy.planner.space.Candidate` it computes *coefficients* (per block of each
segment, per stage, per ``(stage, device group, batch share)`` cell) from the pure functions in
``whalepy.cost_models``; every predicted figure is then a linear function of the inner decisions
(blocks per stage per segment ``n``, checkpointed blocks ``c``, blocks with activations in host memory
``o``, state option per stage), which is what
lets the ILP use exactly the same numbers as :func:`evaluate`.

Per cell of stage ``s`` (device D, micro-batch ``m``), with ``Pl`` the stage's parameters per device
after TP:

- ``compute = sum_g n_g * (fwd + bwd + 2 tp_ar) + c_g * (fwd + tp_ar)`` per micro-batch: block times by
  ``CostContext.block_time``, TP all-reduces of ``tp_comm_bytes`` forward and backward, repeated on
  recompute; the runtime does not overlap DTensor's TP collectives, so they are exposed; plus
  ``o_g * offload_g``, the copies of an offloaded block's saved activations, down in forward and up in
  backward, on the compute stream (:func:`~whalepy.planner._offload_costs.activation_offload_coefficients`);
- ``dp`` per micro-batch: data-parallel collectives not hidden by compute, per block as the runtime
  lowers the stage's state option (:func:`lowering_kind`, the runtime's own choice of DDP /
  ZeroRedundancyOptimizer / FSDP2): FSDP2 all-gathers overlap only the neighbouring block's compute
  (one block of prefetch) and slow it while they do (:func:`~whalepy.planner._runtime_costs.exposed_dp`), plus the first block's
  gather of each chunk (nothing to hide behind);
- ``fetch`` (parameters on CPU / NVMe): the fp32 shard ``4 Pl / dp`` per gather (forward, and backward
  under ZeRO-3) at the slowest hop's rate (:func:`~whalepy.cost_models.offload.fetch_seconds_per_byte`:
  prefetched deep enough that the hops pipeline), overlapping compute: ``T_cell = max(compute + dp, fetch) + p2p``;
- ``p2p``: one :func:`estimate_p2p_time` of the inter-stage activation per send (forward to the next
  (virtual) stage, gradient to the previous one), over the link the pair crosses;
- ``sync`` per step: the gradient reduction of the last micro-batch not hidden by its backward (DDP
  all-reduce per bucket, FSDP2 reduce-scatter per block; under pipelining all reduce-scatters after
  the last backward) plus the last block's, plus ZeroRedundancyOptimizer's parameter all-gather after
  the step. The ``tp`` DP groups of a stage share each node's NIC, so their inter-node bandwidth is
  divided by ``tp``;
- ``opt``: the optimizer step on the GPU (roofline of :data:`~whalepy.planner._offload_costs.ADAM_FLOPS_PER_PARAM` /
  :data:`~whalepy.planner._offload_costs.ADAM_BYTES_PER_PARAM`), or off it as :mod:`whalepy.cost_models.offload` prices each mode:
  ZeRO-Offload (parameters on the GPU, optimizer on the host) streams gradients down and steps on the
  CPU beside the last micro-batch's backward, exposed only past it (under fp16 or clipping the CPU
  step comes after the backward, exposed in full), then copies parameters back;
  host-resident parameters step on the CPU after backward; NVMe states are read and written around
  the step;
- memory: model states (:func:`estimate_model_state_bytes`) + buffers (FSDP2's working set of gathered
  blocks and a block's unsharded gradient, :func:`estimate_fsdp_working_bytes`; unsharded gradients
  accumulated over micro-batches under FSDP2; autocast's 16-bit weight copies) +
  ``inflight * max_k sum_g (n_kg saved_g + c_kg (input_g - saved_g) - o_kg saved_g)`` over the stage's
  chunks ``k`` (``inflight`` counts chunk activations; with balanced chunks this is Narayanan et al.'s
  ``inflight / v`` of the stage, with unbalanced ones the largest chunk is charged for every one in
  flight) + the largest checkpointed or offloaded block's saved bytes (recomputed or fetched back one
  block at a time), against
  :func:`usable_device_bytes` (device memory less the CUDA context, NCCL buffers and the allocator's
  fragmentation).

Checkpoint counts are per virtual stage (chunk) and segment, ``c_kg``; a physical stage's are the sum
over its chunks (``v = 1``: one chunk, the stage).

Step time = ``M T + (S - 1) Tc + X`` with ``T = max`` over cells of ``T_cell`` (per micro-batch, all
of a rank's chunks), ``Tc = max`` over cells and chunks of the chunk time per micro-batch and
``X = max`` over cells of ``sync + opt``. Why: the steady state runs ``M`` micro-batches
through the slowest rank (``M T``); the fill and drain are the pipeline bubble, which for interleaved
1F1B is ``(p - 1)/v`` of a stage's time per micro-batch (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2.2), i.e. ``p - 1``
*chunk* times: a micro-batch's forward (and backward) passes the ``p - 1`` ranks ahead of it one chunk
at a time. That ``(S - 1) T / v`` form holds only for balanced chunks; an unbalanced split waits on
its largest chunk at every hop, so the bubble is charged ``(S - 1)`` times the largest chunk
(``Tc >= T / v`` always, with equality when balanced). Chunk time = ``max(compute_k + dp_k,
fetch / v) + p2p_k``: its blocks' compute, recompute and exposed DP collectives plus its own sends; the
stage's offload fetches are spread evenly over its chunks. For ``v = 1`` the chunk is the stage,
``Tc = T`` and the step is ``(M + S - 1) T + X`` (GPipe / 1F1B).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from whalepy.cost_models.communication import (
    Collective,
    CommGroup,
    Link,
    estimate_collective_time,
    estimate_p2p_time,
)
from whalepy.cost_models.compute import estimate_block_time, estimate_kernels_time, precision_bytes
from whalepy.cost_models.memory import (
    AUTOCAST_WEIGHT_COPY_BYTES,
    estimate_fsdp_working_bytes,
    MASTER_GRAD_BYTES,
    ModelStateBytes,
    estimate_model_state_bytes,
    estimate_stage_model_state_bytes,
    inflight_microbatches,
)
from whalepy.cost_models.offload import host_capacity_per_gpu, nvme_capacity_per_gpu
from whalepy._capabilities import LoweringKind, offloads_to_host
from whalepy.plan import Tier, TPStyle, ZeroStage
from whalepy.planner.space import Candidate, GroupView, Hardware, Segment, StateOption, build_layout
from whalepy.planner._offload_costs import (
    activation_offload_coefficients,
    checkpoint_offload_coefficients,
    offload_coefficients,
)
from whalepy.planner._tiling_costs import tiled_options, tiling_latency_s, unit_params
from whalepy.planner._runtime_costs import (
    DPComm,
    build_dp_block_comm,
    dp_edges,
    exposed_dp,
    grads_at_activation_peak,
    lowering_kind,
    post_step_affine,
    usable_device_bytes,
    uses_autocast,
)
from whalepy.profile import BlockKind, BlockProfile, ModelProfile

def _shared_nic(group: CommGroup, sharers: int) -> CommGroup:
    if sharers <= 1 or group.num_nodes <= 1:
        return group
    return dataclasses.replace(group, inter=group.inter.shared(sharers))


def _pair_link(group: CommGroup) -> Link:
    return group.inter if group.num_nodes > 1 else group.intra


TP_REPLICATED_ACTIVATION_FRACTION = 10 / 34
"""Share of a transformer layer's saved activations that tensor parallelism does not split unless
sequence parallelism is on: Korthikanti et al. 2022 count ``34 sbh`` bytes per layer besides the
attention scores, of which ``10 sbh`` (the two layer-norm inputs, the dropout masks and inputs of the
residual branches) stay whole on every TP rank, giving ``sbh(10 + 24/t + 5as/(ht))``; with sequence
parallelism they are split too, ``sbh/t (34 + 5as/h)``. The profile measures a layer's total; this
fraction applies Korthikanti's split to it."""


LOSS_LOGPROB_BYTES = 4
"""Bytes per output element cross-entropy keeps for backward: its log-softmax, in fp32 (autocast runs
``cross_entropy`` / ``log_softmax`` in fp32). The profile captures the model, not the user's loss, so
the last stage is charged its output plus this."""


def has_sequence_rules(profile: ModelProfile) -> bool:
    return any(r.style is TPStyle.SEQUENCE for b in profile.blocks for r in b.tp_rules)


def tp_activation_fraction(block: BlockProfile, tp: int, sequence_parallel: bool) -> float:
    """Fraction of ``block``'s saved activations held per rank of a TP group of ``tp``."""
    if not tp_applies(block, tp) or tp == 1:
        return 1.0
    if block.kind is BlockKind.LAYER and not sequence_parallel:
        f = TP_REPLICATED_ACTIVATION_FRACTION
        return f + (1 - f) / tp
    return 1 / tp


def tp_applies(block: BlockProfile, tp: int) -> bool:
    """Whether a block is split across the TP group: it has TP rules and every sharded dimension divides
    by ``tp``. Otherwise it runs replicated on every rank of the TP group (whole compute, whole
    parameters), which the costs charge."""
    return tp > 1 and bool(block.tp_rules) and tp in block.tp_degrees


# -- coefficients -----------------------------------------------------------------------------------

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
    (FSDP2 all-gathers beside the block's forward and backward), see :func:`~whalepy.planner._runtime_costs.exposed_dp`."""
    edge: dict[StateOption, float]
    """Per option: the exposed all-gathers of a chunk's first block per micro-batch (nothing to hide
    behind)."""
    seg_tail: dict[StateOption, list[float]]
    """Per option, per block: extra exposed time of the last micro-batch's backward, where the block's
    gradient reduction joins its gathers."""
    tail_edge: dict[StateOption, float]
    """Per option: the last block's gradient reduction, exposed after the last backward."""
    loss_bytes: float
    """Last stage only: the model's output (logits) and the loss's fp32 log-probabilities, alive from
    the end of the forward into the loss's backward (:data:`LOSS_LOGPROB_BYTES`)."""
    autocast_bytes: dict[StateOption, float]
    """Per option: activation bytes autocast keeps beyond the 16-bit ones, the fp32 residual input of
    every block (``2 sbh`` per GPT block, measured; see ``AUTOCAST_WEIGHT_COPY_BYTES``). Autocast
    applies only without pipelining, so the stage holds every block and this is a constant."""
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
    host_fixed: dict[StateOption, float] = field(default_factory=dict)
    """Per option, host bytes per rank it holds whatever its parameter count: the disk tier's staging
    buffers (:func:`~whalepy._capabilities.staging_slots` at prefetch depth 1, each the file-homed
    bytes of the model's largest local block); 0 without NVMe."""
    tied_segments: tuple[int, ...] = ()
    """Segments whose blocks share parameters (:attr:`~whalepy.profile.BlockProfile.shares_params`):
    in a mix, all of the stage's such blocks take one option (FSDP2 keeps tied weights in one unit)."""
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
    def chunk_coefficient(self) -> float:
        """Coefficient of the largest chunk time ``Tc`` in the step: ``S - 1``."""
        return float(self.candidate.num_stages - 1)

    @property
    def num_blocks(self) -> int:
        return sum(s.length for s in self.segments)


class CostContext:
    """Caches block-level costs shared across candidates of one planning run."""

    def __init__(self, profile: ModelProfile, hw: Hardware, *, precision: str = "bf16",
                 sequence_parallel: bool | None = None, clip_gradients: bool = False) -> None:
        self.profile = profile
        self.hw = hw
        self.precision = precision
        self.clip_gradients = clip_gradients
        """The run clips gradients (``PlannerOptions.clip_gradients``): ZeRO-Offload steps after backward."""
        # Sequence parallelism is on when the profile carries SEQUENCE rules (the runtime lowers them).
        self.sequence_parallel = (has_sequence_rules(profile) if sequence_parallel is None
                                  else sequence_parallel)
        # Profiles measure bytes in the model's own dtype (often fp32 when built for planning); training
        # keeps activations, communicated tensors and weight reads in the training precision.
        self.byte_scale = precision_bytes(precision) / (torch.finfo(getattr(torch, profile.dtype)).bits // 8)
        self.block_time = functools.lru_cache(maxsize=None)(self._block_time)
        self.collective = functools.lru_cache(maxsize=None)(self._collective)
        # per-segment costs repeat across the stages and candidates of a run: computed once each, keyed
        # by the segments' identity (hashing them would hash every block profile); _kept keeps them alive
        self._kept: dict[int, tuple[Segment, ...]] = {}
        self._cache: dict[tuple, object] = {}  # type: ignore[type-arg]
        nonfinal = [b.output_bytes for b in profile.blocks[:-1]] or [0]
        self.boundary_bytes = float(max(nonfinal)) * self.byte_scale

    def _collective(self, kind: Collective, nbytes: float, group: CommGroup) -> float:
        return estimate_collective_time(kind, nbytes, group)

    def _cached(self, name: str, segments: tuple[Segment, ...], args: tuple, fn):  # type: ignore[no-untyped-def, type-arg]
        key = (name, id(segments), *args)
        if key not in self._cache:
            self._kept[id(segments)] = segments
            self._cache[key] = fn()
        return self._cache[key]

    def dp_block_comm(self, segments: tuple[Segment, ...], seg_params: tuple[float, ...],
                      group: CommGroup | None) -> DPComm:
        """:func:`build_dp_block_comm` of a stage's data-parallel group (cached)."""
        return self._cached("dp", segments, (seg_params, group), lambda: build_dp_block_comm(
            self.collective, segments, list(seg_params), group, self.precision))

    def segment_costs(self, segments: tuple[Segment, ...], device_name: str, tp: int, micro_batch: float,
                      tp_group: CommGroup | None) -> tuple[tuple[float, ...], ...]:
        """Cached :meth:`_segment_costs`."""
        return self._cached("seg", segments, (device_name, tp, micro_batch, tp_group),
                            lambda: self._segment_costs(segments, device_name, tp, micro_batch, tp_group))

    def _segment_costs(self, segments: tuple[Segment, ...], device_name: str, tp: int, micro_batch: float,
                       tp_group: CommGroup | None) -> tuple[tuple[float, ...], ...]:
        """Per segment, one block's ``(time, recompute, forward, backward, TP communication, saved
        bytes, input bytes)`` for one micro-batch on one device of a TP group (``tp_group``: its ranks'
        communicator, None without TP): forward and backward each run the block's TP all-reduce."""
        ratio = micro_batch / self.profile.batch_size
        rows = []
        for seg in segments:
            b = seg.block
            fwd, bwd = self.block_time(b.index, device_name, tp, micro_batch)
            ar = 0.0
            if tp_group is not None and tp_applies(b, tp) and b.tp_comm_bytes:
                ar = self.collective(Collective.ALL_REDUCE, b.tp_comm_bytes * ratio * self.byte_scale, tp_group)
            rows.append((fwd + bwd + 2 * ar, fwd + ar, fwd, bwd + ar, 2 * ar,
                         b.activation_bytes * ratio * self.byte_scale
                         * tp_activation_fraction(b, tp, self.sequence_parallel),
                         b.input_bytes * ratio * self.byte_scale))
        return tuple(zip(*rows)) if rows else ((),) * 7

    def _block_time(self, block_index: int, device_name: str, tp: int, micro_batch: float
                    ) -> tuple[float, float]:
        """Forward and backward seconds of one block for one micro-batch on one device of a TP group:
        the shape-dependent model of :func:`estimate_kernels_time` over the block's recorded GEMMs,
        attention and memory-bound bytes, with the device's profile (calibrated, shipped or datasheet
        transfer); blocks without recorded kernels use the aggregate roofline."""
        b = self.profile.blocks[block_index]
        device = next(g.device for g in self.hw.groups if g.device.name == device_name)
        ratio = micro_batch / self.profile.batch_size
        div = tp if tp_applies(b, tp) else 1
        if b.kernels is not None:
            return estimate_kernels_time(b.kernels, device=device, precision=self.precision, batch_ratio=ratio,
                                         tp=div, byte_scale=self.byte_scale)
        act_bytes = max(0.0, b.bytes_moved - b.param_bytes) * ratio
        t = estimate_block_time(forward_flops=b.fwd_flops * ratio / div,
                                forward_bytes=(b.param_bytes + act_bytes) * self.byte_scale / div, device=device,
                                backward_flops=b.bwd_flops * ratio / div, precision=self.precision)
        return t.forward_s, t.backward_s

    def model_time_per_sample(self, device: GroupView) -> float:
        """Forward + backward seconds of one sample through the whole model on one device."""
        return sum(sum(self.block_time(i, device.device.name, 1, 1.0)) for i in range(len(self.profile.blocks)))


def build_coefficients(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],
                       options: tuple[StateOption, ...], *, mixed_tiers: bool = False) -> CandidateCoeffs:
    """The candidate's cost coefficients; ``mixed_tiers``: blocks of one stage may keep their states in
    different tiers (:attr:`StageCoeffs.families`)."""
    hw = ctx.hw
    ranks = build_layout(cand, hw)
    S, t, d = cand.num_stages, cand.tp, cand.dp
    stages = []
    seg_params = [seg.block.num_params / (t if tp_applies(seg.block, t) else 1) for seg in segments]
    mixing = mixed_tiers and cand.virtual_stages == 1
    # Stages whose replicas run on the same groups over equal data-parallel links have the same options
    # and per-option coefficients (only in-flight micro-batches, sends and the loss differ from stage to
    # stage): computed once per candidate. CommGroup is a value (link speeds, ranks per node), not ranks.
    per_options: dict[tuple, tuple] = {}  # type: ignore[type-arg]
    per_cell: dict[tuple, tuple] = {}  # type: ignore[type-arg]
    pruned: dict[tuple, tuple] = {}  # type: ignore[type-arg]
    for s in range(S):
        dp_ranks = tuple(ranks[s][r][0] for r in range(d))
        dp_group = _shared_nic(hw.comm(dp_ranks), t) if d > 1 else None
        groups_here = frozenset(cand.cell_groups[s][r] for r in range(d))
        skey = (groups_here, dp_group)
        if skey not in per_options:
            per_options[skey] = _stage_options(ctx, cand, segments, options, groups_here, dp_group, seg_params,
                                               mixing)
        allowed, sync, mem_beta, cpu_beta, nvme_beta, working, buffer_beta, split, freed, host_fixed, tile_extra, \
            dp_comm = per_options[skey]
        # cells: replicas of this stage with the same group and share cost the same
        keyed: dict[tuple[int, int], list[int]] = {}
        for r in range(d):
            keyed.setdefault((cand.cell_groups[s][r], cand.batch_shares[r]), []).append(r)
        cells = []
        for (g, share), reps in keyed.items():
            cells.append(_cell(ctx, cand, segments, s, hw.groups[g], share, tuple(reps), ranks, allowed, dp_comm,
                               tile_extra, memo=(per_cell, skey)))
        ukey = (skey, tuple(id(c.seg_exposed) for c in cells))  # cells with the same per-option coefficients
        if ukey not in pruned:
            # an option only a mix may use is kept out of the pruning (it cannot stand in for one that
            # stands alone) and dropped where no family takes it
            beside = tuple(o for o in allowed if o.beside_offload)
            kept = _undominated(tuple(o for o in allowed if not o.beside_offload), sync, mem_beta, cpu_beta,
                                nvme_beta, working, buffer_beta, cells, host_fixed) + beside
            families = _families(kept, cand, sync, working, freed, cells) if mixing else ()
            pruned[ukey] = (tuple(o for o in kept if not o.beside_offload or any(o in f for f in families)), families)
        allowed, families = pruned[ukey]
        stages.append(StageCoeffs(index=s, cells=cells, seg_params=seg_params, options=allowed, sync=sync,
                                  mem_beta=mem_beta, cpu_beta=cpu_beta, nvme_beta=nvme_beta,
                                  working_bytes=working, state_split=split, grads_freed=freed,
                                  buffer_beta=buffer_beta, host_fixed=host_fixed,
                                  dp_ranks=dp_ranks, families=families,
                                  tied_segments=tuple(g for g, seg in enumerate(segments) if seg.block.shares_params)))
    return CandidateCoeffs(candidate=cand, segments=segments, stages=stages, ranks=ranks,
                           nodes=_node_shares(hw, ranks) if any(o.off_device for st in stages for o in st.options)
                           or any(stage_offloadable(st) or stage_checkpoint_offloadable(st) for st in stages)
                           else (), bubble=cand.bubble_coefficient)


def _stage_options(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],  # type: ignore[no-untyped-def]
                   options: tuple[StateOption, ...], groups_here: frozenset[int], dp_group: CommGroup | None,
                   seg_params: list[float], mixing: bool):
    """A stage's state options (tier, tiling, reduce-every-micro-batch and beside-offload variants) and
    their per-stage coefficients, for a stage on ``groups_here`` with data-parallel group ``dp_group``."""
    hw, t = ctx.hw, cand.tp
    allowed = tuple(o for o in options if all(_tier_ok(hw.groups[g], o) for g in groups_here))
    sync, mem_beta, cpu_beta, nvme_beta, working, buffer_beta, split, freed = {}, {}, {}, {}, {}, {}, {}, {}
    host_fixed: dict[StateOption, float] = {}
    low = precision_bytes(ctx.precision)
    stage_blocks = [seg.block for seg in segments]
    allowed = tiled_options(
        allowed, stage_blocks, tp=t,
        working_bytes=lambda p: estimate_fsdp_working_bytes(block_params=p, zero3=True, compute_bytes=low),
        capacity_bytes=min(usable_device_bytes(hw.groups[g], cand) for g in groups_here))
    allowed = reduce_each_options(allowed, cand)
    if mixing:
        allowed += beside_offload_options(allowed, cand)
    tile_extra = {o: [tiling_latency_s(ctx.collective, b, o.tiles, dp_group) for b in stage_blocks]
                  for o in allowed if o.tiles > 1}
    for o in allowed:
        kind = lowering_kind(o, cand)
        sync[o] = post_step_affine(ctx.collective, kind, dp_group, ctx.precision)
        st = stage_model_states(ctx, cand, o, 1.0)  # what the runtime holds between uses
        mem_beta[o], cpu_beta[o], nvme_beta[o] = st.resident, st.cpu, st.nvme
        # the disk tier's staging buffers, sized by the largest block (of the model: the stage's
        # blocks are not known here) at prefetch depth 1
        host_fixed[o] = stage_model_states(ctx, cand, o, 1.0, largest_block_params=max(seg_params)).cpu - st.cpu
        split[o] = (st.params, st.grads, st.optimizer)
        freed[o] = not grads_at_activation_peak(kind, cand)
        fsdp = kind == LoweringKind.FSDP
        zero3 = o.zero is ZeroStage.PARAMETERS
        unit = max(seg_params) if o.tiles == 1 else max(unit_params(b, o.tiles) for b in stage_blocks)
        working[o] = (estimate_fsdp_working_bytes(block_params=unit, zero3=zero3, compute_bytes=low)
                      if fsdp else 0.0)
        # below ZeRO-3 FSDP2 keeps the stage's parameters gathered, in the compute dtype, from
        # forward to backward (reshard_after_forward=False)
        gathered = low if fsdp and not zero3 else 0.0
        # FSDP2 without gradient sync (every micro-batch but the last) accumulates unsharded
        # gradients in its reduce dtype (fp32)
        # (none when every micro-batch's gradients are reduce-scattered into the sharded ones)
        accumulate = (MASTER_GRAD_BYTES - st.grads if fsdp and cand.num_microbatches > 1 and not o.reduce_each
                      else 0.0)
        autocast = AUTOCAST_WEIGHT_COPY_BYTES if uses_autocast(kind, ctx.precision) else 0.0
        # DDP's gradient buckets are views of the gradients (gradient_as_bucket_view=True): no copy
        buffer_beta[o] = gathered + max(0.0, accumulate) + autocast
    dp_comm = ctx.dp_block_comm(segments, tuple(seg_params), dp_group)
    return (allowed, sync, mem_beta, cpu_beta, nvme_beta, working, buffer_beta, split, freed, host_fixed,
            tile_extra, dp_comm)


def _families(options, cand, sync, working, freed, cells) -> tuple[tuple[StateOption, ...], ...]:  # type: ignore[no-untyped-def]
    """:attr:`StageCoeffs.families` of a stage: its options grouped by lowering, ZeRO stage, gradient
    reduction and tiling, where the runtime lowers their blocks side by side in one stage
    (:func:`whalepy._capabilities.mixed_tiers_error`) and the per-stage costs agree."""
    from whalepy._capabilities import mixed_tiers_error

    groups: dict[tuple, list[StateOption]] = {}  # type: ignore[type-arg]
    for o in options:
        kind = lowering_kind(o, cand)
        key = (kind, o.zero, o.reduce_each, o.tiles, sync[o], working[o], freed[o],
               tuple((c.edge[o], c.tail_edge[o], c.autocast_bytes[o]) for c in cells))
        groups.setdefault(key, []).append(o)
    out = []
    for (kind, *_), members in groups.items():
        if (len(members) > 1 and any(not o.beside_offload for o in members)
                and mixed_tiers_error(kind, [(o.param_tier, o.optimizer_tier) for o in members]) is None):
            out.append(tuple(members))
    return tuple(out)


def beside_offload_options(options: tuple[StateOption, ...], cand: Candidate) -> tuple[StateOption, ...]:
    """For granular tiers: each on-device option whose stage would not be lowered to FSDP2 on its own
    (one replica, or ZeRO-0/1 on DDP), costed as FSDP2 lowers it beside offloading blocks
    (:attr:`~whalepy.planner.space.StateOption.beside_offload`), where some option offloads."""
    if not any(offloads_to_host(o.param_tier, o.optimizer_tier) for o in options):
        return ()
    return tuple(dataclasses.replace(o, beside_offload=True) for o in options
                 if not o.off_device and lowering_kind(o, cand) is not LoweringKind.FSDP)


def reduce_each_options(options: tuple[StateOption, ...], cand: Candidate) -> tuple[StateOption, ...]:
    """``options`` plus, with several micro-batches, the variant of each that reduce-scatters every
    micro-batch (no unsharded gradient accumulation; ``StagePlan.reduce_every_microbatch``) where the
    runtime lowers it (:func:`whalepy._capabilities.reduce_every_microbatch_error`)."""
    from whalepy._capabilities import reduce_every_microbatch_error

    if cand.num_microbatches == 1:
        return options
    extra = [dataclasses.replace(o, reduce_each=True) for o in options if not o.reduce_each
             and reduce_every_microbatch_error(lowering_kind(o, cand), pp=cand.num_stages,
                                               param_tier=o.param_tier, optimizer_tier=o.optimizer_tier) is None]
    return tuple(options) + tuple(e for e in extra if e not in options)


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


def _node_shares(hw: Hardware, ranks) -> tuple[NodeShare, ...]:  # type: ignore[no-untyped-def]
    if ranks not in hw.node_shares:
        hw.node_shares[ranks] = _build_node_shares(hw, ranks)
    return hw.node_shares[ranks]


def _build_node_shares(hw: Hardware, ranks) -> tuple[NodeShare, ...]:  # type: ignore[no-untyped-def]
    placed = hw.cluster.rank_devices()
    per_node: dict[int, list[int]] = {}
    group_of: dict[int, str] = {}
    for s, row in enumerate(ranks):
        for cell in row:
            for rank in cell:
                p = placed[rank]
                per_node.setdefault(p.node, [0] * len(ranks))[s] += 1
                group_of[p.node] = p.group
    out = {}
    for node, counts in per_node.items():
        g = hw.group_by_name(group_of[node])
        host = host_capacity_per_gpu(g.cpu_memory_bytes, g.gpus_per_node)
        nvme = nvme_capacity_per_gpu(g.nvme_capacity_bytes, g.gpus_per_node)
        share = NodeShare(ranks_per_stage=tuple(counts),
                          cpu_capacity=None if host is None else host * g.gpus_per_node,
                          nvme_capacity=None if nvme is None else nvme * g.gpus_per_node)
        out[share] = None
    return tuple(out)


def node_fits(cc: CandidateCoeffs, cpu_bytes: Sequence[float], nvme_bytes: Sequence[float]) -> bool:
    """Whether every node holds its ranks' offloaded states: ``cpu_bytes[s]`` / ``nvme_bytes[s]`` per rank
    of stage ``s``, summed over the node's ranks, within its host memory and NVMe."""
    for n in cc.nodes:
        for per_rank, cap in ((cpu_bytes, n.cpu_capacity), (nvme_bytes, n.nvme_capacity)):
            need = sum(k * b for k, b in zip(n.ranks_per_stage, per_rank))
            if need > 0 and (cap is None or need > cap * (1 + 1e-6)):
                return False
    return True


def stage_model_states(ctx: CostContext, cand: Candidate, option: StateOption, num_params: float, *,
                       working_param_bytes: float = 0.0, largest_block_params: float = 0.0,
                       prefetch_depth: int = 1, num_blocks: int | None = None) -> ModelStateBytes:
    """Model-state bytes per device of a stage of ``cand`` with ``num_params`` local parameters under
    ``option``, as the runtime lowers it (:func:`estimate_model_state_bytes`; the last three size the
    disk tier's staging buffers; an option beside offloaded blocks is lowered as they are)."""
    return estimate_model_state_bytes(
        num_params=num_params, zero_stage=option.zero, dp_degree=cand.dp, tp_degree=cand.tp,
        pp_degree=cand.num_stages, precision=ctx.precision, param_tier=option.param_tier,
        optimizer_tier=option.optimizer_tier, working_param_bytes=working_param_bytes,
        largest_block_params=largest_block_params, prefetch_depth=prefetch_depth, num_blocks=num_blocks,
        stage_offloads=option.beside_offload)


def stage_held_bytes(ctx: CostContext, cand: Candidate, zero: ZeroStage,
                     blocks: Sequence[tuple[float, StateOption]], prefetch_depth: int = 1) -> ModelStateBytes:
    """What a device of a stage of ``cand`` holds between uses, by place, for its blocks' ``(local
    parameters, option)``: :func:`estimate_stage_model_state_bytes` (one lowering for the stage, one
    staging pool for its disk-tier blocks, ``prefetch_depth`` ahead); one option: as
    :func:`stage_model_states`."""
    return estimate_stage_model_state_bytes(
        blocks=[(n, o.param_tier, o.optimizer_tier) for n, o in blocks], zero_stage=zero, dp_degree=cand.dp,
        tp_degree=cand.tp, pp_degree=cand.num_stages, precision=ctx.precision, prefetch_depth=prefetch_depth)


def _undominated(options, sync, mem, cpu, nvme, working, buffers, cells, host_fixed):  # type: ignore[no-untyped-def]
    """Drop state options another option beats or ties on every coefficient (memory, host memory,
    NVMe, working set, post-step communication, exposed communication per block, optimizer step,
    fetches): every cost is monotone in them, so a dominated option is never strictly better. E.g.
    ZeRO-1 beats ZeRO-0 when both lower to FSDP2 and cost the same time."""
    def vec(o):  # type: ignore[no-untyped-def]
        v = [mem[o] + buffers[o], working[o], cpu[o], nvme[o], host_fixed[o], *sync[o]]
        for c in cells:
            v += [c.opt_beta[o], c.fetch_beta[o], c.edge[o], c.tail_edge[o], c.autocast_bytes[o],
                  *c.seg_exposed[o], *c.seg_tail[o]]
        return v

    vecs = {o: vec(o) for o in options}
    keep = []
    for o in options:
        dominated = False
        for p in options:
            if p is o or p == o:
                continue
            a, b = vecs[p], vecs[o]
            le = all(x <= y * (1 + 1e-9) + 1e-30 for x, y in zip(a, b))
            if le and (options.index(p) < options.index(o) or any(x < y * (1 - 1e-9) for x, y in zip(a, b))):
                dominated = True
                break
        if not dominated:
            keep.append(o)
    return tuple(keep)


def _tier_ok(g: GroupView, o: StateOption) -> bool:
    tiers = {o.optimizer_tier, o.param_tier}
    if Tier.CPU in tiers and g.cpu_memory_bytes is None:
        return False
    if Tier.NVME in tiers and (g.nvme_capacity_bytes is None or g.cpu_memory_bytes is None):
        return False
    return True


def _cell(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...], s: int, g: GroupView,
          share: int, reps: tuple[int, ...], ranks, allowed: tuple[StateOption, ...],  # type: ignore[no-untyped-def]
          dp_comm: DPComm, tile_extra: dict[StateOption, list[float]] | None = None,
          memo: tuple[dict, tuple] | None = None) -> CellCoeffs:  # type: ignore[type-arg]
    """``memo``: ``(dict, stage key)`` shared by the stages of one candidate; cells of the same group,
    share and TP group on stages of the same key get the same per-option coefficients (one computation,
    the same objects)."""
    hw, t, d, M = ctx.hw, cand.tp, cand.dp, cand.num_microbatches
    S, v = cand.num_stages, cand.virtual_stages
    mb = share / M
    ratio = mb / ctx.profile.batch_size
    rep = reps[0]
    tp_group = hw.comm(ranks[s][rep]) if t > 1 else None
    seg_time, seg_re, seg_fwd, seg_bwd, seg_comm, seg_saved, seg_input = (
        list(x) for x in ctx.segment_costs(segments, g.device.name, t, mb, tp_group))
    # point-to-point sends of this physical stage's chunks
    chunk_p2p = []
    nbytes = ctx.boundary_bytes * ratio
    J = S * v
    for k in range(v):
        j = s + k * S
        p2p = 0.0
        for nj in ((j + 1) if j < J - 1 else None, (j - 1) if j > 0 else None):
            if nj is None:
                continue
            ns = nj % S
            if ns == s:
                continue
            link = _pair_link(hw.comm((ranks[s][rep][0], ranks[ns][rep][0])))
            p2p += estimate_p2p_time(nbytes, link)
        chunk_p2p.append(p2p)
    p2p = sum(chunk_p2p)
    inflight = inflight_microbatches(cand.schedule, stage_index=s, num_stages=S, num_microbatches=M,
                                     virtual_stages=v)
    mkey = memo and (memo[1], g.index, share, tp_group)
    if memo is not None and mkey in memo[0]:
        opt_beta, opt_overlap, fetch_beta, seg_exposed, edge, seg_tail, tail_edge, autocast_bytes = memo[0][mkey]
    else:
        opt_beta, opt_overlap, fetch_beta, seg_exposed, edge, seg_tail, tail_edge, autocast_bytes = \
            _cell_options(ctx, cand, segments, g, allowed, dp_comm, tile_extra, seg_fwd, seg_bwd, seg_input)
        if memo is not None:
            memo[0][mkey] = (opt_beta, opt_overlap, fetch_beta, seg_exposed, edge, seg_tail, tail_edge,
                             autocast_bytes)
    loss_bytes = 0.0
    if s == S - 1 and ctx.profile.blocks:
        out = ctx.profile.blocks[-1].output_bytes * ratio
        elem = torch.finfo(getattr(torch, ctx.profile.dtype)).bits // 8
        loss_bytes = out * ctx.byte_scale + out / elem * LOSS_LOGPROB_BYTES
    cpu_cap = host_capacity_per_gpu(g.cpu_memory_bytes, g.gpus_per_node)
    nvme_cap = nvme_capacity_per_gpu(g.nvme_capacity_bytes, g.gpus_per_node)
    hkey = ("host copies", g.index, tuple(seg_saved), tuple(seg_input), inflight, v)
    if hkey not in ctx._cache:  # the same for every stage and candidate with these bytes in flight
        ctx._cache[hkey] = (
            activation_offload_coefficients(g, saved=seg_saved, inflight=inflight, virtual_stages=v),
            checkpoint_offload_coefficients(g, inputs=seg_input, inflight=inflight, virtual_stages=v))
    (seg_offload, seg_host), (seg_ckoff, seg_ckhost) = ctx._cache[hkey]  # type: ignore[misc]
    return CellCoeffs(group=g, share=share, micro_batch=mb, replicas=reps,
                      capacity=usable_device_bytes(g, cand), cpu_capacity=cpu_cap,
                      nvme_capacity=nvme_cap, seg_time=seg_time, seg_recompute=seg_re, seg_fwd=seg_fwd,
                      seg_bwd=seg_bwd, seg_comm=seg_comm, seg_saved=seg_saved, seg_input=seg_input, p2p=p2p,
                      chunk_p2p=chunk_p2p, inflight=inflight, opt_beta=opt_beta, opt_overlap=opt_overlap,
                      fetch_beta=fetch_beta,
                      seg_exposed=seg_exposed, edge=edge, seg_tail=seg_tail, tail_edge=tail_edge,
                      autocast_bytes=autocast_bytes, loss_bytes=loss_bytes, seg_offload=seg_offload,
                      seg_host=seg_host, seg_ckoff=seg_ckoff, seg_ckhost=seg_ckhost)


def _cell_options(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...], g: GroupView,  # type: ignore[no-untyped-def]
                  allowed: tuple[StateOption, ...], dp_comm: DPComm, tile_extra, seg_fwd, seg_bwd, seg_input):
    """A cell's per-option coefficients: optimizer step, fetches, exposed data-parallel communication per
    block and at the edges, autocast's copies."""
    t, d, S = cand.tp, cand.dp, cand.num_stages
    key = ("offload", g.index, d, t, S, allowed)
    if key not in ctx._cache:  # the same for every cell of this group and degrees, across candidates
        ctx._cache[key] = offload_coefficients(ctx, cand, g, allowed)
    opt_beta, opt_overlap, fetch_beta = ctx._cache[key]  # type: ignore[misc]
    seg_exposed, edge, seg_tail, tail_edge, autocast_bytes = {}, {}, {}, {}, {}
    pipelined = S > 1
    for o in allowed:
        kind, z3 = lowering_kind(o, cand), o.zero is ZeroStage.PARAMETERS
        rows = [exposed_dp(kind, z3, pipelined, f, b, dp_comm, i, o.reduce_each)
                for i, (f, b) in enumerate(zip(seg_fwd, seg_bwd))]
        seg_exposed[o] = [r[0] for r in rows]
        if tile_extra and o in tile_extra:  # memory-centric tiling's extra collectives (exposed)
            seg_exposed[o] = [x + e for x, e in zip(seg_exposed[o], tile_extra[o])]
        seg_tail[o] = [r[1] for r in rows]
        edge[o], tail_edge[o] = dp_edges(kind, z3, pipelined, dp_comm, o.reduce_each) if rows else (0.0, 0.0)
        autocast_bytes[o] = (sum(seg.length * x for seg, x in zip(segments, seg_input))
                             if uses_autocast(kind, ctx.precision) else 0.0)
    return opt_beta, opt_overlap, fetch_beta, seg_exposed, edge, seg_tail, tail_edge, autocast_bytes


# -- evaluation of a fully specified configuration: whalepy/planner/_evaluation.py (re-exported) ------

from whalepy.planner._evaluation import (  # noqa: E402 - after the coefficients it builds on
    CellEval,
    StageEval,
    Evaluation,
    memory_breakdown,
    chunk_busy_s,
    offload_s,
    evaluate_stage,
    chunk_counts_from_sizes,
    counts_from_boundaries,
    split_stage_checkpoints,
    evaluate,
    step_time,
    lower_bound,
)
