"""Checkpoint offload (``BlockPlan.checkpoint_offload``): a checkpointed block keeps its input in host
memory between its forward and its backward (ZeRO-Infinity's offloaded activation checkpoints).

What is measured and how: ``checkpoint_offload_cases`` (its docstring): the device bytes a block keeps of
its input are the storages of its forward's inputs still alive when its recompute starts (weak
references to the storages); the host bytes are the copies the runtime made in that forward.
"""

from __future__ import annotations

import pytest

from checkpoint_offload_cases import InputProbe, run_checkpoint_offload
from dist_harness import run_distributed
from runtime_cases import Case
from whalepy.errors import PlanError
from whalepy.ir.plan import BlockPlan, Plan
from whalepy.runtime import make_plan

OFF = {"checkpoint": True, "checkpoint_offload": True}


def test_plan_refuses_checkpoint_offload_without_checkpoint():
    with pytest.raises(PlanError, match="checkpoint_offload is set without checkpoint"):
        BlockPlan(name="h.0", checkpoint_offload=True)
    with pytest.raises(PlanError, match="checkpoint_offload is set without checkpoint"):
        make_plan(["h.0", "h.1"], global_batch=2, checkpoint_offload=["h.0"])
    with pytest.raises(PlanError, match="activation_offload and checkpoint are both set"):
        BlockPlan(name="h.0", checkpoint=True, checkpoint_offload=True, activation_offload=True)
    plan = make_plan(["h.0", "h.1"], global_batch=2, checkpoint=True, checkpoint_offload=["h.1"])
    assert [b.checkpoint_offload for b in plan.stages[0].blocks] == [False, True]
    assert Plan.from_json(plan.to_json()) == plan


