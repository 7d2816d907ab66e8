"""The planner offers only what the runtime lowers: one capability check (whalepy.ir.rules) decides
for the planner's enumeration, ``whalepy.estimate`` and the runtime's refusals.

In one process: every candidate the planner enumerates on random instances passes the check, and what
the check refuses, ``estimate`` and the runtime refuse with the same words. On gloo: a planner-made
plan of each pipeline kind the planner produces (GPipe, 1F1B, interleaved 1F1B, sequence-parallel
TP) and a planner-made stage whose blocks keep their states in two tiers (device and NVMe files) train
like one process, all in one 2-rank launch.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import whalepy
from whalepy.ir.rules import check_pipeline, microbatch_error, schedule_error, sequence_parallel_error
from whalepy.errors import PlanError
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
from whalepy.ir.plan import TPStyle
from whalepy.ir.profile import BlockAnnotations
from whalepy.planner import make_options, plan_from_profile
from whalepy.planner.costing import CostContext
from whalepy.planner.space import Hardware
from whalepy.planner.synthetic import transformer_profile

from planner_bruteforce import outer_candidates, random_instance
from planner_fixtures import a100

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
"""As the other runtime tests: fp32 on CPU, the same arithmetic in another order."""


def _tp_sequence(prof, tp: int) -> bool:  # type: ignore[no-untyped-def]
    return tp > 1 and any(r.style is TPStyle.SEQUENCE for b in prof.blocks for r in b.tp_rules)


@pytest.mark.parametrize("seed", range(40))
def test_every_enumerated_candidate_lowers(seed: int) -> None:
    inst = random_instance(random.Random(1000 + seed), max_layers=6)
    opts = make_options(inst.options)
    ctx = CostContext(inst.profile, Hardware(inst.cluster), precision=opts.precision,
                      sequence_parallel=opts.sequence_parallel, memory_margin=opts.memory_margin)
    cands, _ = outer_candidates(ctx, inst.global_batch, **inst.options)
    for c in cands:
        check_pipeline(c.schedule, num_stages=c.num_stages, virtual_stages=c.virtual_stages,
                       num_microbatches=c.num_microbatches,
                       sequence_parallel=_tp_sequence(inst.profile, c.tp), where=c.describe())


def test_sequence_parallel_plans_have_no_pipeline_stages() -> None:
    """With ``split(8)`` on 16 GPUs the planner may pipeline or replicate; with sequence parallelism it
    only replicates, and its alternatives say why pipelines were left out."""
    names = ["embed", *(f"h.{i}" for i in range(8)), "head"]
    prof = transformer_profile(num_layers=8, hidden=4096, seq_len=2048, vocab=50257, num_heads=32,
                               sequence_parallel=True, annotations={n: BlockAnnotations(split=8) for n in names})
    p = plan_from_profile(prof, a100(2), global_batch=64, sequence_parallel=True)
    assert p.pp_degree == 1 and p.tp_degrees == (8,)
    assert any(r.style is TPStyle.SEQUENCE for r in p.tensor_parallel)
    assert any("sequence-sharded residual stream cannot cross pipeline stages" in a.reason
               for a in p.alternatives), p.explain()


def test_estimate_refuses_what_the_runtime_refuses() -> None:
    prof = transformer_profile(num_layers=4, hidden=256, seq_len=128, vocab=8000, num_heads=8)
    with pytest.raises(PlanError, match="Schedule1F1B needs at least as many micro-batches"):
        estimate_from_profile(prof, a100(1), dict(dp=2, pp=4, num_microbatches=2, schedule="1f1b"),
                              global_batch=8)
    # GPipe runs any count: the same shape estimates
    estimate_from_profile(prof, a100(1), dict(dp=2, pp=4, num_microbatches=2, schedule="gpipe"), global_batch=8)
    with pytest.raises(PlanError, match="runs one stage per rank"):
        ParallelConfig(dp=2, pp=4, virtual_stages=2, schedule="1f1b", num_microbatches=4)
    sp = transformer_profile(num_layers=4, hidden=256, seq_len=128, vocab=8000, num_heads=8, sequence_parallel=True)
    with pytest.raises(PlanError, match="sequence-sharded residual stream cannot cross pipeline stages"):
        estimate_from_profile(sp, a100(1), dict(dp=2, tp=2, pp=2, num_microbatches=2), global_batch=8)
    estimate_from_profile(sp, a100(1), dict(dp=4, tp=2, num_microbatches=2), global_batch=8)


def test_capability_rules() -> None:
    assert microbatch_error("1f1b", num_stages=4, num_microbatches=3) is not None
    assert microbatch_error("1f1b", num_stages=4, num_microbatches=4) is None
    assert microbatch_error("1f1b", num_stages=1, num_microbatches=1) is None  # no pipeline: accumulation
    assert microbatch_error("gpipe", num_stages=4, num_microbatches=1) is None
    # ScheduleInterleaved1F1B: max(1, M // S) rounds must divide M
    assert microbatch_error("interleaved_1f1b", num_stages=4, num_microbatches=6) is None
    assert microbatch_error("interleaved_1f1b", num_stages=2, num_microbatches=5) is not None
    assert schedule_error("gpipe", num_stages=2, virtual_stages=2) is not None
    assert schedule_error("interleaved_1f1b", num_stages=1, virtual_stages=2) is not None
    assert schedule_error("interleaved_1f1b", num_stages=2, virtual_stages=2) is None
    assert sequence_parallel_error(sequence_parallel=True, num_stages=2) is not None
    assert sequence_parallel_error(sequence_parallel=True, num_stages=1) is None
    assert sequence_parallel_error(sequence_parallel=False, num_stages=4) is None


# -- planner-made plans on gloo ---------------------------------------------------------------------

def _cluster(per_node: int, nodes: int) -> whalepy.ClusterSpec:
    return whalepy.ClusterSpec.from_dict({"network": {"bandwidth_gbps": 10}, "groups": [
        {"name": "cpu", "gpu": "CPU", "gpus_per_node": per_node, "nodes": nodes, "intra_node": "shm",
         "simulated": True}]})


MIXED_MEMORY_GB = 0.0004
"""400 kB per simulated device: the test GPT's states (30k parameters, 16 bytes each, halved by ZeRO-2
over two ranks) with its activations fit only if some blocks keep their optimizer states in files (the
all-device plan needs 457 kB under the memory model as it is now; 500 kB, the value before the H200
work's activation accounting, fits it whole)."""


def _nvme_cluster(memory_gb: float) -> whalepy.ClusterSpec:
    """Two simulated CPU devices of ``memory_gb`` each, with host memory and NVMe."""
    return whalepy.ClusterSpec.from_dict({"network": {"bandwidth_gbps": 10}, "devices": {"small-cpu": {
        "vendor": "cpu", "memory_gb": memory_gb, "peak_tflops_32": 0.1, "peak_tflops_16": 0.1,
        "memory_bandwidth_gbs": 20, "host_link_gbs": 10}}, "groups": [
        {"name": "cpu", "gpu": "small-cpu", "gpus_per_node": 2, "nodes": 1, "intra_node": "shm", "simulated": True,
         "cpu_memory_gb": 64, "nvme": {"capacity_tb": 1, "read_gbs": 2, "write_gbs": 1}}]})


def _profile(annotation, *, sequence_parallel: bool = False):  # type: ignore[no-untyped-def]
    from runtime_cases import SEQ, build_model

    model = build_model("gpt", 2)
    whalepy.annotate(model, {"transformer": annotation, "lm_head": annotation})
    prof = whalepy.profile(model, (torch.zeros(2, SEQ, dtype=torch.long),), sequence_parallel=sequence_parallel)
    return dataclasses.replace(prof, graph=None)  # picklable for the ranks


def _planned_cases() -> list[tuple[str, object, object]]:
    """A plan of each kind, made by the planner: ``replicate(1)`` on two single-device nodes leaves it
    only pipelines (the schedule option picks which); ``split(2)`` with sequence parallelism makes it
    tensor-parallel with SEQUENCE rules."""
    out = []
    pp = _profile(whalepy.replicate(1))
    for sched in ("gpipe", "1f1b", "interleaved_1f1b"):
        p = plan_from_profile(pp, _cluster(1, 2), global_batch=8, schedules=(sched,), precision="fp32")
        assert p.pp_degree == 2 and p.schedule.value == sched, (sched, p)
        assert (p.virtual_stages == 2) == (sched == "interleaved_1f1b"), p
        out.append((f"pp2 {sched}", p, pp))
    # granular tiers: a device too small for every block's states, with NVMe: the planner keeps some
    # blocks' optimizer states in files and the rest on the device, in one FSDP2 stage
    mixed = _profile(whalepy.replicate(2))
    p = plan_from_profile(mixed, _nvme_cluster(MIXED_MEMORY_GB), global_batch=8, schedules=("1f1b",), precision="fp32")
    assert p.pp_degree == 1 and len({(b.param_tier, b.optimizer_tier) for b in p.stages[0].blocks}) == 2, p
    out.append(("pp1 mixed tiers", p, mixed))
    sp = _profile(whalepy.split(2), sequence_parallel=True)
    p = plan_from_profile(sp, _cluster(2, 1), global_batch=8, sequence_parallel=True, precision="fp32")
    assert p.pp_degree == 1 and p.tp_degrees == (2,), p
    assert any(r.style is TPStyle.SEQUENCE for r in p.tensor_parallel), p
    out.append(("tp2 sequence-parallel", p, sp))
    return out


def _run_planned(cases: list[tuple[str, object, object]], refused) -> list[dict]:  # type: ignore[no-untyped-def]
    import tempfile
    import warnings

    from runtime_cases import adamw, batches, build_model, full_params, lm_loss, reference_run
    from whalepy.runtime import parallelize

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    out = []
    for name, plan, prof in cases:
        data = batches(8, 3)
        ref_losses, ref_params = reference_run("gpt", data)
        mixed = "mixed" in name
        nvme = {"nvme_dir": tempfile.mkdtemp(prefix="whalepy-planned-")} if mixed else {}
        pm = parallelize(build_model("gpt"), _nvme_cluster(MIXED_MEMORY_GB) if mixed else None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
                         optimizer=adamw, global_batch=8, plan=plan, profile=prof, **nvme)
        losses = [pm.train_step(x, y).item() for x, y in data]
        params = full_params(pm)
        out.append({"name": name, "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                    "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in params)})
    plan, prof = refused
    try:
        parallelize(build_model("gpt"), None, example_inputs=(batches(8, 1)[0][0][:2],), loss_fn=lm_loss,
                    optimizer=adamw, global_batch=8, plan=plan, profile=prof)
        out.append({"name": "refused", "error": None})
    except PlanError as e:
        out.append({"name": "refused", "error": str(e)})
    return out


@pytest.mark.distributed
def test_planner_made_plans_lower_and_match_one_process() -> None:
    from dist_harness import run_distributed
    from runtime_cases import case_profile, make_case_plan, Case

    cases = _planned_cases()
    # a plan the planner never makes (1F1B, fewer micro-batches than stages): the runtime refuses it
    # with the capability check's words, before building anything
    bad = make_case_plan(Case("bad", pp=2, microbatches=1, schedule="1f1b"))
    results = run_distributed(_run_planned, 2, cases, (bad, dataclasses.replace(case_profile("gpt"), graph=None)),
                              timeout=300)
    for per_rank in results:
        *trained, refused = per_rank
        assert [r["name"] for r in trained] == [c[0] for c in cases]
        for r in trained:
            assert r["loss_err"] <= LOSS_RTOL and r["param_err"] <= PARAM_ATOL, r
        assert refused["error"] and "Schedule1F1B needs at least as many micro-batches" in refused["error"], refused
