"""A cell's cost coefficients (split from :mod:`whalepy.planner.costing`, whose
:func:`~whalepy.planner.costing.build_coefficients` calls :func:`_cell` once per ``(stage, device group,
batch share)``): per block of each segment its compute, recompute, saved and input bytes; its sends;
micro-batches in flight; and per state option its optimizer step, fetches, exposed data-parallel
communication and autocast copies."""

from __future__ import annotations

import functools

from whalepy.cost_models.communication import Algorithm, Collective, estimate_collective_time, estimate_p2p_time, overlap_loss
from whalepy.cost_models.memory import inflight_microbatches
from whalepy.cost_models.offload import host_capacity_per_gpu, nvme_capacity_per_gpu
from whalepy.ir.plan import ZeroStage
from whalepy.ir.rules import LoweringKind, offloads_to_host
from whalepy.ir.types import Schedule, dtype_bytes
from whalepy.planner._coeffs import CellCoeffs
from whalepy.planner._cost_context import CostContext, _pair_link, loss_kept_bytes, loss_peak_bytes
from whalepy.planner._offload_costs import (
    activation_offload_coefficients,
    checkpoint_offload_coefficients,
    offload_coefficients,
)
from whalepy.planner.runtime_costs import LOSS_REPORT_BYTES, DPComm, chunk_neighbours, dp_edges, exposed_dp, lowering_kind, usable_device_bytes, uses_autocast
from whalepy.planner.space import Candidate, GroupView, Segment, StateOption


