"""``whalepy check``: every rank of a plan lowered in one process (whalepy/tools/rank_check.py).

Layouts of every rank of large plans (1,024 ranks, 3-D; 64 mixed-type ranks with uneven stages and
per-block tiers; interleaved stages) are read and checked without torch; plans broken by hand are
refused with the rank named. Lowering (the runtime's ``parallelize`` on the fake process group, the
model on the meta device, shards as FakeTensors) runs on tiny models, one representative per role, and
the bytes each holds must equal the plan's prediction exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from precision_cases import cpu_cluster
from runtime_cases import batches, build_model, case_profile
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
from whalepy.runtime.mesh import make_plan
from whalepy.tools.rank_check import RankCheckError, check_ranks, rank_layout, roles, simulated

GPT3_BLOCKS = ["embed", *[f"transformer.h.{i}" for i in range(96)], "head"]


def _gpt3_plan() -> dict:
    """GPT-3 175B's 98 blocks on 1,024 A100: pp 8 x dp 16 x tp 8 (the layout of Narayanan et al., SC'21)."""
    return make_plan(GPT3_BLOCKS, pp=8, dp=16, tp=8, global_batch=1536, num_microbatches=12,
                     device_type="A100-80GB", zero_stage=1, precision="bf16").to_dict()


def test_every_rank_of_a_1024_rank_3d_plan_has_its_place():
    plan = _gpt3_plan()
    layouts = rank_layout(plan, GPT3_BLOCKS)
    assert len(layouts) == 1024 and len(roles(layouts)) == 8  # one role per stage: same type and share
    from whalepy.ir.plan import Plan

    p = Plan.from_dict(plan)
    for r in (0, 517, 1023):
        lay = layouts[r]
        stage, replica, tp_index = p.stage_of_rank(r)  # the runtime's own reading of the grid
        assert (lay.stage, lay.replica, lay.tp_index) == (stage.index, replica, tp_index)
        assert lay.tp_group == stage.ranks[replica] and r in lay.dp_group and r in lay.pp_group
        assert len(lay.dp_group) == 16 and len(lay.pp_group) == 8 and lay.batch_share == 96
        assert [b for c in lay.chunks for b in c] == list(stage.block_names)


def test_mixed_types_uneven_stages_and_interleaving_layouts():
    """Llama-70B's 82 blocks on 32 A100 + 32 L40S: 4 uneven stages, per-block tiers, replicas of two types
    with uneven batch shares; and interleaved stages (2 virtual stages per rank)."""
    blocks = ["embed", *[f"model.layers.{i}" for i in range(80)], "head"]
    plan = make_plan(blocks, pp=4, dp=4, tp=4, global_batch=64, num_microbatches=4, stage_sizes=(26, 22, 18, 16),
                     batch_shares=(20, 20, 12, 12), zero_stage=3, precision="bf16", device_type="A100-80GB",
                     tiers={f"model.layers.{i}": ("cpu", "cpu") for i in range(20, 26)}).to_dict()
    types = ["A100-80GB" if (r // 4) % 4 < 2 else "L40S" for r in range(64)]  # replicas 0-1 A100, 2-3 L40S
    plan["rank_device_types"] = types
    for s in plan["stages"]:
        s["device_types"] = [types[row[0]] for row in s["ranks"]]
    layouts = rank_layout(plan, blocks)
    by_role = roles(layouts)
    assert len(by_role) == 4 * 2  # (stage, type, share): each stage has an A100 and an L40S role
    assert [len(layouts[s["ranks"][0][0]].chunks[0]) for s in plan["stages"]] == [26, 22, 18, 16]
    assert {layouts[r].batch_share for r in by_role[(0, "L40S", 12)]} == {12}
    inter = make_plan([f"b{i}" for i in range(8)], pp=2, dp=2, global_batch=8, num_microbatches=4,
                      schedule="interleaved_1f1b", virtual_stages=2).to_dict()
    lay = rank_layout(inter, [f"b{i}" for i in range(8)])
    assert lay[0].chunks == (("b0", "b1"), ("b4", "b5")) and lay[2].chunks == (("b2", "b3"), ("b6", "b7"))


@pytest.mark.parametrize("breakage, rank, words", [
    ("width", 296, "tensor-parallel group"),
    ("block", 384, "'transformer.h.40' is on no stage"),
    ("share", 7 * 8, "sum to 1537"),
    ("rank", 1023, "rank 1023 is on no stage"),
])
def test_a_broken_plan_is_refused_with_its_rank_named(breakage, rank, words):
    plan = copy.deepcopy(_gpt3_plan())
    stage3 = next(s for s in plan["stages"] if s["index"] == 2)
    if breakage == "width":  # stage 2, replica 5's TP group loses a rank
        stage3["ranks"][5] = stage3["ranks"][5][:-1]
    elif breakage == "block":  # a block on no stage
        holder = next(s for s in plan["stages"] if any(b["name"] == "transformer.h.40" for b in s["blocks"]))
        holder["blocks"] = [b for b in holder["blocks"] if b["name"] != "transformer.h.40"]
    elif breakage == "share":  # replica 7 takes one sample more
        plan["batch_shares"][7] += 1
    else:  # the last rank given twice, rank 1023 nowhere
        last = next(s for s in plan["stages"] if s["index"] == 7)
        last["ranks"][-1][-1] = 1022
    with pytest.raises(RankCheckError, match=rf"rank(s)? {rank}\b.*|.*{words}") as err:
        rank_layout(plan, GPT3_BLOCKS)
    assert f"{rank}" in str(err.value) and words in str(err.value), str(err.value)


# -- lowering, one representative per role ----------------------------------------------------------


def _check(kind: str, layers: int, world: int, config: ParallelConfig, **kwargs):  # type: ignore[no-untyped-def]
    prof = case_profile(kind, layers)
    cluster = cpu_cluster(world)
    plan = estimate_from_profile(prof, cluster, config, global_batch=8, precision="fp32").plan

    def build():
        with torch.device("meta"):
            return build_model(kind, layers), (batches(8, 1)[0][0][:2],)

    return plan, check_ranks(plan.to_dict(), build, profile=prof, cluster=simulated(cluster), **kwargs)


def test_lowered_roles_hold_what_the_plan_predicts():
    """Uneven stages (1 + 3 blocks), uneven batch shares (6 and 2), ZeRO-3 over 2 replicas: the roles'
    representatives hold, per place, exactly the plan's model-state bytes, in the meshes of the plan's
    grid."""
    plan, reports = _check("gpt", 2, 4, ParallelConfig(pp=2, dp=2, zero_stage=3, num_microbatches=2,
                                                       boundaries=(1, 3), batch_shares=(6, 2)), ranks=[0, 3])
    assert [len(b) for b in (plan.stages[0].blocks, plan.stages[1].blocks)] == [1, 3]
    for rep in reports:
        assert rep.error is None and rep.meshes["pp"] == rep.layout.pp_group, rep.lines()
        assert rep.held["optimizer"]["device"] > 0  # the step made the states
        assert rep.ok, rep.lines()  # held bytes exact; the 1F1B step's collectives within 1%
        assert {"send_recv", "all_gather", "reduce_scatter"} <= rep.collectives.keys(), rep.lines()


def test_lowering_holds_what_the_plan_charges_under_tp_and_tied_copies():
    """The two gaps of the memory model this check once found, closed, each to the byte (16 bytes per
    parameter: fp32 weight, gradient and two Adam states, ZeRO-3 divides them by dp = 2):

    - TP 2: parameters of modules without a sharding rule, of ``replicate`` rules and the biases of
      row-parallel linears stay whole on every TP rank (``BlockProfile.tp_whole_params``), the rest is
      split; the plan charges ``split / tp + whole``;
    - interleaved stages with tied embeddings (HF GPT-2's ``lm_head`` is ``wte``): the stage holding the
      head keeps a copy of the tied weight (``BlockProfile.tied_copies``), charged to it as well as to
      the embedding's stage."""
    from whalepy.ir.plan import TPStyle

    prof = case_profile("gpt", 2)
    plan, reports = _check("gpt", 2, 8, ParallelConfig(pp=2, dp=2, tp=2, zero_stage=3, num_microbatches=2),
                           ranks=[0, 4])
    model = build_model("gpt")
    for rep in reports:
        blocks = [b for b in prof.blocks if b.name in {n for c in rep.layout.chunks for n in c}]
        style = {r.module: r.style for b in blocks for r in b.tp_rules}
        # what stays whole, from the model and the rules (not from the profile's field)
        whole = sum(p.numel() for n, p in model.named_parameters()
                    for b in blocks if any(n.startswith(m + ".") for m in b.modules)
                    for mod, kind in [n.rsplit(".", 1)]
                    if style.get(mod) in (None, TPStyle.REPLICATE) or (style[mod] is TPStyle.ROWWISE and kind == "bias"))
        assert whole == sum(b.tp_whole_params for b in blocks) > 0
        assert rep.error is None and rep.ok, (rep.lines(), whole)
    plan, reports = _check("hf_tied", 4, 4, ParallelConfig(pp=2, dp=2, zero_stage=3, num_microbatches=2,
                                                           schedule="interleaved_1f1b", virtual_stages=2),
                           ranks=[0, 2])
    wte = build_model("hf_tied", 4).transformer.wte.weight.numel()
    owner, other = reports
    assert other.layout.chunks[-1][-1] == "head"
    # model states exactly (HF GPT-2's pipeline messages carry a mask the stages recompute, which the
    # byte model counts: test_pipelined_steps_move_the_predicted_collective_bytes uses whalepy's GPT)
    for rep in (owner, other):
        assert rep.error is None and rep.held_by_place == rep.predicted, rep.lines()
    # the head's stage holds the copy: 16 bytes per element over dp 2, beside its own blocks
    names = {n for c in other.layout.chunks for n in c}
    own = sum(b.num_params for b in case_profile("hf_tied", 4).blocks if b.name in names)
    assert other.predicted["device"] == 16 * (own + wte) // 2, other.lines()


def test_one_step_moves_the_predicted_collective_bytes():
    """Without pipeline stages a whole training step runs on the fake tensors: ZeRO-3 (2 micro-batches)
    and ZeRO-2 (uneven batch shares) over 4 replicas move per kind what the cost model says (within 1%),
    and hold what it predicts. (A meta model under DDP is not lowered: DDP reads values at its
    construction, a lowering error the check reports.)"""
    for config in (ParallelConfig(dp=4, zero_stage=3, num_microbatches=2),
                   ParallelConfig(dp=4, zero_stage=2, batch_shares=(2, 2, 3, 1))):
        plan, (rep,) = _check("gpt", 2, 4, config, ranks=[3])
        assert rep.collectives and rep.predicted_collectives and rep.ok, rep.lines()
        assert rep.collectives.keys() == rep.predicted_collectives.keys()


def _within(rep, kinds):  # type: ignore[no-untyped-def]
    for kind in kinds:
        got, want = rep.collectives.get(kind, 0), rep.predicted_collectives.get(kind, 0.0)
        assert want > 0 and abs(got - want) <= 0.01 * want, (kind, rep.lines())


def test_pipelined_steps_move_the_predicted_collective_bytes():
    """A whole pipelined step runs on the fake process group (the stages are built with their shapes,
    so torch's schedule exchanges no metadata objects) and moves, per kind, what the cost model says:

    - interleaved 1F1B with a tied embedding and head (pp 2 x v 2, dp 2, ZeRO-3): the sends and
      receives between stages, the all-reduce of the tied weight's gradient over the two stages holding
      a copy, FSDP2's ``M + 1`` all-gathers per chunk and one reduce-scatter;
    - 3-D (pp 2 x dp 2 x tp 2): also the TP all-reduces (row-parallel outputs forward, column-parallel
      input gradients backward) and the head's logits all-gather.

    The data-parallel bytes include what TP leaves whole and a stage's copy of a tied weight, as the
    memory model counts them (test_lowering_holds_what_the_plan_charges_under_tp_and_tied_copies): the
    held model states equal the plan's, and the data-parallel bytes the prediction."""
    for kind, layers, world, config, ranks in (
            ("gpt_tied", 4, 4, ParallelConfig(pp=2, dp=2, zero_stage=3, num_microbatches=2,
                                              schedule="interleaved_1f1b", virtual_stages=2), [0, 2]),
            ("gpt", 2, 8, ParallelConfig(pp=2, dp=2, tp=2, zero_stage=3, num_microbatches=2), [0, 4])):
        plan, reports = _check(kind, layers, world, config, ranks=ranks)
        for rep in reports:
            assert rep.error is None and rep.predicted_collectives is not None, rep.lines()
            _within(rep, ("send_recv", "all_reduce"))
            assert rep.held_by_place == rep.predicted and rep.ok, rep.lines()
        if kind == "gpt_tied":
            assert reports[0].ok, reports[0].lines()  # the embedding's stage: everything as predicted
            assert reports[1].layout.chunks[-1][-1] == "head" and reports[1].collectives["all_reduce"] > 4
