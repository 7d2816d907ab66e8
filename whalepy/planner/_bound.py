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

from whalepy.planner.costing import CandidateCoeffs, CellCoeffs

GIB = float(2**30)

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
    import highspy
    import numpy as np

    S, G, v = len(cells), len(cc.segments), cc.candidate.virtual_stages
    lengths = [seg.length for seg in cc.segments]
    cols_cost: list[float] = []
    cols_ub: list[float] = []
    rows: list[tuple[float, float, list[tuple[int, float]]]] = []  # (lo, hi, [(col, coef)])
    inf = highspy.kHighsInf

    def col(ub: float = inf) -> int:
        cols_cost.append(0.0)
        cols_ub.append(ub)
        return len(cols_cost) - 1

    t = col()
    cols_cost[t] = 1.0
    n = [[col(float(lengths[g])) for g in range(G)] for _ in range(S)]
    for g in range(G):
        rows.append((float(lengths[g]), float(lengths[g]), [(n[s][g], 1.0) for s in range(S)]))
    for s, c in enumerate(cells):
        k = c.inflight / v / GIB
        time_row: list[tuple[int, float]] = [(t, -1.0)]
        mem_row: list[tuple[int, float]] = []
        host_row: list[tuple[int, float]] = []
        for g in range(G):
            time_row.append((n[s][g], c.seg_time[g]))
            mem_row.append((n[s][g], k * c.seg_saved[g]))
            ck = col()
            rows.append((-inf, 0.0, [(ck, 1.0), (n[s][g], -1.0)]))  # c <= n (o joins below)
            time_row.append((ck, c.seg_recompute[g]))
            mem_row.append((ck, k * (c.seg_input[g] - c.seg_saved[g])))
            if c.seg_offload is not None and c.seg_host is not None and c.seg_saved[g] > 0:
                o = col()
                rows[-1][2].append((o, 1.0))  # c + o <= n
                time_row.append((o, c.seg_offload[g]))
                mem_row.append((o, -k * c.seg_saved[g]))
                host_row.append((o, c.seg_host[g] / GIB))
            if c.seg_ckoff is not None and c.seg_ckhost is not None and c.seg_input[g] > 0:
                w = col()
                rows.append((-inf, 0.0, [(w, 1.0), (ck, -1.0)]))  # w <= c
                time_row.append((w, c.seg_ckoff[g]))
                mem_row.append((w, -k * c.seg_input[g]))
                host_row.append((w, c.seg_ckhost[g] / GIB))
        rows.append((-inf, 0.0, time_row))
        rows.append((-inf, (c.capacity * (1 + 1e-6) - c.loss_bytes) / GIB, mem_row))
        host = _host_capacity(cc, s)
        if host_row and host < math.inf:
            rows.append((-inf, host / GIB, host_row))
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    nc = len(cols_cost)
    h.addCols(nc, np.array(cols_cost), np.zeros(nc), np.array(cols_ub), 0, np.zeros(0, dtype=np.int32),
              np.zeros(0, dtype=np.int32), np.zeros(0))
    starts, idx, val = [], [], []
    for _lo, _hi, terms in rows:
        starts.append(len(idx))
        for j, a in terms:
            if a != 0.0:
                idx.append(j)
                val.append(a)
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), len(idx),
              np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(val, dtype=float))
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return h.getInfo().objective_function_value * (1 - LP_SAFETY)