def _cell(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...], s: int, g: GroupView,
          share: int, reps: tuple[int, ...], ranks, allowed: tuple[StateOption, ...],  # type: ignore[no-untyped-def]
          dp_comm: DPComm, tile_extra: dict[StateOption, list[float]] | None = None,
          memo: tuple[dict, tuple] | None = None) -> CellCoeffs:  # type: ignore[type-arg]
    """``memo``: ``(dict, stage key)`` shared by the stages of one candidate and by the candidates that
    differ from it only in which group runs which cell (``costing._shared_memo``); cells of the same
    group, share and TP group on stages of the same key get the same per-block and per-option
    coefficients (one computation, the same objects). What depends on the stage's position (its sends,
    micro-batches in flight, the loss) is computed per cell."""
    hw, t, d, M = ctx.hw, cand.tp, cand.dp, cand.num_microbatches
    S, v = cand.num_stages, cand.virtual_stages
    mb = share / M
    ratio = mb / ctx.profile.batch_size
    rep = reps[0]
    tp_group = hw.comm(ranks[s][rep]) if t > 1 else None
    # point-to-point sends of this physical stage's chunks
    chunk_p2p = []
    nbytes = ctx.boundary_bytes * ratio
    for neighbours in _neighbours(s, S, v):
        p2p = 0.0
        for ns in neighbours:
            pair = hw.comm((ranks[s][rep][0], ranks[ns][rep][0]))
            p2p += estimate_p2p_time(nbytes, _pair_link(pair), pair.launch_latency)
        chunk_p2p.append(p2p)
    p2p = sum(chunk_p2p)
    inflight = inflight_microbatches(cand.schedule, stage_index=s, num_stages=S, num_microbatches=M,
                                     virtual_stages=v)
    mkey = memo and (memo[1], g.index, share, tp_group)
    if memo is not None and mkey in memo[0]:
        per_block, per_option = memo[0][mkey]
    else:
        per_block = tuple(list(x) for x in ctx.segment_costs(segments, g.device.name, t, mb, tp_group))
        per_option = _cell_options(ctx, cand, segments, g, allowed, dp_comm, tile_extra, per_block[2],
                                   per_block[3], per_block[6], mb)
        if memo is not None:
            memo[0][mkey] = (per_block, per_option)
    seg_time, seg_re, seg_fwd, seg_bwd, seg_comm, seg_saved, seg_input = per_block
    (opt_beta, opt_overlap, fetch_beta, seg_exposed, edge, seg_tail, tail_edge, seg_amp_saved,
     seg_autocast) = per_option
    report = loss_report_s(ctx, ranks)
    if report:
        tail_edge = {o: x + report for o, x in tail_edge.items()}
    loss_bytes = loss_held = 0.0
    if s == S - 1 and ctx.profile.blocks:
        out = ctx.profile.blocks[-1].output_bytes * ratio
        elem = dtype_bytes(ctx.profile.dtype)
        loss_bytes = loss_peak_bytes(out * ctx.byte_scale, elem * ctx.byte_scale, output_held=S > 1)
        if S > 1 and cand.schedule is Schedule.GPIPE:
            # GPipe's last stage computes every micro-batch's loss in its forward: each one in flight
            # keeps its output (fwd_cache) and log-probabilities until its backward
            loss_held = (inflight - 1) * loss_kept_bytes(out * ctx.byte_scale, elem * ctx.byte_scale)
    # the group's capacities depend only on which parallel axes are in use: the same for every cell of
    # the group in every candidate with them (computed once; 55k calls on Llama-70B on four GPU types)
    ckey = ("capacities", g.index, t > 1, d > 1, S > 1)
    if ckey not in ctx._cache:
        ctx._cache[ckey] = (usable_device_bytes(g, cand, ctx.memory_margin),
                            ctx.memory_margin.bytes_for(g.device.memory_bytes) if ctx.memory_margin else 0.0,
                            host_capacity_per_gpu(g.cpu_memory_bytes, g.gpus_per_node),
                            nvme_capacity_per_gpu(g.nvme_capacity_bytes, g.gpus_per_node))
    capacity, margin, cpu_cap, nvme_cap = ctx._cache[ckey]  # type: ignore[misc]
    host = memo[0].get((mkey, inflight)) if memo is not None else None
    if host is None:
        hkey = ("host copies", g.index, tuple(seg_saved), tuple(seg_input), inflight, v)
        if hkey not in ctx._cache:  # the same for every stage and candidate with these bytes in flight
            ctx._cache[hkey] = (
                activation_offload_coefficients(g, saved=seg_saved, inflight=inflight, virtual_stages=v),
                checkpoint_offload_coefficients(g, inputs=seg_input, inflight=inflight, virtual_stages=v))
        host = ctx._cache[hkey]
        if memo is not None:
            memo[0][(mkey, inflight)] = host
    (seg_offload, seg_host), (seg_ckoff, seg_ckhost) = host  # type: ignore[misc]
    return CellCoeffs(group=g, share=share, micro_batch=mb, replicas=reps,
                      capacity=capacity, cpu_capacity=cpu_cap, margin=margin,
                      nvme_capacity=nvme_cap, seg_time=seg_time, seg_recompute=seg_re, seg_fwd=seg_fwd,
                      seg_bwd=seg_bwd, seg_comm=seg_comm, seg_saved=seg_saved, seg_input=seg_input, p2p=p2p,
                      chunk_p2p=chunk_p2p, inflight=inflight, opt_beta=opt_beta, opt_overlap=opt_overlap,
                      fetch_beta=fetch_beta,
                      seg_exposed=seg_exposed, edge=edge, seg_tail=seg_tail, tail_edge=tail_edge,
                      seg_amp_saved=seg_amp_saved, seg_autocast=seg_autocast, loss_bytes=loss_bytes,
                      loss_held_bytes=loss_held,
                      seg_offload=seg_offload,
                      seg_host=seg_host, seg_ckoff=seg_ckoff, seg_ckhost=seg_ckhost)


