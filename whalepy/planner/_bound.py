"""The memory-aware part of the pruning bound (:func:`~whalepy.planner.costing.lower_bound`): the least
time per micro-batch of a pipeline's slowest stage when blocks are divisible but every stage's
activations must fit its device, as a small linear program (HiGHS).

A relaxation of the candidate's ILP, read off the same coefficients (``CellCoeffs``: ``seg_time``,
``seg_recompute``, ``seg_offload``, ``seg_ckoff``, ``seg_saved``, ``seg_input``, ``seg_host``,
``seg_ckhost``, ``inflight``, ``capacity``, ``loss_bytes``; ``NodeShare`` capacities), keeping only
terms every plan pays and dropping every non-negative one it cannot price without the state options:

- time: a stage's time per micro-batch is at least its compute, ``sum_g n_g seg_time_g + c_g
  seg_recompute_g + o_g seg_offload_g + w_g seg_ckoff_g`` (:func:`evaluate_stage`: ``time_s =
  max(compute + exposed, fetch) + p2p``);
- device memory: ``inflight * max_k kept_k >= inflight / v * sum_k kept_k`` with ``kept = n saved + c
  (input - saved) - o saved - w input``, plus the loss's bytes on the last stage, at most the usable
  capacity (model states, buffers, the recomputed block's bytes and autocast copies are dropped: all
  non-negative);
- host memory: a rank's offloaded activations and checkpointed inputs are at most its node's host
  capacity over the ranks of its stage on that node (every other term of the node's row is dropped);
- ``c_g + o_g <= n_g``, ``w_g <= c_g``, ``sum_s n_sg = L_g``, all continuous.

Every plan of the candidate that fits is a feasible point of this LP with ``t`` its slowest stage's
compute, so the LP's optimum is at most that; ``tests/test_planner_bound.py`` checks the bound against a
brute force. The LP only matters where memory binds: when every stage could hold every block's
activations (:func:`_memory_binds`) it equals the divisible-work bound and is not solved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from whalepy.planner._solvers import EQ, GE, LE, _Model, _solve_highs, _Var
from whalepy.planner._coeffs import CandidateCoeffs, CellCoeffs

GIB = float(2**30)
BILLION = 1e9


LP_SAFETY = 1e-7
"""The LP's optimum is scaled down by this share before it is used as a bound: HiGHS meets its rows to a
primal feasibility tolerance (1e-7 absolute, on rows scaled to seconds and GiB), so its optimum may sit
that far above the exact one. Well below the MIP gap (1e-4) the search prunes against."""


def _memory_binds(cc: CandidateCoeffs, cells: Sequence[CellCoeffs]) -> bool:
    lengths = [seg.length for seg in cc.segments]
    v = cc.candidate.virtual_stages
    for c in cells:
        need = c.inflight / v * sum(n * a for n, a in zip(lengths, c.seg_saved)) + c.loss_bytes
        if need > c.capacity:
            return True
    return False


def _host_capacity(cc: CandidateCoeffs, s: int) -> float:
    """Host bytes one rank of stage ``s`` may hold at most: its node's capacity over the stage's ranks
    on it, the least over the nodes it runs on (``NodeShare``; no nodes: no host copies possible)."""
    caps = [(n.cpu_capacity or 0.0) * (1 + 1e-6) / n.ranks_per_stage[s] for n in cc.nodes if n.ranks_per_stage[s]]
    return min(caps) if caps else math.inf


class Choices(NamedTuple):
    """Which per-block choices the candidate's ILP may make (the search's ``PlannerOptions``
    ``allow_checkpointing``, ``allow_activation_offload``, ``allow_checkpoint_offload``): the bound
    relaxes that ILP, so it leaves out the columns the ILP does not have. All allowed by default (a
    bound of every plan, whatever the options)."""

    checkpointing: bool = True
    activation_offload: bool = True
    checkpoint_offload: bool = True


ALL_CHOICES = Choices()


States = tuple[dict[_Var, float], dict[_Var, float], float]
"""A stage's model states in its memory rows: device GiB terms, host GiB terms, constant device GiB."""
NO_STATES: States = ({}, {}, 0.0)


