"""Offload modes per block: ZeRO-Offload (parameters on the device, optimizer on the host, stepped during
backward) and activation offload (saved activations in host memory).

The multi-process tests run every case in one launch of 2 gloo ranks each: numerics against the
single-process run (``precision_cases.numerics``), and held bytes against the memory model
(``precision_cases.held_vs_predicted``, where what is counted is described).
"""

from __future__ import annotations

import tempfile

import pytest

from dist_harness import run_distributed
from precision_cases import held_vs_predicted, numerics
from test_precision import LOSS_TOLERANCE
from whalepy.ir.rules import choose_lowering_kind, host_steps_after_backward, state_option_error, steps_on_host
from whalepy.cost_models.memory import estimate_model_state_bytes

HOST_OPT = {"optimizer_tier": "cpu"}
ACT = {"activation_offload": True}


def test_zero_offload_is_lowered_and_accounted():
    assert state_option_error(z := 2, "gpu", "cpu") is None and steps_on_host("gpu", "cpu")
    for precision in ("fp16", "bf16", "fp32"):  # fp16 and clipping: stepped after the backward
        assert state_option_error(z, "gpu", "cpu", precision=precision, clip_gradients=True) is None
        assert host_steps_after_backward(precision, clip_gradients=True)
        assert host_steps_after_backward(precision) == (precision == "fp16")
    assert choose_lowering_kind(0, 2, tp=1, pp=1, offload=True).value == "fsdp2"
    p, d = 1e9, 4
    for zero in (0, 1, 2, 3):
        for precision, b in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
            held = estimate_model_state_bytes(num_params=p, zero_stage=zero, dp_degree=d, precision=precision,
                                              optimizer_tier="cpu")
            # device: the shard in the compute dtype; host: its fp32 master, gradient and Adam states
            assert (held.params, held.grads, held.optimizer, held.cpu) == (b * p / d, 0.0, 0.0, 16 * p / d)


CASES = [dict(name=f"ZeRO-Offload z{z}", precision="fp32", dp=2, zero=z, **HOST_OPT) for z in (0, 1, 2, 3)] + [
    dict(name="ZeRO-Offload TP", precision="fp32", tp=2, **HOST_OPT),
    dict(name="ZeRO-Offload PP", precision="fp32", pp=2, microbatches=2, schedule="1f1b", **HOST_OPT),
    dict(name="ZeRO-Offload z3 bf16", precision="bf16", dp=2, zero=3, **HOST_OPT),
    # gradient accumulation without a pipeline: the host steps once, after the last micro-batch
    dict(name="ZeRO-Offload z2 accumulated", precision="fp32", dp=2, zero=2, microbatches=2, **HOST_OPT),
    dict(name="activation offload z0", precision="fp32", dp=2, **ACT),
    dict(name="activation offload z3", precision="fp32", dp=2, zero=3, **ACT),
    dict(name="activation offload TP", precision="fp32", tp=2, **ACT),
    dict(name="both z2", precision="fp32", dp=2, zero=2, **HOST_OPT, **ACT),
] + [  # ZeRO-Offload stepping after the backward: fp16 loss scaling, clipping (0.05: below every step's norm)
    dict(name="ZeRO-Offload z2 fp16 overflow", precision="fp16", dp=2, zero=2, loss_factor=6.0, **HOST_OPT),
    dict(name="ZeRO-Offload z2 fp32 clipped", precision="fp32", dp=2, zero=2, max_grad_norm=0.05, **HOST_OPT),
    dict(name="ZeRO-Offload PP fp16 clipped overflow", precision="fp16", pp=2, microbatches=2, schedule="1f1b",
         loss_factor=6.0, max_grad_norm=0.05, **HOST_OPT),
    # one stage: device-stepped DTensor gradients (device and FSDP2 host shards) beside the host optimizer's
    dict(name="ZeRO-Offload z3 fp16 mixed tiers clipped overflow", precision="fp16", dp=2, zero=3, loss_factor=6.0,
         max_grad_norm=0.05, tiers={"embed": ("gpu", "gpu"), "head": ("cpu", "cpu")}, **HOST_OPT),
]
"""``loss_factor`` 6 (measured, as ``amp_resume_cases.LOSS_FACTOR``): at the initial loss scale 65536 the
first step's fp16 gradients overflow, both on 2 ranks and in one process; every rank skips it and the
scale backs off to 32768, at which steps 2 and 3 are clean on both sides. (Which steps overflow depends
on the per-rank micro-batch: at factor 8 the 2-rank run also overflows in step 2 and one process does
not, so the runs would take different steps.)"""


