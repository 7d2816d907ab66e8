"""The ILP's placement constraint families (split from :mod:`whalepy.planner.ilp`, whose module
docstring states the formulation): contiguous non-empty stages, annotation pins, checkpointed and
offloaded blocks within each chunk's blocks, one state option (or one family's mix) per stage and the
blocks per option that price its exposed communication."""

from __future__ import annotations

from whalepy.planner._coeffs import (
    CandidateCoeffs,
    TiedCopyCoeff,
    stage_checkpoint_offloadable,
    stage_offloadable,
)
from whalepy.planner._ilp_vars import _BILLION, _acc, _add, _boundary, _stage_ckpt, _var, _Vars
from whalepy.planner._solvers import EQ, GE, LE, _Model, _Var
from whalepy.planner.space import MAX_OPTIONS_PER_STAGE, StateOption


def add_partition_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    J, N = cc.candidate.num_virtual, cc.num_blocks
    for j in range(1, J):
        _add(prob, {x: 1.0 for x in v.q[j]}, -1.0, EQ, f"one_segment_{j}")
        for g, seg in enumerate(cc.segments):
            if seg.length > 1:
                _add(prob, {v.r[j][g]: 1.0, v.q[j][g]: -(seg.length - 1.0)}, 0.0, LE,
                     f"offset_in_segment_{j}_{g}")
    if J > 1:
        _add(prob, _boundary(cc, v, 1)[0], -1.0, GE, "first_stage_nonempty")
        _add(prob, _boundary(cc, v, J - 1)[0], -(N - 1.0), LE, "last_stage_nonempty")
    for j in range(1, J - 1):
        d: dict = {}
        _acc(d, _boundary(cc, v, j + 1), 1.0)
        _acc(d, _boundary(cc, v, j), -1.0)
        _add(prob, d, -1.0, GE, f"stage_nonempty_{j}")


def add_annotation_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars,
                               allowed_stages: dict[int, tuple[int, int]]) -> None:
    """``allowed_stages[i] = (lo, hi)``: block at position ``i`` must sit on a virtual stage in lo..hi."""
    J = cc.candidate.num_virtual
    for i, (lo, hi) in sorted(allowed_stages.items()):
        if lo > 0:
            _add(prob, _boundary(cc, v, lo)[0], -float(i), LE, f"block_{i}_not_before_stage_{lo}")
        if hi + 1 < J:
            _add(prob, _boundary(cc, v, hi + 1)[0], -(i + 1.0), GE,
                 f"block_{i}_not_after_stage_{hi}")


def add_checkpoint_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars, allow: bool) -> None:
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    for j, row in enumerate(v.nj):
        for g in range(len(cc.segments)):
            if not allow:
                v.c[j][g].upBound = 0
                continue
            d: dict = {v.c[j][g]: 1.0}
            const = _acc(d, row[g], -1.0)
            _add(prob, d, const, LE, f"ckpt_le_count_{j}_{g}")
    for s in range(S):
        for g, seg in enumerate(cc.segments):
            if not allow:
                v.h[s][g].upBound = 0
                continue
            d = {x: -1.0 for x in _stage_ckpt(v, S, V, s, g)}
            d[v.h[s][g]] = float(seg.length)
            _add(prob, d, 0.0, GE, f"any_ckpt_{s}_{g}")


def add_activation_offload_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars, allow: bool) -> None:
    """``o[j][g]``: blocks of segment ``g`` in virtual stage ``j`` whose saved activations live in host
    memory, only on stages whose every cell has host memory (:func:`stage_offloadable`);
    ``c[j][g] + o[j][g] <= E[j+1][g] - E[j][g]`` (a block is checkpointed or offloaded, not both) and
    ``L_g h[s][g] >= sum_k (c + o)``, so ``P`` also covers the largest offloaded block, fetched back one
    at a time in backward."""
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    v.o = [dict() for _ in range(cc.candidate.num_virtual)]
    if not allow:
        return
    for s, sc in enumerate(cc.stages):
        for g in stage_offloadable(sc):
            L = cc.segments[g].length
            for k in range(V):
                j = s + k * S
                x = v.o[j][g] = _var(prob, f"o_{j}_{g}", lowBound=0, upBound=L, cat="Integer")
                d: dict = {x: 1.0, v.c[j][g]: 1.0}
                const = _acc(d, v.nj[j][g], -1.0)
                _add(prob, d, const, LE, f"offload_le_count_{j}_{g}")
            d = {v.o[s + k * S][g]: -1.0 for k in range(V)}
            for x in _stage_ckpt(v, S, V, s, g):
                d[x] = -1.0
            d[v.h[s][g]] = float(L)
            _add(prob, d, 0.0, GE, f"any_offload_{s}_{g}")
            v.h[s][g].upBound = 1


