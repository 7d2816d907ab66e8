"""Memory-centric tiling in the planner (``BlockPlan.tiles``): offered where a block's FSDP2 working set
is what keeps ZeRO-3 from fitting, charged as the runtime holds it (one tile gathered, not the block),
and never with tensor parallelism or below ZeRO-3 (what the runtime lowers)."""

from __future__ import annotations

import dataclasses

import pytest

from whalepy.errors import InfeasibleError, PlanError
from whalepy.cost_models.devices import CATALOG
from whalepy.cost_models.memory import estimate_fsdp_working_bytes
from whalepy.planner.estimate import estimate_from_profile
from whalepy.ir.plan import Plan, ZeroStage
from whalepy.planner import plan_from_profile
from whalepy.planner._tiling_costs import TILED_WORKING_SHARE, block_tiles, tiled_options, unit_params
from whalepy.planner.space import StateOption
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import cluster, group

# hidden 12288 (GPT-3 175B's width): one layer is 1.81B parameters, its largest linear (h x 4h) 604M
PROF = transformer_profile(num_layers=4, hidden=12288, seq_len=1024, vocab=32000, num_heads=96, batch=1,
                           name="wide")


def _cluster(gib: float):  # type: ignore[no-untyped-def]
    dev = CATALOG["A100-80GB"].replace(name=f"a100-{gib}g", memory_bytes=int(gib * 2**30))
    return cluster(group("a", dev.name, 8, 1, custom={dev.name: dev}), custom=[dev])


def test_unit_is_the_largest_tile_or_what_the_block_keeps() -> None:
    layer, embed, head = PROF.blocks[1], PROF.blocks[0], PROF.blocks[-1]
    h = 12288
    assert layer.num_linears == 4 and layer.largest_linear_params == 4 * h * h
    assert unit_params(layer, 1) == layer.num_params
    assert unit_params(layer, 4) == pytest.approx(h * h)
    # tiled to nothing, a layer's unit is what is not in its linears (norms, biases)
    assert unit_params(layer, 10**9) == layer.num_params - layer.linear_params
    # the embedding's rows (the vocabulary, 32000, and the 1024 positions) split like a linear's
    assert embed.linear_rows == ((32000, h), (1024, h)) and embed.linear_params == embed.num_params
    assert unit_params(embed, 8) == 4000 * h
    assert unit_params(embed, 10**9) == h  # one row: an embedding block keeps nothing of its own
    # a tied embedding (its block shares the weight with the head) is never tiled: the runtime refuses
    tied = dataclasses.replace(embed, shares_params=True)
    assert unit_params(tied, 8) == tied.num_params and block_tiles(tied, 8) == 1 and block_tiles(embed, 8) == 8


