"""The inner integer linear program: for one outer candidate, place blocks on stages and choose
checkpointing and model-state placement to minimise the predicted step time.

The outer search (:mod:`whalepy.planner.search`) fixes what is not linear: pipeline stages ``S``,
virtual stages per rank ``v`` (``J = S v`` virtual stages), TP degree ``t``, DP degree ``d``,
micro-batches ``M``, the schedule, which device group each ``(stage, replica)`` cell sits on, and
every replica's batch share. All coefficients come from :mod:`whalepy.planner.costing`, the same
functions the exhaustive search and ``whalepy.estimate`` evaluate, so the ILP's objective is the
predicted step time of the configuration it returns.

Blocks are grouped into segments ``g`` (runs of identical consecutive layers, length ``L_g``, first
position ``a_g``; non-repeated blocks are segments of length 1): repeated layers are tied, the ILP
counts them instead of placing each one.

Variables
    ``q[j][g]`` binary: the boundary before virtual stage ``j`` (1 <= j < J) falls in segment ``g``
    (between its first block and its last);
    ``r[j][g]`` integer in ``[0, L_g - 1]``: how far into segment ``g`` it falls;
    the boundary position is ``B_j = sum_g a_g q[j][g] + r[j][g]`` and the blocks of segment ``g``
    before it are ``E[j][g] = L_g sum_{g' > g} q[j][g'] + r[j][g]`` (linear), so virtual stage ``j``
    holds ``E[j+1][g] - E[j][g]`` blocks of ``g`` and physical stage ``s`` holds
    ``n[s][g] = sum_k (E[s+kS+1][g] - E[s+kS][g])``;
    ``c[j][g]`` integer: checkpointed blocks of ``g`` in virtual stage ``j`` (``<= E[j+1][g] - E[j][g]``);
    stage ``s`` checkpoints ``sum_k c[s+kS][g]``; ``h[s][g]`` binary: any are;
    ``y[s][o]`` binary: stage ``s`` uses state option ``o`` (ZeRO stage x optimizer tier x parameter
    tier); ``Q[s][o] >= 0``: the stage's parameters per device if it uses ``o``, else 0
    (disaggregation of the product ``y * Pl``); ``Nb[j][o][g] >= 0``: blocks of segment ``g`` in
    virtual stage ``j`` if its stage uses ``o``, else 0 (disaggregation of ``y * n``; only for segments
    some option of the stage exposes communication on);
    ``T``: time of the slowest stage per micro-batch (all its chunks); ``Tc`` (interleaved only): time
    of the slowest chunk (virtual stage) per micro-batch; ``X``: the slowest stage's exposed gradient
    synchronisation plus optimizer step; per cell ``A`` (GiB of activations: in-flight chunks times the
    largest chunk's kept activations) and ``P`` (GiB: the largest checkpointed block's saved bytes).

Objective
    minimise ``M T + (S - 1) Tc + X`` (interleaved 1F1B) or ``(M + S - 1) T + X`` (GPipe, 1F1B: one
    chunk per stage, ``Tc = T``): the predicted step time. The pipeline bubble is ``S - 1`` chunk
    times (Narayanan et al. SC'21: ``(p - 1)/v`` of a stage's time when its ``v`` chunks are balanced);
    charging the largest chunk keeps it honest when they are not, so the ILP gains nothing from
    unbalanced chunks (the older ``(M + (S - 1)/v) T`` assumed balance and was exploited: gpt3-175b on
    1,024 A100 put one block in chunk 0 and 23 in chunk 1). See :mod:`whalepy.planner.costing`.
    The tie-break (:func:`polish_candidate`, the winning candidate only) solves again with per-stage
    ``Ts[s] <= T`` and ``Xs[s] <= X``, the step time held at most the one found, and minimises
    ``sum_s (M + S - 1) Ts[s] + Xs[s]`` plus a small weight on states off the device.

Constraint families (each added by the function named)
    partition (``add_partition_constraints``): one segment per boundary, ``r <= (L_g - 1) q``,
    ``B_1 >= 1``, ``B_{j+1} >= B_j + 1``, ``B_{J-1} <= N - 1`` (contiguous, non-empty stages);
    annotations (``add_annotation_constraints``): a block at position ``i`` with ``stage(k)`` or a
    ``cluster`` pin allowing stages ``lo..hi``: ``B_lo <= i < B_{hi+1}``;
    checkpointing (``add_checkpoint_constraints``): ``c[j][g] <= E[j+1][g] - E[j][g]``,
    ``L_g h[s][g] >= sum_k c[s+kS][g]``;
    state options (``add_state_option_constraints``): ``sum_o y = 1``, ``Q <= P_max y``,
    ``sum_o Q[s][o] = Pl_s = sum_g n[s][g] p_g``; (``add_option_block_variables``)
    ``Nb[j][o][g] <= L_g y[s][o]``, ``sum_o Nb[j][o][g] = E[j+1][g] - E[j][g]``;
    time (``add_time_constraints``), for every cell (stage, group, share):
    ``T >= compute + p2p``, ``T >= fetch + p2p`` (overlapped transfers), and
    ``T >= compute + p2p + sum_o (sum_{j of s} sum_g Nb[j][o][g] exposed_og + v edge_o y[s][o])``: the
    chosen option's exposed data-parallel communication, zero for the others (no big-M: the older
    ``T >= compute + dp_o + p2p - M_o (1 - y[s][o])`` per option had the same integer solutions but an LP
    relaxation so weak that HiGHS took seconds to refute interleaved candidates);
    interleaved, per chunk ``k``: the same with the chunk's blocks, ``Tc >= fetch / v + max_k p2p_k``;
    tail (``add_tail_constraints``): ``X >= opt + post``, ``X >= opt + overlap - backward + post``
    (ZeRO-Offload's gradient copies and CPU step beside the stage's last backward), and
    ``X >= opt + post + sum_o (sum_{j of s} sum_g Nb[j][o][g] tail_og + tail_edge_o y[s][o])`` per cell;
    memory (``add_memory_constraints``): per cell ``A >= inflight * kept_k`` for every chunk ``k``,
    ``P >= saved_g h[s][g]`` for every segment (one checkpointed block is recomputed at a time) and
    ``states + buffers + A + P <= capacity``;
    nodes (``add_node_constraints``): per node, the offloaded states of its ranks, whichever stages
    they run, ``<=`` its host memory (and NVMe);
    checkpoint offload (``add_checkpoint_offload_constraints``): ``w[j][g] <= c[j][g]`` checkpointed
    blocks keep their input in host memory: ``- inflight * input_g w`` in ``kept``, their copies in the
    time rows, ``inflight * input_g`` per rank in the node's host memory.

Memory is written in GiB and parameters in billions to keep the coefficients well scaled.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from whalepy.cost_models.devices import GIB
from whalepy.planner.costing import (
    CandidateCoeffs,
    Evaluation,
    evaluate,
    stage_checkpoint_offloadable,
    stage_host_activation,
    stage_host_checkpoint,
    stage_offloadable,
)
from whalepy.planner.space import MAX_OPTIONS_PER_STAGE, StateMix, StateOption
from whalepy.planner._solvers import (  # noqa: F401 - MIP_REL_GAP and choose_solver are ilp's public names
    EQ,
    GE,
    LE,
    MIP_REL_GAP,
    _Model,
    _Var,
    _solve_cbc,
    _solve_highs,
    choose_solver,
)

_BILLION = 1e9


@dataclass(slots=True)
class ILPResult:
    status: str
    """``"optimal"``, ``"feasible"`` (time limit hit with a solution), ``"infeasible"``, ``"no solution"``."""
    evaluation: Evaluation | None
    objective: float
    mip_gap: float
    solve_time_s: float
    num_variables: int
    num_constraints: int


def _acc(d: dict, form: tuple[dict, float], coef: float) -> float:  # type: ignore[type-arg]
    """``d += coef * form`` (terms); returns ``coef * constant`` for the caller to add."""
    if coef == 0.0:
        return 0.0
    for var, a in form[0].items():
        d[var] = d.get(var, 0.0) + coef * a
    return coef * form[1]


@dataclass(slots=True)
class _Vars:
    q: list[list[_Var]]
    r: list[list[_Var]]
    nj: list[list[tuple[dict, float]]]
    """Blocks of segment g in virtual stage j, as a linear form."""
    n: list[list[tuple[dict, float]]]
    """Blocks of segment g on physical stage s."""
    c: list[list[_Var]]
    """Checkpointed blocks of segment g in virtual stage j."""
    h: list[list[_Var]]
    y: list[dict[StateOption, _Var]]
    Q: list[dict[StateOption, _Var]]
    T: _Var
    Tc: _Var | None
    X: _Var
    Nb: list[dict[StateOption, dict[int, _Var]]] = field(default_factory=list)
    o: list[dict[int, _Var]] = field(default_factory=list)
    """Blocks of segment g in virtual stage j whose activations are offloaded (only where allowed)."""
    fam: list[list[tuple[_Var, tuple[StateOption, ...]]]] = field(default_factory=list)
    """Per stage, ``(z, options)`` for each family of its options: ``z`` is 1 when the stage's blocks
    use them (an option of no family is a family of its own, ``z`` its ``y``). Per-stage costs that a
    family pays once (working set, first-block gathers, post-step communication, autocast copies) are
    charged on ``z``."""
    w: list[dict[int, _Var]] = field(default_factory=list)
    """Checkpointed blocks of segment g in virtual stage j whose input is in host memory (where allowed)."""
    Ts: list[_Var] = field(default_factory=list)
    """Per stage, its own time per micro-batch (``T`` is at least each): only in the tie-break's model
    (:func:`polish_candidate`); empty otherwise, where the stage rows bound ``T`` directly."""
    Xs: list[_Var] = field(default_factory=list)
    """Per stage, its own exposed synchronisation and optimizer step (``X`` is at least each); as ``Ts``."""


def _var(prob: _Model, name: str, lowBound: float | None = None, upBound: float | None = None,
         cat: str = "Continuous") -> _Var:
    return prob.var(name, lowBound, upBound, cat)


def _boundary(cc: CandidateCoeffs, v: _Vars, j: int) -> tuple[dict, float]:  # type: ignore[type-arg]
    d: dict = {}
    for g, seg in enumerate(cc.segments):
        if seg.start:
            d[v.q[j][g]] = float(seg.start)
        if seg.length > 1:
            d[v.r[j][g]] = 1.0
    return d, 0.0


def _cum(cc: CandidateCoeffs, v: _Vars, j: int, g: int) -> tuple[dict, float]:  # type: ignore[type-arg]
    """Blocks of segment g before virtual boundary j (j = 0: none; j = J: all)."""
    J = cc.candidate.num_virtual
    L = cc.segments[g].length
    if j == 0:
        return {}, 0.0
    if j == J:
        return {}, float(L)
    d = {v.q[j][gg]: float(L) for gg in range(g + 1, len(cc.segments))}
    if L > 1:
        d[v.r[j][g]] = 1.0
    return d, 0.0


def _add(prob: _Model, d: dict, const: float, sense: int, name: str) -> None:  # type: ignore[type-arg]
    """Add ``sum d + const (sense) 0``."""
    prob.rows.append((d, const, sense, name))


def build_variables(prob: _Model, cc: CandidateCoeffs, per_stage: bool = False) -> _Vars:
    cand = cc.candidate
    S, J, G, V = cand.num_stages, cand.num_virtual, len(cc.segments), cand.virtual_stages
    q = [[]] + [[_var(prob, f"q_{j}_{g}", cat="Binary") for g in range(G)] for j in range(1, J)]
    r = [[]] + [[_var(prob, f"r_{j}_{g}", lowBound=0, upBound=max(0, cc.segments[g].length - 1),
                      cat="Integer") for g in range(G)] for j in range(1, J)]
    v = _Vars(q=q, r=r, nj=[], n=[], c=[], h=[], y=[], Q=[], T=_var(prob, "T", lowBound=0),
              Tc=_var(prob, "Tc", lowBound=0) if V > 1 else None, X=_var(prob, "X", lowBound=0))
    v.Nb = [dict() for _ in range(J)]
    cum = [[_cum(cc, v, j, g) for g in range(G)] for j in range(J + 1)]
    for j in range(J):
        row = []
        for g in range(G):
            d: dict = {}
            const = _acc(d, cum[j + 1][g], 1.0) + _acc(d, cum[j][g], -1.0)
            row.append((d, const))
        v.nj.append(row)
        v.c.append([_var(prob, f"c_{j}_{g}", lowBound=0, upBound=cc.segments[g].length, cat="Integer")
                    for g in range(G)])
    for s in range(S):
        row = []
        for g in range(G):
            d = {}
            const = sum(_acc(d, v.nj[s + k * S][g], 1.0) for k in range(V))
            row.append((d, const))
        v.n.append(row)
        v.h.append([_var(prob, f"h_{s}_{g}", cat="Binary") for g in range(G)])
        sc = cc.stages[s]
        v.y.append({o: _var(prob, f"y_{s}_{i}", cat="Binary") for i, o in enumerate(sc.options)})
        v.Q.append({o: _var(prob, f"Q_{s}_{i}", lowBound=0) for i, o in enumerate(sc.options)})
        grouped = {o for f in sc.families for o in f}
        v.fam.append([(_var(prob, f"z_{s}_{i}", cat="Binary"), f) for i, f in enumerate(sc.families)]
                     + [(v.y[s][o], (o,)) for o in sc.options if o not in grouped])
    if per_stage:
        v.Ts = [_var(prob, f"Ts_{s}", lowBound=0) for s in range(S)]
        v.Xs = [_var(prob, f"Xs_{s}", lowBound=0) for s in range(S)]
    return v


def _once(v: _Vars, s: int, coef: dict[StateOption, float], scale: float = 1.0) -> dict[_Var, float]:
    """``sum_f coef[f] z_f``: a per-stage cost of the chosen family, paid once however many of its
    options the stage's blocks use (the family's options share the value)."""
    return {z: coef[f[0]] * scale for z, f in v.fam[s] if coef[f[0]]}


def _stage_ckpt(v: _Vars, S: int, V: int, s: int, g: int) -> list[_Var]:
    return [v.c[s + k * S][g] for k in range(V)]


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


def _host_copy_terms(d: dict, cell, v: _Vars, j: int, g: int) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Add the seconds of the host copies of segment ``g`` in virtual stage ``j`` to a time row ``d``:
    offloaded activations (``o``) and checkpointed inputs in host memory (``w``)."""
    for xs, coef in ((v.o, cell.seg_offload), (v.w, cell.seg_ckoff)):
        x = xs[j].get(g) if xs else None
        if x is not None and coef[g]:
            d[x] = d.get(x, 0.0) + coef[g]


