"""``plan.explain()`` states the real reason each alternative lost, and each reason is checked against
what is true of that candidate: "slower by x%" against both step times, "does not fit by y GiB on group
g" against a brute force finding no plan of it that fits, "pruned: its lower bound x s ..." against the
bound, "time limit" when the search ran out of time. Nothing that did not fit or ran out of time is
called "no better than the incumbent"."""

from __future__ import annotations

import math
import random
import re
import time

from whalepy.errors import InfeasibleError
from whalepy.planner import make_options, plan_from_profile
from whalepy.planner._evaluation import compute_bound
from whalepy.planner.costing import CostContext, build_coefficients, lower_bound, seg_time_rows
from whalepy.planner.space import Hardware, build_segments, build_state_options
from whalepy.planner.synthetic import gpt_profile

from planner_bruteforce import candidate_optimum, outer_candidates, random_instance
from planner_fixtures import a100

SEEDS = range(30)


def _check_plan(inst, plan) -> set[str]:  # type: ignore[no-untyped-def]
    """Check every alternative's reason against the truth; return the kinds of reason seen."""
    opts = make_options(inst.options)
    ctx = CostContext(inst.profile, Hardware(inst.cluster), precision=opts.precision,
                      sequence_parallel=opts.sequence_parallel, memory_margin=opts.memory_margin)
    cands, _ = outer_candidates(ctx, inst.global_batch, **inst.options)
    by_desc = {c.describe(ctx.hw.groups): c for c in cands}
    segments, options = build_segments(inst.profile), build_state_options(opts.zero_stages, opts.allow_offload)
    best = plan.cost.step_time_s
    kinds = set()
    for alt in plan.alternatives:
        r = alt.reason
        assert "no better than the incumbent" not in r and "proved" not in r, r
        if r.startswith(("slower by", "ties the best")):
            kinds.add("slower")
            m = re.match(r"slower by ([\d.]+)%", r)
            if m:
                assert alt.step_time_s > best
                assert float(m.group(1)) == round(100 * (alt.step_time_s / best - 1), 1), (r, alt.step_time_s, best)
        elif r.startswith("does not fit"):
            kinds.add("does not fit")
            assert re.match(r"does not fit by [\d.]+ (GiB|MiB) on group '\w+'", r), r
            cc = build_coefficients(ctx, by_desc[alt.description], segments, options, mixed_tiers=opts.mixed_tiers)
            assert math.isinf(candidate_optimum(cc, opts.allow_checkpointing)[0]), (alt, inst)
        elif r.startswith("pruned: its lower bound (whole blocks"):
            # pruned by the whole-block bound (a small MIP with the state options): no plan of it that
            # fits beats the best less the MIP gap, by brute force
            kinds.add("pruned")
            cc = build_coefficients(ctx, by_desc[alt.description], segments, options, mixed_tiers=opts.mixed_tiers)
            fit = candidate_optimum(cc, opts.allow_checkpointing, opts.allow_activation_offload,
                                    opts.allow_checkpoint_offload)[0]
            assert fit >= best * (1 - 1e-3), (alt, inst)
        elif r.startswith("pruned"):
            kinds.add("pruned")
            lb = float(re.match(r"pruned: its lower bound ([\d.e+-]+) s", r).group(1))
            cand = by_desc[alt.description]
            cc = build_coefficients(ctx, cand, segments, ())
            # the bound it was pruned with: the compute part alone, or with its memory part (the search
            # adds that only to candidates whose compute part is below the incumbent), or the compute part
            # with the least time each block's state options add (the search's floor, _by_bound)
            floor = compute_bound(cand, [seg.length for seg in segments], seg_time_rows(ctx, cand, segments, options)[1])
            assert (any(math.isclose(lb, lower_bound(cc, memory=m), rel_tol=1e-3) for m in (False, True))
                    or math.isclose(lb, floor, rel_tol=1e-3)), r
            assert lb >= best * (1 - 1e-3) and max(lower_bound(cc), floor) >= best * (1 - 1e-9), r
    return kinds


def test_reasons_are_true_on_random_instances(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import whalepy.planner.build as build

    resolved: list[str] = []  # candidates whose HiGHS cutoff solve only said "nothing beats the incumbent"
    real = build._resolve
    monkeypatch.setattr(build, "_resolve", lambda result, cand: resolved.append(
        (r := real(result, cand)).status) or r)
    real_why, whys = build.why_lost, []

    def why(ev, best, hw):  # type: ignore[no-untyped-def]
        # the figures "why it lost" quotes are parts of the step that add up to it, in both plans
        for e in (ev, best):
            assert math.isclose(sum(build.step_parts(e).values()), e.step_time_s, rel_tol=1e-9), e
            assert min(build.step_parts(e).values()) >= -1e-12
        whys.append(text := real_why(ev, best, hw))
        assert text.startswith(f"{build._ms(ev.step_time_s)} vs {build._ms(best.step_time_s)} per step"), text
        return text

    monkeypatch.setattr(build, "why_lost", why)
    seen: set[str] = set()
    for seed in SEEDS:
        inst = random_instance(random.Random(seed))
        try:
            plan = plan_from_profile(inst.profile, inst.cluster, global_batch=inst.global_batch, **inst.options)
        except InfeasibleError:
            continue
        seen |= _check_plan(inst, plan)
    assert {"slower", "does not fit", "pruned"} <= seen, seen
    assert whys
    # some cut-off candidates were in fact slower and some did not fit at all: the cutoff status alone
    # could not tell these apart
    assert {"optimal", "infeasible"} <= set(resolved), resolved


def test_time_limit_is_said() -> None:
    """The search runs out of time right after its first solved candidate (its progress callback sleeps
    past the limit): the candidates left are reported as such, with the limit."""
    limit = 2.0  # room for the first solve on a loaded machine; the sleep then outlasts the rest

    def slow(msg: str) -> None:
        if "best so far" in msg:
            time.sleep(limit + 0.05)

    # 8 GPUs: on one the memory-aware bound prunes every candidate after the first, leaving none to time out
    p = plan_from_profile(gpt_profile("gpt3-1.3b"), a100(8), global_batch=64, time_limit_s=limit, progress=slow)
    reasons = [a.reason for a in p.alternatives]
    assert any(r.startswith(f"time limit: the search's {limit:g} s ran out before it was solved")
               for r in reasons), reasons
    assert any("time limit" in n for n in p.notes)
    assert "time limit" in p.explain()
