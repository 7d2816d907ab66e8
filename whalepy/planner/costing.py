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
  (one block of prefetch) and slow it while they do (:func:`~whalepy.planner.runtime_costs.exposed_dp`), plus the first block's
  gather of each chunk (nothing to hide behind);
- ``fetch`` (parameters on CPU / NVMe): the fp32 shard ``4 Pl / dp`` per gather (forward, and backward
  under ZeRO-3) at the slowest hop's rate (:func:`~whalepy.cost_models.offload.fetch_seconds_per_byte`:
  prefetched deep enough that the hops pipeline), overlapping compute: ``T_cell = max(compute + dp, fetch) + p2p``;
- ``p2p``: one :func:`estimate_p2p_time` of the inter-stage activation per send (forward to the next
  (virtual) stage, gradient to the previous one), over the link the pair crosses;
- ``sync`` per step: the gradient reduction of the last micro-batch not hidden by its backward (DDP
  all-reduce by bucket: each block its bytes and its share of the 25 MiB buckets' calls, the step the
  first and last buckets' calls; FSDP2 reduce-scatter per block; under pipelining all reduce-scatters
  after the last backward) plus the last block's, plus ZeroRedundancyOptimizer's parameter all-gather
  after the step, plus the loss report (``train_step``'s all-reduce of the loss on every rank). The ``tp`` DP groups of a stage share each node's NIC, so their inter-node bandwidth is
  divided by ``tp``;
- ``opt``: the optimizer step on the GPU (:func:`~whalepy.cost_models.compute.adamw_step_time` of the
  implementation the runtime builds, ``foreach``: the profile's measured rate), or off it as :mod:`whalepy.cost_models.offload` prices each mode:
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
from collections.abc import Sequence

from whalepy.cost_models.communication import Collective, CommGroup
from whalepy.cost_models.compute import precision_bytes
from whalepy.cost_models.memory import (
    MASTER_GRAD_BYTES,
    ModelStateBytes,
    estimate_fsdp_working_bytes,
    estimate_model_state_bytes,
    estimate_stage_model_state_bytes,
)
from whalepy.cost_models.offload import host_capacity_per_gpu, nvme_capacity_per_gpu
from whalepy.ir.rules import LoweringKind, offloads_to_host
from whalepy.ir.plan import Tier, ZeroStage
from whalepy.planner.space import Candidate, GroupView, Hardware, Segment, StateOption, build_layout
from whalepy.planner._tiling_costs import tiled_options, tiling_latency_s, unit_params
from whalepy.planner.runtime_costs import (
    grads_after_forwards,
    grads_at_activation_peak,
    lowering_kind,
    post_step_affine,
    usable_device_bytes,
    uses_autocast,
)
# the coefficients, the run's block-level costs and a cell's coefficients are in modules of their own;
# their names are re-exported here, where the rest of whalepy imports them from
from whalepy.planner._coeffs import (  # noqa: F401
    CandidateCoeffs,
    CellCoeffs,
    NodeShare,
    StageCoeffs,
    node_fits,
    stage_checkpoint_offloadable,
    stage_host_activation,
    stage_host_checkpoint,
    stage_offloadable,
)
from whalepy.planner._cost_context import (  # noqa: F401
    LOSS_LOGPROB_BYTES,
    TP_REPLICATED_ACTIVATION_FRACTION,
    CostContext,
    _shared_nic,
    has_sequence_rules,
    stage_model_states,
    tp_activation_fraction,
    tp_splits,
)
from whalepy.planner._cells import _cell, least_option_time, option_kinds
from whalepy.ir.rules import fsdp_row_excess, tied_copy_local_params, tied_copy_row_excess, tp_local_params
from whalepy.planner._coeffs import TiedCopyCoeff


def build_coefficients(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],
                       options: tuple[StateOption, ...], *, mixed_tiers: bool = False) -> CandidateCoeffs:
    """The candidate's cost coefficients; ``mixed_tiers``: blocks of one stage may keep their states in
    different tiers (:attr:`StageCoeffs.families`)."""
    hw = ctx.hw
    ranks = build_layout(cand, hw)
    S, t, d = cand.num_stages, cand.tp, cand.dp
    stages = []
    seg_params = [tp_local_params(seg.block, t) for seg in segments]
    seg_excess = ctx._cached("row excess", segments, (t, d), lambda: row_excess_coeffs(segments, t, d))
    copies = ctx._cached("tied copies", segments, (t, d), lambda: tied_copy_coeffs(segments, t, d)) if S > 1 else ()
    tied_segments = tuple(g for g, seg in enumerate(segments) if seg.block.shares_params)
    uneven = bool(seg_excess) or any(c.row_excess for c in copies)  # FSDP2 splits some first dimension unevenly

    def splits_rows(o: StateOption) -> bool:
        return lowering_kind(o, cand) == LoweringKind.FSDP
    mixing = mixed_tiers and cand.virtual_stages == 1
    # Stages whose replicas run on the same groups over equal data-parallel links have the same options
    # and per-option coefficients (only in-flight micro-batches, sends and the loss differ from stage to
    # stage): computed once. CommGroup is a value (link speeds, ranks per node), not ranks.
    per_options, per_cell, pruned = _shared_memo(ctx, cand, segments, options, mixing)
    for s in range(S):
        dp_ranks = tuple(ranks[s][r][0] for r in range(d))
        dp_group = _shared_nic(hw.comm(dp_ranks), t) if d > 1 else None
        groups_here = frozenset(cand.cell_groups[s][r] for r in range(d))
        skey = (groups_here, dp_group)
        if skey not in per_options:
            per_options[skey] = _stage_options(ctx, cand, segments, options, groups_here, dp_group, seg_params,
                                               mixing)
        allowed, sync, mem_beta, cpu_beta, nvme_beta, working, buffer_beta, split, freed, host_fixed, tile_extra, \
            dp_comm, buffer_split, after, host_grads, wgrad, bgrad = per_options[skey]
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
            # the working set at the loss's backward (without the gradient buffer) and at the first
            # block's backward (with the block's gradients) too
            peaks = {o: (working[o], working[o] - wgrad[o], working[o] - wgrad[o] + bgrad[o]) for o in allowed}
            kept = _undominated(tuple(o for o in allowed if not o.beside_offload), sync, mem_beta, cpu_beta,
                                nvme_beta, peaks, buffer_beta, cells, host_fixed,
                                rows=splits_rows if uneven else None
                                ) + beside
            families = _families(kept, cand, sync, working, freed, cells) if mixing else ()
            pruned[ukey] = (tuple(o for o in kept if not o.beside_offload or any(o in f for f in families)), families)
        allowed, families = pruned[ukey]
        stages.append(StageCoeffs(index=s, cells=cells, seg_params=seg_params, options=allowed, sync=sync,
                                  mem_beta=mem_beta, cpu_beta=cpu_beta, nvme_beta=nvme_beta,
                                  working_bytes=working, state_split=split, grads_freed=freed,
                                  grads_after_forwards=after, host_grads=host_grads, working_grad=wgrad,
                                  block_grad=bgrad,
                                  buffer_beta=buffer_beta, buffer_split=buffer_split, host_fixed=host_fixed,
                                  dp_ranks=dp_ranks, families=families, tied_copies=copies,
                                  tied_sync=tied_sync_coeffs(ctx, cand, copies, s, cells, ranks, allowed),
                                  tied_segments=tied_segments, seg_excess=seg_excess,
                                  row_options=frozenset(filter(splits_rows, allowed)) if uneven else frozenset()))
    return CandidateCoeffs(candidate=cand, segments=segments, stages=stages, ranks=ranks,
                           nodes=_node_shares(hw, ranks) if any(o.off_device for st in stages for o in st.options)
                           or any(stage_offloadable(st) or stage_checkpoint_offloadable(st) for st in stages)
                           else (), bubble=cand.bubble_coefficient)


def seg_time_rows(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],
                  options: tuple[StateOption, ...] = ()) -> tuple[list[list[tuple[float, ...]]], list[list[tuple[float, ...]]]]:
    """Per distinct pipeline of ``cand`` (replicas whose stages run in the same cells), per stage, the
    ``CellCoeffs.seg_time`` :func:`build_coefficients` gives that cell: all that the compute part of the
    pruning bound reads (:func:`~whalepy.planner._evaluation.compute_bound`), without building the cells.
    The search bounds every candidate with it and builds coefficients only for those it looks at further
    (on four GPU types, 2,738 candidates, most of them orders of the groups pruned by this part).
    Returned twice: as is, and plus the least any of ``options`` adds to a block's time
    (:func:`~whalepy.planner._cells.least_option_time`: FSDP2's hook work or autocast's casts, which
    every plan's stage time counts beside its compute)."""
    hw, t, M = ctx.hw, cand.tp, cand.num_microbatches
    ranks = build_layout(cand, hw)
    kinds = option_kinds(ctx, cand, options)
    rows: dict[tuple, tuple[list[tuple[float, ...]], list[tuple[float, ...]]]] = {}  # type: ignore[type-arg]
    for r in range(cand.dp):
        key = tuple((cand.cell_groups[s][r], cand.batch_shares[r]) for s in range(cand.num_stages))
        if key in rows:
            continue
        row, more = [], []
        for s, (g, share) in enumerate(key):
            # the cell's first replica, as build_coefficients keys its cells
            rep = next(q for q in range(cand.dp) if (cand.cell_groups[s][q], cand.batch_shares[q]) == (g, share))
            tp_group = hw.comm(ranks[s][rep]) if t > 1 else None
            name = hw.groups[g].device.name
            row.append(ctx.segment_costs(segments, name, t, share / M, tp_group)[0])
            least = least_option_time(ctx, segments, kinds, name, share / M, t)
            more.append(tuple(x + y for x, y in zip(row[-1], least)))
        rows[key] = (row, more)
    return [a for a, _ in rows.values()], [b for _, b in rows.values()]


