"""Memory model: ZeRO model states, transformer activations, in-flight micro-batches (offload time:
test_cost_offload.py)."""

from __future__ import annotations

import pytest

from whalepy.cost_models.memory import (
    BlockActivations,
    Recompute,
    estimate_zero_paper_model_state_bytes,
    estimate_stage_activation_bytes,
    estimate_transformer_activation_bytes,
    inflight_microbatches,
)
from whalepy.ir.plan import Schedule, Tier, ZeroStage

GB = 1e9  # ZeRO (SC'20) Figure 1 uses decimal gigabytes: 7.5e9 * 16 B = 120 GB.


# -- model states ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage,expected_gb",
    [
        (ZeroStage.NONE, 120.0),
        (ZeroStage.OPTIMIZER, 31.4),
        (ZeroStage.GRADIENTS, 16.6),
        (ZeroStage.PARAMETERS, 1.88),
    ],
)
def test_zero_paper_figures_7_5b_on_64_ranks(stage, expected_gb):
    # Figures as printed in Rajbhandari et al., SC'20 (Figure 1), rounded to three digits there: hence
    # the 0.5% tolerance.
    states = estimate_zero_paper_model_state_bytes(num_params=7.5e9, zero_stage=stage, dp_degree=64)
    assert states.gpu / GB == pytest.approx(expected_gb, rel=0.005)
    assert states.cpu == 0.0 and states.nvme == 0.0


def test_zero_breakdown_and_int_stage():
    psi, nd = 1e9, 8
    s3 = estimate_zero_paper_model_state_bytes(num_params=psi, zero_stage=3, dp_degree=nd)
    assert (s3.params, s3.grads, s3.optimizer) == pytest.approx((2 * psi / nd, 2 * psi / nd, 12 * psi / nd))
    s0 = estimate_zero_paper_model_state_bytes(num_params=psi, zero_stage=0, dp_degree=nd)
    assert (s0.params, s0.grads, s0.optimizer) == pytest.approx((2 * psi, 2 * psi, 12 * psi))


def test_higher_zero_stage_never_uses_more_gpu():
    gpus = [estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=z, dp_degree=16).gpu for z in ZeroStage]
    assert gpus == sorted(gpus, reverse=True)
    # With one replica there is nothing to shard across.
    one = {estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=z, dp_degree=1).gpu for z in ZeroStage}
    assert one == {16e9}


def test_optimizer_offload_moves_k_psi_off_gpu():
    psi, nd = 7.5e9, 64
    cpu = estimate_zero_paper_model_state_bytes(num_params=psi, zero_stage=2, dp_degree=nd, optimizer_tier=Tier.CPU)
    assert cpu.gpu == pytest.approx(2 * psi + 2 * psi / nd)
    assert cpu.cpu == pytest.approx(12 * psi / nd) and cpu.nvme == 0.0
    nvme = estimate_zero_paper_model_state_bytes(num_params=psi, zero_stage=3, dp_degree=nd, optimizer_tier="nvme")
    assert nvme.nvme == pytest.approx(12 * psi / nd) and nvme.cpu == 0.0
    # Total bytes are conserved by moving them between tiers.
    gpu_only = estimate_zero_paper_model_state_bytes(num_params=psi, zero_stage=2, dp_degree=nd)
    assert cpu.total == pytest.approx(gpu_only.total)


def test_param_offload_with_zero3_keeps_working_buffer():
    psi, nd, working = 1e11, 16, 3.2e9
    states = estimate_zero_paper_model_state_bytes(
        num_params=psi, zero_stage=3, dp_degree=nd, param_tier=Tier.NVME, optimizer_tier=Tier.CPU,
        working_param_bytes=working,
    )
    assert states.params == 0.0 and states.optimizer == 0.0
    assert states.nvme == pytest.approx(2 * psi / nd)
    assert states.cpu == pytest.approx(12 * psi / nd)
    assert states.gpu == pytest.approx(2 * psi / nd + working)  # gradient shard + gathered block


def test_param_offload_below_zero3_raises_with_fix():
    with pytest.raises(ValueError, match="zero_stage=3"):
        estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=2, dp_degree=8, param_tier=Tier.CPU)
    with pytest.raises(ValueError, match="ZeRO-3"):
        estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=1, dp_degree=8, working_param_bytes=1e6)


def test_model_state_validation():
    with pytest.raises(ValueError):
        estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=4, dp_degree=8)
    with pytest.raises(ValueError):
        estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=1, dp_degree=0)
    with pytest.raises(ValueError):
        estimate_zero_paper_model_state_bytes(num_params=1e9, zero_stage=1, dp_degree=8, optimizer_tier="tape")


# -- activations ----------------------------------------------------------------------------------

# GPT-3 175B (Korthikanti et al., Table 3): s=2048, h=12288, a=96, b=1, t=8.
S, H, A, B, T = 2048, 12288, 96, 1, 8
SBH = S * B * H
ATTN = 5 * A * S / H  # = 80


