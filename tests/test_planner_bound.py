"""The search is sound: the pruning bound is below every plan of its candidate, and the planner returns
what a brute force over the whole space (no bound, no incumbent, no dominance: tests/planner_bruteforce.py)
returns. The older bound charged TP communication at the profile's byte size instead of the training
precision's and spread a mixed pipeline's work as if every device ran every block alike; both made it
exceed the real cost, and the planner missed the optimum on the two instances pinned below."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from whalepy.hardware.cluster import resolve_precision
from whalepy.errors import InfeasibleError
from whalepy.planner import make_options, plan_from_profile
from whalepy.planner._bound import Choices
from whalepy.planner.costing import CostContext, build_coefficients, compute_bound, lower_bound, seg_time_rows
from whalepy.planner.ilp import MIP_REL_GAP, solve_candidate
from whalepy.planner.search import allowed_stage_ranges, read_annotations
from whalepy.planner.space import Hardware, build_segments, build_state_options
from whalepy.planner.synthetic import gpt_profile, transformer_profile

from planner_bruteforce import Instance, brute_force, candidate_optimum, instance_space, outer_candidates, random_instance
from planner_fixtures import as_fp32_capture, cluster, group, tiny_device

NUM_INSTANCES = 120
REL = 1e-9
"""Float noise: the planner and the brute force cost the same configurations with the same functions."""


def _planned(inst: Instance, **extra) -> float:  # type: ignore[no-untyped-def]
    try:
        return plan_from_profile(inst.profile, inst.cluster, global_batch=inst.global_batch,
                                 **{**inst.options, **extra}).cost.step_time_s
    except InfeasibleError:
        return math.inf


def _assert_optimal(inst: Instance, planned: float, rel: float) -> None:
    best = brute_force(inst.profile, inst.cluster, inst.global_batch, **inst.options)
    if math.isinf(best):
        assert math.isinf(planned), (planned, inst)
    else:
        # never below the optimum (that would be a costing mismatch), and no further above than the
        # solver's stopping gap
        assert best * (1 - REL) <= planned <= best * (1 + rel), (planned, best, inst)


def _missed_mixed() -> Instance:
    """A mixed V100/A100 pipeline: the old bound assumed both device types run every block alike."""
    prof = transformer_profile(num_layers=1, hidden=1024, seq_len=512, vocab=50257, num_heads=8,
                               sequence_parallel=True, name="missed-mixed")
    v100, a100 = tiny_device("v100-1.57g", "V100-32GB", 1.572), tiny_device("a100-1.51g", "A100-80GB", 1.505)
    c = cluster(group("a", v100.name, 4, 1, link="nvlink3", cpu_gb=None, net_gbps=400, custom={v100.name: v100}),
                group("b", a100.name, 4, 1, link="pcie4", cpu_gb=None, net_gbps=400, custom={a100.name: a100}),
                custom=[v100, a100])
    return Instance(prof, c, 16, dict(precision="fp16", max_microbatches=4, schedules=("1f1b",), zero_stages=(0,),
                                      allow_offload=False, allow_checkpointing=False, sequence_parallel=True))


def _missed_fp32() -> Instance:
    """An fp32-captured GPT trained in fp16 on T4s over PCIe: the old bound charged TP all-reduces twice."""
    prof = as_fp32_capture(transformer_profile(num_layers=2, hidden=2048, seq_len=2048, vocab=50257,
                                               num_heads=8, name="missed-fp32"))
    t4 = tiny_device("t4-3.86g", "T4", 3.862)
    c = cluster(group("a", t4.name, 2, 2, link="pcie4", cpu_gb=64, net_gbps=100, custom={t4.name: t4}), custom=[t4])
    return Instance(prof, c, 16, dict(precision="fp16", max_microbatches=4, schedules=("1f1b", "interleaved_1f1b"),
                                      zero_stages=(0, 1), allow_offload=False, allow_checkpointing=True,
                                      sequence_parallel=False))


@pytest.mark.parametrize("make", [_missed_mixed, _missed_fp32])
@pytest.mark.parametrize("solver", ["highs", "exhaustive"])
def test_formerly_missed_optimum(make, solver: str) -> None:  # type: ignore[no-untyped-def]
    inst = make()
    _assert_optimal(inst, _planned(inst, solver=solver), MIP_REL_GAP if solver == "highs" else REL)


@pytest.mark.parametrize("seed", range(NUM_INSTANCES))
def test_planner_equals_brute_force(seed: int) -> None:
    """The default planner (HiGHS, bound pruning, incumbent cutoffs) on random small instances: fp32- and
    bf16-captured profiles, one or two device types, memory from roomy to too small."""
    inst = random_instance(random.Random(seed))
    _assert_optimal(inst, _planned(inst), MIP_REL_GAP)


def _option_floor(ctx, cand, segments, options) -> float:  # type: ignore[no-untyped-def]
    """The search's compute bound with the least time the state options add per block (FSDP2's hook
    work, autocast's casts: ``seg_time_rows``), checked at least the bound without it."""
    lengths = [seg.length for seg in segments]
    plain, more = seg_time_rows(ctx, cand, segments, options)
    floor = compute_bound(cand, lengths, more)
    assert floor >= compute_bound(cand, lengths, plain)
    return floor