def _shared_memo(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],
                 options: tuple[StateOption, ...], mixing: bool) -> tuple[dict, dict, dict]:  # type: ignore[type-arg]
    """The memos of :func:`build_coefficients` (a stage's options, a cell's per-option coefficients, the
    undominated options), shared by every candidate that differs from ``cand`` only in which group runs
    which cell (``cell_groups``): nothing they hold reads it but through their keys (the stage's groups
    and data-parallel link, the cell's group, share and TP link). On four GPU types the orders of the
    groups made 2,738 candidates whose coefficients were built one by one (docs/benchmarks.md)."""
    key = ("stage memo", id(segments), options, mixing, dataclasses.replace(cand, cell_groups=()))
    hit = ctx._cache.get(key)
    if hit is None:
        ctx._kept[id(segments)] = segments  # the id stays this tuple's while the cache lives
        hit = ctx._cache[key] = ({}, {}, {})
    return hit  # type: ignore[return-value]


def row_excess_coeffs(segments: tuple[Segment, ...], tp: int, dp: int) -> tuple[float, ...]:
    """:attr:`StageCoeffs.seg_excess`: per segment, the first replica's
    :func:`~whalepy.ir.rules.fsdp_row_excess` of one block at ``tp`` x ``dp``; empty where all are 0
    (then the coefficients and the ILP are those of an even split)."""
    out = tuple(float(fsdp_row_excess(seg.block, tp, dp)) for seg in segments)
    return out if any(out) else ()


