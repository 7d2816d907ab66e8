"""Evaluation of a fully specified configuration (split from :mod:`whalepy.planner.costing`, which
re-exports these names): the step time and memory of given stage sizes, checkpointed and offloaded
blocks per segment and a state option per stage, from the candidate's coefficients; the lower bound the
search prunes with. The ILP (:mod:`whalepy.planner.ilp`) and the exhaustive search evaluate their
solutions with :func:`evaluate`, so every plan is costed by the same functions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from whalepy.planner._coeffs import (
    CandidateCoeffs,
    CellCoeffs,
    StageCoeffs,
    node_fits,
    stage_host_activation,
    stage_host_checkpoint,
    tied_copy_params,
)
from whalepy.planner.space import MAX_OPTIONS_PER_STAGE, Candidate, StateMix, StateOption

if TYPE_CHECKING:
    from whalepy.planner._bound import Choices

__all__ = ["held_copies", "part_params", "part_state_params", "CellEval", "Evaluation", "StageEval", "checkpoint_offload_s", "chunk_busy_s", "chunk_counts_from_sizes", "compute_bound", "counts_from_boundaries", "evaluate", "evaluate_stage", "lower_bound", "memory_breakdown", "offload_s", "split_stage_checkpoints", "step_time"]


@dataclass(slots=True)
class CellEval:
    cell: CellCoeffs
    compute_s: float
    """Per micro-batch: block compute (and recompute), without communication or the exposed copies of
    offloaded activations (:func:`offload_s`, in ``time_s``)."""
    comm_s: float
    """Per micro-batch: exposed TP collectives and pipeline sends."""
    dp_exposed_s: float
    """Per micro-batch: exposed data-parallel communication (FSDP2 gathers not hidden by compute, and
    the compute they slow down)."""
    fetch_s: float
    time_s: float
    """Per micro-batch: max(compute + TP + exposed DP communication, fetch) + p2p."""
    chunk_time_s: float
    """Per micro-batch, the largest chunk: max(busy_k, fetch / v) + p2p_k (v = 1: time_s)."""
    exposed_sync_s: float
    """Per step: gradient reduction not hidden by the last backward, plus post-step all-gathers."""
    opt_s: float
    memory_bytes: float
    """GPU bytes at the peak: states + buffers + activations."""
    states_bytes: float
    """Parameters + gradients + optimizer states on the GPU."""
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    buffer_bytes: float
    """FSDP2 working set, unsharded gradient accumulation, autocast weight copies."""
    activation_bytes: float
    cpu_bytes: float
    nvme_bytes: float

    tp_s: float = 0.0
    """Per micro-batch: exposed tensor-parallel collectives."""
    cpu_grads_bytes: float = 0.0
    """Of ``cpu_bytes``, host gradients the backward makes after the device's peak (the plan's
    :attr:`~whalepy.ir.plan.StageCost.cpu_grads_bytes`)."""
    working_held_bytes: float = 0.0
    """Of ``buffer_bytes``, FSDP2's working set at the peak (without the gradient buffer at the loss's
    backward)."""
    loss_held_bytes: float = 0.0
    """Of ``activation_bytes``, the loss's tensors (at a block's backward only the other micro-batches'
    kept ones; none at the end of backward)."""

    @property
    def tail_s(self) -> float:
        return self.exposed_sync_s + self.opt_s

    @property
    def p2p_s(self) -> float:
        return self.cell.p2p

    @property
    def reserve_bytes(self) -> float:
        """Device memory the planner keeps back from the allocator: CUDA context, NCCL buffers and
        the allocator's fragmentation allowance (:func:`whalepy.planner.runtime_costs.usable_device_bytes`)."""
        return self.cell.group.device.memory_bytes - self.cell.capacity - self.cell.margin

    @property
    def fits(self) -> bool:
        """Device memory; host memory and NVMe are the node's (:func:`node_fits`)."""
        return self.memory_bytes <= self.cell.capacity * (1 + 1e-6)