def add_checkpoint_offload_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars, allow: bool) -> None:
    """``w[j][g]``: checkpointed blocks of segment ``g`` in virtual stage ``j`` whose input lives in host
    memory (``BlockPlan.checkpoint_offload``), only on stages whose every cell has host memory
    (:func:`stage_checkpoint_offloadable`): ``w[j][g] <= c[j][g]``. Each takes its input off the device
    (``kept``), adds its copies to the stage's time and its input to the node's host memory."""
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    v.w = [dict() for _ in range(cc.candidate.num_virtual)]
    if not allow:
        return
    for s, sc in enumerate(cc.stages):
        for g in stage_checkpoint_offloadable(sc):
            for k in range(V):
                j = s + k * S
                x = v.w[j][g] = _var(prob, f"w_{j}_{g}", lowBound=0, upBound=cc.segments[g].length, cat="Integer")
                _add(prob, {x: 1.0, v.c[j][g]: -1.0}, 0.0, LE, f"ckpt_offload_le_ckpt_{j}_{g}")



def add_state_option_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    v.tied = [[] for _ in cc.stages]
    for s, sc in enumerate(cc.stages):
        if sc.families:
            _add_mixed_options(prob, cc, v, s)
            continue
        copies = _tied_copy_vars(prob, cc, v, s)
        pmax = (sum(seg.length * p for seg, p in zip(cc.segments, sc.seg_params))
                + sum(c.local_params for _, c in copies)) / _BILLION
        _add(prob, {v.y[s][o]: 1.0 for o in sc.options}, -1.0, EQ, f"one_option_{s}")
        for i, o in enumerate(sc.options):
            _add(prob, {v.Q[s][o]: 1.0, v.y[s][o]: -pmax}, 0.0, LE, f"option_params_{s}_{i}")
        d = {v.Q[s][o]: 1.0 for o in sc.options}
        const = 0.0
        for g in range(len(cc.segments)):
            const += _acc(d, v.n[s][g], -sc.seg_params[g] / _BILLION)
        for k, (x, c) in enumerate(copies):
            d[x] = -c.local_params / _BILLION
            # held with option o: t >= u + y_o - 1 (continuous, pushed down by the costs it carries)
            per = {}
            for i, o in enumerate(sc.options):
                t = per[o] = _var(prob, f"tied_copy_on_{s}_{k}_{i}", lowBound=0)
                _add(prob, {t: 1.0, x: -1.0, v.y[s][o]: -1.0}, 1.0, GE, f"tied_copy_on_{s}_{k}_{i}")
            v.tied[s].append(per)
        _add(prob, d, const, EQ, f"option_params_sum_{s}")


def _tied_copy_vars(prob: _Model, cc: CandidateCoeffs, v: _Vars, s: int) -> list[tuple[_Var, TiedCopyCoeff]]:
    """Per tied parameter (:attr:`StageCoeffs.tied_copies`), a binary ``u`` that is 1 when stage ``s``
    holds a copy: ``L_h u >= n[s][h] - L_h n[s][owner]`` for each holding segment ``h`` (the owner's
    segment is one block, so ``n[s][owner]`` is 0 or 1). A copy only adds memory and per-parameter
    time, so the solver sets ``u`` to 0 wherever the rows allow it."""
    out = []
    for i, c in enumerate(cc.stages[s].tied_copies):
        u = _var(prob, f"tied_copy_{s}_{i}", cat="Binary")
        for h in c.holders:
            L = float(cc.segments[h].length)
            d: dict = {u: L}
            const = _acc(d, v.n[s][h], -1.0) + _acc(d, v.n[s][c.owner], L)
            _add(prob, d, const, GE, f"tied_copy_{s}_{i}_{h}")
        out.append((u, c))
    return out