def tied_copy_coeffs(segments: tuple[Segment, ...], tp: int, dp: int = 1) -> tuple[TiedCopyCoeff, ...]:
    """The tied parameters of the model (:attr:`~whalepy.ir.profile.BlockProfile.tied_copies`) as
    :class:`TiedCopyCoeff`: per parameter, the segment of the block counting it and the segments of
    the blocks holding a copy, at TP degree ``tp`` (and its first replica's row excess at ``dp``)."""
    seg_of = {b.name: seg.index for seg in segments for b in seg.blocks}
    found: dict[tuple[str, str], tuple[int, set[int], float, float]] = {}
    for seg in segments:
        for b in seg.blocks:
            for c in b.tied_copies:
                owner = seg_of[c.owner]
                if segments[owner].length != 1:
                    raise ValueError(f"tied parameter {c.parameter}: its block {c.owner} is one of "
                                     f"{segments[owner].length} identical blocks; the planner needs it alone")
                _, holders, p, e = found.setdefault((c.owner, c.parameter),
                                                    (owner, set(), tied_copy_local_params(c, b, tp),
                                                     float(tied_copy_row_excess(c, b, tp, dp))))
                holders.add(seg.index)
    return tuple(TiedCopyCoeff(owner=o, holders=tuple(sorted(h)), local_params=p, row_excess=e)
                 for o, h, p, e in found.values())


def tied_sync_coeffs(ctx: CostContext, cand: Candidate, copies: tuple[TiedCopyCoeff, ...], s: int,
                     cells: list, ranks, options: tuple[StateOption, ...]):  # type: ignore[no-untyped-def]
    """:attr:`StageCoeffs.tied_sync` of stage ``s``: the all-reduce of each copy's gradient (fp32, FSDP2's
    shard of it where the option lowers to FSDP2) between this stage's rank and the first stage's (the
    embedding's: the last stage's for stage 0), the replica's pipeline ranks of one TP index; every TP
    rank syncs its own shard at once over links of the same kind."""
    if not copies:
        return ()
    S, d = cand.num_stages, cand.dp
    out = []
    for c in cells:
        r = c.replicas[0]
        group = ctx.hw.comm((ranks[s][r][0], ranks[0 if s else S - 1][r][0]))
        out.append(tuple({o: ctx.collective(Collective.ALL_REDUCE, MASTER_GRAD_BYTES * k.local_params
                                            / (d if lowering_kind(o, cand) == LoweringKind.FSDP else 1), group)
                          for o in options} for k in copies))
    return tuple(out)


