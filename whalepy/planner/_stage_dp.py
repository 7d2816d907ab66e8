"""A step-time bound with whole blocks, whole checkpoints and one state option per stage, without
branching (issue 26): a table per stage of the least it can add to the step for each number of blocks
per segment it may run, combined by a dynamic program over the stages.

For a pipeline of the candidate (``cells[s]``: its cell of stage ``s``), the step is ``t T + tc Tc + x X``
with ``T``, ``Tc``, ``X`` the largest over the stages of their time per micro-batch, chunk time and tail
(:class:`~whalepy.planner.space.StepForm`, all weights non-negative), so it is at least ``max_s A_s +
max_s x X_s`` with ``A_s = t T_s + tc Tc_s``. For each stage, each vector ``n`` of blocks per segment
and each way of keeping its states, :func:`_floor` gives a pair ``(A, X)`` at most ``(A_s, x X_s)`` of
every plan that gives the stage those blocks that way, whatever its chunks, checkpoints and host
copies (the pairs of a stage's ways, less those another beats in both). The dynamic program runs over
the stages with, per number of blocks given so far, the pairs (largest ``A``, largest ``X``) no other
beats in both; the least ``A + X`` over the pairs that give every block, ``min over (n_0 .. n_S-1 with
sum_s n_s = L) of max_s A + max_s X``, is a bound of every plan. The model's first block is on the
first stage and its last on the last; otherwise the stages' blocks need not be contiguous here (a
relaxation). Where a stage cannot hold ``n`` at all, it has no pair.

The floor of one stage, read off :func:`~whalepy.planner._evaluation.evaluate_stage`'s terms, each
dropped term non-negative:

- one state option per stage (interleaved stages, or options outside every family); a mix of one
  family's options (:attr:`StageCoeffs.families`) is priced with the least of the family's
  coefficients, term by term (every mix of the family, and each of its options alone, costs at least
  that); tied weights' copies and their all-reduce are dropped;
- device memory: ``states - freed + buffers - working_grad + act <= capacity`` (the loss's backward:
  :attr:`StageCoeffs.working_grad` not yet allocated; the first block's backward is dropped) and
  ``states + buffers <= capacity``, with ``act = inflight *
  max_k kept_k + peak + loss``: every chunk ``k`` of the stage (each split of ``n`` over its ``v``
  chunks is tried) keeps at most ``(room - peak) / inflight``, and where a chunk's blocks' saved
  activations exceed that, the least extra time per micro-batch that frees enough of them, in whole
  blocks: each checkpointed (frees ``saved - input``, costs its recompute), its activations copied to
  the host (frees ``saved``, costs the exposed copy) or checkpointed with its input on the host (frees
  ``saved``, costs both) (:func:`_frontier`, exact); ``peak`` is at least the smallest ``saved`` of a
  segment that could be freed where anything is; host memory is not limited (a relaxation);
- ``T_s >= max(compute + exposed, fetch) + p2p`` and, ``v > 1``, ``Tc_s >= max_k max(busy_k, fetch /
  v) + min_k p2p_k`` with each chunk's busy time its blocks', its exposed communication, its recompute
  and copies and its first block's gathers; ``X_s >=`` the per-block and last-block reductions, the
  post-step all-gather and the optimizer step (its part hidden behind the last backward dropped).

With a cutoff (what the search asks: does the bound reach the incumbent less the MIP gap?), pairs at or
above it are dropped, and each stage's floor is first bounded by its linear relaxation (fractional
blocks freed, one chunk of the mean: :func:`_relaxed_floor`, non-decreasing in every ``n_g``), so the
tables skip every ``n`` above one already at the cutoff and price whole blocks only below it. Below
the cutoff the answer is exact, so it serves every lower cutoff too (:data:`_ASKED`), and so does each
stage's table (:data:`_TABLES`, kept across calls: the orders of the GPU groups repeat stages). Where the vectors
are too many to tabulate (:data:`MAX_STATES`), or a chunk's choices too many to list, nothing is said
(None). ``tests/test_planner_stage_dp.py`` checks the bound against the best plan of random candidates
(brute force), with and without a cutoff.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterator, Sequence
from itertools import product

from whalepy.planner._bound import ALL_CHOICES, Choices
from whalepy.planner._coeffs import CandidateCoeffs, CellCoeffs, StageCoeffs

MAX_STATES = 20_000
"""Most blocks-per-segment vectors the dynamic program tabulates (the product of ``L_g + 1`` over the
segments); above it the bound is not computed (a model with many distinct segments)."""

MAX_CHOICES = 4_000
"""Most ways of freeing one segment's blocks of one chunk that :func:`_frontier` lists (three kinds of
freed block and many blocks); above it the bound is not computed."""

SAFETY = 1e-7
"""Share the bound is lowered by, as the LP's (:data:`~whalepy.planner._bound.LP_SAFETY`): sums in
another order than the evaluation's round differently."""


