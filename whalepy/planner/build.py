"""Turn the search's best evaluation into a :class:`~whalepy.ir.plan.Plan`; explain the losers; and, when
nothing fits, say which device group runs short, by how much, and what would make it fit."""

from __future__ import annotations

import dataclasses
import math

from whalepy.errors import InfeasibleError
from whalepy.cost_models.compute import peak_flops
from whalepy.cost_models.device_profiles import compute_profile_notes
from whalepy.planner._shape_advice import shape_notes
from whalepy.cost_models.devices import GIB
from whalepy.ir.plan import (
    Alternative,
    BlockPlan,
    Plan,
    PlanCost,
    Precision,
    SolverReport,
    StageCost,
    StagePlan,
    Tier,
)
from whalepy.planner.costing import (
    CostContext,
    Evaluation,
    build_coefficients,
    chunk_busy_s,
    evaluate_stage,
    memory_breakdown,
    offload_s,
    stage_held_bytes,
    tp_splits,
)
from whalepy.planner._tiling_costs import block_tiles
from whalepy.planner._evaluation import part_params
from whalepy.planner._coeffs import tied_copy_params
from whalepy.ir.rules import fsdp_row_excess, tp_local_params
from whalepy.planner._offload_costs import stage_prefetch
from whalepy.planner.search import SearchResult
from whalepy.planner.ilp import ILPResult
from whalepy.planner.space import Candidate, Rejection, RejectionKind, StateOption


_HAS_PREFETCH_DEPTH = "prefetch_depth" in {f.name for f in dataclasses.fields(BlockPlan)}


