"""The outer search: enumerate candidates (degrees, micro-batches, schedule, device-group layout,
batch shares), bound them, solve the promising ones with the ILP (or exhaustively), and keep the best.

Candidates are visited in order of a lower bound on their step time (:func:`costing.lower_bound`,
read off the same coefficients their cost is made of: the model's per-block compute spread over the
stages as if blocks were divisible, bubbles included, nothing else); once the bound of the next one is
no better than the incumbent, the rest cannot win and are not solved. The bound is below every plan of
its candidate by construction (the argument is in its docstring), so the pruning never loses the
optimum: ``tests/test_planner_bound.py`` checks this against a brute force without any pruning.
Each ILP gets a short first look (the candidates with one chunk per stage first, then the interleaved
ones); those it does not settle are solved in full after the others, against
the better incumbent found by then (:data:`FIRST_LOOK_NODES`): first those whose first look found a plan,
best first, and each only where the bound's whole-block part (``lower_bound(cc, whole_blocks=True,
cutoff=...)``, a small MIP) does not already show that it cannot beat the incumbent less the MIP gap.

Mixed clusters. Two layouts are enumerated: ``"replicas"`` (each data-parallel replica is a whole
pipeline on one group; replicas get uneven integer batch shares, tried from uniform to proportional to
each group's predicted throughput, blended at :data:`SHARE_BLENDS`) and ``"stages"`` (each pipeline
stage on one group, every order of the distinct groups; the ILP then gives the stages uneven block
counts). TP stays inside a node of one type by construction.

Limits. The search is limited by work, never by the clock: each ILP by a number of branch-and-bound nodes
(HiGHS on one thread with a fixed seed is deterministic), so the same inputs give the same plan on an idle
and on a loaded machine. A clock limit applies only where the user sets one (``time_limit_s``,
``ilp_time_limit_s``), and the plan says when it cut. The plan's status is the whole search's:
``"optimal"`` only when every candidate is proven no better (within the MIP gap), else ``"feasible"``
with the proven gap and the candidates a limit stopped (:func:`_what_was_proven`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from whalepy.ir.rules import microbatch_error, schedule_error, sequence_parallel_error
from whalepy.errors import AnnotationError, InfeasibleError
from whalepy.ir.plan import Schedule, Tier
from whalepy.planner._bound import Choices
from whalepy.planner.costing import (
    CandidateCoeffs,
    CostContext,
    Evaluation,
    build_coefficients,
    compute_bound,
    evaluate,
    lower_bound,
    seg_time_rows,
    tp_splits,
)
from whalepy.planner.exhaustive import solve_exhaustive
from whalepy.planner.ilp import MIP_REL_GAP, ILPResult, choose_solver, polish_candidate, solve_candidate
from whalepy.planner.space import (
    Candidate,
    Hardware,
    Rejection,
    RejectionKind,
    Segment,
    StateOption,
    build_segments,
    build_state_options,
    distinct_orders,
    divisors,
)
from whalepy.ir.profile import ModelProfile

SHARE_BLENDS = (0.0, 0.5, 0.75, 1.0)
"""Replica batch shares tried on mixed clusters: ``(1 - a) * uniform + a * proportional to throughput``."""


@dataclass(slots=True)
class Constraints:
    """What the annotations fix."""

    tp: int | None = None
    tp_above_one: bool = False
    tp_one: bool = False
    dp: int | None = None
    num_stages: int | None = None
    stage_of_block: dict[int, int] = field(default_factory=dict)
    groups_of_block: dict[int, frozenset[int]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    """Kind ("split", "replicate", "stage", "cluster") -> a human-readable origin for messages."""


def _source(block, text: str) -> str:  # type: ignore[no-untyped-def]
    return block.annotations.sources[0] if block.annotations.sources else f"{text} on {block.name}"


def _check_cluster_size(block, a, groups) -> None:  # type: ignore[no-untyped-def]
    """``cluster(count=..., nodes=...)`` is honoured when it names whole node groups; a region on part
    of a group is refused (never silently widened), with the spec change that expresses it."""
    if a.cluster_count is None and a.cluster_nodes is None:
        return
    devices = sum(g.size for g in groups)
    nodes = sum(g.num_nodes for g in groups)
    if (a.cluster_count in (None, devices)) and (a.cluster_nodes in (None, nodes)):
        return
    want = ", ".join(f"{k}={v}" for k, v in (("count", a.cluster_count), ("nodes", a.cluster_nodes)) if v)
    if (a.cluster_count or 0) > devices or (a.cluster_nodes or 0) > nodes:
        raise AnnotationError(
            f"{_source(block, 'cluster(...)')}: {want} asks for more than the matching group(s) have "
            f"({', '.join(g.name for g in groups)}: {devices} devices on {nodes} nodes). Fix: lower it to a "
            "whole group's size, or add the devices to the cluster spec")
    raise AnnotationError(
        f"{_source(block, 'cluster(...)')}: {want} asks for part of the matching group(s) "
        f"({', '.join(g.name for g in groups)}: {devices} devices on {nodes} nodes); the planner places "
        "regions on whole node groups. Fix: describe those devices as a node group of their own in the "
        "cluster spec and pin the region with cluster(group=<its name>)")


def read_annotations(profile: ModelProfile, hw: Hardware) -> Constraints:
    c = Constraints()
    splits, reps = {}, {}
    stages: set[int] = set()
    for b in profile.blocks:
        a = b.annotations
        if a.split is not None:
            splits.setdefault(a.split, _source(b, f"split({a.split})"))
        if a.replicate is not None:
            reps.setdefault(a.replicate, _source(b, f"replicate({a.replicate})"))
            if a.replicate == 0 and a.split is None:  # replicate() alone: pure data parallel, TP 1
                c.tp_one = True                       # (a split inside it gives DP over its TP groups)
                c.sources.setdefault("replicate", _source(b, "replicate()"))
        if a.stage is not None:
            stages.add(a.stage)
            c.stage_of_block[b.index] = a.stage
            c.sources.setdefault("stage", _source(b, f"stage({a.stage})"))
        if a.cluster_gpu is not None or a.cluster_group is not None:
            ok = frozenset(g.index for g in hw.groups
                           if (a.cluster_group is None or g.name == a.cluster_group)
                           and (a.cluster_gpu is None or _gpu_matches(g.device.name, a.cluster_gpu)))
            if not ok:
                names = ", ".join(f"{g.name} ({g.device.name})" for g in hw.groups)
                raise AnnotationError(
                    f"{_source(b, 'cluster(...)')} pins {b.name} to "
                    f"{a.cluster_group or a.cluster_gpu!r}, which the cluster does not have; groups: {names}")
            _check_cluster_size(b, a, [g for g in hw.groups if g.index in ok])
            c.groups_of_block[b.index] = ok
            c.sources.setdefault("cluster", _source(b, "cluster(...)"))
        elif a.cluster_count is not None or a.cluster_nodes is not None:
            # count / nodes alone: the region on any one whole group of that size, or on the whole cluster
            ok = frozenset(g.index for g in hw.groups
                           if a.cluster_count in (None, g.size) and a.cluster_nodes in (None, g.num_nodes))
            if not ok:
                _check_cluster_size(b, a, list(hw.groups))  # the whole cluster, or the error naming it
            else:
                c.groups_of_block[b.index] = ok
                c.sources.setdefault("cluster", _source(b, "cluster(...)"))
    positive = {n for n in splits if n > 0}
    if len(positive) > 1:
        raise AnnotationError(f"conflicting split degrees {sorted(positive)}: {', '.join(splits.values())}; "
                              "whalepy plans one TP degree for the whole model")
    if positive:
        c.tp = positive.pop()
        c.sources["split"] = splits[c.tp]
    if 0 in splits:
        c.tp_above_one = True
        c.sources.setdefault("split", splits[0])
    rpos = {n for n in reps if n > 0}
    if len(rpos) > 1:
        raise AnnotationError(f"conflicting replicate degrees {sorted(rpos)}: {', '.join(reps.values())}")
    if rpos:
        c.dp = rpos.pop()
        c.sources["replicate"] = reps[c.dp]
    if c.tp_one and (c.tp_above_one or (c.tp or 1) > 1):
        raise AnnotationError(f"{c.sources['replicate']} needs TP 1 but {c.sources['split']} needs TP > 1")
    if stages:
        if sorted(stages) != list(range(len(stages))):
            raise AnnotationError(f"stage scopes are numbered {sorted(stages)}; expected 0..{len(stages) - 1}")
        c.num_stages = len(stages)
    _check_degrees_fit(c, hw.world_size)
    return c


def check_annotation_degrees(model, W: int) -> None:  # type: ignore[no-untyped-def]
    """Before any capture: the degrees the model's annotations fix (one each; conflicts are reported
    with the block structure, after capture) and its number of stage scopes fit a world of ``W``."""
    from whalepy.primitives import resolve_annotations

    c = Constraints()
    stages = set()
    for path, a in resolve_annotations(model).items():
        def src(kind: str, n: int | None) -> str:
            return next((s for s in a.sources if s.startswith(kind)), f"{kind}({n or ''}) on {path or '<root>'}")

        if a.split and c.tp is None:
            c.tp, c.sources["split"] = a.split, src("split", a.split)
        if a.replicate and c.dp is None:
            c.dp, c.sources["replicate"] = a.replicate, src("replicate", a.replicate)
        if a.stage is not None:
            stages.add(a.stage)
            c.sources.setdefault("stage", src("stage", None))
    c.num_stages = len(stages) or None
    _check_degrees_fit(c, W)


def _check_degrees_fit(c: Constraints, W: int) -> None:
    """Degrees the annotations fix must fit the world: said with the numbers, before any search."""
    def fits(n: int, what: str, src: str,
             fix: str = "use a degree that divides {W}, or leave the degree out to let the planner choose") -> None:
        if n > W or W % n:
            raise AnnotationError(
                f"{src} asks for {n} {what} but the cluster has {W} devices"
                f"{' (' + str(n) + ' > ' + str(W) + ')' if n > W else f', and {n} does not divide {W}'}; "
                + fix.format(W=W))

    if c.dp is not None:
        fits(c.dp, "data-parallel replicas", c.sources["replicate"])
    if c.tp is not None:
        fits(c.tp, "tensor-parallel devices", c.sources["split"])
    if c.num_stages is not None:
        fits(c.num_stages, "pipeline stages (one per stage() scope of the model)", c.sources["stage"],
             "use a number of stage() scopes that divides {W}, or drop them to let the planner split the model")
    fixed = [(n, c.sources[k]) for n, k in ((c.dp, "replicate"), (c.tp, "split"), (c.num_stages, "stage")) if n]
    product = math.prod(n for n, _ in fixed)
    if len(fixed) > 1 and (product > W or W % product):
        raise AnnotationError(
            f"{' x '.join(f'{src} ({n})' for n, src in fixed)} = {product} devices, but the cluster has {W}; "
            f"the fixed degrees must multiply to a divisor of {W}: change one of them or leave it out")


def _dev(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _gpu_matches(device_name: str, wanted: str) -> bool:
    from whalepy.errors import ClusterSpecError
    from whalepy.cost_models.devices import resolve_device_type

    try:
        return resolve_device_type(wanted).name == device_name
    except ClusterSpecError:  # a type defined under the spec's devices: matches by its own name
        return _dev(device_name) == _dev(wanted)


# -- enumeration ------------------------------------------------------------------------------------

def enumerate_candidates(ctx: CostContext, G: int, opts, cons: Constraints,  # type: ignore[no-untyped-def]
                         rejections: list[Rejection], *, force_uniform: bool = False) -> list[Candidate]:
    hw, prof = ctx.hw, ctx.profile
    N = len(prof.blocks)
    W = hw.world_size
    node_gcd = math.gcd(*[g.gpus_per_node for g in hw.groups])
    max_tp = opts.max_tp or max(g.gpus_per_node for g in hw.groups)
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= max_tp and node_gcd % t == 0]
    if cons.tp is not None:
        if cons.tp not in tps:
            raise InfeasibleError(
                f"{cons.sources['split']} fixes TP at {cons.tp}, but TP must be a power of two dividing "
                f"every group's GPUs per node ({node_gcd}) and at most max_tp={max_tp}; TP never leaves a node")
        tps = [cons.tp]
    if cons.tp_above_one:
        tps = [t for t in tps if t > 1]
    if cons.tp_one:
        tps = [1]
    out: list[Candidate] = []
    refused: set[str] = set()
    multi = len(hw.groups) > 1
    for t in tps:
        if t > 1 and not any(tp_splits(b, t) for b in prof.blocks):
            rejections.append(Rejection(None, f"TP {t}: no block can be split {t} ways"))
            continue
        layouts = []  # (S, d, cell_groups, layout, share-mode)
        if not multi:
            for S in divisors(W // t):
                if S <= N:
                    d = W // (S * t)
                    layouts.append((S, d, tuple((0,) * d for _ in range(S)), "homogeneous"))
        else:
            for S in divisors(math.gcd(*[g.size for g in hw.groups])):
                if S > N or any(g.size % (S * t) for g in hw.groups):
                    continue
                reps = tuple(g.index for g in hw.groups for _ in range(g.size // (S * t)))
                layouts.append((S, len(reps), tuple(reps for _ in range(S)), "replicas"))
            # "stages": each stage on one group, every distinct order of the groups
            for d in divisors(math.gcd(*[g.size for g in hw.groups])):
                if any(g.size % (d * t) for g in hw.groups):
                    continue
                k = {g.index: g.size // (d * t) for g in hw.groups}
                S = sum(k.values())
                if S > N:
                    continue
                keys = {g.index: f"{g.device.name}|{g.gpus_per_node}" for g in hw.groups}
                for order in distinct_orders(tuple(g.index for g in hw.groups), keys):
                    cg = tuple((gi,) * d for gi in order for _ in range(k[gi]))
                    layouts.append((S, d, cg, "stages"))
        for S, d, cg, layout in layouts:
            if cons.dp is not None and d != cons.dp:
                continue
            sp = sequence_parallel_error(sequence_parallel=ctx.sequence_parallel and t > 1, num_stages=S)
            if sp is not None:
                if sp not in refused:
                    refused.add(sp)
                    rejections.append(Rejection(None, sp))
                continue
            if cons.num_stages is not None and S != cons.num_stages:
                continue
            if cons.groups_of_block and layout == "replicas" and len(hw.groups) > 1:
                continue  # a pinned block needs all replicas of its stage on its group
            if cons.groups_of_block and not _pins_possible(cons, cg, S):
                continue
            for M, shares in _micro_batches(ctx, G, d, cg, layout, opts, force_uniform):
                for sched, v in _schedules(S, M, N, opts, cons, multi):
                    out.append(Candidate(num_stages=S, tp=t, dp=d, num_microbatches=M, schedule=sched,
                                         virtual_stages=v, cell_groups=cg, batch_shares=shares, layout=layout))
    return out


def _pins_possible(cons: Constraints, cg, S: int) -> bool:  # type: ignore[no-untyped-def]
    for i, groups in cons.groups_of_block.items():
        if not any(cg[s][0] in groups for s in range(S)):
            return False
    return True


def _micro_batches(ctx: CostContext, G: int, d: int, cg, layout: str, opts, force_uniform: bool):  # type: ignore[no-untyped-def]
    max_m = opts.max_microbatches
    if layout != "replicas" or force_uniform or len({g for g in cg[0]}) == 1:
        if G % d:
            return
        for M in divisors(G // d):
            if max_m is None or M <= max_m:
                yield M, (G // d,) * d
        return
    speed = {g: 1.0 / ctx.model_time_per_sample(ctx.hw.groups[g]) for g in set(cg[0])}
    weights = [speed[g] for g in cg[0]]
    for M in divisors(G):
        if max_m is not None and M > max_m:
            continue
        U = G // M
        if U < d:
            continue
        seen = set()
        for a in SHARE_BLENDS:
            w = [(1 - a) / d + a * x / sum(weights) for x in weights]
            units = _apportion(U, w)
            if units and tuple(units) not in seen:
                seen.add(tuple(units))
                yield M, tuple(u * M for u in units)


def _apportion(total: int, weights: list[float]) -> list[int] | None:
    """Largest-remainder split of ``total`` into positive integers proportional to ``weights``."""
    n = len(weights)
    if total < n:
        return None
    extra = total - n
    raw = [extra * w / sum(weights) for w in weights]
    base = [int(math.floor(x)) for x in raw]
    order = sorted(range(n), key=lambda i: raw[i] - base[i], reverse=True)
    for i in order[: extra - sum(base)]:
        base[i] += 1
    return [b + 1 for b in base]


def _schedules(S: int, M: int, N: int, opts, cons: Constraints, multi: bool):  # type: ignore[no-untyped-def]
    """``(schedule, virtual stages)`` pairs the runtime lowers (:mod:`whalepy.ir.rules`) for ``S``
    stages and ``M`` micro-batches, less those the planner does not cost or never needs."""
    if S == 1:
        yield (Schedule.ONE_F_ONE_B if Schedule.ONE_F_ONE_B in opts.schedules else opts.schedules[0]), 1
        return
    for sched in opts.schedules:
        one_f_one_b = Schedule.ONE_F_ONE_B in opts.schedules and _lowers(Schedule.ONE_F_ONE_B, S, 1, M)
        if sched is Schedule.GPIPE and one_f_one_b:
            continue  # same step time as 1F1B, never fewer micro-batches in flight: dominated
        if sched is Schedule.INTERLEAVED_1F1B:
            if cons.num_stages is not None or (multi and cons.groups_of_block):
                continue
            # the costing's bubble and in-flight counts are Narayanan et al.'s, for M a multiple of S
            for v in opts.virtual_stages:
                if v > 1 and M % S == 0 and S * v <= N and _lowers(sched, S, v, M):
                    yield sched, v
        elif _lowers(sched, S, 1, M):
            yield sched, 1


def _lowers(sched: Schedule, S: int, v: int, M: int) -> bool:
    return (schedule_error(sched, num_stages=S, virtual_stages=v) is None
            and microbatch_error(sched, num_stages=S, num_microbatches=M) is None)


# -- solving ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class SearchResult:
    best: Evaluation | None
    best_result: ILPResult | None
    solved: list[tuple[Candidate, ILPResult]]
    rejections: list[Rejection]
    num_candidates: int
    solve_time_s: float
    solver_used: str
    notes: list[str]
    hit_time_limit: bool = False
    segments: tuple[Segment, ...] = ()
    options: tuple[StateOption, ...] = ()
    ctx: CostContext | None = None
    constraints: Constraints | None = None
    candidates: list[Candidate] = field(default_factory=list)
    allow_checkpointing: bool = True
    allow_activation_offload: bool = True
    mixed_tiers: bool = False
    allow_checkpoint_offload: bool = False
    status: str = "none"
    """What the whole search proved: ``"optimal"`` (every candidate proven no better than the plan, within
    the MIP gap) or ``"feasible"`` (some were stopped by a limit first: :attr:`gap`, and why in the notes)."""
    gap: float = math.nan
    """The search's proven gap: the plan's step time is at most this share above the best possible."""
    deadline: float | None = None
    """``time.perf_counter()`` at which the user's time limit runs out; None without one."""