class _Priced:
    """One way of keeping a stage's states, as the floor reads it: one option, or the least of a
    family's coefficients (per parameter, per block, per stage)."""

    __slots__ = ("device", "net", "buffer", "working", "working_loss", "saved", "exposed", "edge", "fetch", "tail", "tail_edge",
                 "tail_beta", "sync_alpha", "moves", "steps", "peak_min")

    def __init__(self, sc: StageCoeffs, c: CellCoeffs, members: Sequence, dp: int, choices: Choices) -> None:  # type: ignore[type-arg]
        G = len(sc.seg_params)
        freed_any = any(sc.grads_freed[o] for o in members)
        self.device = min(sc.mem_beta[o] + sc.buffer_beta[o] for o in members)  # states + buffers, per param
        self.net = min(sc.mem_beta[o] - (sc.state_split[o][1] if freed_any else 0.0) for o in members)
        self.buffer = min(sc.buffer_beta[o] for o in members)
        self.working = min(sc.working_bytes[o] for o in members)
        # at the loss's backward (the activation peak) FSDP2's gradient buffer of the running block is not
        # allocated yet (StageCoeffs.working_grad); the first block's backward, with it, is not required
        # here (dropping a constraint keeps the floor a floor)
        self.working_loss = min(sc.working_bytes[o] - sc.working_grad.get(o, 0.0) for o in members)
        self.saved = [min(c.seg_saved[g] + c.seg_amp_saved[o][g] for o in members) for g in range(G)]
        self.exposed = [min(c.seg_exposed[o][g] for o in members) for g in range(G)]
        self.edge = min(c.edge[o] for o in members)
        self.fetch = min(c.fetch_beta[o] for o in members)
        self.tail = [min(c.seg_tail[o][g] for o in members) for g in range(G)]
        self.tail_edge = min(c.tail_edge[o] for o in members)
        self.tail_beta = (min(c.opt_beta[o] for o in members)
                          + (min(sc.sync[o][1] for o in members) if dp > 1 else 0.0))
        self.sync_alpha = min(sc.sync[o][0] for o in members) if dp > 1 else 0.0
        self.moves = [tuple(_moves(c, g, self.saved[g], choices)) for g in range(G)]
        self.steps = _hull_steps(self.moves)
        self.peak_min = min((self.saved[g] for g in range(G) if self.moves[g]), default=0.0)


def _moves(c: CellCoeffs, g: int, a: float, choices: Choices) -> list[tuple[float, float]]:
    """``(bytes freed, extra seconds per micro-batch)`` of one block of segment ``g`` kept otherwise
    than whole on the device (``a``: its saved bytes): checkpointed, activations on the host,
    checkpointed with its input on the host (those ``choices`` allows, as the ILP's columns)."""
    out = []
    i = c.seg_input[g]
    if choices.checkpointing and a - i > 0:
        out.append((a - i, c.seg_recompute[g]))
    if choices.activation_offload and c.seg_offload is not None and c.seg_host is not None and c.seg_saved[g] > 0:
        out.append((a, c.seg_offload[g]))
    if (choices.checkpointing and choices.checkpoint_offload and c.seg_ckoff is not None
            and c.seg_ckhost is not None and c.seg_input[g] > 0):
        out.append((a, c.seg_recompute[g] + c.seg_ckoff[g]))
    return out


def _hull_steps(moves: list[list[tuple[float, float]]]) -> list[tuple[float, float, int]]:
    """``(seconds per byte, bytes per block, segment)``: the lower convex hull of a block's moves (bytes
    freed against seconds, from (0, 0)), per segment, as increments of rising cost per byte, sorted
    across segments: the cheapest fractional freeing, taken greedily."""
    out = []
    for g, points in enumerate(moves):
        at, cost = 0.0, 0.0
        while True:
            best = None
            for f, x in points:
                if f > at * (1 + 1e-12):
                    slope = (x - cost) / (f - at)
                    if best is None or slope < best[0] or (slope == best[0] and f > best[1]):
                        best = (slope, f, x)
            if best is None:
                break
            out.append((max(best[0], 0.0), best[1] - at, g))
            at, cost = best[1], best[2]
    out.sort(key=lambda s: s[0])
    return out


