"""whalepy.planner.estimate: validated configurations, the same costing as the planner."""

from __future__ import annotations

import pytest

from whalepy.errors import PlanError
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import gpt_profile, transformer_profile

from planner_fixtures import a100


def test_estimate_reproduces_the_plan() -> None:
    prof = transformer_profile(num_layers=12, hidden=2048, seq_len=1024, vocab=32000, num_heads=16)
    c = a100(2)
    p = plan_from_profile(prof, c, global_batch=64, schedules=("1f1b",), allow_offload=False)
    ck = tuple(sum(b.checkpoint for b in s.blocks) for s in p.stages)
    cfg = ParallelConfig(dp=p.dp_degree, tp=p.tp_degrees[0], pp=p.pp_degree, num_microbatches=p.num_microbatches,
                         schedule=p.schedule, zero_stage=int(p.stages[0].zero_stage), checkpoint=ck,
                         boundaries=tuple(len(s.blocks) for s in p.stages))
    if len({int(s.zero_stage) for s in p.stages}) == 1:
        est = estimate_from_profile(prof, c, cfg, global_batch=64)
        assert est.feasible
        assert est.step_time_s == pytest.approx(p.cost.step_time_s, rel=1e-9)


def test_estimate_reports_memory_shortfall() -> None:
    est = estimate_from_profile(gpt_profile("gpt3-175b"), a100(2), dict(dp=16), global_batch=64)
    assert not est.feasible
    assert "short" in est.reason and "A100-80GB" in est.reason
    assert "DOES NOT FIT" in str(est)


def test_more_stages_more_bubble_and_checkpointing_costs_time() -> None:
    prof = gpt_profile("gpt3-1.3b")
    c = a100(1)
    a = estimate_from_profile(prof, c, dict(dp=8, num_microbatches=4), global_batch=64)
    b = estimate_from_profile(prof, c, dict(dp=8, num_microbatches=4, checkpoint=True), global_batch=64)
    assert b.step_time_s > a.step_time_s
    assert b.stages[0].memory_bytes < a.stages[0].memory_bytes
    p1 = estimate_from_profile(prof, c, dict(dp=4, pp=2, num_microbatches=4), global_batch=64)
    assert p1.bubble_s > 0 and a.bubble_s == 0


@pytest.mark.parametrize("bad, match", [
    (dict(dp=3), "world size"),
    (dict(dp=8, schedule="zigzag"), "schedule"),
    (dict(dp=8, zero_stage=4), "zero_stage"),
    (dict(dp=2, tp=4, pp=1, boundaries=(1, 2)), "boundaries"),
    (dict(dp=8, num_microbatches=3), "micro-batches"),
    (dict(dp=8, colour="red"), "unknown config"),
    (dict(dp=1, tp=8, pp=1, checkpoint=(1, 2)), "checkpoint"),
    (dict(dp=4, pp=2, zero_stage=3, num_microbatches=2, host_blocks=(1,)), "host_blocks"),
    (dict(dp=4, pp=2, zero_stage=3, num_microbatches=2, host_blocks=(4, 0)), "leaves none on the device"),
    (dict(dp=4, pp=2, zero_stage=3, num_microbatches=2, host_blocks=(1, 0), offload="cpu"), "no offload"),
])
def test_invalid_configs_are_explained(bad, match) -> None:  # type: ignore[no-untyped-def]
    prof = transformer_profile(num_layers=4, hidden=512, seq_len=256, vocab=8000, num_heads=8)
    with pytest.raises(PlanError, match=match):
        estimate_from_profile(prof, a100(1), bad, global_batch=64)


def test_zero_offload_config_is_the_gpu_cpu_pair() -> None:
    """``offload="cpu", zero_offload=True`` is ZeRO-Offload's ``(gpu, cpu)`` pair in every block: the
    device keeps a bf16 parameter shard (2P/d bytes), the host the fp32 master, gradient and Adam's two
    moments (16P/d); ``offload="cpu"`` alone is ``(cpu, cpu)``: nothing on the device (docs/runtime.md,
    "What each lowering holds")."""
    prof = gpt_profile("gpt3-1.3b")
    P = sum(b.num_params for b in prof.blocks)
    d = 8
    est = {name: estimate_from_profile(prof, a100(1), dict(dp=d, **cfg), global_batch=64).plan
           for name, cfg in (("gpu", {}), ("zero_offload", dict(offload="cpu", zero_offload=True)),
                             ("cpu", dict(offload="cpu")))}
    pairs = {k: {(b.param_tier.value, b.optimizer_tier.value) for s in p.stages for b in s.blocks}
             for k, p in est.items()}
    assert pairs == {"gpu": {("gpu", "gpu")}, "zero_offload": {("gpu", "cpu")}, "cpu": {("cpu", "cpu")}}
    zo, cpu = est["zero_offload"].stages[0].cost, est["cpu"].stages[0].cost
    assert est["zero_offload"].precision.value == "bf16"
    assert zo.model_state_bytes == pytest.approx(2 * P / d, rel=1e-3)
    assert zo.host_state_bytes == pytest.approx(16 * P / d, rel=1e-3) == cpu.host_state_bytes
    assert cpu.model_state_bytes == 0


def test_host_blocks_mix_tiers_inside_a_stage() -> None:
    """``host_blocks``: per stage that many of its layers keep parameters and optimizer states on the host
    (``(cpu, cpu)``) beside the others' on the device (the planner's granular tiers); each stage's
    predicted bytes are the memory model's for its blocks' tiers, and a host block costs time."""
    from whalepy.cost_models.memory import estimate_stage_model_state_bytes
    from whalepy.ir.plan import Tier

    prof = transformer_profile(num_layers=6, hidden=512, seq_len=256, vocab=8000, num_heads=8)
    base = dict(dp=4, pp=2, zero_stage=3, num_microbatches=2, boundaries=(4, 4))
    plain = estimate_from_profile(prof, a100(1), base, global_batch=16)
    est = estimate_from_profile(prof, a100(1), {**base, "host_blocks": (2, 0)}, global_batch=16)
    first, second = est.plan.stages
    tiers = [(b.param_tier, b.optimizer_tier) for b in first.blocks]
    assert tiers.count((Tier.CPU, Tier.CPU)) == 2 and tiers.count((Tier.GPU, Tier.GPU)) == 2
    assert {(b.param_tier, b.optimizer_tier) for b in second.blocks} == {(Tier.GPU, Tier.GPU)}
    for st in est.plan.stages:
        held = estimate_stage_model_state_bytes(
            blocks=[(pb.num_params, b.param_tier, b.optimizer_tier) for b in st.blocks
                    for pb in prof.blocks if pb.name == b.name],
            zero_stage=st.zero_stage, dp_degree=4, precision=est.plan.precision.value)
        assert st.cost.model_state_bytes == pytest.approx(held.resident, rel=1e-9)
        assert st.cost.host_state_bytes == pytest.approx(held.cpu, rel=1e-9)
    assert first.cost.host_state_bytes > 0 == second.cost.host_state_bytes
    assert est.step_time_s > plain.step_time_s
