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
    ``c[s][g]`` integer: checkpointed blocks of ``g`` on stage ``s``; ``h[s][g]`` binary: any are;
    ``y[s][o]`` binary: stage ``s`` uses state option ``o`` (ZeRO stage x optimizer tier x parameter
    tier); ``Q[s][o] >= 0``: the stage's parameters per device if it uses ``o``, else 0
    (disaggregation of the product ``y * Pl``);
    ``T``: time of the slowest stage per micro-batch; ``X``: the slowest stage's exposed gradient
    synchronisation plus optimizer step.

Objective
    minimise ``beta * T + X`` with ``beta = M + S - 1`` (GPipe, 1F1B) or ``M + (S - 1)/v``
    (interleaved 1F1B): the predicted step time.

Constraint families (each added by the function named)
    partition (``add_partition_constraints``): one segment per boundary, ``r <= (L_g - 1) q``,
    ``B_1 >= 1``, ``B_{j+1} >= B_j + 1``, ``B_{J-1} <= N - 1`` (contiguous, non-empty stages);
    annotations (``add_annotation_constraints``): a block at position ``i`` with ``stage(k)`` or a
    ``cluster`` pin allowing stages ``lo..hi``: ``B_lo <= i < B_{hi+1}``;
    checkpointing (``add_checkpoint_constraints``): ``c[s][g] <= n[s][g]``, ``L_g h[s][g] >= c[s][g]``;
    state options (``add_state_option_constraints``): ``sum_o y = 1``, ``Q <= P_max y``,
    ``sum_o Q[s][o] = Pl_s = sum_g n[s][g] p_g``;
    time (``add_time_constraints``), for every cell (stage, group, share):
    ``T >= compute + p2p``, ``T >= gather + p2p``, ``T >= fetch + p2p`` (overlapped transfers);
    tail (``add_tail_constraints``): ``X >= opt``, ``X >= sync - bwd + opt`` per cell;
    memory (``add_memory_constraints``): per cell ``states + act <= capacity`` and, for every segment,
    ``states + act + h[s][g] saved_g <= capacity`` (one checkpointed block is recomputed at a time);
    offloaded states ``<=`` host memory (and NVMe) per GPU.

Memory is written in GiB and parameters in billions to keep the coefficients well scaled.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass

import pulp

from whalepy.plan import ZeroStage
from whalepy.planner.costing import CandidateCoeffs, Evaluation, evaluate
from whalepy.planner.space import StateOption

_GIB = float(2**30)
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


@dataclass(slots=True)
class _Vars:
    q: list[list[pulp.LpVariable]]
    r: list[list[pulp.LpVariable]]
    n: list[list[pulp.LpAffineExpression]]
    c: list[list[pulp.LpVariable]]
    h: list[list[pulp.LpVariable]]
    y: list[dict[StateOption, pulp.LpVariable]]
    Q: list[dict[StateOption, pulp.LpVariable]]
    pl: list[pulp.LpAffineExpression]
    T: pulp.LpVariable
    X: pulp.LpVariable


def _var(prob: pulp.LpProblem, name: str, lowBound: float | None = None, upBound: float | None = None,
         cat: str = "Continuous") -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3 attaches variables to the model
        return prob.add_variable(name, lowBound, upBound, cat=cat)
    return pulp.LpVariable(name, lowBound, upBound, cat=cat)


def _boundary(cc: CandidateCoeffs, v: _Vars, j: int) -> pulp.LpAffineExpression:
    return pulp.lpSum(seg.start * v.q[j][g] + v.r[j][g] for g, seg in enumerate(cc.segments))


def _cum(cc: CandidateCoeffs, v: _Vars, j: int, g: int) -> pulp.LpAffineExpression | float:
    """Blocks of segment g before virtual boundary j (j = 0: none; j = J: all)."""
    J = cc.candidate.num_virtual
    L = cc.segments[g].length
    if j == 0:
        return 0.0
    if j == J:
        return float(L)
    G = len(cc.segments)
    return L * pulp.lpSum(v.q[j][gg] for gg in range(g + 1, G)) + v.r[j][g]