def allowed_stage_ranges(cand: Candidate, cons: Constraints) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for i, k in cons.stage_of_block.items():
        out[i] = (k, k)
    for i, groups in cons.groups_of_block.items():
        ok = [s for s in range(cand.num_stages) if cand.cell_groups[s][0] in groups]
        lo, hi = min(ok), max(ok)
        if i in out:
            lo, hi = max(lo, out[i][0]), min(hi, out[i][1])
        out[i] = (lo, hi)
    return out


FIRST_LOOK_NODES = 1
"""Work limit of a candidate's first look (first pass of :func:`run_search`), in branch-and-bound nodes:
the root only (presolve, cuts, root heuristics). Candidates whose ILP it does not settle are solved with
the full ``ilp_node_limit`` after all others. Small, because the first look's job is to settle the easy
candidates and find incumbents: most ILPs of the benchmark cases settle at the root; the hard ones did
not settle in thousands of nodes either (docs/benchmarks.md)."""


def _by_bound(bounded: list[tuple[float, int, Candidate]], light: Callable[[int], CandidateCoeffs],
              incumbent: Callable[[], float], choices: Choices, floor: dict[int, float]):  # type: ignore[no-untyped-def]
    """Candidates in order of their bound, ties by enumeration order: ``bounded`` holds compute bounds
    (:func:`lower_bound` with ``memory=False``); a candidate that comes up below the incumbent gets its
    full bound (memory part included, from ``light(index)``, its coefficients without state options) and, if
    that is higher, goes back in line with it. Yields ``(bound, index, candidate)``; a candidate yielded
    with its compute bound is at or above the incumbent (pruned either way).

    ``floor``: per candidate, a bound at least its compute bound that the order does not follow (the
    compute bound with the least time the state options add per block, ``seg_time_rows``): a candidate
    whose floor is at or above the incumbent is yielded with it, to be pruned, without its memory part.
    The order stays the compute bound's, so the search meets the incumbents it met without the floor
    (ordered by the floor, it met worse ones first and solved 85 ILPs instead of 48 on Llama-70B on four
    GPU types: docs/benchmarks.md, issue 26 session 17)."""
    heap = [(lb, i, False, c) for lb, i, c in bounded]
    heapq.heapify(heap)
    while heap:
        lb, i, full, c = heapq.heappop(heap)
        if floor[i] > lb and floor[i] >= incumbent() * (1 - 1e-9):
            yield floor[i], i, c
            continue
        if not full and lb < incumbent() * (1 - 1e-9):
            whole = max(lb, lower_bound(light(i), choices=choices))
            if whole > lb:
                heapq.heappush(heap, (whole, i, True, c))
                continue
        yield lb, i, c