def loss_report_s(ctx: CostContext, ranks) -> float:  # type: ignore[no-untyped-def]
    """The step's last collective, on every rank of the plan: ``ParallelModel.train_step`` all-reduces
    the mean loss (:data:`LOSS_REPORT_BYTES`) after the optimizer step, one call that every step waits
    for (on the CPU's gloo a call costs the link's measured per-call time, 1.2-2.1 ms in
    ``bench_predict_cpu.py``; on NCCL its launch latency and the latency terms). Across nodes as a tree
    (``Algorithm.TREE``): NCCL's tuner picks its tree for an all-reduce this small, where a ring's
    ``2(p - 1)`` latency steps would charge 1,024 A100 (128 nodes) 3 ms for 4 bytes. 0 on one rank."""
    world = tuple(sorted({r for stage in ranks for replica in stage for r in replica}))
    if len(world) < 2:
        return 0.0
    return estimate_collective_time(Collective.ALL_REDUCE, LOSS_REPORT_BYTES, ctx.hw.comm(world), Algorithm.TREE)


@functools.lru_cache(maxsize=None)
def _neighbours(stage: int, num_stages: int, virtual_stages: int) -> tuple[tuple[int, ...], ...]:
    """:func:`chunk_neighbours`, cached (the same few stage counts for every candidate)."""
    return tuple(tuple(n) for n in chunk_neighbours(stage, num_stages, virtual_stages))


def _cell_options(ctx: CostContext, cand: Candidate, segments: tuple[Segment, ...], g: GroupView,  # type: ignore[no-untyped-def]
                  allowed: tuple[StateOption, ...], dp_comm: DPComm, tile_extra, seg_fwd, seg_bwd, seg_input,
                  micro_batch: float):
    """A cell's per-option coefficients: optimizer step, fetches, exposed data-parallel communication per
    block and at the edges, autocast's copies, and autocast's extra compute per block (charged with
    ``seg_exposed``, so every consumer of the coefficients sees it; ``seg_autocast`` keeps it apart
    for the plan's breakdown)."""
    t, d, S = cand.tp, cand.dp, cand.num_stages
    key = ("offload", g.index, d, t, S, allowed)
    if key not in ctx._cache:  # the same for every cell of this group and degrees, across candidates
        ctx._cache[key] = offload_coefficients(ctx, cand, g, allowed)
    opt_beta, opt_overlap, fetch_beta = ctx._cache[key]  # type: ignore[misc]
    seg_exposed, edge, seg_tail, tail_edge, seg_amp_saved, seg_autocast = {}, {}, {}, {}, {}, {}
    pipelined = S > 1
    loss = overlap_loss(g.device)
    for o in allowed:
        kind, z3 = lowering_kind(o, cand), o.zero is ZeroStage.PARAMETERS
        rows = [exposed_dp(kind, z3, pipelined, f, b, dp_comm, i, o.reduce_each, loss)
                for i, (f, b) in enumerate(zip(seg_fwd, seg_bwd))]
        seg_exposed[o] = [r[0] for r in rows]
        if tile_extra and o in tile_extra:  # memory-centric tiling's extra collectives (exposed)
            seg_exposed[o] = [x + e for x, e in zip(seg_exposed[o], tile_extra[o])]
        seg_tail[o] = [r[1] for r in rows]
        fsdp = kind == LoweringKind.FSDP
        if fsdp:  # the wrapper's host work (FSDP2 hooks and copies): measured, or modelled on a GPU
            seg_exposed[o] = [x + _wrapper_s(ctx, seg, g.device.name, z3, micro_batch, t)
                              for x, seg in zip(seg_exposed[o], segments)]
        if ctx.measured:
            # the device optimizer steps DTensor shards (a host-resident step is whalepy's fused CPU kernel)
            if (fsdp or t > 1) and not offloads_to_host(o.param_tier, o.optimizer_tier):
                seg_tail[o] = [x + ctx.update_overhead(seg.block.index, g.device.name, fsdp=fsdp, tp=t)
                               for x, seg in zip(seg_tail[o], segments)]
        edge[o], tail_edge[o] = dp_edges(kind, z3, pipelined, dp_comm, o.reduce_each, loss) if rows else (0.0, 0.0)
        # what autocast keeps beside each block's 16-bit figure, per block: kept like the block's own
        # saved tensors (not while it is checkpointed or offloaded), counted on the stage's own blocks
        seg_amp_saved[o] = ([ctx.autocast_saved_extra(seg.block.index, micro_batch) for seg in segments]
                            if uses_autocast(kind, ctx.precision) else [0.0] * len(segments))
        if uses_autocast(kind, ctx.precision):  # autocast's fp32 tensors and casts, per block (compute)
            extra = [_autocast_s(ctx, seg, g.device.name, micro_batch, t) for seg in segments]
            seg_exposed[o] = [x + e for x, e in zip(seg_exposed[o], extra)]
            seg_autocast[o] = extra
        else:
            seg_autocast[o] = [0.0] * len(segments)
    return opt_beta, opt_overlap, fetch_beta, seg_exposed, edge, seg_tail, tail_edge, seg_amp_saved, seg_autocast


