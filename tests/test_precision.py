"""Precision: plans record it, the runtime trains in it, the memory model charges what it holds.

The two multi-process tests (2 gloo ranks each, every case in one launch) measure, per rank, the
model-state bytes held after a step against the plan's prediction, and compare bf16 / fp16 layouts
with a single-process run of the same precision policy (workers and what is counted:
``precision_cases.py``).
"""

from __future__ import annotations

import json
import tempfile

import pytest

from dist_harness import run_distributed
from planner_fixtures import a100
from precision_cases import held_vs_predicted, numerics
from whalepy.ir.rules import LoweringKind, choose_lowering_kind, state_option_error
from whalepy.hardware.cluster import resolve_precision
from whalepy.errors import PlanError
from whalepy.cost_models.devices import CATALOG
from whalepy.cost_models.memory import estimate_model_state_bytes
from whalepy.ir.plan import PLAN_VERSION, Plan, Precision, Tier
from whalepy.planner import plan_from_profile
from whalepy.planner.space import build_state_options
from whalepy.planner.synthetic import transformer_profile

# -- the plan's precision --------------------------------------------------------------------------


def test_default_precision_follows_the_devices():
    h100, v100, t4, cpu = (CATALOG[n] for n in ("H100-SXM", "V100-32GB", "T4", "CPU"))
    assert resolve_precision([h100]) is Precision.BF16
    assert resolve_precision([h100, v100]) is Precision.FP16  # one type without bf16 decides
    assert resolve_precision([t4]) is Precision.FP16
    assert resolve_precision([cpu]) is Precision.FP32
    assert resolve_precision([cpu], "bf16") is Precision.BF16  # bf16 runs on CPU when asked for
    with pytest.raises(PlanError, match="not supported by V100-32GB.*fp16"):
        resolve_precision([h100, v100], "bf16")


def test_planner_records_precision_and_refuses_bf16_on_v100():
    prof = transformer_profile(num_layers=4, hidden=512, seq_len=256, vocab=8000, num_heads=8)
    plan = plan_from_profile(prof, a100(2), global_batch=16, time_limit_s=20)
    assert plan.precision is Precision.BF16
    assert "bf16" in str(plan).splitlines()[0]
    again = Plan.from_json(plan.to_json())
    assert again.precision is Precision.BF16 and again == plan
    fp32 = plan_from_profile(prof, a100(2), global_batch=16, time_limit_s=20, precision="fp32")
    assert fp32.precision is Precision.FP32
    from whalepy import ClusterSpec

    v100 = ClusterSpec.from_dict({"groups": [{"gpu": "V100-32GB", "gpus_per_node": 2, "intra_node": "nvlink2"}]})
    with pytest.raises(PlanError, match="bf16.*V100"):
        plan_from_profile(prof, v100, global_batch=16, precision="bf16")
    assert plan_from_profile(prof, v100, global_batch=16, time_limit_s=20).precision is Precision.FP16


def test_version_1_plans_load_as_fp32():
    prof = transformer_profile(num_layers=4, hidden=512, seq_len=256, vocab=8000, num_heads=8)
    data = json.loads(plan_from_profile(prof, a100(2), global_batch=16, time_limit_s=20).to_json())
    data["version"] = 1
    del data["precision"]
    for stage in data["stages"]:  # fields version 1 did not have
        for key in ("model_state_bytes", "host_state_bytes", "nvme_state_bytes"):
            del stage["cost"][key]
    old = Plan.from_dict(data)
    assert old.precision is Precision.FP32 and old.version == PLAN_VERSION


# -- what the runtime lowers -----------------------------------------------------------------------