def run_search(profile: ModelProfile, hw: Hardware, G: int, opts, *,  # type: ignore[no-untyped-def]
               progress: Callable[[str], None], force_uniform: bool = False) -> SearchResult:
    """The best plan over every candidate, and what the search proved about it (module docstring).

    Limited by work: every ILP by ``opts.ilp_node_limit`` nodes (HiGHS deterministic: one thread, fixed
    seed), so the same inputs give the same plan on any machine load. A clock limit applies only where
    the user set ``opts.time_limit_s`` / ``opts.ilp_time_limit_s``, and is reported when it cuts."""
    t0 = time.perf_counter()
    deadline = None if opts.time_limit_s is None else t0 + opts.time_limit_s
    notes: list[str] = []
    solver = opts.solver
    if solver != "exhaustive":
        solver, solver_notes = choose_solver(solver)
        notes += solver_notes
    ctx = CostContext(profile, hw, precision=opts.precision, sequence_parallel=opts.sequence_parallel,
                      clip_gradients=opts.clip_gradients, optimizer_impl=opts.optimizer_impl, compile=opts.compile,
                      memory_margin=opts.memory_margin)
    cons = read_annotations(profile, hw)
    segments = build_segments(profile)
    options = build_state_options(opts.zero_stages, opts.allow_offload, opts.precision, opts.clip_gradients)
    if all(g.device.vendor == "cpu" for g in hw.groups):
        # a CPU device's memory is the host's: a host tier adds no capacity, only copies
        options = tuple(o for o in options if Tier.CPU not in (o.param_tier, o.optimizer_tier))
    rejections: list[Rejection] = []
    progress(f"enumerating candidates for {hw.world_size} devices, global batch {G}")
    cands = enumerate_candidates(ctx, G, opts, cons, rejections, force_uniform=force_uniform)
    # A candidate's bound is read off its own cost coefficients (one fact, one place); they are built
    # without the state options, which the bound does not read, and in full only for candidates solved.
    # Its memory part (a small LP, planner/_bound.py) is added lazily: only for a candidate that comes up
    # with its compute bound below the incumbent; one whose bound rises goes back in line (_by_bound).
    # The compute part is read off the cells' seg_time alone (seg_time_rows: no coefficients built), the
    # light coefficients only for the candidates that come up below the incumbent (most never do).
    def light(i: int) -> CandidateCoeffs:
        return build_coefficients(ctx, cands[i], segments, ())

    # the bound relaxes the candidate's ILP, which has only the per-block choices the options allow
    choices = Choices(opts.allow_checkpointing, opts.allow_activation_offload, opts.allow_checkpoint_offload)
    lengths = [seg.length for seg in segments]
    bounded, floor = [], {}
    for i, c in enumerate(cands):
        plain, more = seg_time_rows(ctx, c, segments, options)
        bounded.append((compute_bound(c, lengths, plain), i, c))
        floor[i] = compute_bound(c, lengths, more)
    progress(f"{len(cands)} candidates; solving the promising ones with {solver}")
    solved: list[tuple[Candidate, ILPResult]] = []
    best: tuple[float, Evaluation, ILPResult] | None = None
    hit_limit = False
    proven: dict[int, float] = {}
    """Candidate index -> the least step time any plan of it is proven to need (its bound, or what its
    ILP proved): the search's proof of optimality, or its gap, is read off these."""
    # Two passes: a candidate whose ILP is not settled by a first look at its root (FIRST_LOOK_NODES) is
    # set aside and solved in full after the others, when the incumbent they found lets HiGHS prove it
    # cannot win in a fraction of the work. Its first-look solution, if any, is a real plan and counts as
    # an incumbent meanwhile. Every candidate still ends pruned by its bound or solved with the full
    # limit, so the optimum found is the same (a different tie is possible).
    deferred: list[tuple[float, int, Candidate]] = []
    first_look: dict[int, ILPResult] = {}
    first_cc: dict[int, CandidateCoeffs] = {}
    asked: dict[int, float] = {}  # candidate -> the cutoff its whole-block bound was last asked about
    def incumbent() -> float:
        return best[0] if best is not None else math.inf

    for pass_no, chunked in ((0, False), (0, True), (1, None)):
        # the first pass looks at the candidates with one chunk per stage, then at the interleaved ones
        # (their ILPs are 1.4-2 times larger and their root work the search's largest: on the CLI's
        # gpt3-175b on 1,024 A100, 3.6 of 4.2 s of first looks went to three interleaved candidates
        # that then fell in 0.2 s against the incumbent their 1F1B twins set). The second pass's queue
        # is what the first set aside, read once the first is done; in it, those whose first look found
        # a plan come first, best plan first: the incumbent improves early (often to the optimum),
        # against which the others are refuted sooner
        queue = _by_bound([x for x in bounded if (x[2].virtual_stages > 1) is chunked], light, incumbent,
                          choices, floor) if pass_no == 0 else sorted(
            deferred, key=lambda x: (first_look[x[1]].objective, x[0], x[1]))
        for lb, idx, cand in queue:
            proven[idx] = max(proven.get(idx, -math.inf), lb)
            if best is not None and lb >= best[0] * (1 - 1e-9):
                rejections.append(Rejection(cand, f"pruned: its lower bound {lb:.4g} s is not below the best "
                                            f"{best[0]:.4g} s", lb, kind=RejectionKind.PRUNED))
                continue
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                hit_limit = True
                rejections.append(Rejection(cand, f"time limit: the search's {opts.time_limit_s:g} s ran out "
                                            "before it was solved", lb, kind=RejectionKind.TIME_LIMIT))
                continue
            cc = first_cc.pop(idx, None) or build_coefficients(ctx, cand, segments, options,
                                                               mixed_tiers=opts.mixed_tiers)
            cut = None if best is None else best[0] * (1 - MIP_REL_GAP)
            if cut is not None and (pass_no == 0 or best[2] is not first_look.get(idx)) and asked.get(idx) != cut:
                # before its ILP (and, set aside by its first look, before the full one): does the bound
                # with whole blocks and state options (a small MIP, step 7 of lower_bound) reach the ILP's
                # own cutoff? Where it does, the ILP could only say the same ("no better than the
                # incumbent"), at more work. ``lb`` already holds the memory part (step 6, _by_bound) and,
                # asked before its first look at the same cutoff, this answer (the same coefficients: the same)
                asked[idx] = cut
                lb = max(lb, lower_bound(cc, memory=False, whole_blocks=True, cutoff=cut, choices=choices))
                proven[idx] = max(proven[idx], lb)
                if lb >= cut:
                    rejections.append(Rejection(cand, f"pruned: its lower bound (whole blocks, state options) is "
                                                f"not below the best {best[0]:.4g} s less the MIP gap", lb,
                                                kind=RejectionKind.PRUNED))
                    continue
            allowed = allowed_stage_ranges(cand, cons)
            if solver == "exhaustive":
                res = solve_exhaustive(cc, allowed_stages=allowed, allow_checkpointing=opts.allow_checkpointing,
                                       allow_activation_offload=opts.allow_activation_offload,
                                       allow_checkpoint_offload=opts.allow_checkpoint_offload)
                proven[idx] = max(proven[idx], res.evaluation.step_time_s if res.evaluation else math.inf)
                solved.append((cand, res))
            else:
                clock = min((x for x in (remaining, opts.ilp_time_limit_s) if x is not None), default=None)
                res = solve_candidate(cc, allowed_stages=allowed, allow_checkpointing=opts.allow_checkpointing,
                                      allow_activation_offload=opts.allow_activation_offload,
                                      allow_checkpoint_offload=opts.allow_checkpoint_offload,
                                      solver=solver, node_limit=FIRST_LOOK_NODES if pass_no == 0 else
                                      opts.ilp_node_limit, time_limit_s=clock,
                                      cutoff=best[0] * (1 - MIP_REL_GAP) if best is not None else None)
                proven[idx] = max(proven[idx], res.bound)
                if pass_no == 0 and res.stopped_by is not None:
                    deferred.append((lb, idx, cand))
                    first_look[idx] = res
                    first_cc[idx] = cc  # its coefficients, for the second pass
                else:
                    if best is not None and best[2] is first_look.get(idx) and res.evaluation is None:
                        # its own first-look plan is still the incumbent: nothing of it beats that plan
                        # (proven where the ILP settled: res.bound), and that plan stands
                        res = dataclasses.replace(best[2], bound=res.bound, stopped_by=res.stopped_by,
                                                  status="optimal" if res.stopped_by is None else "feasible",
                                                  mip_gap=max(0.0, 1 - res.bound / best[0]))
                        best = (best[0], best[1], res)
                    solved.append((cand, res))
            if res.evaluation is not None and (best is None or res.evaluation.step_time_s < best[0]):
                best = (res.evaluation.step_time_s, res.evaluation, res)
                progress(f"  best so far {best[0]:.4g} s/step: {cand.describe(hw.groups)}")
    remaining = None if deadline is None else deadline - time.perf_counter()
    if best is not None and solver != "exhaustive" and (remaining is None or remaining > 0):
        found = best[2]
        cc = best[1].coeffs
        t1 = time.perf_counter()
        res = polish_candidate(cc, found, allowed_stages=allowed_stage_ranges(cc.candidate, cons),
                               allow_checkpointing=opts.allow_checkpointing,
                               allow_activation_offload=opts.allow_activation_offload,
                               allow_checkpoint_offload=opts.allow_checkpoint_offload, solver=solver,
                               time_limit_s=remaining)
        solved = [(c, res if r is found else r) for c, r in solved]
        progress(f"  tie-break among plans as fast: {time.perf_counter() - t1:.2f} s"
                 + ("" if res.evaluation is found.evaluation else ", the stages below the slowest made faster "
                    "or their states kept on the device"))
        best = (best[0], res.evaluation, res) if res.evaluation is not None else best
    elapsed = time.perf_counter() - t0
    progress(f"search done in {elapsed:.2f} s ({len(solved)} ILPs solved)")
    if hit_limit:
        notes.append(f"time limit of {opts.time_limit_s:g} s reached: some candidates were not solved")
    status, gap = "none", math.nan
    if best is not None:
        status, gap, why = _what_was_proven(best[0], proven, cands, hw, opts, solver)
        notes += why
    return SearchResult(best=best[1] if best else None, best_result=best[2] if best else None, solved=solved,
                        rejections=rejections, num_candidates=len(cands), solve_time_s=elapsed,
                        solver_used=solver, notes=notes, hit_time_limit=hit_limit, segments=segments,
                        options=options, ctx=ctx, constraints=cons, candidates=cands,
                        allow_checkpointing=opts.allow_checkpointing,
                        allow_activation_offload=opts.allow_activation_offload,
                        allow_checkpoint_offload=opts.allow_checkpoint_offload, mixed_tiers=opts.mixed_tiers,
                        status=status, gap=gap, deadline=deadline)


