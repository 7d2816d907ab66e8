"""Gradients reduce-scattered every micro-batch (``StagePlan.reduce_every_microbatch``): FSDP2 sums each
micro-batch's reduced shard into the sharded gradient instead of keeping unsharded gradients of the
whole stage until the last micro-batch. The planner offers it where that accumulation buffer is what
does not fit; the runtime computes what one process computes (gloo, fp32) and issues a reduce-scatter
per FSDP2 unit per micro-batch; stages it cannot lower are refused."""

from __future__ import annotations

import pytest

from whalepy.errors import PlanError
from whalepy.cost_models.devices import CATALOG
from whalepy.planner.estimate import estimate_from_profile
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from dist_harness import run_distributed
from planner_fixtures import cluster, group
from runtime_cases import Case, batches, build_model, case_profile, lm_loss, adamw, make_case_plan, run_cases

PROF = transformer_profile(num_layers=16, hidden=6144, seq_len=2048, vocab=50257, num_heads=48, batch=1, name="m")


def _cluster():  # type: ignore[no-untyped-def]
    # 40 GiB A100s: ZeRO-3 over 16 of them holds the states, not the whole stage's unsharded fp32
    # gradients on top of them
    dev = CATALOG["A100-80GB"].replace(name="a100-40g", memory_bytes=40 * 2**30)
    return cluster(group("a", dev.name, 8, 2, custom={dev.name: dev}), custom=[dev])


def test_planner_reduces_every_microbatch_where_accumulation_does_not_fit() -> None:
    c = _cluster()
    cfg = dict(dp=16, zero_stage=3, checkpoint=True, num_microbatches=4)
    held = estimate_from_profile(PROF, c, cfg, global_batch=64)
    each = estimate_from_profile(PROF, c, {**cfg, "reduce_every_microbatch": True}, global_batch=64)
    assert not held.feasible and each.feasible
    # the buffer it drops is the stage's unsharded fp32 gradient (4 bytes per parameter, less the
    # sharded gradient the states already hold); the reduce-scatters it adds cost time
    drop = held.plan.stages[0].cost.buffer_bytes - each.plan.stages[0].cost.buffer_bytes
    assert drop == pytest.approx(4 * PROF.total_params * (1 - 1 / 16), rel=1e-3)
    assert each.step_time_s > held.step_time_s
    # sequence 8192: one sample's checkpointed activations leave no room for four per micro-batch, and
    # four micro-batches leave none for the accumulated gradients: the planner reduces every micro-batch
    long = transformer_profile(num_layers=16, hidden=6144, seq_len=8192, vocab=50257, num_heads=48, batch=1,
                               name="long")
    plan = plan_from_profile(long, c, global_batch=64, max_tp=1, zero_stages=(3,))
    (st,) = plan.stages
    assert st.reduce_every_microbatch and plan.num_microbatches > 1
    assert "reduce:every-mb" in str(plan)
    # the same layout with every block checkpointed: fits only reducing every micro-batch
    cfg = dict(dp=16, zero_stage=3, num_microbatches=plan.num_microbatches, checkpoint=True)
    assert not estimate_from_profile(long, c, cfg, global_batch=64).feasible
    assert estimate_from_profile(long, c, {**cfg, "reduce_every_microbatch": True}, global_batch=64).feasible


def test_refused_where_not_lowered() -> None:
    c = _cluster()
    with pytest.raises(PlanError, match="pipeline stages is not lowered"):
        estimate_from_profile(PROF, c, dict(dp=8, pp=2, zero_stage=3, num_microbatches=4,
                                            reduce_every_microbatch=True), global_batch=64)
    with pytest.raises(PlanError, match="needs the FSDP2 lowering"):
        estimate_from_profile(PROF, c, dict(dp=16, zero_stage=0, num_microbatches=4,
                                            reduce_every_microbatch=True), global_batch=64)


def _count_reduce_scatters(microbatches: int, each: bool) -> int:
    import whalepy
    from whalepy.tools.comm_count import CollectiveCounter
    from whalepy.cost_models.communication import Collective
    from whalepy.runtime import parallelize

    case = Case("count", dp=2, zero=3, microbatches=microbatches, extra={"reduce_every_microbatch": each})
    data = batches(case.global_batch, 1)
    pm = parallelize(build_model("gpt"), None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
                     optimizer=adamw, global_batch=case.global_batch, plan=make_case_plan(case),
                     profile=case_profile("gpt"))
    with CollectiveCounter() as counter:
        pm.train_step(*data[0])
    del whalepy
    return counter.calls[Collective.REDUCE_SCATTER]


def _worker() -> dict:  # type: ignore[type-arg]
    cases = [
        Case("gpt dp2 zero3 2 micro-batches, reduce every micro-batch", dp=2, zero=3, microbatches=2,
             extra={"reduce_every_microbatch": True}),
        Case("gpt dp2 zero3 checkpointing 4 micro-batches, reduce every micro-batch", dp=2, zero=3,
             checkpoint=True, microbatches=4, extra={"reduce_every_microbatch": True}),
        Case("gpt dp2 zero3 host offload 2 micro-batches, reduce every micro-batch", dp=2, zero=3,
             microbatches=2, extra={"reduce_every_microbatch": True, "param_tier": "cpu", "optimizer_tier": "cpu"}),
    ]
    return {"numerics": run_cases(cases),
            "calls": {(m, e): _count_reduce_scatters(m, e) for m in (1, 2) for e in (False, True)}}


@pytest.mark.distributed
def test_runtime_matches_one_process_and_reduces_each_microbatch() -> None:
    for out in run_distributed(_worker, 2, timeout=300):
        for r in out["numerics"]:
            assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        calls = out["calls"]
        units = calls[(1, False)]
        assert units > 0 and calls[(1, True)] == units  # one micro-batch: the same reductions
        assert calls[(2, False)] == units  # accumulated unsharded: reduced once
        assert calls[(2, True)] == 2 * units  # every micro-batch