def _stage_options(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...],  # type: ignore[no-untyped-def]
                   options: tuple[StateOption, ...], groups_here: frozenset[int], dp_group: CommGroup | None,
                   seg_params: list[float], mixing: bool):
    """A stage's state options (tier, tiling, reduce-every-micro-batch and beside-offload variants) and
    their per-stage coefficients, for a stage on ``groups_here`` with data-parallel group ``dp_group``."""
    hw, t = ctx.hw, cand.tp
    allowed = tuple(o for o in options if all(_tier_ok(hw.groups[g], o) for g in groups_here))
    sync, mem_beta, cpu_beta, nvme_beta, working, buffer_beta, split, freed = {}, {}, {}, {}, {}, {}, {}, {}
    after: dict[StateOption, bool] = {}
    host_grads: dict[StateOption, float] = {}
    wgrad: dict[StateOption, float] = {}
    bgrad: dict[StateOption, float] = {}
    buffer_split: dict[StateOption, tuple[float, float, float]] = {}
    host_fixed: dict[StateOption, float] = {}
    low = precision_bytes(ctx.precision)
    stage_blocks = [seg.block for seg in segments]
    allowed = tiled_options(
        allowed, stage_blocks, tp=t,
        working_bytes=lambda p: estimate_fsdp_working_bytes(block_params=p, zero3=True, compute_bytes=low),
        capacity_bytes=min(usable_device_bytes(hw.groups[g], cand, ctx.memory_margin) for g in groups_here))
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
        after[o] = grads_after_forwards(kind, cand)
        host_grads[o] = st.cpu_grads
        fsdp = kind == LoweringKind.FSDP
        zero3 = o.zero is ZeroStage.PARAMETERS
        unit = max(seg_params) if o.tiles == 1 else max(unit_params(b, o.tiles) for b in stage_blocks)
        working[o] = (estimate_fsdp_working_bytes(block_params=unit, zero3=zero3, compute_bytes=low)
                      if fsdp else 0.0)
        # the running block's gradients: FSDP2's unsharded buffer (part of its working set), or, where
        # the gradients are freed at the activation peak, the block's own; neither exists at the loss's
        # backward, both at the first block's backward (whose activations are still held)
        wgrad[o] = (estimate_fsdp_working_bytes(block_params=unit, zero3=False, compute_bytes=low)
                    if fsdp else 0.0)
        bgrad[o] = wgrad[o] if fsdp else (MASTER_GRAD_BYTES * unit if freed[o] else 0.0)
        # below ZeRO-3 FSDP2 keeps the stage's parameters gathered, in the compute dtype, from
        # forward to backward (reshard_after_forward=False)
        gathered = low if fsdp and not zero3 else 0.0
        # FSDP2 without gradient sync (every micro-batch but the last) accumulates unsharded
        # gradients in its reduce dtype (fp32)
        # (none when every micro-batch's gradients are reduce-scattered into the sharded ones)
        accumulate = (MASTER_GRAD_BYTES - st.grads if fsdp and cand.num_microbatches > 1 and not o.reduce_each
                      else 0.0)
        # per parameter: the measured blocks' own where measured (CostContext.autocast_copy_bytes)
        autocast = (max(ctx.autocast_copy_bytes(hw.groups[g].device.name) for g in groups_here)
                    if uses_autocast(kind, ctx.precision) else 0.0)
        # DDP's gradients are views of its persistent buckets after a synchronised backward
        # (gradient_as_bucket_view=True: grads_at_activation_peak), but the micro-batches it runs
        # under no_sync (all but the last) accumulate into gradients autograd allocates beside them
        bucket = (st.grads if kind in (LoweringKind.DDP, LoweringKind.ZERO1) and cand.num_microbatches > 1
                  else 0.0)
        buffer_beta[o] = gathered + max(0.0, accumulate) + autocast + bucket
        buffer_split[o] = (gathered, max(0.0, accumulate) + bucket, autocast)
    dp_comm = ctx.dp_block_comm(segments, tuple(seg_params), dp_group)
    return (allowed, sync, mem_beta, cpu_beta, nvme_beta, working, buffer_beta, split, freed, host_fixed,
            tile_extra, dp_comm, buffer_split, after, host_grads, wgrad, bgrad)