def _add_stage_rows(prob: _Model, cc: CandidateCoeffs, s: int, c: CellCoeffs, n: list[_Var],
                    choices: Choices = ALL_CHOICES, states: States = NO_STATES) -> dict[_Var, float]:
    """Stage ``s``'s recompute and host-copy columns (those ``choices`` allows), its ``c + o <= n``, ``w <=
    c``, device-memory and host-memory rows, for blocks per segment ``n``; returns its compute (seconds
    per micro-batch) as a linear form, without the sends. ``states``: the model states, added to the
    memory rows."""
    G, v = len(cc.segments), cc.candidate.virtual_stages

    def col(name: str, up: float | None = None) -> _Var:
        return prob.var(name, 0.0, up, "Continuous")

    k = c.inflight / v / GIB
    compute: dict[_Var, float] = {}
    mem_row: dict[_Var, float] = dict(states[0])
    host_row: dict[_Var, float] = dict(states[1])
    for g in range(G):
        compute[n[g]] = c.seg_time[g]
        mem_row[n[g]] = k * c.seg_saved[g]
        ck = col(f"c_{s}_{g}", None if choices.checkpointing else 0.0)
        within = {ck: 1.0, n[g]: -1.0}  # c <= n (o joins below)
        compute[ck] = c.seg_recompute[g]
        mem_row[ck] = k * (c.seg_input[g] - c.seg_saved[g])
        if (choices.activation_offload and c.seg_offload is not None and c.seg_host is not None
                and c.seg_saved[g] > 0):
            o = col(f"o_{s}_{g}")
            within[o] = 1.0  # c + o <= n
            compute[o] = c.seg_offload[g]
            mem_row[o] = -k * c.seg_saved[g]
            host_row[o] = c.seg_host[g] / GIB
        prob.rows.append((within, 0.0, LE, f"within_{s}_{g}"))
        if (choices.checkpointing and choices.checkpoint_offload and c.seg_ckoff is not None
                and c.seg_ckhost is not None and c.seg_input[g] > 0):
            w = col(f"w_{s}_{g}")
            prob.rows.append(({w: 1.0, ck: -1.0}, 0.0, LE, f"ckoff_{s}_{g}"))  # w <= c
            compute[w] = c.seg_ckoff[g]
            mem_row[w] = -k * c.seg_input[g]
            host_row[w] = c.seg_ckhost[g] / GIB
    prob.rows.append((mem_row, states[2] - (c.capacity * (1 + 1e-6) - c.loss_bytes) / GIB, LE, f"memory_{s}"))
    host = _host_capacity(cc, s)
    if host_row and host < math.inf:
        prob.rows.append((host_row, -host / GIB, LE, f"host_{s}"))
    return compute


def relaxed_stage_time(cc: CandidateCoeffs, cells: Sequence[CellCoeffs],
                       choices: Choices = ALL_CHOICES) -> float | None:
    """The LP optimum for one pipeline (``cells[s]``: its cell of stage ``s``), or None where memory does not
    bind or the LP says nothing (infeasible: then the ILP finds that no plan fits)."""
    if not _memory_binds(cc, cells):
        return None
    G = len(cc.segments)
    lengths = [seg.length for seg in cc.segments]
    prob = _Model()
    t = prob.var("t", 0.0, None, "Continuous")
    prob.objective = {t: 1.0}
    n = [[prob.var(f"n_{s}_{g}", 0.0, float(lengths[g]), "Continuous") for g in range(G)] for s in range(len(cells))]
    for g in range(G):
        prob.rows.append(({n[s][g]: 1.0 for s in range(len(cells))}, -float(lengths[g]), EQ, f"blocks_{g}"))
    for s, c in enumerate(cells):
        compute = _add_stage_rows(prob, cc, s, c, n[s], choices)
        prob.rows.append(({**compute, t: -1.0}, 0.0, LE, f"time_{s}"))
    status, objective, _ = _solve_highs(prob, None, None)  # an LP of a few dozen columns: no limit needed
    if status != "optimal":
        return None
    return objective * (1 - LP_SAFETY)


LP_REACH_MARGIN = 1e-6
"""Share by which the linear relaxation's optimum must exceed the cutoff before :func:`integer_step_bound`
takes it as the MIP's answer without solving the MIP: ten times :data:`LP_SAFETY`, so that HiGHS's
tolerances in the LP and in the MIP's own root cannot disagree on it."""

INTEGER_NODE_LIMIT = 200
"""Work limit (branch-and-bound nodes) of the whole-block bound's small MIP (:func:`integer_step_bound`);
where it stops there, HiGHS's dual bound at that moment is used, which is still a bound. Nodes, not
seconds: the same bound on any machine load."""


