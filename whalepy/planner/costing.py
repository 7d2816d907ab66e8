"""The one cost model of a fully specified configuration, shared by the ILP, the exhaustive search and
``whalepy.estimate``.

For an outer :class:`~whalepy.planner.space.Candidate` it computes *coefficients* (per block of each
segment, per stage, per ``(stage, device group, batch share)`` cell) from the pure functions in
``whalepy.cost_models``; every predicted figure is then a linear function of the inner decisions
(blocks per stage per segment ``n``, checkpointed blocks ``c``, state option per stage), which is what
lets the ILP use exactly the same numbers as :func:`evaluate`.

Per cell of stage ``s`` (device D, micro-batch ``m``), with ``Pl`` the stage's parameters per device
after TP:

- ``compute = sum_g n_g * (fwd + bwd + 2 tp_ar) + c_g * (fwd + tp_ar)`` per micro-batch: block times by
  :func:`estimate_block_time` (roofline), TP all-reduces of ``tp_comm_bytes`` forward and backward,
  repeated on recompute;
- ``gather`` (ZeRO-3): all-gather of ``2 Pl`` bytes forward and backward per micro-batch over the
  stage's DP group; ``fetch`` (parameters on CPU / NVMe): ``2 * 2 Pl / dp`` bytes per micro-batch over
  the host link (:func:`estimate_offload_time`); both overlap compute:
  ``T_cell = max(compute, gather, fetch) + p2p``;
- ``p2p``: one :func:`estimate_p2p_time` of the inter-stage activation per send (forward to the next
  (virtual) stage, gradient to the previous one), over the link the pair crosses;
- ``sync`` per step over the DP group: all-reduce of ``2 Pl`` bytes (ZeRO-0), reduce-scatter +
  all-gather (ZeRO-1/2), reduce-scatter (ZeRO-3; its gathers are in ``gather``). Hidden behind the last
  micro-batch's backward: exposed ``max(0, sync - bwd)``. The ``tp`` DP groups of a stage share each
  node's NIC, so their inter-node bandwidth is divided by ``tp``;
- ``opt``: the optimizer step on the GPU (roofline of :data:`ADAM_FLOPS_PER_PARAM` /
  :data:`ADAM_BYTES_PER_PARAM`), or on the CPU (:data:`CPU_ADAM_PARAMS_PER_S_PER_NODE` shared by the
  node's GPUs, plus gradients down and parameters up over PCIe; NVMe adds reading and writing the
  12-byte states);
- memory: model states (:func:`estimate_model_state_bytes`, ZeRO-3 adds the largest block's gathered
  parameters) + ``inflight * max_k sum_g (n_kg saved_g + c_kg (input_g - saved_g))`` over the stage's
  chunks ``k`` (``inflight`` counts chunk activations; with balanced chunks this is Narayanan et al.'s
  ``inflight / v`` of the stage, with unbalanced ones the largest chunk is charged for every one in
  flight) + the largest checkpointed block's saved bytes (recomputed one block at a time), against
  ``USABLE_MEMORY_FRACTION`` of the device.

Checkpoint counts are per virtual stage (chunk) and segment, ``c_kg``; a physical stage's are the sum
over its chunks (``v = 1``: one chunk, the stage).

Step time = ``M T + (S - 1) Tc + X`` with ``T = max`` over cells of ``T_cell`` (per micro-batch, all
of a rank's chunks), ``Tc = max`` over cells and chunks of the chunk time per micro-batch and
``X = max`` over cells of ``max(0, sync - bwd) + opt``. Why: the steady state runs ``M`` micro-batches
through the slowest rank (``M T``); the fill and drain are the pipeline bubble, which for interleaved
1F1B is ``(p - 1)/v`` of a stage's time per micro-batch (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2.2), i.e. ``p - 1``
*chunk* times: a micro-batch's forward (and backward) passes the ``p - 1`` ranks ahead of it one chunk
at a time. That ``(S - 1) T / v`` form holds only for balanced chunks; an unbalanced split waits on
its largest chunk at every hop, so the bubble is charged ``(S - 1)`` times the largest chunk
(``Tc >= T / v`` always, with equality when balanced). Chunk time = ``max(compute_k, gather / v,
fetch / v) + p2p_k``: its blocks' compute and recompute plus its own sends; the stage's ZeRO-3 gathers
and offload fetches are spread evenly over its chunks. For ``v = 1`` the chunk is the stage,
``Tc = T`` and the step is ``(M + S - 1) T + X`` (GPipe / 1F1B).
"""