def _families(options, cand, sync, working, freed, cells) -> tuple[tuple[StateOption, ...], ...]:  # type: ignore[no-untyped-def]
    """:attr:`StageCoeffs.families` of a stage: its options grouped by lowering, ZeRO stage, gradient
    reduction and tiling, where the runtime lowers their blocks side by side in one stage
    (:func:`whalepy.ir.rules.mixed_tiers_error`) and the per-stage costs agree."""
    from whalepy.ir.rules import mixed_tiers_error

    groups: dict[tuple, list[StateOption]] = {}  # type: ignore[type-arg]
    for o in options:
        kind = lowering_kind(o, cand)
        key = (kind, o.zero, o.reduce_each, o.tiles, sync[o], working[o], freed[o],
               tuple((c.edge[o], c.tail_edge[o], tuple(c.seg_amp_saved[o])) for c in cells))
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
    runtime lowers it (:func:`whalepy.ir.rules.reduce_every_microbatch_error`)."""
    from whalepy.ir.rules import reduce_every_microbatch_error

    if cand.num_microbatches == 1:
        return options
    extra = [dataclasses.replace(o, reduce_each=True) for o in options if not o.reduce_each
             and reduce_every_microbatch_error(lowering_kind(o, cand), pp=cand.num_stages,
                                               param_tier=o.param_tier, optimizer_tier=o.optimizer_tier) is None]
    return tuple(options) + tuple(e for e in extra if e not in options)


def _node_shares(hw: Hardware, ranks) -> tuple[NodeShare, ...]:  # type: ignore[no-untyped-def]
    # keyed by the layout's identity (build_layout returns one object per shape): hashing a layout of
    # thousands of ranks per candidate cost more than the shares themselves
    hit = hw.node_shares.get(id(ranks))
    if hit is None or hit[0] is not ranks:
        hit = hw.node_shares[id(ranks)] = (ranks, _build_node_shares(hw, ranks))
    return hit[1]


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


def stage_held_bytes(ctx: CostContext, cand: Candidate, zero: ZeroStage,
                     blocks: Sequence[tuple[float, StateOption] | tuple[float, StateOption, float]],
                     prefetch_depth: int = 1) -> ModelStateBytes:
    """What a device of a stage of ``cand`` holds between uses, by place, for its blocks' ``(local
    parameters, option)`` or ``(local parameters, option, row excess)`` (FSDP2's uneven first dimensions
    on this replica, :func:`~whalepy.ir.rules.fsdp_row_excess`): :func:`estimate_stage_model_state_bytes`
    (one lowering for the stage, one staging pool for its disk-tier blocks, ``prefetch_depth`` ahead);
    one option: as :func:`stage_model_states`."""
    return estimate_stage_model_state_bytes(
        blocks=[(b[0], b[1].param_tier, b[1].optimizer_tier, b[2] if len(b) > 2 else 0.0)  # type: ignore[misc]
                for b in blocks], zero_stage=zero, dp_degree=cand.dp,
        tp_degree=cand.tp, pp_degree=cand.num_stages, precision=ctx.precision, prefetch_depth=prefetch_depth)


def _undominated(options, sync, mem, cpu, nvme, working, buffers, cells, host_fixed, rows=None):  # type: ignore[no-untyped-def]
    """Drop state options another option beats or ties on every coefficient (memory, host memory,
    NVMe, working set, post-step communication, exposed communication per block, optimizer step,
    fetches): every cost is monotone in them, so a dominated option is never strictly better. E.g.
    ZeRO-1 beats ZeRO-0 when both lower to FSDP2 and cost the same time. ``working``: per option, a
    tuple of working-set figures (whole, at the loss's backward, at the first block's). ``rows(o)``: the
    option is charged FSDP2's uneven rows (:attr:`StageCoeffs.seg_excess`), at its model-state
    coefficients."""
    def vec(o):  # type: ignore[no-untyped-def]
        v = [mem[o] + buffers[o], *working[o], cpu[o], nvme[o], host_fixed[o], *sync[o]]
        if rows is not None:
            v += [mem[o], cpu[o], nvme[o]] if rows(o) else [0.0, 0.0, 0.0]
        for c in cells:
            v += [c.opt_beta[o], c.fetch_beta[o], c.edge[o], c.tail_edge[o], *c.seg_amp_saved[o],
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
    compute_bound,
)