def gb(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def stage_blocks(ev: Evaluation) -> list[list[int]]:
    """Block positions of each physical stage (chunks in order for the interleaved schedule)."""
    S = ev.coeffs.candidate.num_stages
    out: list[list[int]] = [[] for _ in range(S)]
    pos = 0
    for j, size in enumerate(ev.boundaries):
        out[j % S].extend(range(pos, pos + size))
        pos += size
    return out


def stage_chunk_sizes(ev: Evaluation) -> list[tuple[int, ...]]:
    """Blocks per virtual chunk of each physical stage; empty tuples without interleaving."""
    S = ev.coeffs.candidate.num_stages
    if ev.coeffs.candidate.virtual_stages <= 1:
        return [() for _ in range(S)]
    out: list[list[int]] = [[] for _ in range(S)]
    for j, size in enumerate(ev.boundaries):
        out[j % S].append(size)
    return [tuple(x) for x in out]


def build_plan(ev: Evaluation, *, ctx: CostContext, global_batch: int, result: SearchResult | None,
               solver_name: str, status: str, mip_gap: float, notes: list[str],
               alternatives: tuple[Alternative, ...] = ()) -> Plan:
    prof, hw = ctx.profile, ctx.hw
    cc = ev.coeffs
    cand = cc.candidate
    seg_of = [seg.index for seg in cc.segments for _ in range(seg.length)]
    stages = []
    rules = []
    step = ev.step_time_s
    M = cand.num_microbatches
    busy: dict[str, float] = {}
    chunks = stage_chunk_sizes(ev)
    S, V = cand.num_stages, cand.virtual_stages
    starts = [0]
    for size in ev.boundaries:
        starts.append(starts[-1] + size)
    positions = stage_blocks(ev)
    for s, st in enumerate(ev.stages):
        blocks = []
        option_of = block_options(st, positions[s], seg_of)
        depths = {}
        for o in dict.fromkeys(option_of.values()):
            mine = [i for i in positions[s] if option_of[i] == o]
            depths[o], _ = stage_prefetch(ctx, cand, st, max(st.cells, key=lambda c: c.time_s), mine, option=o)
        # the disk tier reads a stage's NVMe parameters ahead by one depth (ir.rules.stage_tiers_error)
        disk = max((d for o, d in depths.items() if o.param_tier is Tier.NVME), default=None)
        depths = {o: disk if o.param_tier is Tier.NVME and disk is not None else d for o, d in depths.items()}
        for o in depths:
            mine = [i for i in positions[s] if option_of[i] == o]
            if o.param_tier is not Tier.GPU:
                what = "parameters" if not st.mix else f"parameters of {len(mine)} blocks"
                notes = [*notes, f"stage {s}: {what} on {o.param_tier.value}, fetched {depths[o]} block"
                         f"{'s' if depths[o] > 1 else ''} ahead"]
        for k in range(V):
            j = s + k * S
            left = list(st.chunk_checkpoints[k]) if st.chunk_checkpoints else list(st.checkpoints)
            off_left = list(st.chunk_offloads[k]) if st.chunk_offloads else [0] * len(left)
            ckoff_left = list(st.chunk_checkpoint_offloads[k]) if st.chunk_checkpoint_offloads else [0] * len(left)
            for i in range(starts[j], starts[j + 1]):
                g = seg_of[i]
                ck = left[g] > 0
                left[g] -= ck
                # identical blocks of a segment: the first ones checkpointed (the first of those with
                # their input in host memory), the next ones offloaded
                ckoff = ck and ckoff_left[g] > 0
                ckoff_left[g] -= ckoff
                off = not ck and off_left[g] > 0
                off_left[g] -= off
                o = option_of[i]
                # BlockPlan.prefetch_depth arrives with plan version 3 (issue 10 contract)
                depth_field = {"prefetch_depth": depths[o]} if _HAS_PREFETCH_DEPTH else {}
                blocks.append(BlockPlan(name=prof.blocks[i].name, checkpoint=ck, activation_offload=off,
                                        checkpoint_offload=ckoff,
                                        param_tier=o.param_tier, optimizer_tier=o.optimizer_tier,
                                        tiles=block_tiles(prof.blocks[i], o.tiles),
                                        **depth_field))
                if cand.tp > 1 and tp_splits(prof.blocks[i], cand.tp):
                    rules.extend(prof.blocks[i].tp_rules)
        worst = max(st.cells, key=lambda c: c.time_s)
        tight = max(st.cells, key=lambda c: c.memory_bytes / c.cell.capacity)
        for c in st.cells:
            name = c.cell.group.device.name
            busy[name] = max(busy.get(name, 0.0), M * c.time_s + c.tail_s)
        stages.append(StagePlan(
            index=s, blocks=tuple(blocks), ranks=cc.ranks[s],
            device_types=tuple(hw.groups[cand.cell_groups[s][r]].device.name for r in range(cand.dp)),
            zero_stage=st.option.zero, chunk_sizes=chunks[s], reduce_every_microbatch=st.option.reduce_each,
            cost=StageCost(compute_s=worst.compute_s, comm_s=worst.comm_s, grad_sync_s=worst.exposed_sync_s,
                           offload_s=M * max(0.0, worst.fetch_s - worst.compute_s - worst.comm_s + worst.cell.p2p)
                           + (worst.opt_s if any(o.optimizer_tier is not Tier.GPU for o, _ in st.parts) else 0.0)
                           + M * offload_s(worst.cell, st.offloads),
                           bubble_s=max(0.0, M * ev.T + ev.bubble_s - M * st.time_s),
                           memory_bytes=int(tight.memory_bytes), capacity_bytes=int(tight.cell.capacity),
                           **memory_breakdown(tight), tp_comm_s=worst.tp_s, p2p_s=worst.p2p_s,
                           dp_comm_s=worst.dp_exposed_s,
                           **_held_state_bytes(ctx, cand, st, option_of, depths,
                                               _tied_copies(cc.stages[s], st, option_of, seg_of)),
                           **_buffer_items(cc.stages[s], st, tight),
                           **_chunk_phase_times(worst, st))))
    rank_types = tuple(d.device.name for d in hw.cluster.rank_devices())
    samples = global_batch / step
    model_flops = prof.train_flops * global_batch / prof.batch_size / step
    peak = sum(peak_flops(d.device, ctx.precision) for d in hw.cluster.rank_devices())
    cost = PlanCost(step_time_s=step, samples_per_s=samples,
                    tokens_per_s=samples * prof.seq_len if prof.seq_len else 0.0,
                    model_tflops_per_gpu=model_flops / hw.world_size / 1e12, mfu=model_flops / peak,
                    busy_by_device_type=tuple(sorted(busy.items())))
    report = SolverReport(solver=solver_name, status=status, objective=step, mip_gap=mip_gap,
                          solve_time_s=result.solve_time_s if result else 0.0,
                          num_candidates=result.num_candidates if result else 1)
    return Plan(model_name=prof.model_name, model_fingerprint=prof.fingerprint, world_size=hw.world_size,
                rank_device_types=rank_types, global_batch=global_batch, seq_len=prof.seq_len,
                num_microbatches=M, schedule=cand.schedule, virtual_stages=cand.virtual_stages,
                batch_shares=cand.batch_shares, stages=tuple(stages), tensor_parallel=tuple(dict.fromkeys(rules)),
                cost=cost, solver=report, alternatives=alternatives,
                notes=tuple(notes) + compute_profile_notes(g.device for g in hw.groups)
                + tuple(shape_notes(ctx, tp=cand.tp, micro_batch=global_batch / (cand.dp * M), microbatches=M,
                                    step_s=step)),
                precision=Precision(ctx.precision), optimizer_impl=ctx.optimizer_impl, compile=ctx.compile)


def _chunk_phase_times(worst, st) -> dict[str, tuple[float, ...]]:  # type: ignore[no-untyped-def]
    """StageCost's per-chunk forward and backward seconds per micro-batch of the slowest cell."""
    c = worst.cell
    counts = st.chunk_counts or (st.counts,)
    ckpts = st.chunk_checkpoints or (st.checkpoints,)
    # seg_recompute is one block's forward with its TP all-reduce: the forward pass of a block
    fwd = [sum(n * x for n, x in zip(cn, c.seg_recompute)) for cn in counts]
    offs = st.chunk_offloads or (st.offloads,)
    ckoffs = st.chunk_checkpoint_offloads or tuple(() for _ in counts)
    busy = [chunk_busy_s(c, st.mix or st.option, cn, ck, co, cw) for cn, ck, co, cw in zip(counts, ckpts, offs, ckoffs)]
    return {"chunk_forward_s": tuple(fwd), "chunk_backward_s": tuple(b - f for b, f in zip(busy, fwd))}


def block_options(st, positions: list[int], seg_of: list[int]) -> dict[int, StateOption]:  # type: ignore[no-untyped-def]
    """The state option of each block of a stage: ``st.option``, or for a mix
    (:attr:`~whalepy.planner.costing.StageEval.mix`) its parts' counts per segment handed out in block
    order, the option that keeps most on the device first (the ZeRO-Offload blocks then come last,
    so their gradients are ready first in backward and their host step overlaps the most of it)."""
    if not st.mix:
        return {i: st.option for i in positions}
    rank = {Tier.GPU: 0, Tier.CPU: 1, Tier.NVME: 2}
    parts = sorted(st.mix, key=lambda p: (rank[p[0].param_tier], rank[p[0].optimizer_tier]))
    left = [list(n) for _, n in parts]
    out = {}
    for i in positions:
        g = seg_of[i]
        k = next(k for k, row in enumerate(left) if row[g] > 0)
        left[k][g] -= 1
        out[i] = parts[k][0]
    return out


def _buffer_items(sc, st, tight) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """StageCost's items inside ``buffer_bytes`` and ``activation_bytes`` (the tightest cell): the
    :attr:`~whalepy.planner.costing.StageCoeffs.buffer_split` parts over the stage's local parameters,
    FSDP2's working set, the micro-batches in flight and the loss's bytes."""
    pls = part_params(sc, st.parts, st.counts)
    gathered, accum, autocast = (sum(sc.buffer_split[o][i] * x for o, x in pls) if sc.buffer_split else 0.0
                                 for i in range(3))
    return {"working_set_bytes": round(tight.working_held_bytes), "gathered_params_bytes": round(gathered),
            "grad_accum_bytes": round(accum), "autocast_copy_bytes": round(autocast),
            "inflight_microbatches": tight.cell.inflight, "loss_bytes": round(tight.loss_held_bytes)}


def _tied_copies(sc, st, option_of: dict[int, StateOption], seg_of: list[int]) -> list[tuple[float, StateOption]]:  # type: ignore[no-untyped-def]
    """``(local parameters, option, row excess)`` of each tied-weight copy the stage holds
    (:func:`part_params`'s rule), with the option of the blocks holding it."""
    out = []
    for c in sc.tied_copies:
        if tied_copy_params((c,), st.counts):
            out.append((c.local_params, next(o for i, o in option_of.items() if seg_of[i] in c.holders),
                        c.row_excess))
    return out


def _held_state_bytes(ctx: CostContext, cand: Candidate, st, option_of: dict[int, StateOption],  # type: ignore[no-untyped-def]
                      depths: dict[StateOption, int], copies: list[tuple[float, StateOption, float]]) -> dict[str, int]:
    """StageCost's model-state fields: what a device of the stage holds between uses, by place, for its
    blocks' tiers and the tied-weight ``copies`` it holds (:func:`~whalepy.planner.costing.stage_held_bytes`:
    the disk tier's one staging pool, sized by its largest block and the prefetch depth of its NVMe
    parameters, as the runtime sizes it). The first replica's: FSDP2's shards of uneven first
    dimensions are largest there (:func:`~whalepy.ir.rules.fsdp_row_excess`)."""
    prof = ctx.profile
    local = [(tp_local_params(prof.blocks[i], cand.tp), o, fsdp_row_excess(prof.blocks[i], cand.tp, cand.dp))
             for i, o in option_of.items()] + copies
    # the pool reads ahead by the depth of the NVMe parameters (one for the stage), else one block
    disk = [d for o, d in depths.items() if o.param_tier is Tier.NVME]
    held = stage_held_bytes(ctx, cand, st.option.zero, local, prefetch_depth=max(disk, default=1))
    return {"model_state_bytes": round(held.resident), "host_state_bytes": round(held.cpu),
            "nvme_state_bytes": round(held.nvme)}


# -- alternatives -----------------------------------------------------------------------------------

def _bubble_share(ev: Evaluation) -> float:
    return ev.bubble_s / ev.step_time_s


def step_parts(ev: Evaluation) -> dict[str, float]:
    """``ev``'s step time as a sum, seconds per step: ``t T`` of the slowest cell split into its compute,
    TP collectives, exposed data-parallel gathers, pipeline sends and the host copies / parameter
    fetches not hidden, then the bubble ``tc Tc`` and ``x X`` (gradient sync and optimizer step of the
    stage with the longest tail). The parts add up to ``ev.step_time_s``: :func:`step_time`'s form."""
    form = ev.coeffs.candidate.step_form
    cell = max((c for st in ev.stages for c in st.cells), key=lambda c: c.time_s)
    tail = max((c for st in ev.stages for c in st.cells), key=lambda c: c.tail_s)
    listed = cell.compute_s + cell.tp_s + cell.dp_exposed_s + cell.p2p_s
    t = form.t
    return {"compute": t * cell.compute_s, "TP all-reduce": t * cell.tp_s, "exposed DP gathers": t * cell.dp_exposed_s,
            "pipeline sends": t * cell.p2p_s, "offload copies": t * max(0.0, cell.time_s - listed),
            "bubble": form.tc * ev.Tc, "gradient sync": form.x * tail.exposed_sync_s,
            "optimizer step": form.x * (ev.X - tail.exposed_sync_s)}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if abs(s) < 1 else f"{s:.3g} s"


def why_lost(ev: Evaluation, best: Evaluation, hw) -> str:  # type: ignore[no-untyped-def]
    """The figures that make a losing evaluation slower than the best one: both step times, then the
    parts of the step (:func:`step_parts`) that grew, largest first, until they account for the
    difference, and the largest part that shrank (what the loser gains back)."""
    del hw
    a, b = step_parts(ev), step_parts(best)
    diff = {k: a[k] - b[k] for k in a}
    total = ev.step_time_s - best.step_time_s
    grew = sorted((k for k in diff if diff[k] > 1e-12), key=lambda k: -diff[k])
    shown, covered = [], 0.0
    for k in grew:
        if len(shown) == 3 or (shown and covered >= total):
            break
        shown.append(k)
        covered += diff[k]
    words = [f"{k} {_ms(a[k])} vs {_ms(b[k])} (+{_ms(diff[k])})" for k in shown]
    shrank = min(diff, key=lambda k: diff[k])
    if diff[shrank] < -1e-12:
        words.append(f"less {shrank} ({_ms(a[shrank])} vs {_ms(b[shrank])}, -{_ms(-diff[shrank])})")
    return f"{_ms(ev.step_time_s)} vs {_ms(best.step_time_s)} per step, +{_ms(total)}: " + ", ".join(words)


ALTERNATIVE_RESOLVE_NODES = 200
"""Work limit (branch-and-bound nodes) of re-solving, without the incumbent's cutoff, one candidate whose
cutoff solve only showed that nothing of it beats the incumbent (to say whether it is slower or does not
fit). Work, so that the alternatives are the same on any load; counted in the plan's solve time."""


def _slower(ev: Evaluation, best: Evaluation, res: ILPResult, hw) -> str:  # type: ignore[no-untyped-def]
    if ev.step_time_s <= best.step_time_s:
        head = f"ties the best within the solver's gap ({ev.step_time_s:.4g} s vs {best.step_time_s:.4g} s)"
    else:
        head = f"slower by {100 * (ev.step_time_s / best.step_time_s - 1):.1f}%: {why_lost(ev, best, hw)}"
    if res.status == "feasible":
        gap = "unknown" if math.isnan(res.mip_gap) else f"{100 * res.mip_gap:.2g}%"
        limit = "time limit" if res.stopped_by == "time" else "work limit"
        head += f" (its ILP stopped at its {limit}, gap {gap})"
    return head


def _resolve(result: SearchResult, cand: Candidate) -> ILPResult | None:
    """The candidate solved again without a cutoff: its real outcome (None: the user's time limit has
    run out, it is not re-solved)."""
    import time

    from whalepy.planner.ilp import solve_candidate
    from whalepy.planner.search import allowed_stage_ranges

    assert result.ctx is not None and result.constraints is not None
    left = None if result.deadline is None else result.deadline - time.perf_counter()
    if left is not None and left <= 0:
        return None
    cc = build_coefficients(result.ctx, cand, result.segments, result.options, mixed_tiers=result.mixed_tiers)
    solver = result.solver_used if result.solver_used in ("highs", "cbc") else "highs"
    return solve_candidate(cc, allowed_stages=allowed_stage_ranges(cand, result.constraints),
                           allow_checkpointing=result.allow_checkpointing, solver=solver,
                           node_limit=ALTERNATIVE_RESOLVE_NODES, time_limit_s=left,
                           allow_activation_offload=result.allow_activation_offload,
                           allow_checkpoint_offload=result.allow_checkpoint_offload)


def _outcome(result: SearchResult, cand: Candidate, res: ILPResult, best: Evaluation,  # type: ignore[no-untyped-def]
             hw) -> tuple[str, float]:
    """Why a solved candidate lost, in its real terms: slower by how much, short of memory by how much
    where, or out of time. A cutoff solve (``res.status`` "no better than the incumbent") only shows
    that nothing of it beats the incumbent, which is also what it shows when nothing of it fits: the
    candidate is solved again without the cutoff to tell which. Returns the reason and the step time
    (``inf`` when there is none)."""
    if res.status == "no better than the incumbent":
        again = _resolve(result, cand)
        if again is None:
            return (f"no better than the best {best.step_time_s:.4g} s (its ILP with that cutoff found "
                    "nothing); not re-solved without the cutoff: the search's time limit had run out"), math.inf
        res = again
        if res.status == "no solution":
            return (f"work limit: nothing of it beats the best {best.step_time_s:.4g} s (its ILP with that "
                    f"cutoff found nothing), and in {ALTERNATIVE_RESOLVE_NODES} branch-and-bound nodes without "
                    "the cutoff it found no plan, so whether it fits is not known"), math.inf
    if res.evaluation is not None:
        return _slower(res.evaluation, best, res, hw), res.evaluation.step_time_s
    if res.status == "infeasible":
        return memory_shortfall_text(result.ctx, cand, result), math.inf
    limit = "time limit" if res.stopped_by == "time" else "work limit"
    return f"{limit}: its ILP found no plan within its {limit}", math.inf


def build_alternatives(result: SearchResult, best: Evaluation, top_k: int, hw) -> tuple[Alternative, ...]:  # type: ignore[no-untyped-def]
    """The runners-up and, for each other way a candidate lost, at least one example with its reason:
    slower (by how much and why), does not fit (by how much, on which group), time limit, pruned by its
    lower bound, or ruled out of the outer space."""
    alts: list[Alternative] = []
    best_cand = best.coeffs.candidate
    others = [(c, r) for c, r in result.solved if c != best_cand]
    solved = sorted((x for x in others if x[1].evaluation is not None),
                    key=lambda x: x[1].evaluation.step_time_s)  # type: ignore[union-attr]
    unsolved = [x for x in others if x[1].evaluation is None]
    shown = solved[:top_k]
    for status in ("infeasible", "no better than the incumbent", "no solution"):
        # one example of a cutoff solve ("no better than the incumbent"): telling what it really is takes
        # a re-solve without the cutoff (_resolve), the costliest part of the alternatives (four of them
        # took 14 s of the 36 s of Llama-70B on 64 GPUs of 2 types); the others need none
        want = 1 if status == "no better than the incumbent" else max(1, top_k - len(shown))
        shown += [x for x in unsolved if x[1].status == status][:want]
    for cand, res in shown:
        reason, t = _outcome(result, cand, res, best, hw)
        alts.append(Alternative(description=cand.describe(hw.groups), step_time_s=t, reason=reason))
    for kind in (RejectionKind.TIME_LIMIT, RejectionKind.PRUNED, RejectionKind.OUTER):
        for rej in [r for r in result.rejections if r.kind is kind][: max(1, top_k - len(alts))]:
            desc = "(outer space)" if rej.candidate is None else rej.candidate.describe(hw.groups)
            alts.append(Alternative(description=desc, step_time_s=math.inf, reason=rej.reason))
    big = 2 * max(g.gpus_per_node for g in hw.groups)
    if hw.world_size >= big:
        alts.append(Alternative(description=f"tp={big}", step_time_s=math.inf,
                                reason=f"TP across {big} ranks leaves the node (TP stays within a node)"))
    return tuple(alts)


# -- infeasibility ----------------------------------------------------------------------------------

def _fill(c) -> float:  # type: ignore[no-untyped-def]
    """A cell's memory over its usable capacity (``inf`` where the reserve leaves it none)."""
    return c.memory_bytes / c.cell.capacity if c.cell.capacity > 0 else math.inf


def _min_memory(ctx: CostContext, cand: Candidate, result: SearchResult):  # type: ignore[no-untyped-def]
    """Least-memory configuration of a candidate: even split, everything checkpointed (if allowed),
    the least-memory state option per stage. Returns ``(worst ratio, stage eval, cell eval)``."""
    cc = build_coefficients(ctx, cand, result.segments, result.options)
    N, J = cc.num_blocks, cand.num_virtual
    sizes = [N // J + (1 if j < N % J else 0) for j in range(J)]
    from whalepy.planner.costing import chunk_counts_from_sizes

    rows = chunk_counts_from_sizes(cc, sizes)
    S, V = cand.num_stages, cand.virtual_stages
    worst = None
    allow_ck = result.allow_checkpointing
    for s, sc in enumerate(cc.stages):
        chunks = [rows[s + k * S] for k in range(V)]
        ck = [list(r) if allow_ck else [0] * len(r) for r in chunks]
        best_stage = None
        for o in sc.options:
            ev = evaluate_stage(sc, chunks, ck, o, dp=cand.dp)
            ratio = max(_fill(c) for c in ev.cells)
            if best_stage is None or ratio < best_stage[0]:
                best_stage = (ratio, ev)
        assert best_stage is not None
        if worst is None or best_stage[0] > worst[0]:
            cell = max(best_stage[1].cells, key=_fill)
            worst = (best_stage[0], best_stage[1], cell)
    return worst


def memory_shortfall_text(ctx, cand: Candidate, result: SearchResult) -> str:  # type: ignore[no-untyped-def]
    """Why a candidate the solver found infeasible does not fit, measured on its least-memory layout
    (even split, every block checkpointed where allowed, the least-memory state option per stage)."""
    ratio, st, cell = _min_memory(ctx, cand, result)
    g = cell.cell.group
    if ratio <= 1.0:
        return (f"does not fit: its least-memory layout fits the devices, so the annotated stage boundaries "
                f"or the host memory / NVMe its offloaded states need rule it out (stage {st.index} on group "
                f"{g.name!r})")
    short = cell.memory_bytes - cell.cell.capacity
    by = gb(short) if short >= 0.1 * GIB else f"{short / 2**20:.0f} MiB"
    return (f"does not fit by {by} on group {g.name!r} "
            f"({g.device.name}): stage {st.index} needs {gb(cell.memory_bytes)} per device in its least-memory "
            f"layout ({st.option}), {gb(cell.cell.capacity)} usable")


def raise_infeasible(result: SearchResult, opts, global_batch: int) -> None:  # type: ignore[no-untyped-def]
    ctx = result.ctx
    assert ctx is not None and result.constraints is not None
    cons = result.constraints
    if not result.candidates:
        why = "; ".join(dict.fromkeys(r.reason for r in result.rejections if r.candidate is None)) or ""
        fixed = [f"{v} fixes {k}" for k, v in cons.sources.items()]
        raise InfeasibleError(
            f"no parallel layout of {ctx.hw.world_size} devices fits the constraints for global batch "
            f"{global_batch}: the global batch must divide evenly over the data-parallel replicas and "
            f"micro-batches{'; ' + why if why else ''}{'; ' + '; '.join(fixed) if fixed else ''}. "
            "Change the global batch, the device count or the annotations.")
    best = None
    for cand in result.candidates[:400]:
        ratio, st, cell = _min_memory(ctx, cand, result)
        if best is None or ratio < best[0]:
            best = (ratio, cand, st, cell)
    assert best is not None
    ratio, cand, st, cell = best
    g = cell.cell.group
    if ratio <= 1.0:
        raise InfeasibleError(_host_shortfall_text(ctx, cand, st, cell, opts))
    head = (f"no plan fits: even the least-memory candidate ({cand.describe(ctx.hw.groups)}, "
            f"{st.option}, {'all blocks checkpointed' if opts.allow_checkpointing else 'no checkpointing'}): "
            f"stage {st.index} on group {g.name!r} ({g.device.name}) needs {gb(cell.memory_bytes)} per device, "
            f"has {gb(cell.cell.capacity)} usable: {gb(max(0.0, cell.memory_bytes - cell.cell.capacity))} short "
            f"(model states {gb(cell.states_bytes)}, activations {gb(cell.activation_bytes)}).")
    fixes = [f"more devices (about {math.ceil(ratio * 10) / 10:g}x the memory of this group)"]
    if not opts.allow_checkpointing:
        fixes.append("allow_checkpointing=True")
    if not opts.allow_activation_offload and all(gr.cpu_memory_bytes is not None for gr in ctx.hw.groups):
        fixes.append("allow_activation_offload=True (activations in host memory)")
    if not opts.allow_checkpoint_offload and all(gr.cpu_memory_bytes is not None for gr in ctx.hw.groups):
        fixes.append("allow_checkpoint_offload=True (activation checkpoints in host memory)")
    if 3 not in opts.zero_stages:
        fixes.append("ZeRO-3 (zero_stages including 3)")
    if "replicate" in cons.sources and cons.dp is not None:
        fixes.append(f"{cons.sources['replicate']} fixes DP at {cons.dp}, so ZeRO-3 shards across only "
                     f"{cons.dp} ranks: drop it or raise it")
    if "split" in cons.sources:
        fixes.append(f"{cons.sources['split']} fixes TP at {cons.tp or '>1'}: a larger TP degree would shard "
                     "more: drop or raise it")
    if "stage" in cons.sources:
        fixes.append(f"{cons.sources['stage']}: the stage scopes fix {cons.num_stages} pipeline stages and "
                     "their boundaries: more stages would spread the layers")
    if "cluster" in cons.sources:
        fixes.append(f"{cons.sources['cluster']} pins blocks to one group")
    if not opts.allow_offload:
        fixes.append("allow_offload=True (CPU / NVMe offload)")
    elif any(gr.cpu_memory_bytes is None for gr in ctx.hw.groups):
        fixes.append("CPU offload: give cpu_memory_gb for the groups in the cluster spec")
    mb = min(cand.batch_shares) / cand.num_microbatches
    if mb > 1:
        fixes.append(f"a smaller micro-batch (this one is {mb:g} samples)")
    raise InfeasibleError(head + " To fit: " + "; ".join(fixes) + ".")




__all__ = ["build_alternatives", "build_plan", "raise_infeasible"]


def _host_shortfall_text(ctx, cand: Candidate, st, cell, opts) -> str:  # type: ignore[no-untyped-def]
    """The least-memory candidate fits its devices: what rules it out is host memory or NVMe (per GPU of
    the node: the node's capacity shared by its GPUs), or the annotations."""
    g = cell.cell.group
    where = (f"the least-memory candidate ({cand.describe(ctx.hw.groups)}, {st.option}) fits the devices of "
             f"group {g.name!r} ({gb(cell.memory_bytes)} of {gb(cell.cell.capacity)} usable)")
    short = []
    for what, need, cap in (("host memory", cell.cpu_bytes, cell.cell.cpu_capacity),
                            ("NVMe", cell.nvme_bytes, cell.cell.nvme_capacity)):
        if need > 0 and (cap is None or need > cap):
            has = "none given" if cap is None else f"{gb(cap)}"
            short.append(f"{what}: {gb(need)} per GPU, the node has {has} per GPU")
    if not short:
        return (f"no plan fits: {where}, so the annotated stage boundaries or the host memory / NVMe of "
                "the nodes rule every candidate out. To fit: relax the annotations, or give more host memory "
                "/ NVMe per node (cpu_memory_gb, nvme in the cluster spec).")
    fixes = ["more nodes (the offloaded states shard over more hosts)",
             "more host memory / NVMe per node (cpu_memory_gb, nvme in the cluster spec)"]
    if not opts.allow_offload:
        fixes.append("allow_offload=True")
    return (f"no plan fits: {where}, but its offloaded states and activations do not fit the nodes: "
            f"{'; '.join(short)}. To fit: {'; '.join(fixes)}.")