def _what_was_proven(best: float, proven: dict[int, float], cands: list[Candidate], hw: Hardware,
                     opts, solver: str) -> tuple[str, float, list[str]]:  # type: ignore[no-untyped-def]
    """The search's status, its proven gap and, where it is not optimal, why: ``"optimal"`` only when
    every candidate is proven no better than the plan found, within the MIP gap (pruned by its bound,
    refuted or solved by its ILP); else ``"feasible"`` with ``1 - (least proven step time) / best`` and
    the candidates that were cut off by a limit, with what is proven of them."""
    floor = min(proven.values(), default=best)
    gap = max(0.0, 1 - floor / best) if math.isfinite(floor) else 1.0
    if solver == "exhaustive" or gap <= MIP_REL_GAP * (1 + 1e-6):
        return "optimal", min(gap, MIP_REL_GAP), []
    open_ = sorted((b, i) for i, b in proven.items() if b < best * (1 - MIP_REL_GAP))
    limits = []
    if opts.time_limit_s is not None or opts.ilp_time_limit_s is not None:
        limits.append("the time limit")
    limits.append(f"its work limit (ilp_node_limit={opts.ilp_node_limit} branch-and-bound nodes)")
    shown = "; ".join(f"{cands[i].describe(hw.groups)}: "
                      + (f"at least {b:.4g} s" if math.isfinite(b) else "nothing proven") for b, i in open_[:3])
    more = f" and {len(open_) - 3} more" if len(open_) > 3 else ""
    gap_text = f"{100 * gap:.2g}%" if gap < 1 else "unknown (nothing proven of one)"
    return "feasible", gap, [
        f"not proven optimal: proven gap {gap_text} (the plan is at most that far above the best possible); "
        f"{len(open_)} candidate(s) stopped by {' or '.join(limits)} before they were settled: {shown}{more}. "
        "Raise ilp_node_limit to close it"]


def evaluate_fixed(ctx: CostContext, cand: Candidate, sizes, ckpts, options, offs=None, ckoffs=None) -> Evaluation:  # type: ignore[no-untyped-def]
    segments = build_segments(ctx.profile)
    used = [o for x in options for o in ((x,) if isinstance(x, StateOption) else (p for p, _ in x))]
    cc: CandidateCoeffs = build_coefficients(ctx, cand, segments, tuple(dict.fromkeys(used)),
                                             mixed_tiers=len(used) > len(options))
    return evaluate(cc, sizes, ckpts, options, offs, ckoffs)