from __future__ import annotations

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
from whalepy.cost_models.compute import estimate_block_time, estimate_compute_time, precision_bytes
from whalepy.cost_models.memory import (
    ModelStateBytes,
    estimate_model_state_bytes,
    estimate_offload_time,
    inflight_microbatches,
)
from whalepy.plan import Tier, TPStyle, ZeroStage
from whalepy.planner.space import Candidate, GroupView, Hardware, Segment, StateOption, build_layout
from whalepy.profile import BlockKind, BlockProfile, ModelProfile

USABLE_MEMORY_FRACTION = 0.9
"""Fraction of device memory the planner fills; the rest is left for the CUDA context, NCCL buffers,
kernel workspaces and allocator fragmentation (PyTorch's caching allocator commonly strands 5-10%)."""

USABLE_HOST_MEMORY_FRACTION = 0.8
"""Fraction of a node's host memory available to offloaded states (the OS, data loading, pinned
staging buffers keep the rest)."""

ADAM_FLOPS_PER_PARAM = 12.0
"""Element-wise operations of one mixed-precision Adam update per parameter (moments, bias
correction, square root, division, weight update)."""

ADAM_BYTES_PER_PARAM = 28.0
"""Device-memory traffic of one Adam update per parameter: read fp32 master, momentum and variance
(12) and the 16-bit gradient (2); write the three fp32 tensors (12) and the 16-bit parameter (2)."""

CPU_ADAM_PARAMS_PER_S_PER_NODE = 4.5e9
"""Parameters per second one node's CPUs update with a vectorised CPU Adam: ZeRO-Offload's CPU-Adam
updates 1 B parameters in about 0.22 s (Ren et al., "ZeRO-Offload", USENIX ATC'21, Fig. 7). Shared by
the node's GPUs."""

_FIT_N1, _FIT_N2 = float(2**30), float(2**31)