def add_state_option_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    for s, sc in enumerate(cc.stages):
        if sc.families:
            _add_mixed_options(prob, cc, v, s)
            continue
        pmax = sum(seg.length * p for seg, p in zip(cc.segments, sc.seg_params)) / _BILLION
        _add(prob, {v.y[s][o]: 1.0 for o in sc.options}, -1.0, EQ, f"one_option_{s}")
        for i, o in enumerate(sc.options):
            _add(prob, {v.Q[s][o]: 1.0, v.y[s][o]: -pmax}, 0.0, LE, f"option_params_{s}_{i}")
        d = {v.Q[s][o]: 1.0 for o in sc.options}
        const = 0.0
        for g in range(len(cc.segments)):
            const += _acc(d, v.n[s][g], -sc.seg_params[g] / _BILLION)
        _add(prob, d, const, EQ, f"option_params_sum_{s}")


def _add_mixed_options(prob: _Model, cc: CandidateCoeffs, v: _Vars, s: int) -> None:
    """Granular tiers on stage ``s`` (one chunk, :attr:`StageCoeffs.families`): one family,
    ``sum_f z_f = 1``; of it, one to :data:`MAX_OPTIONS_PER_STAGE` options, ``z_f <= sum_{o in f} y_o
    <= K z_f``, ``y_o <= z_f`` (and an option only a mix may use, ``beside_offload``, only with another
    option of its family); whole blocks per option and segment, integer ``Nb[s][o][g] <= L_g y_o``
    with ``sum_o Nb = n_s[g]`` and at least one block per chosen option, the blocks of
    :attr:`StageCoeffs.tied_segments` all with one option; and each option's parameters ``Q_o = sum_g p_g Nb[s][o][g]``."""
    sc = cc.stages[s]
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
    for i, o in enumerate(sc.options):
        nb[o] = {}
        for g, seg in enumerate(cc.segments):
            x = nb[o][g] = _var(prob, f"Nb_{s}_{i}_{g}", lowBound=0, upBound=seg.length, cat="Integer")
            _add(prob, {x: 1.0, v.y[s][o]: -float(seg.length)}, 0.0, LE, f"option_blocks_{s}_{g}_{i}")
        d = {x: sc.seg_params[g] / _BILLION for g, x in nb[o].items() if sc.seg_params[g]}
        d[v.Q[s][o]] = -1.0
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
    exposes communication on, and only on stages with such an option."""
    S = cc.candidate.num_stages
    for s, sc in enumerate(cc.stages):
        if sc.families:  # whole blocks per option already (_add_mixed_options)
            continue
        active = [g for g in range(len(cc.segments))
                  if any(c.seg_exposed[o][g] or c.seg_tail[o][g] for c in sc.cells for o in sc.options)]
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


def _option_terms(base: dict, v: _Vars, s: int, sc, chunks: list[int], per: dict, edge: dict) -> dict | None:  # type: ignore[no-untyped-def, type-arg]
    """``base + sum_o (sum_{j in chunks} sum_g Nb[j][o][g] per[o][g] + edge[o] y[s][o])`` (the chosen
    option's exposed communication added), or None when no option exposes any."""
    d = dict(base)
    for x, a in _once(v, s, edge).items():
        d[x] = d.get(x, 0.0) + a
    for o in sc.options:
        for j in chunks:
            for g, x in v.Nb[j].get(o, {}).items():
                if per[o][g]:
                    d[x] = d.get(x, 0.0) + per[o][g]
    return d if len(d) > len(base) else None


def add_time_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    G = len(cc.segments)
    for s, sc in enumerate(cc.stages):
        tv = v.Ts[s] if v.Ts else v.T
        if v.Ts:
            _add(prob, {tv: 1.0, v.T: -1.0}, 0.0, LE, f"time_stage_{s}")
        for ci, cell in enumerate(sc.cells):
            d: dict = {tv: -1.0}
            const = cell.p2p
            for g in range(G):
                const += _acc(d, v.n[s][g], cell.seg_time[g])
                if cell.seg_recompute[g]:
                    for x in _stage_ckpt(v, S, V, s, g):
                        d[x] = d.get(x, 0.0) + cell.seg_recompute[g]
                for k in range(V):
                    _host_copy_terms(d, cell, v, s + k * S, g)
            _add(prob, d, const, LE, f"time_compute_{s}_{ci}")
            dd = _option_terms(d, v, s, sc, [s + k * S for k in range(V)], cell.seg_exposed,
                               {o: V * cell.edge[o] for o in sc.options})
            if dd is not None:
                _add(prob, dd, const, LE, f"time_dp_{s}_{ci}")
            fetch = {v.Q[s][o]: cell.fetch_beta[o] * _BILLION for o in sc.options if cell.fetch_beta[o]}
            if fetch:
                _add(prob, {**fetch, tv: -1.0}, cell.p2p, LE, f"time_fetch_{s}_{ci}")
            if v.Tc is None:
                continue
            for k in range(V):
                j = s + k * S
                d = {v.Tc: -1.0}
                const = cell.chunk_p2p[k]
                for g in range(G):
                    const += _acc(d, v.nj[j][g], cell.seg_time[g])
                    if cell.seg_recompute[g]:
                        d[v.c[j][g]] = d.get(v.c[j][g], 0.0) + cell.seg_recompute[g]
                    _host_copy_terms(d, cell, v, j, g)
                _add(prob, d, const, LE, f"chunk_time_{s}_{ci}_{k}")
                dd = _option_terms(d, v, s, sc, [j], cell.seg_exposed, cell.edge)
                if dd is not None:
                    _add(prob, dd, const, LE, f"chunk_dp_{s}_{ci}_{k}")
            pmax = max(cell.chunk_p2p)
            if fetch:
                _add(prob, {**{x: a / V for x, a in fetch.items()}, v.Tc: -1.0}, pmax, LE,
                     f"chunk_fetch_{s}_{ci}")


def add_tail_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    dp = cc.candidate.dp
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    for s, sc in enumerate(cc.stages):
        xv = v.Xs[s] if v.Xs else v.X
        if v.Xs:
            _add(prob, {xv: 1.0, v.X: -1.0}, 0.0, LE, f"tail_stage_{s}")
        post: dict = _once(v, s, {o: a for o, (a, _) in sc.sync.items()})
        for o in sc.options:
            b = sc.sync[o][1]
            if b:
                post[v.Q[s][o]] = b * _BILLION
        for ci, cell in enumerate(sc.cells):
            d = {v.Q[s][o]: cell.opt_beta[o] * _BILLION for o in sc.options}
            if dp > 1:
                for x, a in post.items():
                    d[x] = d.get(x, 0.0) + a
            d[xv] = -1.0
            _add(prob, d, 0.0, LE, f"tail_opt_{s}_{ci}")
            dd = None
            if dp > 1:
                dd = _option_terms(d, v, s, sc, [s + k * S for k in range(V)], cell.seg_tail, cell.tail_edge)
                if dd is not None:
                    _add(prob, dd, 0.0, LE, f"tail_sync_{s}_{ci}")
            lap = {v.Q[s][o]: cell.opt_overlap[o] * _BILLION for o in sc.options if cell.opt_overlap[o]}
            if lap:
                # ZeRO-Offload: the gradient copies and CPU step beside the last backward are exposed
                # past its end: X >= (the row above) + overlap - backward; below zero that row binds
                dl = dict(dd if dd is not None else d)
                for x, a in lap.items():
                    dl[x] = dl.get(x, 0.0) + a
                const = 0.0
                for g in range(len(cc.segments)):
                    const += _acc(dl, v.n[s][g], -cell.seg_bwd[g])
                _add(prob, dl, const, LE, f"tail_offload_{s}_{ci}")


def add_memory_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    G = len(cc.segments)
    for s, sc in enumerate(cc.stages):
        full = {v.Q[s][o]: (sc.mem_beta[o] + sc.buffer_beta[o]) * _BILLION / GIB for o in sc.options}
        # at the activation peak, gradients the runtime has not created yet are not held
        states = {v.Q[s][o]: (sc.mem_beta[o] + sc.buffer_beta[o]
                              - (sc.state_split[o][1] if sc.grads_freed[o] else 0.0)) * _BILLION / GIB
                  for o in sc.options}
        for x, a in _once(v, s, sc.working_bytes, 1.0 / GIB).items():
            states[x] = states.get(x, 0.0) + a
            full[x] = full.get(x, 0.0) + a
        freed_any = any(sc.grads_freed[o] for o in sc.options)
        for ci, cell in enumerate(sc.cells):
            k_in = cell.inflight / GIB
            ckpt_any = [g for g in range(G) if cell.seg_saved[g] > 0]
            P = _var(prob, f"P_{s}_{ci}", lowBound=0) if ckpt_any else None
            if P is not None:
                for g in ckpt_any:
                    _add(prob, {P: -1.0, v.h[s][g]: cell.seg_saved[g] / GIB}, 0.0, LE,
                         f"memory_recompute_{s}_{ci}_{g}")

            def kept(j: int) -> tuple[dict, float]:  # type: ignore[type-arg]
                d: dict = {}
                const = 0.0
                for g in range(G):
                    const += _acc(d, v.nj[j][g], k_in * cell.seg_saved[g])
                    extra = k_in * (cell.seg_input[g] - cell.seg_saved[g])
                    if extra:
                        d[v.c[j][g]] = d.get(v.c[j][g], 0.0) + extra
                    x = v.o[j].get(g)
                    if x is not None:  # an offloaded block keeps nothing on the device
                        d[x] = -k_in * cell.seg_saved[g]
                    x = v.w[j].get(g) if v.w else None
                    if x is not None:  # nor does a checkpointed one whose input is in host memory
                        d[x] = -k_in * cell.seg_input[g]
                return d, const

            d = dict(states)
            loss = cell.loss_bytes / GIB
            for x, a in _once(v, s, cell.autocast_bytes, 1.0 / GIB).items():
                d[x] = d.get(x, 0.0) + a
            if P is not None:
                d[P] = 1.0
            if V == 1:
                const = _acc(d, kept(s), 1.0)
            else:
                A = _var(prob, f"A_{s}_{ci}", lowBound=0)
                for k in range(V):
                    kd, kc = kept(s + k * S)
                    kd[A] = -1.0
                    _add(prob, kd, kc, LE, f"activations_{s}_{ci}_{k}")
                d[A] = 1.0
                const = 0.0
            _add(prob, d, const + loss - cell.capacity / GIB, LE, f"memory_{s}_{ci}")
            if freed_any:  # the end of backward: every gradient, no activations
                _add(prob, dict(full), -cell.capacity / GIB, LE, f"memory_states_{s}_{ci}")


def add_node_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    """Host memory and NVMe are the node's, shared by its GPUs whichever stages they run: per node,
    ``sum_s (ranks of s on it) * sum_o beta_o Q[s][o] <= capacity``."""
    for ni, node in enumerate(cc.nodes):
        for kind, cap in (("host_memory", node.cpu_capacity), ("nvme", node.nvme_capacity)):
            d: dict = {}
            for s, sc in enumerate(cc.stages):
                k = node.ranks_per_stage[s]
                beta = sc.cpu_beta if kind == "host_memory" else sc.nvme_beta
                for o in sc.options:
                    if k and beta[o]:
                        d[v.Q[s][o]] = k * beta[o] * _BILLION / GIB
                    if kind == "host_memory" and k and sc.host_fixed.get(o):  # staging buffers
                        d[v.y[s][o]] = d.get(v.y[s][o], 0.0) + k * sc.host_fixed[o] / GIB
                # offloaded activations and checkpointed inputs in host memory, per rank
                for xs, per_rank in ((v.o, stage_host_activation), (v.w, stage_host_checkpoint)):
                    chunks = [xs[s + kk * cc.candidate.num_stages] for kk in range(cc.candidate.virtual_stages)
                              ] if kind == "host_memory" and k and xs else []
                    host = per_rank(sc) if any(chunks) else []
                    for row in chunks:
                        for g, x in row.items():
                            if host[g]:
                                d[x] = d.get(x, 0.0) + k * host[g] / GIB
            if d:
                _add(prob, d, -(cap or 0.0) / GIB, LE, f"{kind}_node_{ni}")


def _build(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]], allow_checkpointing: bool,
           allow_activation_offload: bool, allow_checkpoint_offload: bool,
           per_stage: bool = False) -> tuple[_Model, _Vars]:
    """The ILP of one candidate, its objective the predicted step time."""
    prob = _Model()
    v = build_variables(prob, cc, per_stage)
    M, S = cc.candidate.num_microbatches, cc.candidate.num_stages
    if v.Tc is None:
        prob.objective = {v.T: float(M + S - 1), v.X: 1.0}
    else:
        prob.objective = {v.T: float(M), v.Tc: cc.chunk_coefficient, v.X: 1.0}
    add_partition_constraints(prob, cc, v)
    add_annotation_constraints(prob, cc, v, allowed_stages)
    add_checkpoint_constraints(prob, cc, v, allow_checkpointing)
    add_activation_offload_constraints(prob, cc, v, allow_activation_offload)
    add_checkpoint_offload_constraints(prob, cc, v, allow_checkpoint_offload and allow_checkpointing)
    add_state_option_constraints(prob, cc, v)
    add_option_block_variables(prob, cc, v)
    add_time_constraints(prob, cc, v)
    add_tail_constraints(prob, cc, v)
    add_memory_constraints(prob, cc, v)
    add_node_constraints(prob, cc, v)
    return prob, v