def _pareto(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The points no other frees as much for less, by bytes freed rising (and so seconds rising)."""
    points.sort(key=lambda p: (-p[0], p[1]))
    freed, cost = [], []
    low = math.inf
    for f, x in points:
        if x < low:
            freed.append(f)
            cost.append(x)
            low = x
    return freed[::-1], cost[::-1]


@functools.lru_cache(maxsize=4096)
def _segment_frontier(moves: tuple[tuple[float, float], ...], m: int) -> tuple[tuple[float, float], ...] | None:
    """Every way of freeing ``m`` blocks of one segment (how many take each move), Pareto-filtered."""
    k = len(moves)
    if math.comb(m + k, k) > MAX_CHOICES:
        return None
    pts = []
    for counts in product(range(m + 1), repeat=k):
        if sum(counts) <= m:
            pts.append((sum(n * f for n, (f, _) in zip(counts, moves)), sum(n * x for n, (_, x) in zip(counts, moves))))
    freed, cost = _pareto(pts)
    return tuple(zip(freed, cost))


def _frontier(w: _Priced, m: tuple[int, ...], memo: dict) -> tuple[list[float], list[float]] | None:  # type: ignore[type-arg]
    """The least extra seconds per micro-batch of freeing at least so many bytes of a chunk with ``m``
    blocks per segment, in whole blocks: ``(bytes, seconds)`` rising together, exact."""
    key = (id(w), m)
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    acc = [(0.0, 0.0)]
    out = None
    for g, k in enumerate(m):
        if k == 0 or not w.moves[g]:
            continue
        seg = _segment_frontier(w.moves[g], k)
        if seg is None:
            break
        if len(acc) == 1 and acc[0] == (0.0, 0.0):  # the first segment freed: its frontier as it is
            acc = list(seg)
            continue
        freed, cost = _pareto([(f1 + f2, x1 + x2) for f1, x1 in acc for f2, x2 in seg])
        acc = list(zip(freed, cost))
    else:
        out = ([f for f, _ in acc], [x for _, x in acc])
    memo[key] = out
    return out


def _fixed(n: Sequence[int], c: CellCoeffs, sc: StageCoeffs, w: _Priced):  # type: ignore[no-untyped-def]
    """What the stage's option fixes for blocks ``n``: ``(params, room for activations, X)``; None
    where the states alone do not fit."""
    pl = sum(k * p for k, p in zip(n, sc.seg_params))
    cap = c.capacity * (1 + 1e-6)
    if w.device * pl + w.working > cap:
        return None
    room = cap - (w.net * pl + w.buffer * pl + w.working_loss + c.loss_bytes)
    if room < 0:
        return None
    X = (sum(k * x for k, x in zip(n, w.tail)) + w.tail_edge + w.tail_beta * pl
         + (w.sync_alpha if pl > 0 else 0.0))
    return pl, room, X


def _relaxed_floor(n: Sequence[int], c: CellCoeffs, sc: StageCoeffs, ways: list[_Priced], v: int,
                   form) -> float:  # type: ignore[no-untyped-def]
    """At most every ``A + X`` of :func:`_floor`: blocks freed in fractions, the chunks' activations as
    their mean, the chunk time from the stage's; non-decreasing in every ``n[g]`` (a further block needs
    at most its own bytes freed and adds to every other term)."""
    base = sum(k * x for k, x in zip(n, c.seg_time))
    p2p_min = min(c.chunk_p2p) if v > 1 and c.chunk_p2p else c.p2p
    best = math.inf
    for w in ways:
        fixed = _fixed(n, c, sc, w)
        if fixed is None:
            continue
        pl, room, X = fixed
        extra = 0.0
        if c.inflight > 0:
            need = sum(k * a for k, a in zip(n, w.saved)) - room * v / c.inflight
            for slope, per_block, g in w.steps:
                if need <= 0:
                    break
                take = min(need, n[g] * per_block)
                extra += slope * take
                need -= take
            if need > 1e-9 * room:
                continue  # no recompute or host copy makes the activations fit
        lead = max(base + extra + sum(k * e for k, e in zip(n, w.exposed)) + v * w.edge, w.fetch * pl)
        if v > 1:
            whole = max((math.ceil(k / v) * x for k, x in zip(n, c.seg_time) if k), default=0.0)
            Tc = max(lead / v, whole + w.edge) + p2p_min
        else:
            Tc = lead + c.p2p
        best = min(best, form.value(lead + c.p2p, Tc, X))
    return best


@functools.lru_cache(maxsize=8192)
def _splits(n: tuple[int, ...], v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Every split of ``n`` into ``v`` non-empty chunks, up to their order (the floor does not depend
    on it): chunks in non-increasing order; the most even first (the least chunk time comes early, and
    :func:`_floor` skips the splits that cannot beat it)."""
    return tuple(sorted((tuple(x) for x in _split_iter(n, v)), key=lambda ch: max(map(sum, ch))))