def _affine(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """``(alpha, beta)`` with ``fn(n) = alpha + beta n`` for ``n > 0`` (alpha-beta costs are affine)."""
    f1, f2 = fn(_FIT_N1), fn(_FIT_N2)
    beta = (f2 - f1) / (_FIT_N2 - _FIT_N1)
    return max(0.0, f1 - beta * _FIT_N1), beta


def _shared_nic(group: CommGroup, sharers: int) -> CommGroup:
    if sharers <= 1 or group.num_nodes <= 1:
        return group
    inter = Link(bandwidth=group.inter.bandwidth / sharers, latency=group.inter.latency)
    return CommGroup(ranks_per_node=group.ranks_per_node, num_nodes=group.num_nodes,
                     intra=group.intra, inter=inter)


def _pair_link(group: CommGroup) -> Link:
    return group.inter if group.num_nodes > 1 else group.intra


TP_REPLICATED_ACTIVATION_FRACTION = 10 / 34
"""Share of a transformer layer's saved activations that tensor parallelism does not split unless
sequence parallelism is on: Korthikanti et al. 2022 count ``34 sbh`` bytes per layer besides the
attention scores, of which ``10 sbh`` (the two layer-norm inputs, the dropout masks and inputs of the
residual branches) stay whole on every TP rank, giving ``sbh(10 + 24/t + 5as/(ht))``; with sequence
parallelism they are split too, ``sbh/t (34 + 5as/h)``. The profile measures a layer's total; this
fraction applies Korthikanti's split to it."""


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
    """Host memory per GPU for offloaded states, bytes (None: no CPU offload possible)."""
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
    """Optimizer step seconds per local parameter of the stage."""
    fetch_beta: dict[StateOption, float]
    """Parameter fetch seconds per micro-batch per local parameter (parameters off the GPU)."""


@dataclass(slots=True)
class StageCoeffs:
    index: int
    cells: list[CellCoeffs]
    seg_params: list[float]
    """Parameters per device (after TP) of one block of each segment."""
    options: tuple[StateOption, ...]
    """State options allowed on this stage (offload only where every cell's group has the tier)."""
    sync: dict[StateOption, tuple[float, float]]
    """Per option, ``(alpha, beta)`` seconds per step, beta per local parameter."""
    gather: dict[StateOption, tuple[float, float]]
    """Per option, ZeRO-3 parameter gathers per micro-batch ``(alpha, beta)``."""
    mem_beta: dict[StateOption, float]
    """GPU bytes of model states per local parameter."""
    cpu_beta: dict[StateOption, float]
    nvme_beta: dict[StateOption, float]
    working_bytes: dict[StateOption, float]
    """Per option, bytes not proportional to the stage's parameters: under FSDP2 ZeRO-3 the largest
    block's gathered parameters in the compute dtype, resident while it runs."""
    dp_ranks: tuple[int, ...]


@dataclass(slots=True)
class CandidateCoeffs:
    candidate: Candidate
    segments: tuple[Segment, ...]
    stages: list[StageCoeffs]
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
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
                 sequence_parallel: bool | None = None) -> None:
        self.profile = profile
        self.hw = hw
        self.precision = precision
        # Sequence parallelism is on when the profile carries SEQUENCE rules (the runtime lowers them).
        self.sequence_parallel = (has_sequence_rules(profile) if sequence_parallel is None
                                  else sequence_parallel)
        # Profiles measure bytes in the model's own dtype (often fp32 when built for planning); training
        # keeps activations, communicated tensors and weight reads in the training precision.
        self.byte_scale = precision_bytes(precision) / (torch.finfo(getattr(torch, profile.dtype)).bits // 8)
        self.block_time = functools.lru_cache(maxsize=None)(self._block_time)
        self.collective = functools.lru_cache(maxsize=None)(self._collective)
        nonfinal = [b.output_bytes for b in profile.blocks[:-1]] or [0]
        self.boundary_bytes = float(max(nonfinal)) * self.byte_scale

    def _collective(self, kind: Collective, nbytes: float, group: CommGroup) -> float:
        return estimate_collective_time(kind, nbytes, group)

    def _block_time(self, block_index: int, device_name: str, tp: int, micro_batch: float
                    ) -> tuple[float, float]:
        b = self.profile.blocks[block_index]
        device = next(g.device for g in self.hw.groups if g.device.name == device_name)
        ratio = micro_batch / self.profile.batch_size
        div = tp if tp_applies(b, tp) else 1
        act_bytes = max(0.0, b.bytes_moved - b.param_bytes) * ratio
        t = estimate_block_time(forward_flops=b.fwd_flops * ratio / div,
                                forward_bytes=(b.param_bytes + act_bytes) * self.byte_scale / div, device=device,
                                backward_flops=b.bwd_flops * ratio / div, precision=self.precision)
        return t.forward_s, t.backward_s

    def model_time_per_sample(self, device: GroupView) -> float:
        """Forward + backward seconds of one sample through the whole model on one device."""
        return sum(sum(self.block_time(i, device.device.name, 1, 1.0)) for i in range(len(self.profile.blocks)))


def build_coefficients(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],
                       options: tuple[StateOption, ...]) -> CandidateCoeffs:
    hw, prof = ctx.hw, ctx.profile
    ranks = build_layout(cand, hw)
    S, v, t, d, M = cand.num_stages, cand.virtual_stages, cand.tp, cand.dp, cand.num_microbatches
    J = S * v
    stages = []
    seg_params = [seg.block.num_params / (t if tp_applies(seg.block, t) else 1) for seg in segments]
    block = precision_bytes(ctx.precision) * max(seg_params)  # the largest block, gathered for compute
    for s in range(S):
        dp_ranks = tuple(ranks[s][r][0] for r in range(d))
        dp_group = _shared_nic(hw.comm(dp_ranks), t) if d > 1 else None
        groups_here = {cand.cell_groups[s][r] for r in range(d)}
        allowed = tuple(o for o in options if all(_tier_ok(hw.groups[g], o) for g in groups_here))
        sync, gather, mem_beta, cpu_beta, nvme_beta, working = {}, {}, {}, {}, {}, {}
        for o in allowed:
            sync[o] = _sync_affine(ctx, o, dp_group)
            gather[o] = _gather_affine(ctx, dp_group) if o.zero is ZeroStage.PARAMETERS else (0.0, 0.0)
            st = stage_model_states(ctx, cand, o, 1.0)
            mem_beta[o], cpu_beta[o], nvme_beta[o] = st.gpu, st.cpu, st.nvme
            working[o] = stage_model_states(ctx, cand, o, 0.0, working_param_bytes=block).working_params
        # cells: replicas of this stage with the same group and share cost the same
        keyed: dict[tuple[int, int], list[int]] = {}
        for r in range(d):
            keyed.setdefault((cand.cell_groups[s][r], cand.batch_shares[r]), []).append(r)
        cells = []
        for (g, share), reps in keyed.items():
            cells.append(_cell(ctx, cand, segments, s, hw.groups[g], share, tuple(reps), ranks, allowed))
        allowed = _undominated(allowed, sync, gather, mem_beta, cpu_beta, nvme_beta, cells)
        stages.append(StageCoeffs(index=s, cells=cells, seg_params=seg_params, options=allowed, sync=sync,
                                  gather=gather, mem_beta=mem_beta, cpu_beta=cpu_beta, nvme_beta=nvme_beta,
                                  working_bytes=working, dp_ranks=dp_ranks))
    del J, M, prof
    return CandidateCoeffs(candidate=cand, segments=segments, stages=stages, ranks=ranks,
                           bubble=cand.bubble_coefficient)