def build_variables(prob: pulp.LpProblem, cc: CandidateCoeffs) -> _Vars:
    cand = cc.candidate
    S, J, G = cand.num_stages, cand.num_virtual, len(cc.segments)
    q = [[]] + [[_var(prob, f"q_{j}_{g}", cat="Binary") for g in range(G)] for j in range(1, J)]
    r = [[]] + [[_var(prob, f"r_{j}_{g}", lowBound=0, upBound=max(0, cc.segments[g].length - 1),
                                 cat="Integer") for g in range(G)] for j in range(1, J)]
    v = _Vars(q=q, r=r, n=[], c=[], h=[], y=[], Q=[], pl=[], T=_var(prob, "T", lowBound=0),
              X=_var(prob, "X", lowBound=0))
    for s in range(S):
        row = []
        for g in range(G):
            expr = pulp.LpAffineExpression()
            for k in range(cand.virtual_stages):
                j = s + k * S
                expr += _cum(cc, v, j + 1, g) - _cum(cc, v, j, g)
            row.append(expr)
        v.n.append(row)
        v.c.append([_var(prob, f"c_{s}_{g}", lowBound=0, upBound=cc.segments[g].length, cat="Integer")
                    for g in range(G)])
        v.h.append([_var(prob, f"h_{s}_{g}", cat="Binary") for g in range(G)])
        sc = cc.stages[s]
        v.y.append({o: _var(prob, f"y_{s}_{i}", cat="Binary") for i, o in enumerate(sc.options)})
        v.Q.append({o: _var(prob, f"Q_{s}_{i}", lowBound=0) for i, o in enumerate(sc.options)})
        v.pl.append(pulp.lpSum(v.n[s][g] * (sc.seg_params[g] / _BILLION) for g in range(G)))
    return v


def add_partition_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars) -> None:
    J, N = cc.candidate.num_virtual, cc.num_blocks
    for j in range(1, J):
        prob += pulp.lpSum(v.q[j]) == 1, f"one_segment_{j}"
        for g, seg in enumerate(cc.segments):
            if seg.length > 1:
                prob += v.r[j][g] <= (seg.length - 1) * v.q[j][g], f"offset_in_segment_{j}_{g}"
    if J > 1:
        prob += _boundary(cc, v, 1) >= 1, "first_stage_nonempty"
        prob += _boundary(cc, v, J - 1) <= N - 1, "last_stage_nonempty"
    for j in range(1, J - 1):
        prob += _boundary(cc, v, j + 1) >= _boundary(cc, v, j) + 1, f"stage_nonempty_{j}"


def add_annotation_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars,
                               allowed_stages: dict[int, tuple[int, int]]) -> None:
    """``allowed_stages[i] = (lo, hi)``: block at position ``i`` must sit on a virtual stage in lo..hi."""
    J = cc.candidate.num_virtual
    for i, (lo, hi) in sorted(allowed_stages.items()):
        if lo > 0:
            prob += _boundary(cc, v, lo) <= i, f"block_{i}_not_before_stage_{lo}"
        if hi + 1 < J:
            prob += _boundary(cc, v, hi + 1) >= i + 1, f"block_{i}_not_after_stage_{hi}"


def add_checkpoint_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars, allow: bool) -> None:
    for s in range(cc.candidate.num_stages):
        for g, seg in enumerate(cc.segments):
            prob += v.c[s][g] <= v.n[s][g], f"ckpt_le_count_{s}_{g}"
            if not allow:
                prob += v.c[s][g] == 0, f"no_ckpt_{s}_{g}"
            prob += seg.length * v.h[s][g] >= v.c[s][g], f"any_ckpt_{s}_{g}"


def add_state_option_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars) -> None:
    for s, sc in enumerate(cc.stages):
        pmax = sum(seg.length * p for seg, p in zip(cc.segments, sc.seg_params)) / _BILLION
        prob += pulp.lpSum(v.y[s].values()) == 1, f"one_option_{s}"
        for i, o in enumerate(sc.options):
            prob += v.Q[s][o] <= pmax * v.y[s][o], f"option_params_{s}_{i}"
        prob += pulp.lpSum(v.Q[s].values()) == v.pl[s], f"option_params_sum_{s}"


