"""``solver="exhaustive"``: enumerate the same inner space as the ILP and cost every point with the same
functions (:func:`whalepy.planner.costing.evaluate_stage`).

For one outer candidate it walks every contiguous partition of the blocks into virtual stages, and per
stage every split of each chunk's blocks per segment into checkpointed, activation-offloaded and
plain ones, and every state option or granular-tier mix of one family (one-chunk stages). The objective ``M max_s T_s + (S - 1) max_s Tc_s + max_s X_s`` is
monotone in each stage's ``(T_s, Tc_s, X_s)``, and host memory and NVMe are the node's (a sum over its
ranks' stages), so per stage only the choices Pareto-optimal in ``(T_s, Tc_s, X_s, host bytes, NVMe
bytes)`` are kept and combined stage by stage (keeping each stage's bytes), and a combination counts
only where every node holds them (:func:`~whalepy.planner.costing.node_fits`), which is exact. Meant
for small instances (tests of the ILP); :data:`MAX_PARTITIONS` bounds the work.

It is exhaustive over one candidate's inner space only: as ``solver="exhaustive"`` it runs inside the
outer search, which prunes candidates by their lower bound like it does for the ILP. The check of the
whole search against enumeration without any pruning is ``tests/planner_bruteforce.py``.
"""

from __future__ import annotations

import itertools
import math
import time

from whalepy.errors import PlanError
from whalepy.planner.costing import (
    CandidateCoeffs,
    chunk_counts_from_sizes,
    evaluate,
    evaluate_stage,
    node_fits,
    stage_checkpoint_offloadable,
    stage_offloadable,
    step_time,
)
from whalepy.planner.ilp import ILPResult
from whalepy.planner.space import MAX_OPTIONS_PER_STAGE

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


def _pareto(points: list[tuple]) -> list[tuple]:  # type: ignore[type-arg]
    """Points no other point beats or ties on all of their numbers (every entry but the last)."""
    points.sort(key=lambda p: p[:-1])
    out: list[tuple] = []  # type: ignore[type-arg]
    for p in points:
        if not any(all(a <= b + 1e-15 for a, b in zip(q[:-1], p[:-1])) for q in out):
            out.append(p)
    return out


def _splits(n: int, ckpt: bool, off: bool):  # type: ignore[no-untyped-def]
    """``(checkpointed, offloaded)`` counts of ``n`` blocks."""
    for c in range(n + 1 if ckpt else 1):
        for o in range(n - c + 1 if off else 1):
            yield c, o