def act(**kw):
    return estimate_transformer_activation_bytes(seq_len=S, micro_batch=B, hidden=H, num_heads=A, **kw)


def test_activation_formulas_gpt3_175b():
    assert ATTN == 80
    assert act() == pytest.approx(SBH * (34 + 80))  # about 2.87 GB per layer
    assert act(tp_degree=T) == pytest.approx(SBH * (10 + 24 / 8 + 80 / 8))
    assert act(tp_degree=T, sequence_parallel=True) == pytest.approx(SBH / 8 * (34 + 80))
    assert act(tp_degree=T, recompute="selective") == pytest.approx(SBH * (10 + 24 / 8))
    selective_sp = act(tp_degree=T, sequence_parallel=True, recompute=Recompute.SELECTIVE)
    assert selective_sp == pytest.approx(SBH * 34 / 8)
    assert act(tp_degree=T, recompute=Recompute.FULL) == pytest.approx(2 * SBH)
    assert act(tp_degree=T, sequence_parallel=True, recompute=Recompute.FULL) == pytest.approx(2 * SBH / 8)


def test_activation_ordering_and_paper_5x_claim():
    ladder = [
        act(),
        act(tp_degree=T),
        act(tp_degree=T, sequence_parallel=True),
        act(tp_degree=T, sequence_parallel=True, recompute="selective"),
        act(tp_degree=T, recompute="full"),
    ]
    assert ladder == sorted(ladder, reverse=True)
    # The paper's headline: SP + selective recompute cut activation memory about 5x versus TP alone.
    assert 5.0 < ladder[1] / ladder[3] < 6.0


def test_activation_tp1_forms_agree_and_scale_with_batch():
    assert act(tp_degree=1) == act(tp_degree=1, sequence_parallel=True)
    double = estimate_transformer_activation_bytes(seq_len=S, micro_batch=2, hidden=H, num_heads=A)
    assert double == pytest.approx(2 * act())
    with pytest.raises(ValueError):
        act(recompute="some")
    with pytest.raises(ValueError):
        act(tp_degree=0)


# -- pipeline in-flight micro-batches --------------------------------------------------------------


def test_inflight_gpipe_and_1f1b():
    s, m = 4, 16
    def per_stage(schedule):
        kw = dict(num_stages=s, num_microbatches=m)
        return [inflight_microbatches(schedule, stage_index=i, **kw) for i in range(s)]

    assert per_stage(Schedule.GPIPE) == [m] * s
    assert per_stage("1f1b") == [4, 3, 2, 1]
    # Fewer micro-batches than stages caps the count.
    assert inflight_microbatches(Schedule.ONE_F_ONE_B, stage_index=0, num_stages=8, num_microbatches=3) == 3


def test_inflight_interleaved_matches_narayanan_factor():
    s, v, m = 4, 2, 16

    def chunks(i, micro=m):
        return inflight_microbatches(
            Schedule.INTERLEAVED_1F1B, stage_index=i, num_stages=s, num_microbatches=micro, virtual_stages=v
        )

    # Each chunk holds 1/v of a stage; stage 0 holds S * (1 + (S-1)/(S v)) stages' worth.
    assert chunks(0) / v == pytest.approx(s * (1 + (s - 1) / (s * v)))
    assert chunks(s - 1) < chunks(0)
    assert chunks(0, micro=1) == v


def test_inflight_validation():
    with pytest.raises(ValueError):
        inflight_microbatches(
            Schedule.ONE_F_ONE_B, stage_index=0, num_stages=4, num_microbatches=8, virtual_stages=2
        )
    with pytest.raises(ValueError):
        inflight_microbatches(Schedule.GPIPE, stage_index=4, num_stages=4, num_microbatches=8)
    with pytest.raises(ValueError):
        inflight_microbatches("zb", stage_index=0, num_stages=4, num_microbatches=8)


def test_stage_activation_bytes():
    blocks = [BlockActivations(saved_bytes=10.0, input_bytes=1.0) for _ in range(4)]
    assert estimate_stage_activation_bytes(blocks=blocks, num_inflight=3) == pytest.approx(3 * 40.0)
    ckpt = [BlockActivations(saved_bytes=10.0 + i, input_bytes=1.0, checkpoint=True) for i in range(4)]
    # Inputs only, plus the largest block recomputed once during its backward.
    checkpointed = estimate_stage_activation_bytes(blocks=ckpt, num_inflight=3)
    assert checkpointed == pytest.approx(3 * 4.0 + 13.0)
    assert checkpointed < estimate_stage_activation_bytes(blocks=blocks, num_inflight=3)
    # Interleaved: in-flight counts chunks, each 1/v of the stage's blocks.
    interleaved = estimate_stage_activation_bytes(blocks=blocks, num_inflight=11, virtual_stages=2)
    assert interleaved == pytest.approx(11 * 40.0 / 2)