def _split_iter(n: tuple[int, ...], v: int) -> Iterator[list[tuple[int, ...]]]:
    if v == 1:
        if sum(n):
            yield [n]
        return
    for first in product(*(range(k + 1) for k in n)):
        rest = tuple(a - b for a, b in zip(n, first))
        if not sum(first) or first < rest:
            continue
        for tail in _split_iter(rest, v - 1):
            if tail[0] <= first:
                yield [first, *tail]


def _floor(n: tuple[int, ...], c: CellCoeffs, sc: StageCoeffs, ways: list[_Priced], v: int, form,  # type: ignore[no-untyped-def]
           memo: dict, limit: float) -> list[tuple[float, float]] | None:  # type: ignore[type-arg]
    """Per way of keeping the states, ``(A, X)``: the least ``t T_s + tc Tc_s`` (over the chunk splits,
    checkpoints and host copies) and ``x X_s`` of the stage running ``n`` (module docstring); those
    with ``A + X`` below ``limit``, Pareto-filtered. None where a chunk's choices are too many to list."""
    p2p_min = min(c.chunk_p2p) if v > 1 and c.chunk_p2p else c.p2p
    p2p, inflight, seg_time = c.p2p, c.inflight, c.seg_time
    ft, ftc = form.t, form.tc  # form.value(T, Tc, 0.0), spelled out: the hot loop of the bound
    out: list[tuple[float, float]] = []
    for w in ways:
        fixed = _fixed(n, c, sc, w)
        if fixed is None:
            continue
        pl, room, X = fixed
        X *= form.x
        fetch = w.fetch * pl
        # per chunk (its blocks per segment): its blocks' time, exposed communication and first
        # gathers, and its saved activations; the same chunks recur across the splits and vectors
        parts = memo.get((id(w), "chunk"))
        if parts is None:
            parts = memo[(id(w), "chunk")] = {}
        # the least over the splits, of those whose pair could be below the limit: a split is skipped
        # only where its cheap part already puts the pair at the limit (``cheap + X``, rounded as the
        # pair's sum is) or above a split's found, so the pairs kept are exactly those of the least A
        # below the limit, whatever the limit (what lets a table priced for one limit serve a lower one)
        best = math.inf
        for chunks in _splits(n, v):
            busy0, kept = [], []
            for m in chunks:
                part = parts.get(m)
                if part is None:
                    part = parts[m] = (sum(k * (x + e) for k, x, e in zip(m, seg_time, w.exposed)) + w.edge,
                                       sum(k * a for k, a in zip(m, w.saved)))
                busy0.append(part[0])
                kept.append(part[1])
            lead0 = max(sum(busy0), fetch)
            cheap = ft * (lead0 + p2p) + ftc * ((max(max(busy0), fetch / v) + p2p_min) if v > 1 else lead0 + p2p)
            if cheap >= best or cheap + X >= limit:
                continue
            busy = busy0
            if inflight > 0 and max(kept) * inflight > room * (1 + 1e-9):
                # something is freed: the recomputed (or fetched back) block's bytes are at the peak
                allowed = (room - w.peak_min) / inflight
                busy = list(busy0)
                for k, m in enumerate(chunks):
                    need = kept[k] - allowed
                    if need <= 1e-9 * room:
                        continue
                    front = _frontier(w, m, memo)
                    if front is None:
                        return None
                    freed, cost = front
                    j = bisect.bisect_left(freed, need * (1 - 1e-9))
                    if j == len(freed):
                        busy = None
                        break
                    busy[k] += cost[j]
                if busy is None:
                    continue
            lead = max(sum(busy), fetch)
            Tc = (max(max(busy), fetch / v) + p2p_min) if v > 1 else lead + p2p
            best = min(best, ft * (lead + p2p) + ftc * Tc)
        if best + X < limit:
            _add(out, (best, X))
    return out