def _parts(n: int, r: int):  # type: ignore[no-untyped-def]
    """Every way to hand ``n`` identical blocks to ``r`` options in order (compositions, zeros allowed)."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), r - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(r))


def _mixes(sc, counts: tuple[int, ...]) -> list:  # type: ignore[no-untyped-def, type-arg]
    """Every granular-tier mix of a one-chunk stage with ``counts`` blocks per segment: 2 to
    :data:`MAX_OPTIONS_PER_STAGE` options of one family, each with at least one block."""
    out = []
    for fam in sc.families:
        for r in range(2, min(MAX_OPTIONS_PER_STAGE, len(fam)) + 1):
            for opts in itertools.combinations(fam, r):
                for split in itertools.product(*(list(_parts(n, r)) for n in counts)):
                    per = [tuple(split[g][i] for g in range(len(counts))) for i in range(r)]
                    if (all(any(p) for p in per) and not all(o.beside_offload for o in opts)
                            and sum(1 for p in per if any(p[g] for g in sc.tied_segments)) <= 1):
                        out.append(tuple(zip(opts, per)))
    return out


def _ckoff_choices(rows: list[list[int]], ok: set[int]):  # type: ignore[no-untyped-def]
    """Every count of checkpointed blocks per segment of each chunk whose input is in host memory (at most
    the checkpointed ones, only on segments in ``ok``), none first."""
    ranges = [range(k + 1) if g in ok else range(1) for row in rows for g, k in enumerate(row)]
    G = len(rows[0])
    for flat in itertools.product(*ranges):
        yield [list(flat[i * G:(i + 1) * G]) for i in range(len(rows))]


def solve_exhaustive(cc: CandidateCoeffs, *, allowed_stages: dict[int, tuple[int, int]],
                     allow_checkpointing: bool, allow_activation_offload: bool = True,
                     allow_checkpoint_offload: bool = True) -> ILPResult:
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
            G = len(chunks[0])
            off_ok = set(stage_offloadable(sc)) if allow_activation_offload else set()
            ck_ok = set(stage_checkpoint_offloadable(sc)) if allow_checkpoint_offload else set()
            ranges = [list(_splits(n, allow_checkpointing, g in off_ok)) for row in chunks for g, n in enumerate(row)]
            choices = [o for o in sc.options if not o.beside_offload] + (_mixes(sc, chunks[0]) if len(chunks) == 1 else [])
            for split in itertools.product(*ranges):
                rows = [[split[k * G + g][0] for g in range(G)] for k in range(len(chunks))]
                offs = [[split[k * G + g][1] for g in range(G)] for k in range(len(chunks))]
                for o in choices:
                    for ckoffs in _ckoff_choices(rows, ck_ok):
                        ev = evaluate_stage(sc, chunks, rows, o, dp=cand.dp, chunk_offs=offs, chunk_ckoffs=ckoffs)
                        if ev.fits:
                            c0 = ev.cells[0]
                            pts.append((ev.time_s, ev.chunk_time_s, ev.tail_s, c0.cpu_bytes if cc.nodes else 0.0,
                                        c0.nvme_bytes if cc.nodes else 0.0, (rows, o, offs, ckoffs)))
                            if not any(map(any, ckoffs)):
                                # the inputs fit on the device: putting some in host memory only adds
                                # copies and host bytes (every other term is the same), so it is dominated
                                break
            stage_cache[key] = _pareto(pts)
        return stage_cache[key]

    for sizes in _compositions(N, J):
        starts = list(itertools.accumulate((0, *sizes[:-1])))
        if any(not _ok(i, starts, sizes, allowed_stages) for i in allowed_stages):
            continue
        cc_rows = chunk_counts_from_sizes(cc, sizes)
        # (T, Tc, X, host and NVMe bytes per rank of each stage so far, choices)
        combined: list = [(0.0, 0.0, 0.0, ())]  # type: ignore[type-arg]
        for s in range(S):
            f = front(s, tuple(tuple(cc_rows[s + k * S]) for k in range(v)))
            if not f:
                combined = []
                break
            combined = _pareto([(max(a[0], b[0]), max(a[1], b[1]), max(a[2], b[2]), *a[3:-1], b[3], b[4],
                                 a[-1] + (b[-1],)) for a in combined for b in f])
        for pt in combined:
            if cc.nodes and not node_fits(cc, [pt[3 + 2 * s] for s in range(S)], [pt[4 + 2 * s] for s in range(S)]):
                continue
            obj = step_time(cc, pt[0], pt[1], pt[2])
            if obj < best[0]:
                best = (obj, (sizes, pt[-1]))
    elapsed = time.perf_counter() - t0
    if best[1] is None:
        return ILPResult("infeasible", None, math.inf, 0.0, elapsed, 0, 0)
    sizes, choice = best[1]
    ckpts: list[list[int]] = [[] for _ in range(J)]
    offs: list[list[int]] = [[] for _ in range(J)]
    ckoffs: list[list[int]] = [[] for _ in range(J)]
    for s, (rows, _, orows, wrows) in enumerate(choice):
        for k, row in enumerate(rows):
            ckpts[s + k * S] = row
            offs[s + k * S] = orows[k]
            ckoffs[s + k * S] = wrows[k]
    ev = evaluate(cc, sizes, ckpts, [c[1] for c in choice], offs, ckoffs)
    return ILPResult("optimal", ev, best[0], 0.0, elapsed, 0, 0)


def _ok(i: int, starts: list[int], sizes: tuple[int, ...], allowed: dict[int, tuple[int, int]]) -> bool:
    lo, hi = allowed[i]
    j = max(k for k, st in enumerate(starts) if st <= i)
    return lo <= j <= hi