def _check_bounds(inst: Instance) -> tuple[int, int]:
    """``lower_bound <= cost`` for every candidate, with and without its whole-block part (step 7, a small
    MIP): against its best plan that fits, host copies of activations included where the bound is above
    the best plan ignoring memory (its memory part). The whole-block part asked about a cutoff (what the
    search does) claims to reach it only when no plan that fits is below it. Returns the candidates
    checked and how many of them the memory part lifted."""
    opts, ctx, cands, segments, options = instance_space(inst)
    lifted = 0
    for cand in cands:
        cc = build_coefficients(ctx, cand, segments, options)
        lb = lower_bound(cc)
        # what the search computes: the bound of coefficients built without state options
        assert lower_bound(build_coefficients(ctx, cand, segments, ())) == lb
        # without activation or checkpoint offload: their copies only add time, so the best plan ignoring
        # memory never offloads and bounds every plan that does (and enumerating it made this test 20x slower)
        whole = lower_bound(cc, whole_blocks=True)
        assert whole >= lb
        fit, any_ = candidate_optimum(cc, opts.allow_checkpointing, allow_activation_offload=False,
                                      allow_checkpoint_offload=False)
        assert whole <= fit * (1 + REL), (lb, whole, any_, fit, cand, inst)
        # the compute part with the least time the state options add per block (what the search prunes
        # by): below the best plan, memory ignored
        floor = _option_floor(ctx, cand, segments, options)
        assert floor <= any_ * (1 + REL), (floor, any_, cand, inst)
        if any(c.seg_offload is not None or c.seg_ckoff is not None for st in cc.stages for c in st.cells):
            # told that the ILP makes no host copies (the planner's options), steps 6-7 leave their
            # columns out: still below the best plan without them
            narrow = lower_bound(cc, whole_blocks=True, choices=Choices(opts.allow_checkpointing, False, False))
            assert narrow <= fit * (1 + REL), (lb, narrow, fit, cand, inst)
        if whole > any_ * (1 + REL):
            lifted += lb > any_ * (1 + REL)
            # above the best plan ignoring memory: the bound's memory part (planner/_bound.py) says every
            # plan that fits pays recompute or host copies; check it against every plan that fits, host
            # copies included
            fit = candidate_optimum(cc, opts.allow_checkpointing, allow_activation_offload=True,
                                    allow_checkpoint_offload=True)[0]
            assert whole <= fit * (1 + REL), (lb, whole, any_, fit, cand, inst)
        if math.isfinite(fit):
            # asked whether it reaches a cutoff just above the best plan: it must not claim to
            below = fit * (1 + 1e-6)
            assert lower_bound(cc, whole_blocks=True, cutoff=below) < below, (fit, cand, inst)
    return len(cands), lifted


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), fp32_capture=st.booleans(), mixed=st.booleans())
def test_bound_below_every_candidate_cost(seed: int, fp32_capture: bool, mixed: bool) -> None:
    _check_bounds(random_instance(random.Random(seed), fp32_capture=fp32_capture, mixed=mixed))


@pytest.mark.parametrize("seed,mixed", [(3, False), (11, True), (16, False), (30, True)])
def test_memory_part_of_the_bound(seed: int, mixed: bool) -> None:
    """Instances where memory binds: the bound's memory part (``planner/_bound.py``: recompute or host
    copies every fitting plan pays) lifts it above the best plan ignoring memory on some candidates, and
    it stays below every plan that fits, activation and checkpoint offload included (brute force)."""
    _, lifted = _check_bounds(random_instance(random.Random(seed), fp32_capture=False, mixed=mixed))
    assert lifted >= 2