def stage_model_states(ctx: CostContext, cand: Candidate, option: StateOption, num_params: float, *,
                       working_param_bytes: float = 0.0) -> ModelStateBytes:
    """Model-state bytes per device of a stage of ``cand`` with ``num_params`` local parameters under
    ``option``, as the runtime lowers it (:func:`estimate_model_state_bytes`)."""
    return estimate_model_state_bytes(
        num_params=num_params, zero_stage=option.zero, dp_degree=cand.dp, tp_degree=cand.tp,
        pp_degree=cand.num_stages, precision=ctx.precision, param_tier=option.param_tier,
        optimizer_tier=option.optimizer_tier, working_param_bytes=working_param_bytes)


def _undominated(options, sync, gather, mem, cpu, nvme, cells):  # type: ignore[no-untyped-def]
    """Drop state options another option beats or ties on every coefficient (memory, host memory,
    NVMe, synchronisation, gathers, optimizer step, fetches): every cost is monotone in them, so a
    dominated option is never strictly better. E.g. ZeRO-1 beats ZeRO-0 when reduce-scatter +
    all-gather cost what an all-reduce costs."""
    def vec(o):  # type: ignore[no-untyped-def]
        z3 = o.zero is ZeroStage.PARAMETERS
        v = [mem[o], 1.0 if z3 else 0.0, cpu[o], nvme[o], *sync[o], *gather[o]]
        for c in cells:
            v += [c.opt_beta[o], c.fetch_beta[o]]
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
            strict = any(x < y * (1 - 1e-9) for x, y in zip(a, b))
            if le and (strict or options.index(p) < options.index(o)):
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