def _add_mixed_options(prob: _Model, cc: CandidateCoeffs, v: _Vars, s: int) -> None:
    """Granular tiers on stage ``s`` (one chunk, :attr:`StageCoeffs.families`): one family,
    ``sum_f z_f = 1``; of it, one to :data:`MAX_OPTIONS_PER_STAGE` options, ``z_f <= sum_{o in f} y_o
    <= K z_f``, ``y_o <= z_f`` (and an option only a mix may use, ``beside_offload``, only with another
    option of its family); whole blocks per option and segment, integer ``Nb[s][o][g] <= L_g y_o``
    with ``sum_o Nb = n_s[g]`` and at least one block per chosen option, the blocks of
    :attr:`StageCoeffs.tied_segments` all with one option; and each option's parameters ``Q_o = sum_g p_g Nb[s][o][g]``."""
    sc = cc.stages[s]
    copies = _tied_copy_vars(prob, cc, v, s)
    _add(prob, {z: 1.0 for z, _ in v.fam[s]}, -1.0, EQ, f"one_family_{s}")
    for i, (z, f) in enumerate(v.fam[s]):
        if len(f) == 1:
            continue
        d = {v.y[s][o]: 1.0 for o in f}
        _add(prob, {**d, z: -1.0}, 0.0, GE, f"family_used_{s}_{i}")
        _add(prob, {**d, z: -float(MAX_OPTIONS_PER_STAGE)}, 0.0, LE, f"family_options_{s}_{i}")
        for o in f:
            _add(prob, {v.y[s][o]: 1.0, z: -1.0}, 0.0, LE, f"family_member_{s}_{i}_{sc.options.index(o)}")
            if o.beside_offload:  # only beside an offloading option of the family
                d = {v.y[s][p]: -1.0 for p in f if not p.beside_offload}
                _add(prob, {**d, v.y[s][o]: 1.0}, 0.0, LE, f"beside_offload_{s}_{sc.options.index(o)}")
    nb: dict[StateOption, dict[int, _Var]] = {}
    v.tied[s] = [{} for _ in copies]
    for i, o in enumerate(sc.options):
        nb[o] = {}
        for g, seg in enumerate(cc.segments):
            x = nb[o][g] = _var(prob, f"Nb_{s}_{i}_{g}", lowBound=0, upBound=seg.length, cat="Integer")
            _add(prob, {x: 1.0, v.y[s][o]: -float(seg.length)}, 0.0, LE, f"option_blocks_{s}_{g}_{i}")
        d = {x: sc.seg_params[g] / _BILLION for g, x in nb[o].items() if sc.seg_params[g]}
        d[v.Q[s][o]] = -1.0
        for k, (u, c) in enumerate(copies):
            # the copy is in this option's parameters when the stage holds it and the option a holder:
            # w >= u + Nb[o][h] / L_h - 1, binary (the holders take one option, tied_segments)
            w = v.tied[s][k][o] = _var(prob, f"tied_copy_{s}_{i}_{k}", cat="Binary")
            for h in c.holders:
                L = float(cc.segments[h].length)
                _add(prob, {w: L, u: -L, nb[o][h]: -1.0}, L, GE, f"tied_copy_option_{s}_{i}_{k}_{h}")
            d[w] = c.local_params / _BILLION
        _add(prob, d, 0.0, EQ, f"option_params_{s}_{i}")
        # a chosen option keeps at least one block (else a mix could claim an offloading part it lacks)
        _add(prob, {**{x: 1.0 for x in nb[o].values()}, v.y[s][o]: -1.0}, 0.0, GE, f"option_used_{s}_{i}")
    for g in range(len(cc.segments)):
        d = {nb[o][g]: 1.0 for o in sc.options}
        const = _acc(d, v.nj[s][g], -1.0)
        _add(prob, d, const, EQ, f"option_blocks_sum_{s}_{g}")
    if sc.tied_segments:  # blocks sharing parameters: one option, tie[o], for all of them
        tie = {o: _var(prob, f"tie_{s}_{i}", cat="Binary") for i, o in enumerate(sc.options)}
        _add(prob, {x: 1.0 for x in tie.values()}, -1.0, LE, f"tied_one_option_{s}")
        for i, o in enumerate(sc.options):
            for g in sc.tied_segments:
                _add(prob, {nb[o][g]: 1.0, tie[o]: -float(cc.segments[g].length)}, 0.0, LE, f"tied_{s}_{i}_{g}")
    v.Nb[s] = nb