def memory_breakdown(c: CellEval) -> dict[str, int]:
    """A cell's memory by kind, bytes per device (the :class:`~whalepy.ir.plan.StageCost` fields)."""
    return dict(params_bytes=int(c.params_bytes), grads_bytes=int(c.grads_bytes),
                optimizer_bytes=int(c.optimizer_bytes), activation_bytes=int(c.activation_bytes),
                buffer_bytes=int(c.buffer_bytes), reserve_bytes=int(c.reserve_bytes),
                margin_bytes=int(c.cell.margin),
                cpu_bytes=int(c.cpu_bytes), cpu_grads_bytes=int(c.cpu_grads_bytes), nvme_bytes=int(c.nvme_bytes))


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
    chunk_offloads: tuple[tuple[int, ...], ...] = ()
    """Per chunk, blocks per segment whose saved activations are kept in host memory."""
    host_activation_bytes: float = 0.0
    """Host bytes per rank of the offloaded activations (included in each cell's ``cpu_bytes``)."""
    chunk_checkpoint_offloads: tuple[tuple[int, ...], ...] = ()
    """Per chunk, checkpointed blocks per segment whose input is kept in host memory."""
    mix: StateMix = ()
    """Granular tiers: the options the stage's blocks are split over with their blocks per segment
    (``option`` is the first); empty: every block uses ``option``."""

    @property
    def parts(self) -> StateMix:
        """``((option, blocks per segment), ...)``: the mix, or ``option`` with all the stage's blocks."""
        return self.mix or ((self.option, self.counts),)

    @property
    def offloads(self) -> tuple[int, ...]:
        """Blocks per segment with activations offloaded on this stage (all chunks)."""
        if not self.chunk_offloads:
            return (0,) * len(self.counts)
        return tuple(sum(col) for col in zip(*self.chunk_offloads))

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
        return self.coeffs.candidate.step_form.tc * self.Tc


def chunk_busy_s(c: CellCoeffs, option: StateOption | StateMix, counts: Sequence[int], ckpts: Sequence[int],
                 offs: Sequence[int] = (), ckoffs: Sequence[int] = ()) -> float:
    """Per micro-batch, one chunk of a cell without its sends: its blocks' forward, backward and TP
    all-reduces, recompute of its checkpointed blocks, the exposed host copies of its blocks with
    offloaded activations or checkpointed inputs, and its exposed data-parallel communication
    (``option``: a mix is one chunk, its parts' blocks ``counts``)."""
    parts = ((option, counts),) if isinstance(option, StateOption) else option
    first = parts[0][0]
    return (sum(n * x for n, x in zip(counts, c.seg_time))
            + sum(n * e for o, ns in parts for n, e in zip(ns, c.seg_exposed[o]))
            + sum(k * x for k, x in zip(ckpts, c.seg_recompute)) + offload_s(c, offs)
            + checkpoint_offload_s(c, ckoffs) + c.edge[first])


def checkpoint_offload_s(c: CellCoeffs, ckoffs: Sequence[int]) -> float:
    """Seconds per micro-batch of keeping the inputs of ``ckoffs`` checkpointed blocks per segment in
    host memory."""
    if not any(ckoffs):
        return 0.0
    if c.seg_ckoff is None:
        raise ValueError(f"checkpoint offload on group {c.group.device.name!r}, which has no host memory given")
    return sum(k * x for k, x in zip(ckoffs, c.seg_ckoff))


def offload_s(c: CellCoeffs, offs: Sequence[int]) -> float:
    """Exposed activation-offload seconds per micro-batch of ``offs`` blocks per segment."""
    if not any(offs):
        return 0.0
    if c.seg_offload is None:
        raise ValueError(f"activation offload on group {c.group.device.name!r}, which has no host memory given")
    return sum(k * x for k, x in zip(offs, c.seg_offload))