def _run(prob: _Model, solver: str, time_limit_s: float, cutoff: float | None,
         rel_gap: float = MIP_REL_GAP) -> tuple[str, float, float]:
    if solver == "highs":
        return _solve_highs(prob, time_limit_s, cutoff, rel_gap)
    return _solve_cbc(prob, time_limit_s, rel_gap)


def solve_candidate(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]],
                    allow_checkpointing: bool, solver: str, time_limit_s: float,
                    cutoff: float | None = None, allow_activation_offload: bool = True,
                    allow_checkpoint_offload: bool = True) -> ILPResult:
    """Build and solve the ILP of one candidate; the returned evaluation is the costing of the solution.

    ``cutoff``: only solutions with a smaller objective are wanted (the incumbent of the outer search);
    with HiGHS a candidate that cannot beat it comes back ``"no better than the incumbent"`` sooner. CBC
    ignores it while solving."""
    t0 = time.perf_counter()
    prob, v = _build(cc, allowed_stages=allowed_stages, allow_checkpointing=allow_checkpointing,
                     allow_activation_offload=allow_activation_offload,
                     allow_checkpoint_offload=allow_checkpoint_offload)
    status, objective, gap = _run(prob, solver, time_limit_s, cutoff)
    nvars, ncons = len(prob.vars), len(prob.rows)
    elapsed = time.perf_counter() - t0
    if status == "no solution":  # stopped (time limit) before finding one: nothing to read back, nothing
        # refuted (its objective is inf, which the cutoff test below would read as "no better")
        return ILPResult(status, None, math.inf, math.inf, elapsed, nvars, ncons)
    if status in ("infeasible", "cutoff") or (cutoff is not None and objective >= cutoff):
        status = "infeasible" if status == "infeasible" and cutoff is None else "no better than the incumbent"
        return ILPResult(status, None, math.inf, 0.0, elapsed, nvars, ncons)
    return ILPResult(status, _extract(cc, v), objective, gap, elapsed, nvars, ncons)