@pytest.mark.distributed
def test_offload_modes_match_single_process():
    """Every mode alone and with ZeRO stages 0-3 on dp=2, with TP and with PP, after 3 AdamW steps:
    fp32 losses and parameters within 1e-5 of one process (the host optimizer's fused CPU AdamW and
    the reference's loop differ only in rounding); the bf16 and fp16 cases within the tolerances of
    ``test_precision`` (stated and justified there).

    ZeRO-Offload under fp16 and with clipping (host step after the backward) against one process with
    the same loss scaling and ``clip_grad_norm_``: the loss scale after every step is the reference's on
    every rank (the overflowing first step is skipped everywhere, exactly); the clipping's global norm,
    device and host gradients together, is the reference's within the loss tolerance (fp32: 1e-5; fp16:
    one unit roundoff, as the gradients it sums are fp16 matmul results that differ between layouts by
    roundings; an overflowing step's norm is inf on both sides)."""
    per_rank = run_distributed(numerics, 2, CASES, timeout=600)
    names = set()
    for results in per_rank:
        for r in results:
            names.add(r["name"])
            after_backward = r["precision"] == "fp16" or r["ref_norms"]
            if r["name"].startswith(("ZeRO-Offload", "both")):
                # during backward: every block's host step was queued as its gradients arrived (none
                # left for the optimizer-step point), so it could overlap the backward; under fp16 or
                # clipping none was (every block steps after the backward)
                queued, blocks = r["host_blocks"]
                assert blocks > 0 and queued == (0 if after_backward else blocks), r
            else:
                assert r["host_blocks"] is None, r
            # FSDP2's host shards step with torch's fused CPU kernel (host_optimizer.fused_variant); the
            # user's AdamW (no flags) is left as built everywhere else
            assert r["fused"] in (r["host_shards"], None), r
            assert r["host_shards"] == (r["name"] == "ZeRO-Offload z3 fp16 mixed tiers clipped overflow"), r
            assert r["scales"] == r["ref_scales"], r
            if r["precision"] == "fp16":
                assert r["skipped"] == [True, False, False] and r["scales"] == [32768.0] * 3, r
            if r["ref_norms"]:
                for got, want in zip(r["norms"], r["ref_norms"]):
                    assert got == want or abs(got - want) <= LOSS_TOLERANCE[r["precision"]] * want, r  # inf == inf
                    assert want > 0.05 or want == float("inf"), r  # the clipping engaged
            assert r["loss_err"] <= LOSS_TOLERANCE[r["precision"]], r
            if r["precision"] == "fp32":
                assert r["param_err"] <= 1e-5, r
            else:
                assert 0 < r["precision_noise"] < 0.2, r
                assert r["update_err"] <= 2 * r["precision_noise"], r
    assert names == {c["name"] for c in CASES}


HELD_CASES = [(z, "cpu-optimizer", "fp32") for z in (0, 1, 2, 3)] + [(z, "cpu-optimizer", "bf16") for z in (0, 3)] + [
    (2, "cpu-optimizer", "fp16")]


@pytest.mark.distributed
def test_zero_offload_held_bytes_match_the_memory_model():
    """On every rank the device shards and the host's masters, gradient buffers and Adam states equal
    :func:`estimate_model_state_bytes` for (gpu, cpu) within 1% (the acceptance bound)."""
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_distributed(held_vs_predicted, 2, HELD_CASES, root, timeout=600)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(HELD_CASES)
        for r in results:
            held = {place: sum(kind[place] for kind in r["held"].values()) for place in ("device", "host", "files")}
            for place, predicted in r["predicted"].items():
                assert held[place] == pytest.approx(predicted, rel=0.01, abs=0), (rank, r["case"], held, r)
            assert r["held"]["grads"]["device"] == 0 and r["held"]["optimizer"]["device"] == 0, r
            assert held["host"] > 0