def _check_mix(sc: StageCoeffs, mix: StateMix, counts: Sequence[int], v: int) -> None:
    options = [o for o, _ in mix]
    if v != 1:
        raise ValueError(f"stage {sc.index}: granular tiers (several state options) need one chunk per stage")
    if len(set(options)) != len(options) or not 1 < len(options) <= MAX_OPTIONS_PER_STAGE:
        raise ValueError(f"stage {sc.index}: a mix needs 2 to {MAX_OPTIONS_PER_STAGE} distinct options, got "
                         f"{[str(o) for o in options]}")
    if all(o.beside_offload for o in options):
        raise ValueError(f"stage {sc.index}: a mix needs an option that offloads (the others are lowered beside it)")
    if not any(set(options) <= set(f) for f in sc.families):
        raise ValueError(f"stage {sc.index}: options {[str(o) for o in options]} are not one family of the stage")
    if sum(1 for _, n in mix if any(n[g] for g in sc.tied_segments)) > 1:
        raise ValueError(f"stage {sc.index}: blocks that share parameters (segments {list(sc.tied_segments)}) "
                         "are split over several options")
    if [sum(col) for col in zip(*(n for _, n in mix))] != list(counts) or any(x < 0 for _, n in mix for x in n):
        raise ValueError(f"stage {sc.index}: the mix's blocks {[list(n) for _, n in mix]} do not split {list(counts)}")


def part_params(sc: StageCoeffs, parts: StateMix, counts: Sequence[int]) -> list[tuple[StateOption, float]]:
    """Local parameters per device of each part ``(option, blocks per segment)`` of a stage with
    ``counts`` blocks per segment: its blocks', and the copies of tied weights the stage holds
    (:attr:`StageCoeffs.tied_copies`) in the part whose blocks hold them."""
    pls = {o: sum(n * p for n, p in zip(ns, sc.seg_params)) for o, ns in parts}
    for k, o in held_copies(sc, parts, counts):
        pls[o] += sc.tied_copies[k].local_params
    return list(pls.items())


def part_state_params(sc: StageCoeffs, parts: StateMix, counts: Sequence[int],
                      pls: list[tuple[StateOption, float]] | None = None) -> list[tuple[StateOption, float]]:
    """:func:`part_params` as the model states count them: under FSDP2 (:attr:`StageCoeffs.row_options`)
    the first replica's shards hold the blocks' and copies' :attr:`StageCoeffs.seg_excess` /
    ``row_excess`` beyond the even split, charged like parameters (``(P + excess) / dp``)."""
    pls = part_params(sc, parts, counts) if pls is None else pls
    if not sc.row_options:
        return pls
    extra = {o: sum(n * e for n, e in zip(ns, sc.seg_excess)) for o, ns in parts if o in sc.row_options}
    for k, o in held_copies(sc, parts, counts):
        if o in extra:
            extra[o] += sc.tied_copies[k].row_excess
    return [(o, x + extra.get(o, 0.0)) for o, x in pls]


def held_copies(sc: StageCoeffs, parts: StateMix, counts: Sequence[int]) -> list[tuple[int, StateOption]]:
    """``(index in sc.tied_copies, option of the blocks holding it)`` of each tied copy the stage holds."""
    return [(k, next(o for o, ns in parts if any(ns[h] for h in c.holders)))
            for k, c in enumerate(sc.tied_copies) if tied_copy_params((c,), counts)]