def test_tiled_variant_only_where_the_working_set_is_large() -> None:
    z3, z0 = StateOption(ZeroStage.PARAMETERS), StateOption(ZeroStage.NONE)
    work = lambda p: estimate_fsdp_working_bytes(block_params=p, zero3=True, compute_bytes=2)  # noqa: E731
    untiled = work(PROF.blocks[1].num_params)
    small = tiled_options((z0, z3), PROF.blocks, tp=1, working_bytes=work, capacity_bytes=untiled / TILED_WORKING_SHARE)
    assert small == (z0, z3)
    big = tiled_options((z0, z3), PROF.blocks, tp=1, working_bytes=work, capacity_bytes=untiled)
    assert big[:2] == (z0, z3) and len(big) == 3
    t = big[2].tiles
    assert big[2] == dataclasses.replace(z3, tiles=t) and t > 1
    # the fewest tiles: the working set with half as many is above the share, or tiles reached the
    # largest unit tiling leaves whole (a layer's norms and biases: the embedding is tiled too)
    floor = max(b.num_params - b.linear_params for b in PROF.blocks)
    assert work(unit_params(PROF.blocks[1], t)) <= TILED_WORKING_SHARE * untiled or unit_params(PROF.blocks[1], t) <= floor
    assert work(unit_params(PROF.blocks[1], t // 2)) > TILED_WORKING_SHARE * untiled
    assert unit_params(PROF.blocks[1], t // 2) > floor
    # never with tensor parallelism
    assert tiled_options((z3,), PROF.blocks, tp=2, working_bytes=work, capacity_bytes=untiled) == (z3,)


def test_planner_tiles_when_the_block_working_set_does_not_fit() -> None:
    c = _cluster(22)
    plan = plan_from_profile(PROF, c, global_batch=8, max_microbatches=1, max_tp=1)
    # one stage, or (GPipe's stages peak before any gradient exists) a pipeline of one micro-batch
    assert all(st.zero_stage is ZeroStage.PARAMETERS and st.tp_degree == 1 for st in plan.stages)
    tiles = [b.tiles for st in plan.stages for b in st.blocks]
    assert min(tiles) > 1 and len(set(tiles)) == 1  # embedding, layers and head tiled alike
    pp = len(plan.stages)
    cfg = dict(dp=8 // pp, pp=pp, schedule=plan.schedule, zero_stage=3,
               checkpoint=tuple(sum(b.checkpoint for b in st.blocks) for st in plan.stages),
               boundaries=tuple(len(st.blocks) for st in plan.stages))
    # the same configuration untiled does not fit; tiled, the estimate is the plan's own prediction
    assert not estimate_from_profile(PROF, c, {**cfg, "tiles": 1}, global_batch=8).feasible
    est = estimate_from_profile(PROF, c, {**cfg, "tiles": tiles[1]}, global_batch=8)
    assert est.feasible
    assert est.step_time_s == pytest.approx(plan.cost.step_time_s, rel=1e-9)
    assert [st.cost.memory_bytes for st in est.plan.stages] == [st.cost.memory_bytes for st in plan.stages]
    # the plan says so, and survives a round trip
    assert f"tiles:{tiles[1]}" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_planner_tiles_the_embedding_when_it_is_the_largest_unit() -> None:
    """A million-token vocabulary: the embedding (4.1B parameters) dwarfs a layer (0.2B). Tiled like the
    linears, it no longer bounds the FSDP2 working set: a plan fits on 28 GiB devices with every block
    tiled; the same model with the embedding untileable (a tied one) has no plan there."""
    big = transformer_profile(num_layers=4, hidden=4096, seq_len=1024, vocab=1_000_000, num_heads=32, batch=1,
                              name="big-vocab")
    embed = big.blocks[0]
    assert embed.num_params == max(b.num_params for b in big.blocks)
    c = _cluster(28)
    (stage,) = plan_from_profile(big, c, global_batch=8, max_microbatches=1, max_tp=1).stages
    tiles = [b.tiles for b in stage.blocks]
    assert stage.zero_stage is ZeroStage.PARAMETERS and tiles[0] > 1 and len(set(tiles)) == 1
    vocab = embed.linear_rows[0][0]  # padded to a multiple of 128, as the synthetic profile does
    assert vocab == 1_000_064 and unit_params(embed, tiles[0]) == -(-vocab // tiles[0]) * 4096
    tied = dataclasses.replace(big, blocks=(dataclasses.replace(embed, shares_params=True), *big.blocks[1:]))
    with pytest.raises(InfeasibleError):
        plan_from_profile(tied, c, global_batch=8, max_microbatches=1, max_tp=1)


def test_tiling_costs_time_and_is_not_chosen_when_not_needed() -> None:
    c = _cluster(80)
    plan = plan_from_profile(PROF, c, global_batch=8, max_microbatches=1, max_tp=1, zero_stages=(3,))
    assert all(b.tiles == 1 for s in plan.stages for b in s.blocks)
    cfg = dict(dp=8, zero_stage=3, checkpoint=True)
    one = estimate_from_profile(PROF, c, {**cfg, "tiles": 1}, global_batch=8)
    four = estimate_from_profile(PROF, c, {**cfg, "tiles": 4}, global_batch=8)
    assert four.step_time_s > one.step_time_s
    assert four.plan.stages[0].cost.buffer_bytes < one.plan.stages[0].cost.buffer_bytes


def test_tiles_refused_below_zero3_and_with_tp() -> None:
    c = _cluster(80)
    with pytest.raises(PlanError, match="tiles=2 needs ZeRO-3"):
        estimate_from_profile(PROF, c, dict(dp=8, zero_stage=2, tiles=2), global_batch=8)
    with pytest.raises(PlanError, match="tensor parallelism"):
        estimate_from_profile(PROF, c, dict(dp=4, tp=2, zero_stage=3, tiles=2), global_batch=8)
    plan = estimate_from_profile(PROF, c, dict(dp=8, zero_stage=3, tiles=2), global_batch=8).plan
    s0 = plan.stages[0]
    with pytest.raises(PlanError, match="block 'embed': tiles=2 needs ZeRO-3"):
        dataclasses.replace(s0, zero_stage=ZeroStage.GRADIENTS)