def test_one_block_keeps_its_input_on_the_host_and_gradients_are_exact():
    """One process, the control included: the same block checkpointed with its input on the device keeps
    the input's bytes (the probe sees them), with checkpoint_offload it keeps none and its host copy is
    the input's size; gradients equal (the recompute gets a bit-exact copy)."""
    import torch
    from torch import nn

    from whalepy.runtime.checkpointing import apply_activation_checkpointing, apply_checkpoint_offload

    def run(offload: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        pre, block = nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        host = apply_checkpoint_offload([block], torch.device("cpu")) if offload else None
        if not offload:
            apply_activation_checkpointing([block])
        probe = InputProbe({"block": block})
        x = torch.randn(5, 8, requires_grad=True)
        block(pre(x) * 2).sum().backward()  # the input (pre(x) * 2) is held by nothing but the block
        return probe, host, [x.grad] + [p.grad for p in block.parameters()]

    (kept_probe, _, kept_grads), (off_probe, host, off_grads) = run(False), run(True)
    nbytes = 5 * 16 * 4
    assert kept_probe.input_bytes == off_probe.input_bytes == {"block": nbytes}
    assert kept_probe.kept == {"block": nbytes} and off_probe.kept == {"block": 0}
    assert list(host.values()) == [nbytes]
    assert all(torch.equal(a, b) for a, b in zip(kept_grads, off_grads))


CASES = [
    (Case("z3 dp2", dp=2, zero=3, num_layers=4), OFF, {}),
    (Case("pp2 1f1b", pp=2, microbatches=2, num_layers=4), OFF, {}),
    (Case("tp2", tp=2, num_layers=4), OFF, {}),
    (Case("tp2 sequence parallel", tp=2, num_layers=4), OFF, {"sequence_parallel": True}),
    (Case("z3 dp2 tiles 2", dp=2, zero=3, num_layers=4), OFF, {"tiles": 2}),
    # the control: inputs on the device (and checkpointing under sequence parallelism, whose entry
    # hook must not scatter again in the recompute)
    (Case("tp2 sequence parallel, checkpoint alone", tp=2, num_layers=4), {"checkpoint": True},
     {"sequence_parallel": True}),
]


@pytest.mark.distributed
def test_checkpoint_offload_matches_single_process_and_frees_the_device_input():
    """2 gloo ranks, every block checkpointed with its input in host memory: ZeRO-3 over dp 2, 1F1B over 2
    pipeline stages with 2 micro-batches, TP 2 (with and without sequence parallelism: inputs that are
    DTensors, copied by their local shard) and ZeRO-3 with memory-centric tiling. After 3 AdamW steps, fp32 losses and parameters within
    1e-5 of one process (the host copy is exact; what differs is the distributed reductions' rounding).

    Every block module made a host copy equal to its input's bytes (exact) in its forward; every block
    module recomputed in backward (the transformer layers; not a module that saved nothing, such as a
    dropout of p=0, which has nothing to recompute) kept 0 device bytes of its input between its forward
    and its backward (exact: a storage is alive or not), except the first module of each stage module:
    its input is held by its caller anyway (the batch, or the stage input the pipeline schedule keeps for
    the stage's input gradient), so there the device bytes are the input's and the host copy is extra.
    The control case (checkpointing alone) keeps exactly the input's bytes on the device, no host copy."""
    per_rank = run_distributed(run_checkpoint_offload, 2, CASES, timeout=600)
    assert all(r["param_err"] is not None for r in per_rank[0])  # rank 0 gathers the full parameters
    for results in per_rank:
        assert [r["name"] for r in results] == [c.name for c, _, _ in CASES]
        for r in results:
            assert r["loss_err"] <= 1e-5 and (r["param_err"] is None or r["param_err"] <= 1e-5), r
            offload = r["fields"].get("checkpoint_offload", False)
            for path, b in r["blocks"].items():
                assert b["input"] > 0 and b["host"] == (b["input"] if offload else None), (r["name"], path, b)
                if path.startswith("transformer.h."):
                    assert b["recomputed"] >= 1, (r["name"], path, b)
                if b["recomputed"] and not b["stage_input"]:
                    assert b["kept"] == (0 if offload else b["input"]), (r["name"], path, b)
            assert sum(bool(b["recomputed"]) and not b["stage_input"] for b in r["blocks"].values()) >= 2, r


def test_memory_model_moves_the_checkpoint_to_the_host():
    from whalepy.cost_models.memory import (
        BlockActivations,
        estimate_stage_activation_bytes,
        estimate_stage_activation_host_bytes,
    )
    from whalepy.cost_models.offload import OffloadRates, estimate_checkpoint_offload_time

    blocks = [BlockActivations(saved_bytes=10.0 + i, input_bytes=1.0 + i, checkpoint=True, checkpoint_offload=i < 2)
              for i in range(4)]
    # device: the inputs of blocks 2 and 3 (3 + 4) per micro-batch in flight, and the largest recompute (13)
    assert estimate_stage_activation_bytes(blocks=blocks, num_inflight=3) == 3 * 7.0 + 13.0
    # host: the inputs of blocks 0 and 1 (1 + 2) per micro-batch in flight
    assert estimate_stage_activation_host_bytes(blocks=blocks, num_inflight=3) == 3 * 3.0
    with pytest.raises(ValueError, match="checkpoint_offload needs checkpoint"):
        BlockActivations(saved_bytes=1.0, input_bytes=1.0, checkpoint_offload=True)
    rates = OffloadRates(h2d=20e9, d2h=10e9, cpu_adam=1e9)
    assert estimate_checkpoint_offload_time(rates, input_bytes=1e9) == pytest.approx(0.1 + 0.05)


def test_host_bytes_match_the_memory_model():
    """The host copy each transformer layer's forward makes equals what the memory model puts in host
    memory for it (``estimate_stage_activation_host_bytes`` over the profile's ``input_bytes``) at the
    profile's batch: exact. Blocks of several modules (embeddings, head) are left out: each of their
    modules is checkpointed, and keeps its own input, where the profile records the block's first input."""
    import torch

    from runtime_cases import SEQ, VOCAB, build_model, case_profile
    from whalepy.cost_models.memory import BlockActivations, estimate_stage_activation_host_bytes
    from whalepy.runtime.checkpointing import apply_checkpoint_offload

    prof = case_profile("gpt")
    model = build_model("gpt")
    layers = [b for b in prof.blocks if len(b.modules) == 1]
    host = apply_checkpoint_offload([model.get_submodule(b.modules[0]) for b in layers], torch.device("cpu"))
    model(torch.randint(0, VOCAB, (prof.batch_size, SEQ))).float().sum().backward()
    assert len(layers) == 2
    for b in layers:
        predicted = estimate_stage_activation_host_bytes(blocks=[BlockActivations(
            saved_bytes=b.activation_bytes, input_bytes=b.input_bytes, checkpoint=True, checkpoint_offload=True)],
            num_inflight=1)
        assert predicted > 0 and host[model.get_submodule(b.modules[0])] == predicted, (b.name, predicted)