def evaluate_stage(sc: StageCoeffs, chunk_counts: Sequence[Sequence[int]], chunk_ckpts: Sequence[Sequence[int]],
                   option: StateOption | StateMix, *, dp: int,
                   chunk_offs: Sequence[Sequence[int]] | None = None,
                   chunk_ckoffs: Sequence[Sequence[int]] | None = None) -> StageEval:
    """Cost of one physical stage: blocks, checkpointed blocks, blocks with offloaded activations
    (``chunk_offs``, None: none) and checkpointed blocks whose input is in host memory (``chunk_ckoffs``,
    None: none; at most the checkpointed ones) per segment of each of its chunks (one chunk without
    interleaving) and its state option, or a mix of options of one family
    (:data:`~whalepy.planner.space.StateMix`, one chunk only): per-parameter and per-block costs summed
    over the parts, per-stage ones (working set, first-block gathers, last reduction, post-step
    all-gathers, autocast copies) paid once, the family's."""
    v = len(chunk_counts)
    G = len(sc.seg_params)
    counts = [sum(row[g] for row in chunk_counts) for g in range(G)]
    if isinstance(option, StateOption):
        if option.beside_offload:
            raise ValueError(f"stage {sc.index}: {option} is only part of a mix")
        mix: StateMix = ()
        parts: StateMix = ((option, tuple(counts)),)
    else:
        mix = parts = tuple((o, tuple(n)) for o, n in option)
        _check_mix(sc, mix, counts, v)
        option = mix[0][0]
    ckpts = [sum(row[g] for row in chunk_ckpts) for g in range(G)]
    if chunk_offs is None or not any(map(any, chunk_offs)):
        chunk_offs = [[0] * G for _ in range(v)]
        offs = [0] * G
        host_act = 0.0
    else:
        offs = [sum(row[g] for row in chunk_offs) for g in range(G)]
        if any(k + o > n for cn, ck, co in zip(chunk_counts, chunk_ckpts, chunk_offs) for n, k, o in zip(cn, ck, co)):
            raise ValueError(f"stage {sc.index}: checkpointed {ckpts} plus offloaded {offs} blocks exceed {counts}")
        host_act = sum(o * x for o, x in zip(offs, stage_host_activation(sc)))
    if chunk_ckoffs is None or not any(map(any, chunk_ckoffs)):
        chunk_ckoffs = [[0] * G for _ in range(v)]
    elif any(w > k for ck, cw in zip(chunk_ckpts, chunk_ckoffs) for k, w in zip(ck, cw)):
        raise ValueError(f"stage {sc.index}: checkpoint-offloaded blocks {list(map(list, chunk_ckoffs))} exceed "
                         f"the checkpointed ones {list(map(list, chunk_ckpts))}")
    ckoffs = [sum(row[g] for row in chunk_ckoffs) for g in range(G)]
    host_act += sum(w * x for w, x in zip(ckoffs, stage_host_checkpoint(sc))) if any(ckoffs) else 0.0
    pls = part_params(sc, parts, counts)
    pl = sum(x for _, x in pls)
    alpha, beta = sc.sync[option]
    post = alpha + beta * pl if dp > 1 and pl > 0 else 0.0

    def per_param(coef: dict[StateOption, float]) -> float:
        return sum(coef[o] * x for o, x in pls)

    sls = part_state_params(sc, parts, counts, pls)

    def per_state(coef: dict[StateOption, float]) -> float:  # the model states: FSDP2's rows as split
        return sum(coef[o] * x for o, x in sls)

    states = per_state(sc.mem_beta)
    sp, sg, so = (sum(sc.state_split[o][i] * x for o, x in sls) for i in range(3))
    freed = sg if sc.grads_freed[option] else 0.0
    buffers = per_param(sc.buffer_beta) + sc.working_bytes[option]
    copies = held_copies(sc, parts, counts)
    cells = []
    for ci, c in enumerate(sc.cells):
        tied_s = sum(sc.tied_sync[ci][k][o] for k, o in copies)  # every step, whatever the dp degree
        off_s = offload_s(c, offs) + checkpoint_offload_s(c, ckoffs)
        compute = (sum(n * x for n, x in zip(counts, c.seg_time)) + sum(k * x for k, x in zip(ckpts, c.seg_recompute))
                   + off_s)
        comm = sum(n * x for n, x in zip(counts, c.seg_comm))
        exposed = sum(n * e for o, ns in parts for n, e in zip(ns, c.seg_exposed[o])) + v * c.edge[option]
        amp_s = (sum(n * e for o, ns in parts for n, e in zip(ns, c.seg_autocast[o]))
                 if c.seg_autocast is not None else 0.0)
        fetch = per_param(c.fetch_beta)
        backward = sum(n * x for n, x in zip(counts, c.seg_bwd))  # the last micro-batch's, hides ZeRO-Offload
        time_s = max(compute + exposed, fetch) + c.p2p
        # an offloaded block keeps nothing on the device between its forward and its backward, nor does a
        # checkpointed one whose input is in host memory
        saved = [a + e for a, e in zip(c.seg_saved, c.seg_amp_saved[option])]  # with autocast's extras
        kept = [sum(n * a + k * (i - a) - o * a - w * i
                    for n, k, o, w, a, i in zip(cn, ck, co, cw, saved, c.seg_input))
                for cn, ck, co, cw in zip(chunk_counts, chunk_ckpts, chunk_offs, chunk_ckoffs)]
        if v == 1:
            chunk_time = time_s
        else:
            chunk_time = max(max(chunk_busy_s(c, option, cn, ck, co, cw), fetch / v) + p
                             for cn, ck, co, cw, p in zip(chunk_counts, chunk_ckpts, chunk_offs, chunk_ckoffs,
                                                          c.chunk_p2p))
        # recomputed or fetched back in backward, one block at a time
        peak = max((a for k, o, a in zip(ckpts, offs, saved) if k + o > 0), default=0.0)
        loss_act = c.loss_bytes + c.loss_held_bytes
        act = c.inflight * max(kept) + peak + loss_act
        # GPipe: after the first micro-batch's backward, every gradient and the other micro-batches'
        # activations (their recomputed block and loss backward still to come)
        gpipe = sc.grads_after_forwards.get(option) and c.inflight > 1
        loss_rest = c.loss_bytes + c.loss_held_bytes * (c.inflight - 2) / (c.inflight - 1) if gpipe else 0.0
        rest = (c.inflight - 1) * max(kept) + peak + loss_rest if gpipe else 0.0
        # the peak: the loss's backward (activations, gradients not yet created if freed, nor the running
        # block's gradient buffer), the first block's backward (its gradients, the loss's tensors freed),
        # GPipe's first backward, or the end of backward
        wg, bg = sc.working_grad.get(option, 0.0), sc.block_grad.get(option, 0.0)
        at_loss = states - freed + buffers - wg + act
        at_block = states - freed + buffers - wg + bg + act - c.loss_bytes if bg else float("-inf")
        at_end = states + buffers + rest
        top = max(at_loss, at_block, at_end)
        at_act = top > at_end or at_loss == at_end  # ties: the activation peak (as before)
        in_block = at_act and at_block > at_loss
        grads_held = sg if (not freed or not at_act) else 0.0
        if in_block and not wg:  # the block's own gradients, where they are freed at the activation peak
            grads_held += bg
        # host gradients (CPUOffloadPolicy) are made in backward like the device's
        host_grads = per_state(sc.host_grads) if sc.host_grads and sc.grads_freed[option] and at_act else 0.0
        held_buffers = buffers - wg if at_act and not in_block else buffers
        held_act = (act - c.loss_bytes if in_block else act) if at_act else rest
        # per-step work after the last backward: the data-parallel reductions (none without replicas: their
        # group is None and every such term 0) and the measured DTensor optimizer overhead (TP alone too)
        sync_s = (sum(n * x for o, ns in parts for n, x in zip(ns, c.seg_tail[o])) + c.tail_edge[option]
                  + post)
        cells.append(CellEval(
            cell=c, compute_s=compute - comm - off_s + amp_s, comm_s=comm + c.p2p, dp_exposed_s=exposed - amp_s,
            fetch_s=fetch,
            time_s=time_s, chunk_time_s=chunk_time, exposed_sync_s=sync_s + tied_s,
            opt_s=per_param(c.opt_beta) + max(0.0, per_param(c.opt_overlap) - backward),
            memory_bytes=top,
            states_bytes=states, params_bytes=sp, grads_bytes=grads_held, optimizer_bytes=so,
            buffer_bytes=held_buffers, activation_bytes=held_act, tp_s=comm,
            cpu_grads_bytes=host_grads, working_held_bytes=sc.working_bytes[option] - (buffers - held_buffers),
            loss_held_bytes=((c.loss_held_bytes if in_block else loss_act) if at_act else loss_rest),
            cpu_bytes=per_state(sc.cpu_beta) + sum(sc.host_fixed.get(o, 0.0) for o, _ in parts) + host_act,
            nvme_bytes=per_state(sc.nvme_beta)))
    return StageEval(index=sc.index, counts=tuple(counts), checkpoints=tuple(ckpts), option=option,
                     local_params=pl, sync_s=max(c.exposed_sync_s for c in cells), cells=cells,
                     chunk_counts=tuple(tuple(r) for r in chunk_counts),
                     chunk_checkpoints=tuple(tuple(r) for r in chunk_ckpts),
                     chunk_offloads=tuple(tuple(r) for r in chunk_offs), host_activation_bytes=host_act,
                     chunk_checkpoint_offloads=tuple(tuple(r) for r in chunk_ckoffs) if any(ckoffs) else (),
                     mix=mix)


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
             options: Sequence[StateOption | StateMix], offs: Sequence[Sequence[int]] | None = None,
             ckoffs: Sequence[Sequence[int]] | None = None) -> Evaluation:
    """Cost of a fully specified configuration: virtual-stage ``sizes``, checkpointed blocks per segment
    of every virtual stage (``J`` rows, model order; ``S`` rows of per-stage counts are spread over each
    stage's chunks first chunk first), and a state option (or a mix of them,
    :data:`~whalepy.planner.space.StateMix`) per stage; ``offs``: blocks per segment with activations
    offloaded to host memory, ``J`` rows (None: none); ``ckoffs``: checkpointed blocks per segment whose
    input is in host memory, ``J`` rows (None: none)."""
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
    if offs is not None and len(offs) != cand.num_virtual:
        raise ValueError(f"{len(offs)} activation-offload rows for {cand.num_virtual} virtual stages")
    if ckoffs is not None and len(ckoffs) != cand.num_virtual:
        raise ValueError(f"{len(ckoffs)} checkpoint-offload rows for {cand.num_virtual} virtual stages")
    stages = []
    for s, sc in enumerate(cc.stages):
        used = [options[s]] if isinstance(options[s], StateOption) else [o for o, _ in options[s]]  # type: ignore[union-attr]
        if any(o not in sc.options for o in used):
            raise ValueError(f"stage {s}: state option {[str(o) for o in used]} is not available there")
        stages.append(evaluate_stage(sc, [chunk_counts[s + k * S] for k in range(v)],
                                     [chunk_ckpts[s + k * S] for k in range(v)], options[s], dp=cand.dp,
                                     chunk_offs=None if offs is None else [offs[s + k * S] for k in range(v)],
                                     chunk_ckoffs=None if ckoffs is None else [ckoffs[s + k * S] for k in range(v)]))
    T = max(st.time_s for st in stages)
    Tc = max(st.chunk_time_s for st in stages)
    X = max(st.tail_s for st in stages)
    fits = all(st.fits for st in stages) and node_fits(
        cc, [st.cells[0].cpu_bytes for st in stages], [st.cells[0].nvme_bytes for st in stages])
    return Evaluation(coeffs=cc, stages=stages, boundaries=tuple(sizes), T=T, X=X,
                      step_time_s=step_time(cc, T, Tc, X), fits=fits, Tc=Tc)