def test_state_options_offered_are_the_ones_lowered():
    options = build_state_options((0, 1, 2, 3), allow_offload=True)
    assert options and all(state_option_error(o.zero, o.param_tier, o.optimizer_tier) is None for o in options)
    tiers = {(o.optimizer_tier, o.param_tier) for o in options}
    assert tiers == {(Tier.GPU, Tier.GPU), (Tier.CPU, Tier.CPU), (Tier.NVME, Tier.GPU), (Tier.NVME, Tier.CPU),
                     (Tier.CPU, Tier.GPU), (Tier.NVME, Tier.NVME), (Tier.CPU, Tier.NVME)}  # (optimizer, parameters)
    assert "optimizer_tier to 'nvme' or 'cpu'" in state_option_error(3, "nvme", "gpu")
    assert "CPUOffloadPolicy" in state_option_error(2, "cpu", "gpu")
    # ZeRO-Offload in fp16 and with clipping (its host step then comes after the backward)
    assert set(build_state_options((0, 1, 2, 3), True, "fp16", clip_gradients=True)) == set(options)


def test_model_state_accounting_by_lowering_kind():
    p, d = 1e9, 8
    assert choose_lowering_kind(0, d, tp=1, pp=1, offload=False) is LoweringKind.DDP
    ddp = estimate_model_state_bytes(num_params=p, zero_stage=0, dp_degree=d, precision="bf16")
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.working_params) == (4 * p, 4 * p, 8 * p, 2 * p)
    assert estimate_model_state_bytes(num_params=p, zero_stage=0, dp_degree=d, precision="fp32").working_params == 0
    z1 = estimate_model_state_bytes(num_params=p, zero_stage=1, dp_degree=d)
    assert z1.resident == 8 * p + 8 * p / d
    z3 = estimate_model_state_bytes(num_params=p, zero_stage=3, dp_degree=d, working_param_bytes=5.0)
    assert (z3.resident, z3.working_params) == (16 * p / d, 5.0)
    # ZeRO-0 with tensor parallelism is lowered to FSDP2 (reshard_after_forward=False): sharded states,
    # parameters gathered whole in the compute dtype from forward to backward
    z0tp = estimate_model_state_bytes(num_params=p, zero_stage=0, dp_degree=d, tp_degree=2, precision="bf16")
    assert (z0tp.resident, z0tp.working_params) == (16 * p / d, 2 * p)
    cpu = estimate_model_state_bytes(num_params=p, zero_stage=3, dp_degree=d, param_tier="cpu", optimizer_tier="cpu")
    assert (cpu.resident, cpu.cpu) == (0.0, 16 * p / d)
    nvme = estimate_model_state_bytes(num_params=p, zero_stage=0, dp_degree=d, optimizer_tier="nvme")
    # two file generations while a step writes, one between steps
    assert (nvme.resident, nvme.nvme, nvme.nvme_between_steps, nvme.cpu) == (8 * p, 2 * 8 * p, 8 * p, 0.0)
    # staging: prefetch_depth + 2 buffers of the largest block's file-homed bytes (DDP: whole tensors)
    staged = estimate_model_state_bytes(num_params=p, zero_stage=0, dp_degree=d, optimizer_tier="nvme", precision="fp32",
                                        largest_block_params=p / 10, prefetch_depth=2)
    assert staged.cpu == 4 * 8 * p / 10
    assert staged.working_params == 8 * p / 10  # the stepped block's states copied to the device
    inf = estimate_model_state_bytes(num_params=p, zero_stage=3, dp_degree=d, param_tier="nvme",
                                     optimizer_tier="nvme", largest_block_params=p / 10)
    # gradients in files too (4 p / d <= one generation, 12 p / d: the peak stays two generations);
    # the host keeps only the staging buffers
    assert (inf.resident, inf.nvme, inf.nvme_between_steps, inf.cpu) == (0.0, 2 * 12 * p / d, 12 * p / d,
                                                                         3 * 12 * p / 10 / d)
    # parameters in files, states on the host: S = G = 4 p / d, peak S + max(S, G) = 8 p / d
    inf_cpu = estimate_model_state_bytes(num_params=p, zero_stage=3, dp_degree=d, param_tier="nvme",
                                         optimizer_tier="cpu", largest_block_params=p / 10)
    assert (inf_cpu.nvme, inf_cpu.nvme_between_steps, inf_cpu.cpu) == (8 * p / d, 4 * p / d,
                                                                       8 * p / d + 3 * 4 * p / 10 / d)
    with pytest.raises(ValueError, match="CPUOffloadPolicy"):
        estimate_model_state_bytes(num_params=p, zero_stage=2, dp_degree=d, param_tier="cpu")