def _sync_affine(ctx: CostContext, o: StateOption, group: CommGroup | None) -> tuple[float, float]:
    if group is None:
        return 0.0, 0.0
    c = ctx.collective
    if o.zero is ZeroStage.NONE:
        return _affine(lambda n: c(Collective.ALL_REDUCE, 2 * n, group))
    if o.zero is ZeroStage.PARAMETERS:
        return _affine(lambda n: c(Collective.REDUCE_SCATTER, 2 * n, group))
    return _affine(lambda n: c(Collective.REDUCE_SCATTER, 2 * n, group) + c(Collective.ALL_GATHER, 2 * n, group))


def _gather_affine(ctx: CostContext, group: CommGroup | None) -> tuple[float, float]:
    if group is None:
        return 0.0, 0.0
    return _affine(lambda n: 2 * ctx.collective(Collective.ALL_GATHER, 2 * n, group))


def _cell(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...], s: int, g: GroupView,
          share: int, reps: tuple[int, ...], ranks, allowed: tuple[StateOption, ...]) -> CellCoeffs:  # type: ignore[no-untyped-def]
    hw, t, d, M = ctx.hw, cand.tp, cand.dp, cand.num_microbatches
    S, v = cand.num_stages, cand.virtual_stages
    mb = share / M
    ratio = mb / ctx.profile.batch_size
    rep = reps[0]
    tp_group = hw.comm(ranks[s][rep]) if t > 1 else None
    seg_time, seg_re, seg_fwd, seg_bwd, seg_comm, seg_saved, seg_input = [], [], [], [], [], [], []
    for seg in segments:
        b = seg.block
        fwd, bwd = ctx.block_time(b.index, g.device.name, t, mb)
        ar = 0.0
        if tp_group is not None and tp_applies(b, t) and b.tp_comm_bytes:
            ar = ctx.collective(Collective.ALL_REDUCE, b.tp_comm_bytes * ratio * ctx.byte_scale, tp_group)
        seg_time.append(fwd + bwd + 2 * ar)
        seg_re.append(fwd + ar)
        seg_fwd.append(fwd)
        seg_bwd.append(bwd + ar)
        seg_comm.append(2 * ar)
        seg_saved.append(b.activation_bytes * ratio * ctx.byte_scale * tp_activation_fraction(b, t, ctx.sequence_parallel))
        seg_input.append(b.input_bytes * ratio * ctx.byte_scale)
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
    opt_beta, fetch_beta = {}, {}
    n = 1e9
    host = g.device.host_link_bandwidth
    for o in allowed:
        per_local = 1.0 / d if o.zero >= ZeroStage.OPTIMIZER else 1.0
        if o.optimizer_tier is Tier.GPU:
            step = estimate_compute_time(flops=ADAM_FLOPS_PER_PARAM * n, bytes_moved=ADAM_BYTES_PER_PARAM * n,
                                         device=g.device, precision="fp32") / n
        else:
            step = g.gpus_per_node / CPU_ADAM_PARAMS_PER_S_PER_NODE + 4.0 / host
            if o.optimizer_tier is Tier.NVME:
                # the node's NVMe drives serve all its GPUs at once
                step += g.gpus_per_node * (12.0 / g.nvme_read_bandwidth  # type: ignore[operator]
                                           + 12.0 / g.nvme_write_bandwidth)  # type: ignore[operator]
        opt_beta[o] = step * per_local
        if o.param_tier is Tier.GPU:
            fetch_beta[o] = 0.0
        else:
            nvme = (g.nvme_read_bandwidth / g.gpus_per_node  # type: ignore[operator]
                    if o.param_tier is Tier.NVME else None)  # shared by the node's GPUs
            per_byte = estimate_offload_time(bytes_to_move=n, host_link_bandwidth=host, nvme_read_bandwidth=nvme,
                                             compute_time_s=0.0, prefetch_depth=2) / n
            fetch_beta[o] = per_byte * 2 * 2 / d
    cpu_cap = (g.cpu_memory_bytes * USABLE_HOST_MEMORY_FRACTION / g.gpus_per_node
               if g.cpu_memory_bytes is not None else None)
    nvme_cap = g.nvme_capacity_bytes / g.gpus_per_node if g.nvme_capacity_bytes is not None else None
    return CellCoeffs(group=g, share=share, micro_batch=mb, replicas=reps,
                      capacity=g.device.memory_bytes * USABLE_MEMORY_FRACTION, cpu_capacity=cpu_cap,
                      nvme_capacity=nvme_cap, seg_time=seg_time, seg_recompute=seg_re, seg_fwd=seg_fwd,
                      seg_bwd=seg_bwd, seg_comm=seg_comm, seg_saved=seg_saved, seg_input=seg_input, p2p=p2p,
                      chunk_p2p=chunk_p2p, inflight=inflight, opt_beta=opt_beta, fetch_beta=fetch_beta)