POLISH_REL_GAP = 1e-7
"""Relative MIP gap of the tie-break (:func:`polish_candidate`). Its objective sums every stage's time,
several times the step time, and the differences it separates (a stage that is not the slowest doing
ms less work in a step of minutes) are ~1e-5 of that: :data:`MIP_REL_GAP` would stop before it sees
them. Bounded by the tie-break's time limit instead."""
OFFLOAD_TIE_BREAK_SHARE = 1e-5
"""The tie-break's (:func:`polish_candidate`) weight on states kept off the device: all of the model's
parameters off the device weigh this share of the step time, a part of them their part of it. Of plans
whose stages are equally fast it picks the one with more states on the device (no host memory, no PCIe
traffic the cost model calls hidden); a stage time within this share of the step may be traded for it.
A preference, not a cost: the predicted step time is held fixed. Relative, so that it stays above the
tie-break's MIP gap (:data:`POLISH_REL_GAP` of a sum of ``S`` stage times) at every model size."""


def polish_candidate(cc: CandidateCoeffs, found: ILPResult, *, allowed_stages: dict[int, tuple[int, int]],
                     allow_checkpointing: bool, solver: str, time_limit_s: float,
                     allow_activation_offload: bool = True, allow_checkpoint_offload: bool = True) -> ILPResult:
    """The tie-break: among the plans of ``cc`` whose step time is no worse than ``found``'s, the one whose
    every stage is fastest (sum over stages of what each would make the step, were it the slowest),
    then with the fewest states off the device (:data:`OFFLOAD_TIE_BREAK_SHARE`).

    The step time depends only on the slowest stage and the largest tail, so the ILP is indifferent to
    what the other stages do below them: it may offload their optimizer states or checkpoint their
    blocks for nothing (gpt3-175b on 1,024 A100, pp 8: two stages with half their memory free stepped
    on the CPU). Returns ``found`` where the tie-break finds nothing better in ``time_limit_s``."""
    if found.evaluation is None:
        return found
    t0 = time.perf_counter()
    prob, v = _build(cc, allowed_stages=allowed_stages, allow_checkpointing=allow_checkpointing,
                     allow_activation_offload=allow_activation_offload,
                     allow_checkpoint_offload=allow_checkpoint_offload, per_stage=True)
    # the step time stays at most the one found (its objective, as the solver computed it)
    _add(prob, dict(prob.objective), -found.objective * (1 + 1e-9), LE, "polish_step_time")
    M, S = cc.candidate.num_microbatches, cc.candidate.num_stages
    weight = float(M + S - 1) if v.Tc is None else float(M)
    objective: dict = {}
    # Q is in billions of parameters per device; the model's, per device, is the same on every stage
    local_params = sum(p * seg.length for p, seg in zip(cc.stages[0].seg_params, cc.segments))
    per_billion = OFFLOAD_TIE_BREAK_SHARE * found.objective * _BILLION / max(1.0, local_params)
    for s, sc in enumerate(cc.stages):
        objective[v.Ts[s]] = weight
        objective[v.Xs[s]] = 1.0
        for o in sc.options:
            if o.off_device:
                objective[v.Q[s][o]] = per_billion
    prob.objective = objective
    status, _, _ = _run(prob, solver, time_limit_s, None, POLISH_REL_GAP)
    elapsed = time.perf_counter() - t0
    if status not in ("optimal", "feasible"):
        return dataclasses.replace(found, solve_time_s=found.solve_time_s + elapsed)
    ev = _extract(cc, v)
    if not ev.fits or ev.step_time_s > found.evaluation.step_time_s * (1 + 1e-9):
        return dataclasses.replace(found, solve_time_s=found.solve_time_s + elapsed)
    return dataclasses.replace(found, evaluation=ev, solve_time_s=found.solve_time_s + elapsed)