def _add(pairs: list[tuple[float, float]], p: tuple[float, float]) -> None:
    """Keep ``p`` in ``pairs`` unless one there is at most it in both parts; drop those it beats."""
    a, x = p
    beaten = False
    for pa, px in pairs:  # a loop, not any(...): the dynamic program calls this 400k times on two GPU types
        if pa <= a and px <= x:
            return
        if a <= pa and x <= px:
            beaten = True
    if beaten:
        pairs[:] = [(pa, px) for pa, px in pairs if not (a <= pa and x <= px)]
    pairs.append(p)


class _Table:
    """What one stage's floors need and have found, kept across calls (:func:`_table`): its ways of
    keeping states, the chunk memo of :func:`_floor`, the relaxed floor per vector and, per vector, the
    pairs :func:`_floor` gave and the limit it gave them for (exact below it, so they serve every lower
    limit: pairs of a higher limit filtered to those below the lower one are what it would give)."""

    __slots__ = ("held", "ways", "memo", "lows", "floors")

    def __init__(self, held: tuple, ways: list[_Priced]) -> None:  # type: ignore[type-arg]
        self.held = held  # the cell and stage whose objects' ids key the table: kept alive with it
        self.ways = ways
        self.memo: dict = {}  # type: ignore[type-arg]
        self.lows: dict[tuple[int, ...], float] = {}
        self.floors: dict[tuple[int, ...], tuple[float, list[tuple[float, float]] | None]] = {}


_TABLES: dict[tuple, _Table] = {}  # type: ignore[type-arg]
"""Stage tables by what they read. The candidates that differ only in the order of the GPU groups (on
four types, 2,738 of them) give many stages the same cell coefficients (shared objects: costing's
``_shared_memo``) in the same position: 144 stage tables of 14 calls on Llama-70B on four types were 58
distinct ones."""
_TABLES_MAX = 256


def _table(c: CellCoeffs, sc: StageCoeffs, groups: list, dp: int, choices: Choices, v: int, form) -> _Table:  # type: ignore[no-untyped-def, type-arg]
    """The table of a stage whose floors read ``c``, ``sc`` (each coefficient by identity: the shared,
    never-modified objects the coefficient builder hands out; each number by value) and the rest."""
    key = (tuple(id(x) for x in (c.seg_time, c.seg_recompute, c.seg_saved, c.seg_input, c.seg_exposed,
                                 c.seg_amp_saved, c.seg_tail, c.edge, c.tail_edge, c.fetch_beta, c.opt_beta,
                                 c.seg_offload, c.seg_host, c.seg_ckoff, c.seg_ckhost, sc.mem_beta,
                                 sc.buffer_beta, sc.state_split, sc.grads_freed, sc.working_bytes,
                                 sc.working_grad, sc.sync)),
           c.capacity, c.inflight, c.loss_bytes, c.p2p, tuple(c.chunk_p2p), tuple(sc.seg_params),
           tuple(tuple(m) for m in groups), dp, choices, v, form)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.pop(next(iter(_TABLES)))
        table = _TABLES[key] = _Table((c, sc), [_Priced(sc, c, members, dp, choices) for members in groups])
    return table


_ASKED: dict[tuple, tuple] = {}  # type: ignore[type-arg]
"""The last answers, by candidate (held, so that its ``id`` is not reused) and pipeline: the search asks
a candidate set aside by its first look again before its full ILP, mostly with the same cutoff."""
_ASKED_MAX = 64


def stage_dp_bound(cc: CandidateCoeffs, cells: Sequence[CellCoeffs], cutoff: float | None = None,
                   choices: Choices = ALL_CHOICES) -> float | None:
    """The least over the splits of the blocks into the stages of the slowest stage's floor (module
    docstring), a step time no plan of this pipeline beats; None where not computed (no state options
    in ``cc``, too many segments or choices). ``cutoff``: only whether the bound reaches it matters;
    floors at or above it are not combined, and ``cutoff`` is returned where every split has one.

    Below its cutoff the answer is exact, so an answer for a cutoff serves every lower one: ``value``
    if below it, else the cutoff (the search's cutoffs only fall)."""
    key = (id(cc), tuple(id(c) for c in cells), choices)
    seen = _ASKED.get(key)
    if seen is not None and seen[0] is cc and cutoff is not None and seen[1] is not None and cutoff <= seen[1]:
        value = seen[2]
        return value if value is None or value < cutoff else cutoff
    value = _stage_dp_bound(cc, cells, cutoff, choices)
    if len(_ASKED) >= _ASKED_MAX:
        _ASKED.pop(next(iter(_ASKED)))
    _ASKED[key] = (cc, cutoff, value)
    return value


