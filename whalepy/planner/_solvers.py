"""The ILP's model container and its solvers (split from :mod:`whalepy.planner.ilp`, which builds the
model and re-exports these names): a plain-Python model of variables and rows, handed to HiGHS as arrays
in one call (highspy) or converted to PuLP for CBC."""

from __future__ import annotations

import math
import sys
import tempfile
import warnings

import pulp

from whalepy.errors import PlanError


def _drop_import_tracebacks(package: str) -> None:
    """Drop the tracebacks of the exceptions ``package`` keeps from its own import.

    PuLP keeps the exception of each solver it failed to load as a class attribute (``err`` of
    ``pulp.apis.copt_api.COPT_DLL``, ``pulp.apis.cplex_api.CPLEX_PY``, ...). Its traceback holds the frame
    that caught it, and a frame holds its caller (``f_back``) up to the frame whose ``import`` loaded the
    package first: ``whalepy.parallelize`` (which imports the planner on its first call), with the model
    it moved to the GPU. That model then outlived its ``ParallelModel`` for the rest of the process (the
    H200 run of 2026-11-26: 5.28 GiB, the first model's fp32 parameters, in every later peak; docs/
    cost_model.md, "Validation: one H200"). The exceptions and their messages stay."""
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == package or name.startswith(package + ".")):
            continue
        for obj in list(vars(mod).values()):
            err = getattr(obj, "err", None) if isinstance(obj, type) else None
            while isinstance(err, BaseException) and err.__traceback__ is not None:
                err.__traceback__ = None
                err = err.__context__


_drop_import_tracebacks("pulp")

# Linear forms are ``(dict[_Var, float], constant)``. The model is built in plain Python (``_Model``) and
# handed to HiGHS as arrays in one call (or converted to PuLP for CBC): PuLP's model building and its
# column-by-column transfer to HiGHS took longer than HiGHS's solve on the small ILPs the search makes.

LE, GE, EQ = -1, 1, 0
"""Constraint senses (PuLP's values)."""


class _Var:
    __slots__ = ("index", "name", "lowBound", "upBound", "integer", "varValue")

    def __init__(self, index: int, name: str, lb: float | None, ub: float | None, integer: bool) -> None:
        self.index, self.name, self.lowBound, self.upBound, self.integer = index, name, lb, ub, integer
        self.varValue: float | None = None


class _Model:
    """Variables, rows ``sum d + const (sense) 0`` in addition order, a linear objective. The solvers
    receive the variables that appear, sorted by name (:func:`_solve_highs`)."""

    def __init__(self) -> None:
        self.vars: list[_Var] = []
        self.rows: list[tuple[dict, float, int, str]] = []  # type: ignore[type-arg]
        self.objective: dict = {}  # type: ignore[type-arg]
        self.dual_bound = -math.inf
        """After :func:`_solve_highs`: a lower bound of the optimum HiGHS proved (its MIP dual bound, or
        the LP's optimum), valid even when it stopped at a limit; ``-inf`` where it proved none."""
        self.stopped_by: str | None = None
        """After a solve: ``"nodes"`` (its work limit) or ``"time"`` (a user's clock limit) where one of
        them ended it before it settled, else None."""

    def var(self, name: str, lb: float | None, ub: float | None, cat: str) -> _Var:
        if cat == "Binary":
            lb, ub = 0, 1
        v = _Var(len(self.vars), name, lb, ub, cat != "Continuous")
        self.vars.append(v)
        return v


# PuLP 4 keeps expressions in its Rust core and builds them with factory methods; PuLP 3 with the
# constructor.
_PULP4 = hasattr(pulp.LpAffineExpression, "from_dict")


def _expr(d: dict, const: float = 0.0) -> pulp.LpAffineExpression:  # type: ignore[type-arg]
    if _PULP4:
        return pulp.LpAffineExpression.from_dict(d, const)
    return pulp.LpAffineExpression(d, constant=const)


MIP_REL_GAP = 1e-4
"""Relative MIP gap at which a candidate's ILP counts as solved (HiGHS's default)."""


def _cbc(**kwargs):  # type: ignore[no-untyped-def]
    """CBC as this pulp provides it: a ``cbc`` executable (``pip install 'pulp[cbc]'`` or one on PATH)
    through ``COIN_CMD``, else the copy pulp 3 bundles (``PULP_CBC_CMD``, deprecated in pulp 3.3,
    gone in pulp 4)."""
    coin = pulp.COIN_CMD(**kwargs)
    if coin.available() or not hasattr(pulp, "PULP_CBC_CMD"):
        return coin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(**kwargs)


