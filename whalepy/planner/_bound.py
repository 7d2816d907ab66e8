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

from whalepy.planner._solvers import EQ, LE, _Model, _solve_highs, _Var
from whalepy.planner.costing import CandidateCoeffs, CellCoeffs

GIB = float(2**30)

LP_TIME_LIMIT_S = 10.0
"""A ceiling for the bound's LP (a few dozen columns, solved in milliseconds): never reached in practice."""
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


def relaxed_stage_time(cc: CandidateCoeffs, cells: Sequence[CellCoeffs]) -> float | None:
    """The LP optimum for one pipeline (``cells[s]``: its cell of stage ``s``), or None where memory does not
    bind or the LP says nothing (infeasible: then the ILP finds that no plan fits)."""
    if not _memory_binds(cc, cells):
        return None
    S, G, v = len(cells), len(cc.segments), cc.candidate.virtual_stages
    lengths = [seg.length for seg in cc.segments]
    prob = _Model()

    def col(name: str, ub: float | None = None) -> _Var:
        return prob.var(name, 0.0, ub, "Continuous")

    t = col("t")
    prob.objective = {t: 1.0}
    n = [[col(f"n_{s}_{g}", float(lengths[g])) for g in range(G)] for s in range(S)]
    for g in range(G):
        prob.rows.append(({n[s][g]: 1.0 for s in range(S)}, -float(lengths[g]), EQ, f"blocks_{g}"))
    for s, c in enumerate(cells):
        k = c.inflight / v / GIB
        time_row: dict[_Var, float] = {t: -1.0}
        mem_row: dict[_Var, float] = {}
        host_row: dict[_Var, float] = {}
        for g in range(G):
            time_row[n[s][g]] = c.seg_time[g]
            mem_row[n[s][g]] = k * c.seg_saved[g]
            ck = col(f"c_{s}_{g}")
            within = {ck: 1.0, n[s][g]: -1.0}  # c <= n (o joins below)
            time_row[ck] = c.seg_recompute[g]
            mem_row[ck] = k * (c.seg_input[g] - c.seg_saved[g])
            if c.seg_offload is not None and c.seg_host is not None and c.seg_saved[g] > 0:
                o = col(f"o_{s}_{g}")
                within[o] = 1.0  # c + o <= n
                time_row[o] = c.seg_offload[g]
                mem_row[o] = -k * c.seg_saved[g]
                host_row[o] = c.seg_host[g] / GIB
            prob.rows.append((within, 0.0, LE, f"within_{s}_{g}"))
            if c.seg_ckoff is not None and c.seg_ckhost is not None and c.seg_input[g] > 0:
                w = col(f"w_{s}_{g}")
                prob.rows.append(({w: 1.0, ck: -1.0}, 0.0, LE, f"ckoff_{s}_{g}"))  # w <= c
                time_row[w] = c.seg_ckoff[g]
                mem_row[w] = -k * c.seg_input[g]
                host_row[w] = c.seg_ckhost[g] / GIB
        prob.rows.append((time_row, 0.0, LE, f"time_{s}"))
        prob.rows.append((mem_row, -(c.capacity * (1 + 1e-6) - c.loss_bytes) / GIB, LE, f"memory_{s}"))
        host = _host_capacity(cc, s)
        if host_row and host < math.inf:
            prob.rows.append((host_row, -host / GIB, LE, f"host_{s}"))
    status, objective, _ = _solve_highs(prob, LP_TIME_LIMIT_S, None)
    if status != "optimal":
        return None
    return objective * (1 - LP_SAFETY)