def _wrapper_s(ctx: CostContext, seg: Segment, device_name: str, z3: bool, micro_batch: float, t: int) -> float:
    """Seconds per micro-batch FSDP2's wrapper adds to a block of ``seg`` (``CostContext.wrapper_overhead``;
    resharding after forward under ZeRO-3)."""
    return ctx.wrapper_overhead(seg.block.index, device_name, "fsdp_reshard" if z3 else "fsdp", micro_batch, t)


def _autocast_s(ctx: CostContext, seg: Segment, device_name: str, micro_batch: float, t: int) -> float:
    """Seconds per micro-batch autocast's fp32 tensors and casts add to a block of ``seg``."""
    return ctx.autocast_extra(seg.block.index, device_name, t, micro_batch)


def option_kinds(ctx: CostContext, cand: Candidate, options: tuple[StateOption, ...]) -> tuple[tuple[str, bool], ...]:
    """The distinct ``(lowering kind, ZeRO-3)`` pairs of ``options`` in ``cand`` (what
    :func:`least_option_time` prices): the same for every candidate with its degrees and stage count."""
    key = ("option kinds", id(options), cand.dp, cand.tp, cand.num_stages)
    if key not in ctx._cache:
        ctx._kept[id(options)] = options  # the id stays this tuple's while the cache lives
        ctx._cache[key] = tuple(sorted({(lowering_kind(o, cand), o.zero is ZeroStage.PARAMETERS) for o in options}))
    return ctx._cache[key]  # type: ignore[return-value]


def least_option_time(ctx: CostContext, segments: tuple[Segment, ...], kinds: tuple[tuple[str, bool], ...],
                      device_name: str, micro_batch: float, t: int) -> tuple[float, ...]:
    """Per segment, the least over the state options of ``kinds`` (:func:`option_kinds`) of the seconds
    per micro-batch that a block's option adds to its time whatever else it exposes: FSDP2's wrapper work
    where the option lowers to FSDP2, autocast's casts where it trains under autocast (the terms
    :func:`_cell_options` adds to ``seg_exposed``, each non-negative beside the data-parallel
    communication it adds too), at TP degree ``t``. Every plan on a device of ``device_name`` spends at
    least this per block and micro-batch besides ``seg_time``: what the pruning bound's compute part adds
    (``costing.seg_time_rows``); 0 without options."""
    if not kinds:
        return (0.0,) * len(segments)
    key = ("least option time", id(segments), kinds, device_name, micro_batch, t)
    if key not in ctx._cache:
        ctx._kept[id(segments)] = segments  # the id stays this tuple's while the cache lives
        rows = []
        for kind, z3 in kinds:
            if kind == LoweringKind.FSDP:
                rows.append([_wrapper_s(ctx, seg, device_name, z3, micro_batch, t) for seg in segments])
            elif uses_autocast(kind, ctx.precision):
                rows.append([_autocast_s(ctx, seg, device_name, micro_batch, t) for seg in segments])
            else:
                rows.append([0.0] * len(segments))
        ctx._cache[key] = tuple(min(col) for col in zip(*rows))
    return ctx._cache[key]  # type: ignore[return-value]