def add_option_block_variables(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    """``Nb[j][o][g]``: blocks of segment ``g`` in virtual stage ``j`` if its stage uses option ``o``,
    else 0 (the disaggregation of ``y * n``, as ``Q`` is of ``y * Pl``): ``0 <= Nb <= L_g y``,
    ``sum_o Nb[j][o][g] = n_j[g]``. The options' exposed communication is then one linear term per
    option, ``sum_g Nb exposed_og``, in the time and tail constraints, with a tight LP relaxation (the
    older big-M constraint per option, relaxed by the whole model's exposure when the option was not
    chosen, left HiGHS at its time limit on interleaved candidates). Only for segments some option
    exposes communication on, and only on stages with such an option; and for segments whose blocks
    FSDP2 splits unevenly (:attr:`StageCoeffs.seg_excess`: the memory rows charge their excess per
    option)."""
    S = cc.candidate.num_stages
    for s, sc in enumerate(cc.stages):
        if sc.families:  # whole blocks per option already (_add_mixed_options)
            continue
        active = [g for g in range(len(cc.segments))
                  if any(c.seg_exposed[o][g] or c.seg_tail[o][g] for c in sc.cells for o in sc.options)
                  or (sc.row_options and sc.seg_excess and sc.seg_excess[g])]
        if not active:
            continue
        for j in range(s, cc.candidate.num_virtual, S):
            for i, o in enumerate(sc.options):
                v.Nb[j][o] = {g: _var(prob, f"Nb_{j}_{i}_{g}", lowBound=0) for g in active}
            for g in active:
                L = float(cc.segments[g].length)
                for i, o in enumerate(sc.options):
                    _add(prob, {v.Nb[j][o][g]: 1.0, v.y[s][o]: -L}, 0.0, LE, f"option_blocks_{j}_{g}_{i}")
                d: dict = {v.Nb[j][o][g]: 1.0 for o in sc.options}
                const = _acc(d, v.nj[j][g], -1.0)
                _add(prob, d, const, EQ, f"option_blocks_sum_{j}_{g}")


def add_chunk_symmetry_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars,
                                   allowed_stages: dict[int, tuple[int, int]]) -> None:
    """Symmetry breaking across the chunks of one stage (interleaved 1F1B): chunks ``k`` and ``k + 1``
    of stage ``s`` (virtual stages ``j = s + k S`` and ``j + S``) are interchangeable when every virtual
    stage from ``j`` to ``j + S`` can only hold blocks of one repeated segment (virtual stage ``i`` holds
    positions within ``[i, N - J + i]``: each is non-empty) and the chunks' sends cost the same on every
    cell. Then exchanging the two chunks' blocks, checkpoints, host copies and per-option blocks moves
    only the boundaries between them, keeps every other virtual stage's blocks, and leaves every row of
    the ILP satisfied with the same objective (the stage's rows sum over its chunks; the chunk rows,
    ``A >= inflight kept_k`` and ``Tc >= chunk_k``, are the same for both but for ``chunk_p2p[k]``).
    So some optimum has the chunks' blocks of that segment non-increasing, ``E[j+1] - E[j] >=
    E[j+S+1] - E[j+S]``: imposing it removes the mirrored copies of every solution from the
    branch-and-bound tree, not the optimum. Not with annotation pins (they tie blocks to positions)."""
    cand = cc.candidate
    S, V, J, N = cand.num_stages, cand.virtual_stages, cand.num_virtual, cc.num_blocks
    if V < 2 or allowed_stages:
        return
    for s, sc in enumerate(cc.stages):
        for k in range(V - 1):
            j = s + k * S
            if any(c.chunk_p2p[k] != c.chunk_p2p[k + 1] for c in sc.cells):
                continue
            lo, hi = j, N - J + j + S  # positions virtual stages j..j+S may hold
            g = next((g for g, seg in enumerate(cc.segments)
                      if seg.start <= lo and hi < seg.start + seg.length), None)
            if g is None:
                continue
            d: dict = {}
            const = _acc(d, v.nj[j][g], 1.0) + _acc(d, v.nj[j + S][g], -1.0)
            _add(prob, d, const, GE, f"chunk_symmetry_{s}_{k}")
