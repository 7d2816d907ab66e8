"""``solver="exhaustive"``: enumerate the same inner space as the ILP and cost every point with the same
functions (:func:`whalepy.planner.costing.evaluate_stage`).

For one outer candidate it walks every contiguous partition of the blocks into virtual stages, and per
stage every checkpoint count per segment and every state option. The objective
``beta * max_s T_s + max_s X_s`` is monotone in each stage's ``(T_s, X_s)``, so per stage only the
Pareto-optimal feasible choices are kept and combined stage by stage, which is exact. Meant for small
instances (tests of the ILP); :data:`MAX_PARTITIONS` bounds the work.
"""

from __future__ import annotations

import itertools
import math
import time

from whalepy._errors import PlanError
from whalepy.planner.costing import CandidateCoeffs, counts_from_boundaries, evaluate, evaluate_stage
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


def _pareto(points: list[tuple[float, float, object]]) -> list[tuple[float, float, object]]:
    points.sort(key=lambda p: (p[0], p[1]))
    out, best_x = [], math.inf
    for p in points:
        if p[1] < best_x - 1e-15:
            out.append(p)
            best_x = p[1]
    return out


def solve_exhaustive(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]],
                     allow_checkpointing: bool) -> ILPResult:
    t0 = time.perf_counter()
    cand = cc.candidate
    J, N = cand.num_virtual, cc.num_blocks
    check_size(N, J)
    stage_cache: dict[tuple[int, tuple[int, ...]], list] = {}
    best = (math.inf, None)

    def front(s: int, counts: tuple[int, ...]) -> list:  # type: ignore[type-arg]
        key = (s, counts)
        if key not in stage_cache:
            sc = cc.stages[s]
            pts = []
            ranges = [range(n + 1) if allow_checkpointing else range(1) for n in counts]
            for ck in itertools.product(*ranges):
                for o in sc.options:
                    ev = evaluate_stage(sc, counts, ck, o, virtual_stages=cand.virtual_stages, dp=cand.dp)
                    if ev.fits:
                        pts.append((ev.time_s, ev.tail_s, (ck, o)))
            stage_cache[key] = _pareto(pts)
        return stage_cache[key]

    for sizes in _compositions(N, J):
        starts = list(itertools.accumulate((0, *sizes[:-1])))
        if any(not _ok(i, starts, sizes, allowed_stages) for i in allowed_stages):
            continue
        counts = counts_from_boundaries(cc, sizes)
        combined = [(0.0, 0.0, ())]
        for s in range(cand.num_stages):
            f = front(s, tuple(counts[s]))
            if not f:
                combined = []
                break
            combined = _pareto([(max(a, b), max(x, y), ch + (c,)) for a, x, ch in combined for b, y, c in f])
        for T, X, choice in combined:
            obj = cc.bubble * T + X
            if obj < best[0]:
                best = (obj, (sizes, choice))
    elapsed = time.perf_counter() - t0
    if best[1] is None:
        return ILPResult("infeasible", None, math.inf, 0.0, elapsed, 0, 0)
    sizes, choice = best[1]
    ev = evaluate(cc, sizes, [list(c[0]) for c in choice], [c[1] for c in choice])
    return ILPResult("optimal", ev, best[0], 0.0, elapsed, 0, 0)


def _ok(i: int, starts: list[int], sizes: tuple[int, ...], allowed: dict[int, tuple[int, int]]) -> bool:
    lo, hi = allowed[i]
    j = max(k for k, st in enumerate(starts) if st <= i)
    return lo <= j <= hi