def _state_terms(prob: _Model, cc: CandidateCoeffs, s: int, c: CellCoeffs, n: list[_Var]):  # type: ignore[no-untyped-def]
    """Stage ``s``'s model states, whatever its state options: its parameters spread over the options as
    continuous ``Q[o] >= 0`` (billions per device, ``sum_o Q[o] = sum_g n_g p_g``; one option, or a mix
    of them, is such a point), each per-parameter cost summed over them and each per-block or per-stage
    cost the least over the options. Returns the model states for the memory rows (:data:`States`),
    and the forms (terms, constant) ``fetch`` (parameter fetches per micro-batch,
    :func:`~whalepy.planner._evaluation.evaluate_stage`'s ``per_param(fetch_beta)``), ``exposed``
    (data-parallel communication per micro-batch) and ``tail`` (optimizer step and exposed
    synchronisation per step, the post-step all-gather's fixed part dropped: a stage without
    parameters has none). The gradients count as freed at the activation peak where the option frees
    them (the peak is then at least the states less the gradients, plus activations)."""
    sc = cc.stages[s]
    G, opts = len(cc.segments), sc.options
    v = cc.candidate.virtual_stages
    q = {o: prob.var(f"Q_{s}_{i}", 0.0, None, "Continuous") for i, o in enumerate(opts)}
    prob.rows.append(({**{x: 1.0 for x in q.values()}, **{n[g]: -sc.seg_params[g] / BILLION for g in range(G)}},
                      0.0, EQ, f"params_{s}"))
    device = {q[o]: (sc.mem_beta[o] + sc.buffer_beta[o]
                     - (sc.state_split[o][1] if sc.grads_freed[o] else 0.0)) * BILLION / GIB for o in opts}
    host = {q[o]: sc.cpu_beta[o] * BILLION / GIB for o in opts if sc.cpu_beta[o]}
    # the activation peak: without the running block's gradient buffer; autocast's extras: none while
    # checkpointed
    const = min(sc.working_bytes[o] - sc.working_grad.get(o, 0.0) for o in opts) / GIB
    fetch = ({q[o]: c.fetch_beta[o] * BILLION for o in opts if c.fetch_beta[o]}, 0.0)
    exposed = ({n[g]: min(c.seg_exposed[o][g] for o in opts) for g in range(G)}, v * min(c.edge[o] for o in opts))
    tail: dict[_Var, float] = {q[o]: c.opt_beta[o] * BILLION for o in opts}
    tail_const = 0.0
    # exposed synchronisation: the last backward's reductions and the post-step all-gather (all 0 without
    # replicas), and the measured DTensor optimizer overhead (tensor parallelism alone too)
    for o in opts:
        tail[q[o]] += sc.sync[o][1] * BILLION
    for g in range(G):
        tail[n[g]] = min(c.seg_tail[o][g] for o in opts)
    tail_const = min(c.tail_edge[o] for o in opts)
    return (device, host, const), fetch, exposed, (tail, tail_const)


