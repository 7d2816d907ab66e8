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

Constraint families (each added by the function named: the placement families in
:mod:`whalepy.planner._ilp_layout`, time, tail, memory and nodes in :mod:`whalepy.planner._ilp_costs`,
the variables by :func:`~whalepy.planner._ilp_vars.build_variables`)
    partition (``add_partition_constraints``): one segment per boundary, ``r <= (L_g - 1) q``,
    ``B_1 >= 1``, ``B_{j+1} >= B_j + 1``, ``B_{J-1} <= N - 1`` (contiguous, non-empty stages);
    annotations (``add_annotation_constraints``): a block at position ``i`` with ``stage(k)`` or a
    ``cluster`` pin allowing stages ``lo..hi``: ``B_lo <= i < B_{hi+1}``;
    chunk symmetry (``add_chunk_symmetry_constraints``, interleaved, no pins): chunks ``k`` and ``k + 1``
    of a stage whose sends cost the same, with every virtual stage between them inside one repeated
    segment, are interchangeable, so ``E[j+1][g] - E[j][g] >= E[j+S+1][g] - E[j+S][g]`` (``j = s + k S``);
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

With an incumbent, :func:`solve_candidate` adds its cutoff as a row, ``objective <= cutoff`` (besides
HiGHS's objective bound), for presolve and propagation.

Memory is written in GiB and parameters in billions to keep the coefficients well scaled.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from whalepy.planner.costing import CandidateCoeffs, Evaluation, evaluate
from whalepy.planner.space import StateMix, StateOption
from whalepy.planner._ilp_costs import (
    add_memory_constraints,
    add_node_constraints,
    add_tail_constraints,
    add_time_constraints,
)
from whalepy.planner._ilp_layout import (
    add_activation_offload_constraints,
    add_annotation_constraints,
    add_checkpoint_constraints,
    add_checkpoint_offload_constraints,
    add_chunk_symmetry_constraints,
    add_option_block_variables,
    add_partition_constraints,
    add_state_option_constraints,
)
from whalepy.planner._ilp_vars import _BILLION, _add, _boundary, _Vars, build_variables
from whalepy.planner._solvers import (  # noqa: F401 - MIP_REL_GAP and choose_solver are ilp's public names
    LE,
    MIP_REL_GAP,
    _Model,
    _solve_cbc,
    _solve_highs,
    choose_solver,
)


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
    bound: float = -math.inf
    """The least step time any plan of this candidate can have, as its solve proved it: the solver's dual
    bound, the cutoff where nothing below it exists, ``inf`` where nothing fits, ``-inf`` where it proved
    nothing. What the search's own proof of optimality (or its gap) is made of."""
    stopped_by: str | None = None
    """``"nodes"`` (the ILP's work limit) or ``"time"`` (a user's time limit) where one of them ended the
    solve before it settled; None where it settled."""


def _build(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]], allow_checkpointing: bool,
           allow_activation_offload: bool, allow_checkpoint_offload: bool,
           per_stage: bool = False) -> tuple[_Model, _Vars]:
    """The ILP of one candidate, its objective the predicted step time."""
    prob = _Model()
    v = build_variables(prob, cc, per_stage)
    prob.objective = cc.candidate.step_form.terms(v.T, v.T if v.Tc is None else v.Tc, v.X)
    add_partition_constraints(prob, cc, v)
    add_annotation_constraints(prob, cc, v, allowed_stages)
    add_chunk_symmetry_constraints(prob, cc, v, allowed_stages)
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


def _run(prob: _Model, solver: str, node_limit: int | None, cutoff: float | None,
         rel_gap: float = MIP_REL_GAP, time_limit_s: float | None = None) -> tuple[str, float, float]:
    if solver == "highs":
        return _solve_highs(prob, node_limit, cutoff, rel_gap, time_limit_s=time_limit_s)
    return _solve_cbc(prob, node_limit, rel_gap, time_limit_s=time_limit_s)


ILP_NODE_LIMIT = 250
"""Default work limit of one candidate's ILP, in branch-and-bound nodes (``PlannerOptions.ilp_node_limit``).
Work, not seconds, so that the same inputs give the same plan on any machine load. Most ILPs of the
benchmark cases settle within 40 nodes; the few that do not ran 180-3,400 nodes in 5 s without settling,
at 1-16 ms a node (docs/benchmarks.md, "At scale, limited by work"): 250 nodes is about the old 5 s
budget on the slowest of them. An ILP stopped here keeps its best plan, and its dual bound enters the
search's proven gap."""