def step_time(cc: CandidateCoeffs, T: float, Tc: float, X: float) -> float:
    """``M T + (S - 1) Tc + X`` (:class:`~whalepy.planner.space.StepForm`)."""
    return cc.candidate.step_form.value(T, Tc, X)


def lower_bound(cc: CandidateCoeffs, *, memory: bool = True, whole_blocks: bool = False,
                cutoff: float | None = None, choices: Choices | None = None) -> float:
    """A step time no plan of ``cc``'s candidate beats, read off the coefficients its cost is made of.

    It uses nothing but ``CellCoeffs.seg_time`` (per block of each segment, seconds per micro-batch:
    what :func:`evaluate_stage` sums into a cell's ``compute``) and the shape of :func:`step_time`;
    no constant of the cost model appears here, so whatever a block costs (compute model, byte scale,
    TP communication) the bound moves with it. The argument, each step an inequality of the cost's
    structure:

    1. ``step = M T + (S - 1) Tc + X`` with ``X >= 0`` (a max of exposed sync ``max(0, .)`` plus an
       optimizer step, both non-negative).
    2. Per cell, ``time_s = max(compute, gather, fetch) + p2p >= compute`` (a max is at least its first
       argument, ``p2p >= 0``), and ``compute = sum_g n_g seg_time_g + sum_g c_g seg_recompute_g
       >= sum_g n_g seg_time_g =: C_s`` (recompute and exposed activation copies are non-negative). So ``T >= max_s C_s`` for every
       replica's cells.
    3. A chunk's time is ``max(compute_k, ...) + p2p_k >= compute_k`` and the chunks' ``compute_k`` sum
       to the stage's ``compute``, so ``Tc >= max_s C_s / v``; with ``v = 1`` the chunk is the stage and
       ``Tc = T``.
    4. Relaxing the partition of replica ``r`` (``n_sg >= 0``, ``sum_s n_sg = L_g``, fractional), for
       any weights ``lambda_s >= 0`` summing to one, ``max_s C_s >= sum_s lambda_s C_s >= sum_g L_g
       min_s lambda_s w_sg`` with ``w_sg`` the seg_time of segment ``g`` on stage ``s``'s cell of
       ``r``. The weights ``lambda_s ~ 1 / W_s`` (``W_s = sum_g L_g w_sg``, the whole model on that
       cell) make this ``1 / sum_s (1 / W_s)`` when every cell runs every block alike (``W / S`` on one
       device type), and never more than the fractional optimum otherwise.
    5. Blocks are whole: the ``L_g`` blocks of segment ``g`` run on ``S`` stages, so some stage runs at
       least ``ceil(L_g / S)`` of them (pigeonhole), and some chunk ``ceil(L_g / (S v))``: ``T >=
       ceil(L_g / S) min_s w_sg`` and ``Tc >= ceil(L_g / (S v)) min_s w_sg``, for every segment (80
       layers in 32 chunks: some chunk runs 3, where step 3 alone says 2.5).
    6. Memory (``memory=True``): every stage's activations must fit its device, so a plan that fits
       pays recompute or host copies wherever they do not; the least slowest-stage compute of a
       divisible partition that fits is a small LP (:func:`~whalepy.planner._bound.relaxed_stage_time`,
       its module docstring has the argument), a lower bound of ``max_s compute_s`` that replaces
       ``frac_r`` when higher. Step 3 holds with recompute and copies counted in ``compute``.

    Hence ``step >= M T* + (S - 1) Tc*`` with ``T* = max_r max(frac_r, block_r)`` and ``Tc* = T*``
    (``v = 1``) or ``max(T* / v, max_r chunk_r)`` (``block_r``, ``chunk_r``: step 5's): model states, gathers, fetches, p2p and the tail
    only add to it. ``tests/test_planner_bound.py`` checks ``bound <= cost`` of every plan that fits,
    for every candidate of random instances (brute force).

    Only per-block coefficients of the cells are read (``seg_time``, and for step 6 the recompute,
    copy and byte ones), which no state option changes, so ``cc`` may be built with no options
    (``build_coefficients(ctx, cand, segments, ())``, what the search does: it skips the per-option
    work for candidates it never solves). ``memory=False`` skips step 6 (the search's first ordering,
    before it adds step 6 to the candidates that come up below the incumbent).

    7. Whole blocks and state options (``whole_blocks=True``, on coefficients built with their state
       options): a small MIP per pipeline, :func:`~whalepy.planner._bound.integer_step_bound` (its
       docstring has the argument): integer blocks per stage, memory with the model states, sends,
       fetches, exposed communication and the tail. A step time in itself; the bound is the larger of it
       and the above. Costlier (a MIP, 0.1-1 s), so the search uses it only on the candidates whose
       first look (:data:`~whalepy.planner.search.FIRST_LOOK_NODES`) did not settle them, and with
       ``cutoff`` (the incumbent less the MIP gap): it only asks whether the bound reaches that, which
       HiGHS answers at its first solution below it, or with a proof that there is none (the bound is
       then ``cutoff``).
    8. Stage by stage (``whole_blocks=True`` with a ``cutoff``, interleaved candidates, where step 7 does
       not reach it): :func:`~whalepy.planner._stage_dp.stage_dp_bound`, a table per stage of the least
       it adds to the step per vector of blocks, in whole checkpoints, chunks and one state option,
       combined over the stages by a dynamic program (its module docstring has the argument).
    """
    from whalepy.planner._bound import ALL_CHOICES, integer_step_bound, relaxed_stage_time
    from whalepy.planner._stage_dp import stage_dp_bound

    choices = choices or ALL_CHOICES
    cand = cc.candidate
    S, v, M = cand.num_stages, cand.virtual_stages, cand.num_microbatches
    lengths = [seg.length for seg in cc.segments]
    T, B, whole_step = 0.0, 0.0, 0.0
    # replicas whose stages all run in the same cells are one pipeline as far as the bound goes
    cells = [{r: c for c in st.cells for r in c.replicas} for st in cc.stages]
    pipelines = {tuple(id(cell_of[r]) for cell_of in cells): r for r in range(cand.dp)}
    for r in pipelines.values():
        frac, block, chunk = _compute_parts([cell_of[r].seg_time for cell_of in cells], lengths, S, v)
        # 6. memory: every stage's activations fit (recompute, offload), as a small LP (planner/_bound.py)
        relaxed = relaxed_stage_time(cc, [cell_of[r] for cell_of in cells], choices) if memory else None
        if relaxed is not None:
            frac = max(frac, relaxed)
        T, B = max(T, frac, block), max(B, chunk)
        # 7. whole blocks and state options: a small MIP (planner/_bound.py)
        if whole_blocks:
            pipeline = [cell_of[r] for cell_of in cells]
            whole_step = max(whole_step, integer_step_bound(cc, pipeline, cutoff, choices) or 0.0)
            # 8. whole checkpoints, one state option per stage, stage by stage (planner/_stage_dp.py): asked
            # only of interleaved candidates (whose ILPs cost the most) where the MIP does not reach the
            # cutoff (a table per stage, costlier than most MIPs)
            if cutoff is not None and whole_step < cutoff and v > 1:
                whole_step = max(whole_step, stage_dp_bound(cc, pipeline, cutoff, choices) or 0.0)
            if cutoff is not None and whole_step >= cutoff:
                break
    Tc = T if v == 1 else max(T / v, B)
    return max(cc.candidate.step_form.value(T, Tc, 0.0), whole_step)