def integer_step_bound(cc: CandidateCoeffs, cells: Sequence[CellCoeffs], cutoff: float | None = None,
                       choices: Choices = ALL_CHOICES) -> float | None:
    """A step time no plan of one pipeline beats, with whole blocks: a small MIP, ``min M t + (S - 1) tc +
    x`` (``tc = t`` for ``v = 1``) over integer blocks per stage and segment ``n[s][g]`` (``sum_s = L_g``,
    at least ``v`` per stage, the model's first block on the first stage and its last on the last, as in
    every plan), continuous recompute and host copies (those ``choices`` allows) under the
    stage's device and host memory (the rows of :func:`relaxed_stage_time`), with ``t >= compute_s +
    p2p_s``, ``v tc >= compute_s + p2p_s`` and, the largest chunk holding at least ``u[s][g] >= n[s][g]
    / v`` (integer) blocks of segment ``g``, ``tc >= u[s][g] (seg_time_g + min_o exposed_og) + min_o
    edge_o + min_k chunk_p2p_k`` (the least over the stage's options, none without them). Where ``cc``
    has state options, their terms too (:func:`_state_terms`: states in memory, fetches, exposed
    communication, ``x >=`` the tail); else ``x = 0``. None where HiGHS proves nothing.

    ``cutoff``: the question is only whether the bound reaches it. HiGHS then stops at the first
    solution below it (the bound cannot reach it: the dual bound of that moment is returned) or proves
    that none exists (``cutoff`` is returned: the MIP's optimum is at least that)."""
    S, G, v = len(cells), len(cc.segments), cc.candidate.virtual_stages
    lengths = [seg.length for seg in cc.segments]
    prob = _Model()
    t = prob.var("t", 0.0, None, "Continuous")
    tc = prob.var("tc", 0.0, None, "Continuous") if v > 1 else t
    x = prob.var("x", 0.0, None, "Continuous")
    prob.objective = cc.candidate.step_form.terms(t, tc, x)
    # the model's first block runs on the first stage (its first chunk), its last block on the last stage
    first = min(cc.segments, key=lambda seg: seg.start).index
    final = max(cc.segments, key=lambda seg: seg.start).index
    n = [[prob.var(f"n_{s}_{g}", float((s == 0 and g == first) or (s == S - 1 and g == final)), float(lengths[g]),
                   "Integer") for g in range(G)] for s in range(S)]
    for g in range(G):
        prob.rows.append(({n[s][g]: 1.0 for s in range(S)}, -float(lengths[g]), EQ, f"blocks_{g}"))
    for s, c in enumerate(cells):
        prob.rows.append(({ns: 1.0 for ns in n[s]}, -float(v), GE, f"nonempty_{s}"))
        times = []
        if cc.stages[s].options:
            states, fetch, (exposed, edge), (tail, tail_const) = _state_terms(prob, cc, s, c, n[s])
            compute = _add_stage_rows(prob, cc, s, c, n[s], choices, states)
            busy = {**compute}
            for var, a in exposed.items():
                busy[var] = busy.get(var, 0.0) + a
            times += [(busy, edge + c.p2p), (fetch[0], c.p2p)]
            prob.rows.append(({**tail, x: -1.0}, tail_const, LE, f"tail_{s}"))
        else:
            times.append((_add_stage_rows(prob, cc, s, c, n[s], choices), c.p2p))
        for i, (form, const) in enumerate(times):
            prob.rows.append(({**form, t: -1.0}, const, LE, f"time_{s}_{i}"))
            if v > 1:
                prob.rows.append(({**form, tc: -float(v)}, const, LE, f"chunks_{s}_{i}"))
        if v == 1:
            continue
        # the largest chunk's blocks each pay their compute and the least exposed time over the options,
        # the chunk its edge once (chunk_busy_s)
        opts = cc.stages[s].options
        least = [min((c.seg_exposed[o][g] for o in opts), default=0.0) for g in range(G)]
        edge_least = min((c.edge[o] for o in opts), default=0.0)
        for g in range(G):
            if lengths[g] > 1 and c.seg_time[g] > 0:
                u = prob.var(f"u_{s}_{g}", 0.0, float(lengths[g]), "Integer")
                prob.rows.append(({n[s][g]: 1.0, u: -float(v)}, 0.0, LE, f"largest_chunk_{s}_{g}"))
                prob.rows.append(({u: c.seg_time[g] + least[g], tc: -1.0}, min(c.chunk_p2p) + edge_least, LE,
                                  f"chunk_{s}_{g}"))
    if cutoff is not None:
        # the MIP's optimum is at least its linear relaxation's: where that reaches the cutoff, so does the
        # MIP, whose answer would be the cutoff (below). The LP costs a third of the MIP's run on Llama-70B
        # on four GPU types and settles 220 of its 373 questions (docs/benchmarks.md, session 15)
        status, objective, _ = _solve_highs(prob, None, None, relaxed=True)
        if status == "infeasible" or (status == "optimal" and objective >= cutoff * (1 + LP_REACH_MARGIN)):
            return cutoff
    status, objective, _ = _solve_highs(prob, INTEGER_NODE_LIMIT, cutoff, first_solution=cutoff is not None)
    if cutoff is not None and (status in ("cutoff", "infeasible") or (status == "optimal" and objective >= cutoff)):
        # HiGHS may end "optimal" on a solution at or above the cutoff: it searched the whole tree and
        # found nothing below it, so the optimum is at least the cutoff (its objective is not a bound)
        return cutoff
    if status == "infeasible" or not math.isfinite(prob.dual_bound) or prob.dual_bound <= 0:
        return None
    return prob.dual_bound * (1 - LP_SAFETY)