def _z3(sc, v: _Vars, s: int) -> pulp.LpAffineExpression:  # type: ignore[no-untyped-def]
    return pulp.lpSum(v.y[s][o] for o in sc.options if o.zero is ZeroStage.PARAMETERS)


def add_time_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars) -> None:
    dp = cc.candidate.dp
    for s, sc in enumerate(cc.stages):
        G = len(cc.segments)
        gather = pulp.lpSum(
            sc.gather[o][0] * v.y[s][o] + sc.gather[o][1] * _BILLION * v.Q[s][o]
            for o in sc.options if o.zero is ZeroStage.PARAMETERS) if dp > 1 else 0
        for ci, cell in enumerate(sc.cells):
            compute = pulp.lpSum(v.n[s][g] * cell.seg_time[g] + v.c[s][g] * cell.seg_recompute[g] for g in range(G))
            prob += v.T >= compute + cell.p2p, f"time_compute_{s}_{ci}"
            if dp > 1 and any(o.zero is ZeroStage.PARAMETERS for o in sc.options):
                prob += v.T >= gather + cell.p2p, f"time_gather_{s}_{ci}"
            fetch = pulp.lpSum(cell.fetch_beta[o] * _BILLION * v.Q[s][o] for o in sc.options if cell.fetch_beta[o])
            if any(cell.fetch_beta[o] for o in sc.options):
                prob += v.T >= fetch + cell.p2p, f"time_fetch_{s}_{ci}"


def add_tail_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars) -> None:
    dp = cc.candidate.dp
    for s, sc in enumerate(cc.stages):
        G = len(cc.segments)
        sync = pulp.lpSum(sc.sync[o][0] * v.y[s][o] + sc.sync[o][1] * _BILLION * v.Q[s][o] for o in sc.options)
        for ci, cell in enumerate(sc.cells):
            opt = pulp.lpSum(cell.opt_beta[o] * _BILLION * v.Q[s][o] for o in sc.options)
            prob += v.X >= opt, f"tail_opt_{s}_{ci}"
            if dp > 1:
                bwd = pulp.lpSum(v.n[s][g] * cell.seg_bwd[g] for g in range(G))
                prob += v.X >= sync - bwd + opt, f"tail_sync_{s}_{ci}"


def add_memory_constraints(prob: pulp.LpProblem, cc: CandidateCoeffs, v: _Vars) -> None:
    vs = cc.candidate.virtual_stages
    for s, sc in enumerate(cc.stages):
        G = len(cc.segments)
        states = pulp.lpSum(sc.mem_beta[o] * _BILLION / _GIB * v.Q[s][o] for o in sc.options)
        states += sc.working_bytes / _GIB * _z3(sc, v, s)
        cpu = pulp.lpSum(sc.cpu_beta[o] * _BILLION / _GIB * v.Q[s][o] for o in sc.options if sc.cpu_beta[o])
        nvme = pulp.lpSum(sc.nvme_beta[o] * _BILLION / _GIB * v.Q[s][o] for o in sc.options if sc.nvme_beta[o])
        for ci, cell in enumerate(sc.cells):
            k = cell.inflight / vs / _GIB
            act = pulp.lpSum(k * (v.n[s][g] * cell.seg_saved[g] + v.c[s][g] * (cell.seg_input[g] - cell.seg_saved[g]))
                             for g in range(G))
            cap = cell.capacity / _GIB
            prob += states + act <= cap, f"memory_{s}_{ci}"
            for g in range(G):
                if cell.seg_saved[g] > 0:
                    prob += states + act + cell.seg_saved[g] / _GIB * v.h[s][g] <= cap, f"memory_recompute_{s}_{ci}_{g}"
            if any(sc.cpu_beta[o] for o in sc.options):
                prob += cpu <= (cell.cpu_capacity or 0.0) / _GIB, f"host_memory_{s}_{ci}"
            if any(sc.nvme_beta[o] for o in sc.options):
                prob += nvme <= (cell.nvme_capacity or 0.0) / _GIB, f"nvme_{s}_{ci}"