def solve_candidate(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]],
                    allow_checkpointing: bool, solver: str, node_limit: int | None = ILP_NODE_LIMIT,
                    time_limit_s: float | None = None, cutoff: float | None = None,
                    allow_activation_offload: bool = True, allow_checkpoint_offload: bool = True) -> ILPResult:
    """Build and solve the ILP of one candidate; the returned evaluation is the costing of the solution.

    ``node_limit``: branch-and-bound nodes (work: the same answer on any load); ``time_limit_s``: a
    clock limit, only where a user set one. ``cutoff``: only solutions with a smaller objective are
    wanted (the incumbent of the outer search); with HiGHS a candidate that cannot beat it comes back
    ``"no better than the incumbent"`` sooner. CBC ignores it while solving."""
    t0 = time.perf_counter()
    prob, v = _build(cc, allowed_stages=allowed_stages, allow_checkpointing=allow_checkpointing,
                     allow_activation_offload=allow_activation_offload,
                     allow_checkpoint_offload=allow_checkpoint_offload)
    if cutoff is not None:
        # the cutoff also as a row, objective <= cutoff: HiGHS's presolve and node propagation tighten
        # every column against it (T, Tc, X bounded, hence blocks, checkpoints and states per stage),
        # which its objective bound alone does not; no solution is lost (only those below the cutoff
        # are wanted). 20-30% fewer simplex iterations on the benchmark cases (docs/benchmarks.md)
        _add(prob, dict(prob.objective), -cutoff, LE, "objective_cutoff")
    status, objective, gap = _run(prob, solver, node_limit, cutoff, time_limit_s=time_limit_s)
    nvars, ncons = len(prob.vars), len(prob.rows)
    elapsed = time.perf_counter() - t0
    dual = prob.dual_bound if solver == "highs" else (objective * (1 - MIP_REL_GAP) if status == "optimal"
                                                      else -math.inf)
    if status == "no solution":  # stopped (a limit) before finding one: nothing to read back, nothing
        # refuted (its objective is inf, which the cutoff test below would read as "no better")
        return ILPResult(status, None, math.inf, math.inf, elapsed, nvars, ncons, dual, prob.stopped_by)
    if status in ("infeasible", "cutoff") or (cutoff is not None and objective >= cutoff):
        # infeasible or cut off: nothing below the cutoff exists (proven); a solution at or above it
        # found by a solve a limit stopped proves only the solver's dual bound
        settled = status in ("infeasible", "cutoff", "optimal")
        bound = (math.inf if cutoff is None else cutoff) if settled else dual
        status = "infeasible" if status == "infeasible" and cutoff is None else "no better than the incumbent"
        return ILPResult(status, None, math.inf, 0.0, elapsed, nvars, ncons, bound,
                         None if settled else prob.stopped_by)
    return ILPResult(status, _extract(cc, v), objective, gap, elapsed, nvars, ncons, dual, prob.stopped_by)


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


POLISH_NODE_LIMIT = 200
"""Work limit of the tie-break among equally fast plans of the winning candidate
(:func:`polish_candidate`), in branch-and-bound nodes. It never changes the predicted step time, so it
gets a small, fixed budget: most settle at the root; one that does not keeps the best it found, or the
plan as the search left it."""


def polish_candidate(cc: CandidateCoeffs, found: ILPResult, *, allowed_stages: dict[int, tuple[int, int]],
                     allow_checkpointing: bool, solver: str, node_limit: int | None = POLISH_NODE_LIMIT,
                     time_limit_s: float | None = None, allow_activation_offload: bool = True,
                     allow_checkpoint_offload: bool = True) -> ILPResult:
    """The tie-break: among the plans of ``cc`` whose step time is no worse than ``found``'s, the one whose
    every stage is fastest (sum over stages of what each would make the step, were it the slowest),
    then with the fewest states off the device (:data:`OFFLOAD_TIE_BREAK_SHARE`).

    The step time depends only on the slowest stage and the largest tail, so the ILP is indifferent to
    what the other stages do below them: it may offload their optimizer states or checkpoint their
    blocks for nothing (gpt3-175b on 1,024 A100, pp 8: two stages with half their memory free stepped
    on the CPU). Returns ``found`` where the tie-break finds nothing better within its limits."""
    if found.evaluation is None:
        return found
    t0 = time.perf_counter()
    prob, v = _build(cc, allowed_stages=allowed_stages, allow_checkpointing=allow_checkpointing,
                     allow_activation_offload=allow_activation_offload,
                     allow_checkpoint_offload=allow_checkpoint_offload, per_stage=True)
    # the step time stays at most the one found (its objective, as the solver computed it)
    _add(prob, dict(prob.objective), -found.objective * (1 + 1e-9), LE, "polish_step_time")
    # each stage's time weighs what T does in the step form (the chunk term stays on Tc where there is one)
    weight = cc.candidate.step_form.terms(v.T, v.T if v.Tc is None else v.Tc, v.X)[v.T]
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
    status, _, _ = _run(prob, solver, node_limit, None, POLISH_REL_GAP, time_limit_s)
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
