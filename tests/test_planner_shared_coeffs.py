"""Coefficients shared across the orders of the groups (issue 26): candidates that differ only in which
group runs which cell share a stage's options, a cell's per-option coefficients and the pruning of
dominated options (``costing._shared_memo``). Built in one cost context, every candidate's coefficients
equal the same candidate's built alone in a fresh one, so the search sees the numbers it saw before."""

from __future__ import annotations

from whalepy.planner import make_options
from whalepy.planner.costing import CostContext, build_coefficients
from whalepy.planner.space import Hardware, build_segments, build_state_options
from whalepy.planner.synthetic import gpt_profile

from planner_bruteforce import outer_candidates
from planner_fixtures import cluster, group


def test_coefficients_shared_across_group_orders_equal_those_built_alone() -> None:
    # four GPU types of two GPUs each: the "stages" layouts come in every order of the four groups
    spec = cluster(group("a100", "A100-80GB", 2, 1, link="nvswitch"), group("l40s", "L40S", 2, 1, link="pcie4"),
                   group("h100", "H100-SXM", 2, 1, link="nvswitch"), group("a40", "A100-40GB", 2, 1, link="nvswitch"))
    prof = gpt_profile("gpt2", num_layers=4)  # tied embeddings: the tied copies' coefficients too
    opts = make_options({"precision": "bf16"})

    def context() -> CostContext:
        return CostContext(prof, Hardware(spec), precision=opts.precision)

    ctx = context()
    cands, _ = outer_candidates(ctx, 16)
    orders = [c for c in cands if c.layout == "stages" and c.num_stages == 4]
    assert len({c.cell_groups for c in orders}) >= 24  # every order of the four groups
    segments = build_segments(prof)
    options = build_state_options(opts.zero_stages, opts.allow_offload, opts.precision)
    checked = 0
    for state, mixed in (((), False), (options, True)):
        shared = [build_coefficients(ctx, c, segments, state, mixed_tiers=mixed) for c in cands]
        for c, cc in zip(cands, shared):
            if c.layout == "homogeneous":
                continue
            alone = build_coefficients(context(), c, build_segments(prof), state, mixed_tiers=mixed)
            assert alone.stages == cc.stages, c
            assert (alone.nodes, alone.ranks, alone.bubble) == (cc.nodes, cc.ranks, cc.bubble), c
            checked += 1
    # and they were shared: a cell of a group and share holds the per-option coefficients of the same
    # cell in an earlier order of the groups (the same objects)
    seen: dict[tuple, object] = {}  # type: ignore[type-arg]
    reused = 0
    for c in orders:
        for cell in build_coefficients(ctx, c, segments, options).stages[0].cells:
            key = (c.tp, c.dp, c.num_microbatches, c.schedule, c.virtual_stages, cell.group.index, cell.share)
            if key in seen:
                reused += seen[key] is cell.seg_exposed
            else:
                seen[key] = cell.seg_exposed
    assert checked >= 50 and reused > 0
