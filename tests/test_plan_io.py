"""Plan JSON: exact round trip, unknown versions and other models refused."""

from __future__ import annotations

import json

import pytest

from whalepy.errors import PlanError
from whalepy.ir.plan import Plan
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import a100


@pytest.fixture(scope="module")
def plan() -> Plan:
    prof = transformer_profile(num_layers=8, hidden=1024, seq_len=512, vocab=32000, num_heads=16)
    return plan_from_profile(prof, a100(2), global_batch=64)


def test_round_trip_is_exact(plan: Plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_unknown_version_is_refused(plan: Plan) -> None:
    data = json.loads(plan.to_json())
    data["version"] = 999
    with pytest.raises(PlanError, match="version"):
        Plan.from_dict(data)


def test_wrong_model_fingerprint_is_refused(plan: Plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "plan.json"
    plan.save(path)
    Plan.load(path, model_fingerprint=plan.model_fingerprint)
    with pytest.raises(PlanError, match="fingerprint"):
        Plan.load(path, model_fingerprint="0" * 16)


def test_malformed_plans_are_plan_errors() -> None:
    from whalepy.ir.plan import Plan
    from whalepy.runtime import make_plan

    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_json("[1, 2]")
    with pytest.raises(PlanError, match="num_microbatches must be a positive integer"):
        make_plan(["b0", "b1"], dp=2, global_batch=8, num_microbatches=0)


def test_offload_fields_round_trip_and_version_2_loads(plan: Plan) -> None:
    import dataclasses

    from whalepy.ir.plan import BlockPlan, PLAN_VERSION

    assert PLAN_VERSION == 6
    s0 = plan.stages[0]
    blocks = list(s0.blocks)
    blocks[0] = dataclasses.replace(blocks[0], checkpoint=False, activation_offload=True, prefetch_depth=2)
    changed = dataclasses.replace(plan, stages=(dataclasses.replace(s0, blocks=tuple(blocks)),) + plan.stages[1:])
    again = Plan.from_json(changed.to_json())
    assert again == changed
    assert (again.stages[0].blocks[0].activation_offload, again.stages[0].blocks[0].prefetch_depth) == (True, 2)
    assert "act:cpu" in str(again)
    # a version-2 file has neither field: it loads with the defaults
    data = json.loads(plan.to_json())
    data["version"] = 2
    for stage in data["stages"]:
        for b in stage["blocks"]:
            del b["activation_offload"], b["prefetch_depth"], b["tiles"]
    old = Plan.from_dict(data)
    assert old.version == PLAN_VERSION and old == plan
    assert all(not b.activation_offload and b.prefetch_depth == 1 for s in old.stages for b in s.blocks)
    # a version-3 file has no tiles: untiled
    data = json.loads(plan.to_json())
    data["version"] = 3
    for stage in data["stages"]:
        for b in stage["blocks"]:
            del b["tiles"]
    assert Plan.from_dict(data) == plan and all(b.tiles == 1 for s in plan.stages for b in s.blocks)
    # a version-4 file has no checkpoint_offload: checkpoints stay on the device
    data = json.loads(plan.to_json())
    data["version"] = 4
    for stage in data["stages"]:
        for b in stage["blocks"]:
            del b["checkpoint_offload"]
    assert Plan.from_dict(data) == plan and not any(b.checkpoint_offload for s in plan.stages for b in s.blocks)
    # checkpoint_offload round-trips and is shown
    blocks[1] = dataclasses.replace(blocks[1], checkpoint=True, checkpoint_offload=True)
    changed = dataclasses.replace(plan, stages=(dataclasses.replace(s0, blocks=tuple(blocks)),) + plan.stages[1:])
    again = Plan.from_json(changed.to_json())
    assert again == changed and again.stages[0].blocks[1].checkpoint_offload
    assert "ckpt:cpu" in str(again)
    bad = json.loads(changed.to_json())
    bad["stages"][0]["blocks"][1]["checkpoint"] = False
    with pytest.raises(PlanError, match="checkpoint_offload is set without checkpoint"):
        Plan.from_dict(bad)
    # checked on load: offload excludes recomputation, the depth is a positive integer
    bad = json.loads(changed.to_json())
    bad["stages"][0]["blocks"][0]["checkpoint"] = True
    with pytest.raises(PlanError, match="activation_offload and checkpoint"):
        Plan.from_dict(bad)
    for depth in (0, -1, 1.5, True):
        with pytest.raises(PlanError, match="prefetch_depth must be an integer >= 1"):
            BlockPlan(name="b", prefetch_depth=depth)