# -- evaluation of a fully specified configuration ----------------------------------------------------

@dataclass(slots=True)
class CellEval:
    cell: CellCoeffs
    compute_s: float
    comm_s: float
    gather_s: float
    fetch_s: float
    time_s: float
    """Per micro-batch: max(compute, gather, fetch) + p2p."""
    chunk_time_s: float
    """Per micro-batch, the largest chunk: max(compute_k, gather / v, fetch / v) + p2p_k (v = 1: time_s)."""
    exposed_sync_s: float
    opt_s: float
    memory_bytes: float
    states_bytes: float
    activation_bytes: float
    cpu_bytes: float
    nvme_bytes: float

    @property
    def tail_s(self) -> float:
        return self.exposed_sync_s + self.opt_s

    @property
    def fits(self) -> bool:
        c = self.cell
        ok = self.memory_bytes <= c.capacity * (1 + 1e-6)
        if self.cpu_bytes > 0:
            ok = ok and c.cpu_capacity is not None and self.cpu_bytes <= c.cpu_capacity * (1 + 1e-6)
        if self.nvme_bytes > 0:
            ok = ok and c.nvme_capacity is not None and self.nvme_bytes <= c.nvme_capacity * (1 + 1e-6)
        return ok


@dataclass(slots=True)
class StageEval:
    index: int
    counts: tuple[int, ...]
    """Blocks per segment on this stage (all chunks)."""
    checkpoints: tuple[int, ...]
    """Checkpointed blocks per segment on this stage (all chunks)."""
    option: StateOption
    local_params: float
    sync_s: float
    cells: list[CellEval]
    chunk_counts: tuple[tuple[int, ...], ...] = ()
    """Per chunk (virtual stage ``index + k S``), blocks per segment."""
    chunk_checkpoints: tuple[tuple[int, ...], ...] = ()

    @property
    def time_s(self) -> float:
        return max(c.time_s for c in self.cells)

    @property
    def chunk_time_s(self) -> float:
        return max(c.chunk_time_s for c in self.cells)

    @property
    def tail_s(self) -> float:
        return max(c.tail_s for c in self.cells)

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.cells)


@dataclass(slots=True)
class Evaluation:
    coeffs: CandidateCoeffs
    stages: list[StageEval]
    boundaries: tuple[int, ...]
    """Blocks in each virtual stage, in model order."""
    T: float
    X: float
    step_time_s: float
    fits: bool
    notes: list[str] = field(default_factory=list)
    Tc: float = 0.0
    """Largest chunk time per micro-batch (``T`` without interleaving)."""

    @property
    def bubble_s(self) -> float:
        """Pipeline fill and drain per step: ``(S - 1) Tc``."""
        return self.coeffs.chunk_coefficient * self.Tc


