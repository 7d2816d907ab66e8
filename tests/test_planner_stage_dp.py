"""The stage-by-stage bound (``planner/_stage_dp.py``: whole checkpoints, one state option per stage, a
table per stage combined over the stages) is below every plan of its candidate: checked against the
brute force of ``tests/planner_bruteforce.py`` (every split, checkpoint, host copy and state option) on
random small instances, interleaved candidates included, with and without a cutoff."""

from __future__ import annotations

import math
import random

from whalepy.planner._bound import Choices
from whalepy.planner._stage_dp import stage_dp_bound
from whalepy.planner.costing import build_coefficients, lower_bound

from planner_bruteforce import candidate_optimum, instance_space, random_instance

REL = 1e-9


def _pipelines(cc):  # type: ignore[no-untyped-def]
    cells = [{r: c for c in st.cells for r in c.replicas} for st in cc.stages]
    seen = {tuple(id(cell_of[r]) for cell_of in cells): r for r in range(cc.candidate.dp)}
    return [[cell_of[r] for cell_of in cells] for r in seen.values()]


def _check(seed: int, mixed: bool, fp32: bool) -> int:
    """Every candidate of one random instance; returns how many the bound puts above steps 1-6."""
    inst = random_instance(random.Random(1000 + seed), fp32_capture=fp32, mixed=mixed)
    opts, ctx, cands, segments, options = instance_space(inst)
    above_steps_1_6 = 0
    for cand in cands:
        cc = build_coefficients(ctx, cand, segments, options)
        bounds = [stage_dp_bound(cc, p) for p in _pipelines(cc)]
        if any(b is None for b in bounds):
            continue
        bound = max(bounds)
        fit = candidate_optimum(cc, opts.allow_checkpointing, allow_activation_offload=True,
                                allow_checkpoint_offload=True)[0]
        assert bound <= fit * (1 + REL), (bound, fit, cand, inst)
        # told that the ILP makes no host copies: below the best plan without them
        narrow = max(stage_dp_bound(cc, p, choices=Choices(opts.allow_checkpointing, False, False)) or 0.0
                     for p in _pipelines(cc))
        fit_narrow = candidate_optimum(cc, opts.allow_checkpointing, allow_activation_offload=False,
                                       allow_checkpoint_offload=False)[0]
        assert narrow <= fit_narrow * (1 + REL), (narrow, fit_narrow, cand, inst)
        if math.isfinite(fit):
            # asked whether it reaches a cutoff just above the best plan: it must not claim to
            below = fit * (1 + 1e-6)
            assert all((stage_dp_bound(cc, p, below) or 0.0) < below for p in _pipelines(cc)), (fit, cand, inst)
            above_steps_1_6 += bound > lower_bound(cc) * (1 + 1e-6)
    return above_steps_1_6


def test_stage_bound_below_every_plan() -> None:
    """Twelve random instances (one or two device types, fp32- or bf16-captured), every candidate; the
    bound is above steps 1-6 of the pruning bound on some of them (it says something)."""
    lifted = sum(_check(seed, seed % 2 == 1, seed % 3 == 0) for seed in range(12))
    assert lifted >= 50  # 118 on these instances


def test_stage_tables_kept_across_calls_give_the_same_bound() -> None:
    """The stage tables are kept across calls (``_stage_dp._TABLES``: candidates that differ in the order
    of the GPU groups share stages); a table priced for a higher cutoff serves a lower one by filtering
    its pairs. Asked first without a cutoff, then with lower ones, the bound equals the one computed
    from empty tables, to the last bit."""
    import whalepy.planner._stage_dp as sd

    asked = 0
    for seed in range(6):
        inst = random_instance(random.Random(2000 + seed), fp32_capture=seed % 3 == 0, mixed=seed % 2 == 1)
        _, ctx, cands, segments, options = instance_space(inst)
        for cand in cands:
            cc = build_coefficients(ctx, cand, segments, options)
            for p in _pipelines(cc):
                sd._TABLES.clear()
                sd._ASKED.clear()
                free = stage_dp_bound(cc, p)
                if free is None:
                    continue
                for cut in (free * 1.5, free * (1 + 1e-6), free * 0.999, free * 0.9):
                    sd._TABLES.clear()
                    sd._ASKED.clear()
                    cold = stage_dp_bound(build_coefficients(ctx, cand, segments, options), p, cut)
                    sd._ASKED.clear()  # the tables filled by the calls above, not the last answer
                    stage_dp_bound(build_coefficients(ctx, cand, segments, options), p)
                    warm = stage_dp_bound(build_coefficients(ctx, cand, segments, options), p, cut)
                    assert warm == cold, (warm, cold, cut, cand, inst)
                    asked += 1
    assert asked >= 20