def choose_solver(requested: str) -> tuple[str, list[str]]:
    """The MIP solver that will run for ``requested`` (``"highs"`` or ``"cbc"``), and notes for the plan.
    HiGHS falls back to CBC when highspy is missing; a solver that cannot run raises :class:`PlanError`
    (checked before any candidate is built)."""
    highs_ok = pulp.HiGHS().available()
    if requested == "highs" and highs_ok:
        return "highs", []
    if _cbc(msg=False).available():
        if requested == "highs":
            return "cbc", ["HiGHS (highspy) is not available: solved with CBC instead, which is slower"]
        return "cbc", []
    if requested == "cbc":
        hint = "use solver='highs' (the default)" if highs_ok else "pip install highspy and use solver='highs'"
        raise PlanError(f"solver='cbc': pulp {pulp.__version__} provides no CBC (pulp 4 no longer bundles "
                        f"it; pip install 'pulp[cbc]'), or {hint}")
    raise PlanError(f"no MIP solver: highspy is not importable and pulp {pulp.__version__} provides no "
                    "CBC; pip install highspy (or use solver='exhaustive' for small models)")


_banner_silenced = False


def _highs():  # type: ignore[no-untyped-def]
    """A ``highspy.Highs``. HiGHS prints its copyright banner to the process's stdout (file descriptor 1,
    from C++, so ``contextlib.redirect_stdout`` does not catch it) when the first instance of a process
    is made, before any option can be set: that first construction runs with fd 1 pointed at
    ``/dev/null``, so that ``whalepy plan > plan.txt`` and a training log hold no solver output."""
    global _banner_silenced
    import highspy

    if _banner_silenced:
        return highspy.Highs()
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _banner_silenced = True
    return h


def _name_of(x: _Var) -> str:
    return x.name