def evaluate_stage(sc: StageCoeffs, chunk_counts: Sequence[Sequence[int]], chunk_ckpts: Sequence[Sequence[int]],
                   option: StateOption, *, dp: int) -> StageEval:
    """Cost of one physical stage: blocks and checkpointed blocks per segment of each of its chunks
    (one chunk without interleaving) and its state option."""
    v = len(chunk_counts)
    G = len(sc.seg_params)
    counts = [sum(row[g] for row in chunk_counts) for g in range(G)]
    ckpts = [sum(row[g] for row in chunk_ckpts) for g in range(G)]
    pl = sum(n * p for n, p in zip(counts, sc.seg_params))
    alpha, beta = sc.sync[option]
    sync = alpha + beta * pl if dp > 1 else 0.0
    ga, gb = sc.gather[option]
    gather = ga + gb * pl if (dp > 1 and option.zero is ZeroStage.PARAMETERS) else 0.0
    states = sc.mem_beta[option] * pl + sc.working_bytes[option]
    cells = []
    for c in sc.cells:
        compute = sum(n * x for n, x in zip(counts, c.seg_time)) + sum(k * x for k, x in zip(ckpts, c.seg_recompute))
        comm = sum(n * x for n, x in zip(counts, c.seg_comm))
        bwd = sum(n * x for n, x in zip(counts, c.seg_bwd))
        fetch = c.fetch_beta[option] * pl
        time_s = max(compute, gather, fetch) + c.p2p
        kept = [sum(n * a + k * (i - a) for n, k, a, i in zip(cn, ck, c.seg_saved, c.seg_input))
                for cn, ck in zip(chunk_counts, chunk_ckpts)]
        if v == 1:
            chunk_time = time_s
        else:
            chunk_time = max(max(sum(n * x for n, x in zip(cn, c.seg_time))
                                 + sum(k * x for k, x in zip(ck, c.seg_recompute)), gather / v, fetch / v) + p
                             for cn, ck, p in zip(chunk_counts, chunk_ckpts, c.chunk_p2p))
        peak = max((a for k, a in zip(ckpts, c.seg_saved) if k > 0), default=0.0)
        act = c.inflight * max(kept) + peak
        cells.append(CellEval(
            cell=c, compute_s=compute - comm, comm_s=comm + c.p2p, gather_s=gather, fetch_s=fetch,
            time_s=time_s, chunk_time_s=chunk_time, exposed_sync_s=max(0.0, sync - bwd),
            opt_s=c.opt_beta[option] * pl, memory_bytes=states + act, states_bytes=states, activation_bytes=act,
            cpu_bytes=sc.cpu_beta[option] * pl, nvme_bytes=sc.nvme_beta[option] * pl))
    return StageEval(index=sc.index, counts=tuple(counts), checkpoints=tuple(ckpts), option=option,
                     local_params=pl, sync_s=sync, cells=cells,
                     chunk_counts=tuple(tuple(r) for r in chunk_counts),
                     chunk_checkpoints=tuple(tuple(r) for r in chunk_ckpts))


def chunk_counts_from_sizes(cc: CandidateCoeffs, sizes: Sequence[int]) -> list[list[int]]:
    """Blocks per segment of each virtual stage, in model order."""
    out = [[0] * len(cc.segments) for _ in sizes]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    for j in range(len(sizes)):
        lo, hi = bounds[j], bounds[j + 1]
        for seg in cc.segments:
            a, b = max(lo, seg.start), min(hi, seg.start + seg.length)
            if b > a:
                out[j][seg.index] = b - a
    return out


def counts_from_boundaries(cc: CandidateCoeffs, sizes: Sequence[int]) -> list[list[int]]:
    """Blocks per physical stage per segment from the sizes of the virtual stages."""
    S = cc.candidate.num_stages
    counts = [[0] * len(cc.segments) for _ in range(S)]
    for j, row in enumerate(chunk_counts_from_sizes(cc, sizes)):
        for g, n in enumerate(row):
            counts[j % S][g] += n
    return counts


def split_stage_checkpoints(chunk_counts: Sequence[Sequence[int]], stage_ckpts: Sequence[int]) -> list[list[int]]:
    """Spread a stage's checkpointed blocks per segment over its chunks, filling the first chunk first."""
    left = list(stage_ckpts)
    out = []
    for row in chunk_counts:
        take = [min(n, k) for n, k in zip(row, left)]
        left = [k - t for k, t in zip(left, take)]
        out.append(take)
    if any(left):
        raise ValueError(f"checkpoint counts {list(stage_ckpts)} exceed the stage's blocks per segment")
    return out