def test_bound_below_cost_on_a_full_size_gpt() -> None:
    """The reported case at full size (24 layers, h 2048, fp32 capture, 8 T4 on PCIe 3, global batch 8),
    where the old bound exceeded the solved cost of 23 of 40 candidates: every candidate's ILP optimum
    (HiGHS, no cutoff) is at least its bound."""
    prof = as_fp32_capture(gpt_profile("gpt3-1.3b"))
    c = cluster(group("t4", "T4", 8, 1, link="pcie3"))
    opts = make_options({})
    # the planner's default precision for T4 (fp16: no bf16), as plan_from_profile resolves it
    ctx = CostContext(prof, Hardware(c), precision=resolve_precision(g.device for g in c.groups).value)
    cons = read_annotations(prof, ctx.hw)
    cands, _ = outer_candidates(ctx, 8)
    segments, options = build_segments(prof), build_state_options(opts.zero_stages, opts.allow_offload, ctx.precision)
    checked = tighter = floored = 0
    for cand in cands:
        cc = build_coefficients(ctx, cand, segments, options)
        res = solve_candidate(cc, allowed_stages=allowed_stage_ranges(cand, cons), allow_checkpointing=True,
                              solver="highs", time_limit_s=10)
        if res.evaluation is None:
            continue
        checked += 1
        # below the optimum, hence below what the ILP returns (within MIP_REL_GAP above it)
        assert lower_bound(cc) <= res.evaluation.step_time_s * (1 + REL), (cand, res.evaluation.step_time_s)
        floor = _option_floor(ctx, cand, segments, options)
        assert floor <= res.evaluation.step_time_s * (1 + REL), (cand, floor, res.evaluation.step_time_s)
        floored += floor > lower_bound(build_coefficients(ctx, cand, segments, ()), memory=False) * (1 + 1e-6)
        whole = lower_bound(cc, whole_blocks=True)
        assert whole <= res.evaluation.step_time_s * (1 + REL), (cand, whole, res.evaluation.step_time_s)
        tighter += whole > lower_bound(cc) * (1 + 1e-6)
    assert checked >= 20
    assert tighter >= checked // 2  # the whole-block part (sends, tail, whole blocks) lifts most
    assert floored > 0  # T4's short blocks pay FSDP2's hook work under every option that shards


def test_candidates_set_aside_are_solved_in_full(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With no work for first looks (no node at all) every ILP is set aside, and the second pass must still solve each
    candidate in full: the planner equals the brute force (a second pass that never ran kept first-look
    plans or none)."""
    import whalepy.planner.search as search

    full_solves = []
    real = search.solve_candidate

    def counting(cc, **kw):  # type: ignore[no-untyped-def]
        if kw["node_limit"] != 0:
            full_solves.append(cc.candidate)
        return real(cc, **kw)

    monkeypatch.setattr(search, "FIRST_LOOK_NODES", 0)
    monkeypatch.setattr(search, "solve_candidate", counting)
    for seed in range(4):
        inst = random_instance(random.Random(seed))
        _assert_optimal(inst, _planned(inst), MIP_REL_GAP)
    assert full_solves


def test_a_first_look_stopped_without_a_plan_is_not_a_refutation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An ILP stopped by a limit before it found any plan refutes nothing, cutoff or not: it is
    "no solution" (set aside for the second pass), never "no better than the incumbent" (dropped). The
    search lost optima that way when a first look ran out before its first plan."""
    import whalepy.planner.ilp as ilp

    inst = random_instance(random.Random(0))
    opts = make_options(inst.options)
    ctx = CostContext(inst.profile, Hardware(inst.cluster), precision=opts.precision, memory_margin=opts.memory_margin)
    cand = outer_candidates(ctx, inst.global_batch, **inst.options)[0][0]
    cc = build_coefficients(ctx, cand, build_segments(inst.profile),
                            build_state_options(opts.zero_stages, opts.allow_offload, opts.precision))
    monkeypatch.setattr(ilp, "_run", lambda *a, **k: ("no solution", math.inf, 0.0))
    for cutoff in (None, 1.0):
        res = solve_candidate(cc, allowed_stages={}, allow_checkpointing=True, solver="highs", time_limit_s=0.1,
                              cutoff=cutoff)
        assert res.status == "no solution" and res.evaluation is None, (cutoff, res.status)