def _compute_parts(w: list[list[float]], lengths: list[int], S: int, v: int) -> tuple[float, float, float]:
    """Steps 4 and 5 of :func:`lower_bound` for one pipeline (``w[s]``: its stage ``s``'s ``seg_time``):
    ``(fractional partition, whole blocks per stage, whole blocks per chunk)``."""
    whole = [sum(n * x for n, x in zip(lengths, row)) for row in w]
    # 5. whole blocks: some stage holds ceil(L_g / S) of segment g's blocks, some chunk ceil(L_g / (S v))
    block = max(math.ceil(n / S) * min(row[g] for row in w) for g, n in enumerate(lengths) if n > 0)
    chunk = max(math.ceil(n / (S * v)) * min(row[g] for row in w) for g, n in enumerate(lengths) if n > 0)
    if min(whole) <= 0.0:
        frac = 0.0
    else:
        norm = sum(1.0 / x for x in whole)
        frac = sum(n * min(row[g] / (x * norm) for row, x in zip(w, whole)) for g, n in enumerate(lengths))
    return frac, block, chunk


def compute_bound(cand: Candidate, lengths: list[int], pipelines: list[list[list[float]]]) -> float:
    """Steps 1-5 of :func:`lower_bound` (``memory=False``) from each distinct pipeline's ``seg_time`` rows
    alone (:func:`~whalepy.planner.costing.seg_time_rows`), without the candidate's coefficients: the
    same arithmetic, so the same value to the last bit."""
    S, v = cand.num_stages, cand.virtual_stages
    T, B = 0.0, 0.0
    for w in pipelines:
        frac, block, chunk = _compute_parts(w, lengths, S, v)
        T, B = max(T, frac, block), max(B, chunk)
    Tc = T if v == 1 else max(T / v, B)
    return cand.step_form.value(T, Tc, 0.0)