def _extract(cc: CandidateCoeffs, v: _Vars) -> Evaluation:
    J, N = cc.candidate.num_virtual, cc.num_blocks
    bounds = [0]
    for j in range(1, J):
        d, _ = _boundary(cc, v, j)
        bounds.append(int(round(sum(a * (x.varValue or 0.0) for x, a in d.items()))))
    bounds.append(N)
    sizes = [bounds[j + 1] - bounds[j] for j in range(J)]
    ckpts = [[int(round(c.varValue or 0)) for c in row] for row in v.c]
    G = len(cc.segments)
    offs = [[int(round(row[g].varValue or 0)) if g in row else 0 for g in range(G)] for row in v.o]
    ckoffs = [[int(round(row[g].varValue or 0)) if g in row else 0 for g in range(G)] for row in v.w]
    options = [_chosen(cc, v, s) for s in range(len(cc.stages))]
    return evaluate(cc, sizes, ckpts, options, offs if any(map(any, offs)) else None,
                    ckoffs if any(map(any, ckoffs)) else None)



def _chosen(cc: CandidateCoeffs, v: _Vars, s: int) -> StateOption | StateMix:
    """Stage ``s``'s option, or its mix (options with blocks, whole blocks per segment from ``Nb``)."""
    sc = cc.stages[s]
    if not sc.families:
        return max(sc.options, key=lambda o: v.y[s][o].varValue or 0.0)
    G = len(cc.segments)
    parts = [(o, tuple(int(round(v.Nb[s][o][g].varValue or 0.0)) for g in range(G))) for o in sc.options
             if (v.y[s][o].varValue or 0.0) > 0.5]
    parts = [(o, n) for o, n in parts if any(n)]
    return parts[0][0] if len(parts) == 1 else tuple(parts)