# -- held vs predicted, per rank (2 gloo ranks, one launch) ------------------------------------------

HELD_CASES = [(z, None, prec) for prec in ("fp32", "bf16") for z in (0, 1, 2, 3)] + [
    (z, "cpu", prec) for prec in ("fp32", "bf16") for z in (0, 3)]
"""The disk tier (files at their peak and between steps, staging buffers) is measured in
test_runtime_infinity.py."""


@pytest.mark.distributed
def test_held_model_state_bytes_match_the_plan():
    """Every ZeRO stage and offload tier, fp32 and bf16 plans: on every rank the bytes of parameters,
    gradients and optimizer states held on the device, in host memory and in files equal the plan's
    prediction for its stage within 1% (the acceptance bound; ZeroRedundancyOptimizer partitions whole
    tensors, so its ranks could differ from P / d by up to one tensor's states)."""
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_distributed(held_vs_predicted, 2, HELD_CASES, root, timeout=600)
    kinds = set()
    for rank, results in enumerate(per_rank):
        for r in results:
            held = {place: sum(kind[place] for kind in r["held"].values()) for place in ("device", "host", "files")}
            kinds.add(r["kind"])
            for place, predicted in r["predicted"].items():
                assert held[place] == pytest.approx(predicted, rel=0.01, abs=0), (rank, r["case"], r["kind"], held,
                                                                                  r["predicted"])
            assert sum(held.values()) > 0
    assert kinds == {"ddp", "ddp+zero_redundancy_optimizer", "fsdp2"}


# -- numerics of low-precision layouts (2 gloo ranks, one launch) ------------------------------------

NUMERICS_CASES = [
    dict(name="DP", precision="bf16", dp=2),
    dict(name="ZeRO-3", precision="bf16", dp=2, zero=3),
    dict(name="TP", precision="bf16", tp=2),
    dict(name="PP", precision="bf16", pp=2, microbatches=2, schedule="gpipe"),
    dict(name="DP fp16", precision="fp16", dp=2),
    dict(name="ZeRO-3 fp16", precision="fp16", dp=2, zero=3),
    dict(name="PP fp16", precision="fp16", pp=2, microbatches=2, schedule="1f1b"),
    dict(name="TP fp16", precision="fp16", tp=2),
    dict(name="ZeRO-3 fp32", precision="fp32", dp=2, zero=3),  # fp32 layouts: test_runtime_parallel etc.
    # ZeRO-Infinity under fp16: the scaler unscales the file-mapped gradients in place
    dict(name="ZeRO-3 fp16 nvme", precision="fp16", dp=2, zero=3, param_tier="nvme", optimizer_tier="nvme"),
]

LOSS_TOLERANCE = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 1e-5}
"""Relative loss tolerance: one unit roundoff of the compute dtype (bf16 2^-8, fp16 2^-11). Layouts
round differently (other matmul shapes, reduction orders, bf16 activations at pipeline boundaries),
so a logit may differ by one rounding of the dtype; the loss itself is computed in fp32 (autocast)
and so differs by at most that relative amount. fp32 layouts keep the project's 1e-5."""


@pytest.mark.distributed
def test_low_precision_layouts_match_single_process():
    """DP, ZeRO-3, TP and PP in bf16 (and fp16 with loss scaling) against one process with the same
    precision policy (autocast; FSDP2 layouts: also FSDP2 on a one-rank mesh with the same
    MixedPrecisionPolicy), over 3 AdamW steps.

    Parameters: Adam normalises each update, so an element whose gradient is at rounding level can
    move by +-lr in either run; parameters are compared by the distance of their updates instead,
    ``|p - p_ref| / |p_ref - p_0|`` (2-norms over all parameters). Its tolerance is measured, not
    chosen: ``noise = |p_ref - p_fp32| / |p_ref - p_0|``, how far the same single-process run moves
    when only its precision changes. Both the layout and the reference are runs in the low precision,
    each that far from fp32 at most, so by the triangle inequality they differ by at most
    ``2 * noise``; a layout with a real error (a missing gradient reduction, a wrong loss scale)
    lands far outside it."""
    per_rank = run_distributed(numerics, 2, NUMERICS_CASES, timeout=600)
    for results in per_rank:
        for r in results:
            assert r["loss_err"] <= LOSS_TOLERANCE[r["precision"]], r
            if r["precision"] == "fp32":
                assert r["param_err"] <= 1e-5, r
            else:
                assert 0 < r["precision_noise"] < 0.2, r  # the low precision is really in use
                assert r["update_err"] <= 2 * r["precision_noise"], r