def evaluate(cc: CandidateCoeffs, sizes: Sequence[int], ckpts: Sequence[Sequence[int]],
             options: Sequence[StateOption]) -> Evaluation:
    """Cost of a fully specified configuration: virtual-stage ``sizes``, checkpointed blocks per segment
    of every virtual stage (``J`` rows, model order; ``S`` rows of per-stage counts are spread over each
    stage's chunks first chunk first), and a state option per stage."""
    cand = cc.candidate
    S, v = cand.num_stages, cand.virtual_stages
    if len(sizes) != cand.num_virtual or sum(sizes) != cc.num_blocks or min(sizes) < 1:
        raise ValueError(f"stage sizes {list(sizes)} do not split {cc.num_blocks} blocks into "
                         f"{cand.num_virtual} non-empty stages")
    chunk_counts = chunk_counts_from_sizes(cc, sizes)
    if len(ckpts) == cand.num_virtual:
        chunk_ckpts = [list(r) for r in ckpts]
    elif len(ckpts) == S:
        chunk_ckpts = [[] for _ in range(cand.num_virtual)]
        for s in range(S):
            rows = split_stage_checkpoints([chunk_counts[s + k * S] for k in range(v)], ckpts[s])
            for k in range(v):
                chunk_ckpts[s + k * S] = rows[k]
    else:
        raise ValueError(f"{len(ckpts)} checkpoint rows for {cand.num_virtual} virtual stages")
    stages = []
    for s, sc in enumerate(cc.stages):
        if options[s] not in sc.options:
            raise ValueError(f"stage {s}: state option {options[s]} is not available there")
        stages.append(evaluate_stage(sc, [chunk_counts[s + k * S] for k in range(v)],
                                     [chunk_ckpts[s + k * S] for k in range(v)], options[s], dp=cand.dp))
    T = max(st.time_s for st in stages)
    Tc = max(st.chunk_time_s for st in stages)
    X = max(st.tail_s for st in stages)
    return Evaluation(coeffs=cc, stages=stages, boundaries=tuple(sizes), T=T, X=X,
                      step_time_s=step_time(cc, T, Tc, X), fits=all(st.fits for st in stages), Tc=Tc)


def step_time(cc: CandidateCoeffs, T: float, Tc: float, X: float) -> float:
    """``M T + (S - 1) Tc + X`` (see the module docstring)."""
    return cc.candidate.num_microbatches * T + cc.chunk_coefficient * Tc + X


def lower_bound(ctx: CostContext, cand: Candidate) -> float:
    """A step time no plan of ``cand`` beats, times the bubble coefficient: for every replica, its
    whole-model compute (with TP all-reduces) divided over its stages as if blocks were infinitely
    divisible, ``T >= 1 / sum_s (1 / full_model_time_on_group(s))`` (``full / S`` on one device type);
    no p2p, gradient sync or memory limits."""
    best = 0.0
    kinds = {(share, tuple(row[r] for row in cand.cell_groups)) for r, share in enumerate(cand.batch_shares)}
    for share, groups in kinds:
        mb = share / cand.num_microbatches
        ratio = mb / ctx.profile.batch_size
        full: dict[int, float] = {}
        for g in set(groups):
            view = ctx.hw.groups[g]
            tp_group = ctx.hw.comm(view.ranks[:cand.tp]) if cand.tp > 1 else None
            total = 0.0
            for b in ctx.profile.blocks:
                total += sum(ctx.block_time(b.index, view.device.name, cand.tp, mb))
                if tp_group is not None and tp_applies(b, cand.tp) and b.tp_comm_bytes:
                    total += 2 * ctx.collective(Collective.ALL_REDUCE, b.tp_comm_bytes * ratio, tp_group)
            full[g] = total
        best = max(best, 1.0 / sum(1.0 / full[g] for g in groups))
    return cand.bubble_coefficient * best
