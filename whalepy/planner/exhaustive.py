"""``solver="exhaustive"``: enumerate the same inner space as the ILP and cost every point with the same
functions (:func:`whalepy.planner.costing.evaluate_stage`).

For one outer candidate it walks every contiguous partition of the blocks into virtual stages, and per
stage every checkpoint count per segment of each chunk and every state option. The objective
``M max_s T_s + (S - 1) max_s Tc_s + max_s X_s`` is monotone in each stage's ``(T_s, Tc_s, X_s)``, so
per stage only the Pareto-optimal feasible choices are kept and combined stage by stage, which is exact. Meant for small
instances (tests of the ILP); :data:`MAX_PARTITIONS` bounds the work.

It is exhaustive over one candidate's inner space only: as ``solver="exhaustive"`` it runs inside the
outer search, which prunes candidates by their lower bound like it does for the ILP. The check of the
whole search against enumeration without any pruning is ``tests/planner_bruteforce.py``.
"""

from __future__ import annotations

import itertools
import math
import time

from whalepy._errors import PlanError
from whalepy.planner.costing import CandidateCoeffs, chunk_counts_from_sizes, evaluate, evaluate_stage, step_time
from whalepy.planner.ilp import ILPResult

MAX_PARTITIONS = 20000
"""Most block partitions one candidate may have for the exhaustive solver."""
MAX_BLOCKS = 16
"""Most blocks a model may have for the exhaustive solver."""


def check_size(num_blocks: int, num_virtual: int) -> None:
    n = math.comb(num_blocks - 1, num_virtual - 1) if num_virtual <= num_blocks else 0
    if num_blocks > MAX_BLOCKS or n > MAX_PARTITIONS:
        raise PlanError(
            f"solver='exhaustive' is for small instances (at most {MAX_BLOCKS} blocks and "
            f"{MAX_PARTITIONS} partitions per candidate); this one has {num_blocks} blocks and "
            f"{n} partitions into {num_virtual} stages. Use solver='highs' (the default).")


def _compositions(n: int, k: int):  # type: ignore[no-untyped-def]
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def _pareto(points: list[tuple[float, float, float, object]]) -> list[tuple[float, float, float, object]]:
    """Points no other point beats or ties on all of ``(T, Tc, X)``."""
    points.sort(key=lambda p: (p[0], p[1], p[2]))
    out: list[tuple[float, float, float, object]] = []
    for p in points:
        if not any(q[0] <= p[0] + 1e-15 and q[1] <= p[1] + 1e-15 and q[2] <= p[2] + 1e-15 for q in out):
            out.append(p)
    return out


def solve_exhaustive(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]],
                     allow_checkpointing: bool) -> ILPResult:
    t0 = time.perf_counter()
    cand = cc.candidate
    J, N, S, v = cand.num_virtual, cc.num_blocks, cand.num_stages, cand.virtual_stages
    check_size(N, J)
    stage_cache: dict[tuple[int, tuple[tuple[int, ...], ...]], list] = {}
    best = (math.inf, None)

    def front(s: int, chunks: tuple[tuple[int, ...], ...]) -> list:  # type: ignore[type-arg]
        key = (s, chunks)
        if key not in stage_cache:
            sc = cc.stages[s]
            pts = []
            flat = [n for row in chunks for n in row]
            ranges = [range(n + 1) if allow_checkpointing else range(1) for n in flat]
            G = len(chunks[0])
            for ck in itertools.product(*ranges):
                rows = [list(ck[k * G:(k + 1) * G]) for k in range(len(chunks))]
                for o in sc.options:
                    ev = evaluate_stage(sc, chunks, rows, o, dp=cand.dp)
                    if ev.fits:
                        pts.append((ev.time_s, ev.chunk_time_s, ev.tail_s, (rows, o)))
            stage_cache[key] = _pareto(pts)
        return stage_cache[key]

    for sizes in _compositions(N, J):
        starts = list(itertools.accumulate((0, *sizes[:-1])))
        if any(not _ok(i, starts, sizes, allowed_stages) for i in allowed_stages):
            continue
        cc_rows = chunk_counts_from_sizes(cc, sizes)
        combined = [(0.0, 0.0, 0.0, ())]
        for s in range(S):
            f = front(s, tuple(tuple(cc_rows[s + k * S]) for k in range(v)))
            if not f:
                combined = []
                break
            combined = _pareto([(max(a, b), max(ac, bc), max(x, y), ch + (c,))
                                for a, ac, x, ch in combined for b, bc, y, c in f])
        for T, Tc, X, choice in combined:
            obj = step_time(cc, T, Tc, X)
            if obj < best[0]:
                best = (obj, (sizes, choice))
    elapsed = time.perf_counter() - t0
    if best[1] is None:
        return ILPResult("infeasible", None, math.inf, 0.0, elapsed, 0, 0)
    sizes, choice = best[1]
    ckpts: list[list[int]] = [[] for _ in range(J)]
    for s, (rows, _) in enumerate(choice):
        for k, row in enumerate(rows):
            ckpts[s + k * S] = row
    ev = evaluate(cc, sizes, ckpts, [c[1] for c in choice])
    return ILPResult("optimal", ev, best[0], 0.0, elapsed, 0, 0)


def _ok(i: int, starts: list[int], sizes: tuple[int, ...], allowed: dict[int, tuple[int, int]]) -> bool:
    lo, hi = allowed[i]
    j = max(k for k, st in enumerate(starts) if st <= i)
    return lo <= j <= hi