# -- checkpoints resume mixed-precision runs exactly (2 gloo ranks, one launch) ----------------------

RESUME_CASES = [
    dict(name="ZeRO-3 fp16", precision="fp16", dp=2, zero=3),
    dict(name="PP fp16", precision="fp16", pp=2, microbatches=2, schedule="1f1b"),
    # also loaded by a plan that steps on the device (its fp32 FSDP2 shards take the masters)
    dict(name="ZeRO-Offload z3 bf16", precision="bf16", dp=2, zero=3, extra={"optimizer_tier": "cpu"},
         load_into={"extra": {}}),
    # fp16 ZeRO-Offload: the host steps after the backward, the scaler's state resumes with the masters
    dict(name="ZeRO-Offload z2 fp16", precision="fp16", dp=2, zero=2, extra={"optimizer_tier": "cpu"}),
    # full_state_dict of several stages: each stage gathers its masters, rank 0 receives them
    dict(name="PP ZeRO-Offload bf16", precision="bf16", pp=2, microbatches=2, extra={"optimizer_tier": "cpu"}),
]


@pytest.mark.distributed
def test_mixed_precision_runs_resume_exactly(tmp_path):
    """6 steps straight through vs 3 steps, ``pm.save``, a fresh ``parallelize`` of a differently
    initialised model, ``pm.load``, 3 steps; and vs the same cut through ``pm.state_dict()`` and
    ``pm.load_state_dict`` in memory (workers: ``amp_resume_cases.py``). Exact equality of
    losses and weights, no tolerance: the resumed run repeats the same CPU arithmetic on the same
    inputs from a bit-identical state (fp32 optimizer states and masters, the scaler's scale and
    count), so any difference is state that was lost.

    fp16 (FSDP2 and a pipeline, whose last stage scales the loss): the scaler backed off in the first
    steps (the scale at the cut is not the initial one), and every rank resumes with the scale and
    growth tracker of the straight run; a checkpoint without the scaler's state loads with the initial
    scale and one warning. bf16 ZeRO-Offload: ``full_state_dict`` returns the fp32 host masters (not
    bf16 numbers), they resume exactly, and a plan stepping on the device loads them exactly. fp16
    ZeRO-Offload (its host optimizer steps after the backward): masters, host Adam states and scaler
    resume exactly, the skipped first steps included."""
    from amp_resume_cases import resume_cases

    per_rank = run_distributed(resume_cases, 2, RESUME_CASES, str(tmp_path), timeout=600)
    for rank, results in enumerate(per_rank):
        assert [r["name"] for r in results] == [c["name"] for c in RESUME_CASES]
        assert [("into_err" in r) for r in results] == [("load_into" in c) for c in RESUME_CASES]
        for r in results:
            assert r["resumed"] == r["losses"] and r["in_memory"] == r["losses"][3:], (rank, r)
            assert r["param_err"] == 0.0 and r["in_memory_err"] == 0.0 and r["keys"], (rank, r)
            assert r.get("into_err", 0.0) == 0.0, (rank, r)
            if r["precision"] == "fp16":
                assert r["scaler_at_cut"]["scale"] < 65536.0, (rank, r)  # the setup moves the scale
                assert r["scaler_at_cut"]["_growth_tracker"] > 0, (rank, r)
                same = [r["scaler_resumed"], r["scaler_in_memory"], per_rank[0][results.index(r)]["scaler"]]
                assert all(s == r["scaler"] for s in same), (rank, r)
                assert r["old_scale"] == 65536.0, (rank, r)
                assert len(r["old_warned"]) == (1 if rank == 0 else 0), (rank, r)
            elif rank == 0:
                assert r["dtypes"] == ["torch.float32"] and r["off_bf16"] > 0, r