def _solve_highs(prob: _Model, node_limit: int | None, cutoff: float | None,
                 rel_gap: float = MIP_REL_GAP, *, time_limit_s: float | None = None,
                 first_solution: bool = False, relaxed: bool = False) -> tuple[str, float, float]:
    """Solve with HiGHS in-process: ``(status, objective, mip gap)``, column values into ``varValue``.
    ``status``: ``optimal``, ``feasible`` (stopped with a solution), ``infeasible``, ``cutoff`` (nothing
    below ``cutoff``) or ``no solution``. ``first_solution``: stop at the first solution found (below
    ``cutoff``, if given): for a question that one solution answers. ``relaxed``: the linear relaxation
    (every column continuous), whose optimum is at most the MIP's.

    Limited by work, never by the clock unless ``time_limit_s`` is given (a user's limit): at most
    ``node_limit`` branch-and-bound nodes (``mip_max_nodes``; None: no limit), one thread, HiGHS's fixed
    random seed. HiGHS's MIP is deterministic under these settings, so the same model stops at the same
    node with the same answer on an idle and on a loaded machine. ``prob.stopped_by`` says which limit,
    if any, ended the solve (``"nodes"`` or ``"time"``)."""
    import highspy
    import numpy as np

    h = _highs()
    for key, value in (("output_flag", False), ("log_to_console", False), ("mip_rel_gap", rel_gap),
                       ("threads", 1), ("random_seed", 0)):
        h.setOptionValue(key, value)
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(max(time_limit_s, 1e-3)))
    if node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(node_limit))
    if cutoff is not None:
        h.setOptionValue("objective_bound", float(cutoff))
    if first_solution:
        h.setOptionValue("mip_max_improving_sols", 1)
    inf = highspy.kHighsInf
    # columns: the variables that appear, sorted by name, as PuLP handed them to HiGHS (the same model
    # gives the same optimum among the many ties of identical layers)
    used = set(prob.objective)
    for row in prob.rows:
        used.update(row[0])
    order = sorted(used, key=_name_of)
    cols = {x: i for i, x in enumerate(order)}
    n = len(order)
    objective = prob.objective
    cost = np.fromiter((objective.get(x, 0.0) for x in order), dtype=float, count=n)
    lower = np.fromiter((-inf if x.lowBound is None else x.lowBound for x in order), dtype=float, count=n)
    upper = np.fromiter((inf if x.upBound is None else x.upBound for x in order), dtype=float, count=n)
    h.addCols(n, cost, lower, upper, 0, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
    ints = np.array([i for i, x in enumerate(order) if x.integer and not relaxed], dtype=np.int32)
    if len(ints):
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    lo, hi, starts, idx, val = [], [], [], [], []
    column = cols.__getitem__
    for d, const, sense, _name in prob.rows:
        lo.append(-const if sense != LE else -inf)
        hi.append(-const if sense != GE else inf)
        starts.append(len(idx))
        if 0 in d.values():  # zero coefficients are left out of the matrix
            for x, a in d.items():
                if a != 0:
                    idx.append(cols[x])
                    val.append(a)
        else:
            idx.extend(map(column, d))
            val.extend(d.values())
    h.addRows(len(lo), np.array(lo, dtype=float), np.array(hi, dtype=float), len(idx),
              np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(val, dtype=float))
    h.run()
    ms, info = h.getModelStatus(), h.getInfo()
    S = highspy.HighsModelStatus
    prob.stopped_by = {S.kTimeLimit: "time", S.kSolutionLimit: "nodes", S.kIterationLimit: "nodes"}.get(ms)
    if len(ints):
        prob.dual_bound = float(info.mip_dual_bound)
    elif ms == S.kOptimal:
        prob.dual_bound = float(info.objective_function_value)
    if ms in (S.kInfeasible, S.kUnboundedOrInfeasible):
        return "infeasible", math.inf, 0.0
    if ms == S.kObjectiveBound:
        return "cutoff", math.inf, 0.0
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible: no solution to read
        return "no solution", math.inf, 0.0
    for x, value in zip(order, h.getSolution().col_value):
        x.varValue = value
    if ms == S.kOptimal:
        return "optimal", info.objective_function_value, 0.0
    return "feasible", info.objective_function_value, float(info.mip_gap)


def _pulp_var(lp: pulp.LpProblem, name: str, low: float | None, up: float | None, cat: str) -> pulp.LpVariable:
    """A PuLP variable: PuLP >= 3.3 attaches variables to the model (``add_variable``; PuLP 4 has no
    free-standing ``LpVariable(name, low, up, cat)``), older PuLP builds them free-standing."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def _solve_cbc(prob: _Model, node_limit: int | None, rel_gap: float = MIP_REL_GAP, *,
               time_limit_s: float | None = None) -> tuple[str, float, float]:
    """Solve with CBC through PuLP (HiGHS unavailable, or asked for); same results as
    :func:`_solve_highs`, with the same limits (CBC's ``maxNodes``; seconds only where given).
    PuLP 3 and 4 both (:func:`_expr`, :func:`_outcome`)."""
    lp = pulp.LpProblem("whalepy_plan", pulp.LpMinimize)
    cols = [_pulp_var(lp, x.name, x.lowBound, x.upBound, "Integer" if x.integer else "Continuous")
            for x in prob.vars]
    lp.setObjective(_expr({cols[x.index]: a for x, a in prob.objective.items()}))
    for d, const, sense, name in prob.rows:
        terms = {cols[x.index]: a for x, a in d.items()}
        if _PULP4:
            e = _expr(terms, const)
            e.sense = sense
            lp.addConstraint(e, name)
        else:
            lp.addConstraint(pulp.LpConstraint(_expr(terms), sense=sense, rhs=-const), name)
    solver = _cbc(msg=False, gapRel=rel_gap, threads=1, maxNodes=node_limit,
                  timeLimit=None if time_limit_s is None else max(1, int(round(time_limit_s))))
    # CBC writes its model and solution files into tmpDir; the process's working directory is left alone
    with tempfile.TemporaryDirectory(prefix="whalepy_ilp_") as tmp:
        solver.tmpDir = tmp
        outcome = _outcome(lp, lp.solve(solver))
    if outcome in ("infeasible", "no solution"):
        return outcome, math.inf, 0.0
    if outcome == "feasible":
        prob.stopped_by = "nodes" if time_limit_s is None else "time"
    for x, col in zip(prob.vars, cols):
        x.varValue = col.varValue
    return outcome, float(pulp.value(lp.objective)), math.nan if outcome == "feasible" else 0.0


def _outcome(prob: pulp.LpProblem, solved) -> str:  # type: ignore[no-untyped-def]
    """``"optimal"``, ``"feasible"`` (stopped early with a solution), ``"infeasible"`` (including: no
    solution can beat the objective bound) or ``"no solution"``. PuLP 4's ``solve`` returns an
    ``LpSolveStats``; PuLP 3's a status code, with the solution's status on the problem."""
    if _PULP4:
        S = pulp.LpSolveStatus
        if solved.status == S.Infeasible or (not solved.has_solution and solved.status == S.GapLimit):
            return "infeasible"
        if not solved.has_solution:
            return "no solution"
        return "optimal" if solved.status == S.Optimal else "feasible"
    if solved == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible"
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return "no solution"
    return "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible"