def test_activation_offload_moves_saved_tensors_and_keeps_gradients():
    """One process: the hooks copy what a block saves (not its parameters) and backward gives the same
    gradients as without them (the copy is exact)."""
    import torch
    from torch import nn

    from whalepy.runtime.checkpointing import apply_activation_offload

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    plain.load_state_dict(block.state_dict())
    sizes = apply_activation_offload([block], torch.device("cpu"))
    x = torch.randn(5, 8, requires_grad=True)
    out = block(x)
    out.sum().backward()
    gx, grads = x.grad.clone(), [p.grad.clone() for p in block.parameters()]
    x.grad = None
    plain(x).sum().backward()
    # the copies are exact, but a fresh allocation's alignment can send a vectorised CPU kernel (GELU's
    # backward) through its scalar tail for other elements: differences of a few fp32 ulps (seen: 9e-8
    # on gradients of ~0.3), so fp32 rounding, not equality
    assert torch.allclose(gx, x.grad, rtol=1e-6, atol=1e-7)
    assert all(torch.allclose(a, p.grad, rtol=1e-6, atol=1e-7) for a, p in zip(grads, plain.parameters()))
    # saved activations: x (first linear), the pre-GELU tensor (GELU), its output (second linear), fp32;
    # the weights (and the transposed views of them that linear saves) stay
    assert sizes == [4 * (5 * 8 + 5 * 16 + 5 * 16)]


def test_activation_offload_host_bytes_match_the_memory_model():
    """The host copies each block's forward makes equal what the memory model puts in host memory for
    it (``estimate_stage_activation_host_bytes`` over the profile's saved bytes), block by block: the
    GPT test model at the profile's batch, every block offloaded (within 1%; exact here)."""
    import torch

    from runtime_cases import SEQ, VOCAB, build_model, case_profile
    from whalepy.cost_models.memory import BlockActivations, estimate_stage_activation_host_bytes
    from whalepy.runtime.checkpointing import apply_activation_offload

    prof = case_profile("gpt")
    model = build_model("gpt")
    # one list per block; a block of several modules (embeddings, head) gets one entry per module
    sizes = {b.name: apply_activation_offload([model.get_submodule(p) for p in b.modules], torch.device("cpu"))
             for b in prof.blocks}
    x = torch.randint(0, VOCAB, (prof.batch_size, SEQ))
    model(x).float().sum().backward()
    for b in prof.blocks:
        predicted = estimate_stage_activation_host_bytes(
            blocks=[BlockActivations(saved_bytes=b.activation_bytes, input_bytes=0, offload=True)], num_inflight=1)
        assert predicted > 0 and sum(sizes[b.name]) == pytest.approx(predicted, rel=0.01), (b.name, sizes, predicted)


def test_offloaded_activations_leave_the_device_in_the_memory_model():
    from whalepy.cost_models.memory import (
        BlockActivations,
        estimate_stage_activation_bytes,
        estimate_stage_activation_host_bytes,
    )

    blocks = [BlockActivations(saved_bytes=10.0 + i, input_bytes=1.0, offload=i < 2) for i in range(4)]
    # kept: blocks 2 and 3 (12 + 13) per micro-batch; transient: the largest offloaded block (11)
    assert estimate_stage_activation_bytes(blocks=blocks, num_inflight=3) == 3 * 25.0 + 11.0
    assert estimate_stage_activation_host_bytes(blocks=blocks, num_inflight=3) == 3 * 21.0


def test_offload_messages_are_said_once_per_job(caplog):
    import logging

    from whalepy.errors import log_once

    log = logging.getLogger("whalepy.test_offload")
    with caplog.at_level(logging.INFO, logger="whalepy.test_offload"):
        said = [log_once(log, logging.WARNING, "offload-test-key", "offloaded block %d", i) for i in range(5)]
    assert said == [True, False, False, False, False]
    assert [r.getMessage() for r in caplog.records] == ["offloaded block 0"]


@pytest.mark.distributed
def test_zero_offload_checkpoints_resume_across_plans(tmp_path):
    """Save after 2 steps, resume from a differently initialised model under another plan, train the
    third step: ZeRO-Offload -> ZeRO-Offload (ZeRO-2 -> 3), ZeRO-Offload -> device optimizer, device
    optimizer -> ZeRO-Offload; parameters and losses within 1e-5 of one uninterrupted process (a lost
    Adam state would move the third step's parameters by about the learning rate, 1e-3)."""
    from runtime_cases import Case, run_cases

    def case(name: str, zero: int, **extra):  # type: ignore[no-untyped-def]
        return Case(name, dp=2, zero=zero, steps=3, global_batch=8, extra=extra)

    cases = [("resume", case("offload z2", 2, **HOST_OPT), case("offload z3", 3, **HOST_OPT), str(tmp_path / "a")),
             ("resume", case("offload z3", 3, **HOST_OPT), case("device z2", 2), str(tmp_path / "b")),
             ("resume", case("device z3", 3), case("offload z1", 1, **HOST_OPT), str(tmp_path / "c"))]
    for results in run_distributed(run_cases, 2, cases, timeout=600):
        assert len(results) == 3
        for r in results:
            assert r["load_err"] <= 1e-5 and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