def _stage_dp_bound(cc: CandidateCoeffs, cells: Sequence[CellCoeffs], cutoff: float | None,
                    choices: Choices) -> float | None:
    cand = cc.candidate
    S, v = len(cells), cand.virtual_stages
    lengths = tuple(seg.length for seg in cc.segments)
    if any(not sc.options for sc in cc.stages) or math.prod(L + 1 for L in lengths) > MAX_STATES:
        return None
    form = cand.step_form
    limit = math.inf if cutoff is None else cutoff
    vectors = sorted((n for n in product(*(range(L + 1) for L in lengths)) if sum(n) >= v), key=sum)
    G = len(lengths)
    first = min(cc.segments, key=lambda seg: seg.start).index
    final = max(cc.segments, key=lambda seg: seg.start).index
    # per blocks used so far, the Pareto pairs (largest A, largest X) of the stages so far: the step is
    # at least t max T + tc max Tc + x max X >= max_s A_s + max_s X_s
    reach: dict[tuple[int, ...], list[tuple[float, float]]] = {(0,) * G: [(0.0, 0.0)]}
    for s, c in enumerate(cells):
        sc = cc.stages[s]
        in_family = {o for f in sc.families for o in f} if v == 1 else set()
        groups = [(o,) for o in sc.options if o not in in_family] + (list(sc.families) if v == 1 else [])
        table = _table(c, sc, groups, cand.dp, choices, v, form)
        ways, memo, lows, known = table.ways, table.memo, table.lows, table.floors
        low: dict[tuple[int, ...], float] = {}
        last = s == S - 1
        # the model's first block runs on the first stage (its first chunk), its last block on the last
        must = [g for g, here in ((first, s == 0), (final, last)) if here]
        # the stages after this one hold at least v blocks each
        most = sum(lengths) - v * (S - 1 - s)
        if last:  # the last stage takes what is left
            wanted = {tuple(L - u for L, u in zip(lengths, used)) for used in reach}
            todo = [n for n in vectors if n in wanted]
        else:
            todo = [n for n in vectors if sum(n) <= most]
        floors: dict[tuple[int, ...], list[tuple[float, float]]] = {}
        for n in todo:
            # the relaxed floor rises with every n[g]: above a vector at the limit, every one is (every
            # vector below one in ``todo`` is in it, before it, except on the last stage)
            below = [tuple(k - (h == g) for h, k in enumerate(n)) for g in range(G) if n[g]]
            if not last and any(sum(b) >= v and low.get(b, math.inf) >= limit for b in below):
                continue
            if n not in lows:
                lows[n] = _relaxed_floor(n, c, sc, ways, v, form)
            low[n] = lows[n]
            if low[n] >= limit or any(not n[g] for g in must):
                continue
            seen = known.get(n)
            if seen is not None and seen[1] is not None and limit <= seen[0]:
                # priced for a higher limit: exact below it, so its pairs below this one are the answer
                f = [p for p in seen[1] if p[0] + p[1] < limit]
            else:
                f = _floor(n, c, sc, ways, v, form, memo, limit)
                known[n] = (limit, f)
            if f is None:
                return None
            if f:
                floors[n] = f
        nxt: dict[tuple[int, ...], list[tuple[float, float]]] = {}
        items = [(n, sum(n), f) for n, f in floors.items()]
        for used, pairs in reach.items():
            room = tuple(L - u for L, u in zip(lengths, used))
            if last:
                ways_n = floors.get(room)
                candidates = [] if ways_n is None else [(room, sum(room), ways_n)]
            else:
                candidates = items
            spare = most - sum(used)
            for n, size, ways_n in candidates:
                if size > spare or any(map(int.__gt__, n, room)):
                    continue
                total = tuple(a + b for a, b in zip(used, n))
                into = None
                for pa, px in pairs:
                    for fa, fx in ways_n:
                        a = pa if pa > fa else fa
                        x = px if px > fx else fx
                        if a + x < limit:
                            if into is None:
                                into = nxt.setdefault(total, [])
                            _add(into, (a, x))
        reach = nxt
        if not reach:
            return cutoff
    pairs = reach.get(lengths)
    if not pairs:
        return cutoff
    return min(a + x for a, x in pairs) * (1 - SAFETY)