MIP_REL_GAP = 1e-4
"""Relative MIP gap at which a candidate's ILP counts as solved (HiGHS's default)."""


def make_solver(name: str, time_limit_s: float, tmpdir: str, cutoff: float | None = None):  # type: ignore[no-untyped-def]
    if name == "highs":
        extra = {} if cutoff is None else {"objective_bound": cutoff}
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=MIP_REL_GAP, threads=1, **extra)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit_s))), gapRel=MIP_REL_GAP)
    solver.tmpDir = tmpdir
    return solver


def solve_candidate(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]],
                    allow_checkpointing: bool, solver: str, time_limit_s: float,
                    cutoff: float | None = None) -> ILPResult:
    """Build and solve the ILP of one candidate; the returned evaluation is the costing of the solution.

    ``cutoff``: only solutions with a smaller objective are wanted (the incumbent of the outer search);
    with HiGHS a candidate that cannot beat it comes back ``"infeasible"`` sooner. CBC ignores it."""
    t0 = time.perf_counter()
    prob = pulp.LpProblem("whalepy_plan", pulp.LpMinimize)
    v = build_variables(prob, cc)
    prob += cc.bubble * v.T + v.X, "step_time"
    add_partition_constraints(prob, cc, v)
    add_annotation_constraints(prob, cc, v, allowed_stages)
    add_checkpoint_constraints(prob, cc, v, allow_checkpointing)
    add_state_option_constraints(prob, cc, v)
    add_time_constraints(prob, cc, v)
    add_tail_constraints(prob, cc, v)
    add_memory_constraints(prob, cc, v)
    with tempfile.TemporaryDirectory(prefix="whalepy_ilp_") as tmp, _chdir(tmp):
        status = prob.solve(make_solver(solver, time_limit_s, tmp, cutoff))
    sol_status = prob.sol_status
    nvars = len(prob.variables())
    ncons = prob.numConstraints() if hasattr(prob, "numConstraints") else len(prob.constraints)
    elapsed = time.perf_counter() - t0
    if status == pulp.LpStatusInfeasible or sol_status == pulp.LpSolutionInfeasible:
        return ILPResult("infeasible" if cutoff is None else "no better than the incumbent", None,
                         float("inf"), 0.0, elapsed, nvars, ncons)
    if sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return ILPResult("no solution", None, float("inf"), 0.0, elapsed, nvars, ncons)
    if cutoff is not None and float(pulp.value(prob.objective)) >= cutoff:
        return ILPResult("no better than the incumbent", None, float("inf"), 0.0, elapsed, nvars, ncons)
    gap = 0.0
    if sol_status != pulp.LpSolutionOptimal:
        gap = _highs_gap(prob)
    ev = _extract(cc, v)
    status_name = "optimal" if sol_status == pulp.LpSolutionOptimal else "feasible"
    return ILPResult(status_name, ev, float(pulp.value(prob.objective)), gap, elapsed, nvars, ncons)


def _highs_gap(prob: pulp.LpProblem) -> float:
    model = getattr(prob, "solverModel", None)
    try:
        return float(model.getInfo().mip_gap)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - CBC or an older highspy: the gap is not reachable
        return float("nan")


def _extract(cc: CandidateCoeffs, v: _Vars) -> Evaluation:
    J, N = cc.candidate.num_virtual, cc.num_blocks
    bounds = [0] + [int(round(pulp.value(_boundary(cc, v, j)))) for j in range(1, J)] + [N]
    sizes = [bounds[j + 1] - bounds[j] for j in range(J)]
    ckpts, options = [], []
    for s, sc in enumerate(cc.stages):
        ckpts.append([int(round(c.varValue or 0)) for c in v.c[s]])
        options.append(max(sc.options, key=lambda o: v.y[s][o].varValue or 0.0))
    return evaluate(cc, sizes, ckpts, options)


@contextlib.contextmanager
def _chdir(path: str):  # type: ignore[no-untyped-def]
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)
