"""The memory tiers on a CUDA GPU, against one process on the same GPU (skipped without CUDA).

CI has no GPU, so these tests skip there; ``benchmarks/gpu_session.sh`` runs them on one (docs/benchmarks.md,
"A GPU session"). They test what the CPU / gloo tests cannot: the CUDA-only branches of the runtime
(pinned host buffers, ``non_blocking`` copies and the events and streams that order them, NCCL
collectives over host-tier tensors, the CUDA allocator in ``trace_memory``; docs/runtime.md, "CUDA
paths"). One process and one GPU (world 1, NCCL): the tiers' numerics do not depend on the number of
ranks, which the gloo tests vary.

Each case is lowered by ``parallelize`` from ``make_plan`` (the tiny GPT of ``runtime_cases``, 3 AdamW
steps) and compared with the same model trained in this process on the same GPU with the same precision
policy (autocast; where the plan lowers to FSDP2, ``fully_shard`` per block and at the root on a one-rank
mesh with the same ``MixedPrecisionPolicy``; fp16: a GradScaler; clipping: ``clip_grad_norm_``), with the
tolerances the CPU tests state (``test_precision.LOSS_TOLERANCE``; fp32 1e-5 for losses and parameters;
bf16 / fp16 updates within twice the precision's own distance from fp32).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch

from runtime_cases import Case, adamw, batches, build_model, case_profile, lm_loss, make_case_plan, train_single

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA tiers: no CUDA device here (benchmarks/gpu_session.sh runs them on a GPU)")

GLOBAL_BATCH = 8
STEPS = 3
LOSS_TOLERANCE = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 1e-5}
"""As ``test_precision.LOSS_TOLERANCE`` (one unit roundoff of the compute dtype; fp32 the project's 1e-5)."""
PARAM_ATOL = 1e-5
"""fp32: the same arithmetic in another order (the host optimizer's fused CPU AdamW against CUDA's)."""


@pytest.fixture(scope="module")
def nccl() -> Any:
    """One rank on GPU 0 with an NCCL process group, as a one-GPU ``torchrun`` would make it."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    yield torch.device("cuda", 0)
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _device_name() -> str:
    from whalepy.cost_models.devices import match_device_name

    found = match_device_name(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    return found.name if found is not None else "CPU"


def reference(precision: str, fsdp: bool, data: list, *, max_grad_norm: float | None = None) -> dict[str, Any]:
    """One process on the GPU with the runtime's precision policy (``precision_cases.reference_run`` on
    CUDA; FSDP2 on a one-rank CUDA mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from precision_cases import reference_run

    mesh = init_device_mesh("cuda", (1,)) if fsdp else None
    out = reference_run(precision, fsdp, data, mesh, max_grad_norm=max_grad_norm, device="cuda")
    out["params"] = {k: v.float().cpu() for k, v in out["params"].items()}
    return out


def lower(name: str, precision: str, data: list, *, plan: Any = None, zero: int = 0, checkpoint: bool = False,
          max_grad_norm: float | None = None, nvme_dir: Any = None, model: Any = None, **tiers: Any) -> Any:
    from whalepy.runtime import parallelize

    if plan is None:
        plan = make_case_plan(Case(name, zero=zero, checkpoint=checkpoint, global_batch=GLOBAL_BATCH,
                                   extra={"precision": precision, "device_type": _device_name(), **tiers}))
    return parallelize(model if model is not None else build_model("gpt"), None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss, optimizer=adamw,
                       global_batch=GLOBAL_BATCH, plan=plan, profile=case_profile("gpt"),
                       max_grad_norm=max_grad_norm, nvme_dir=nvme_dir)


def train(pm: Any, data: list) -> dict[str, Any]:
    out: dict[str, Any] = {"losses": [], "scales": [], "norms": []}
    for x, y in data:
        out["losses"].append(pm.train_step(x, y).item())
        out["scales"].append(pm.amp.loss_scale())
        out["norms"].append(pm.last_grad_norm)
    # the model's weights under original names: tiles joined, ZeRO-Offload's fp32 masters
    out["params"] = {k: v.float().cpu() for k, v in pm.full_state_dict().items()}
    return out


def check(got: dict[str, Any], precision: str, fsdp: bool, data: list, *,
          max_grad_norm: float | None = None) -> None:
    """``got`` against the reference with the tolerances of the module docstring."""
    ref = reference(precision, fsdp, data, max_grad_norm=max_grad_norm)
    tol = LOSS_TOLERANCE[precision]
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= tol * abs(b), (got["losses"], ref["losses"])
    assert got["scales"] == ref["scales"]
    if max_grad_norm is not None:
        for a, b in zip(got["norms"], ref["norms"], strict=True):
            assert abs(a - b) <= tol * abs(b), (got["norms"], ref["norms"])
    params, ref_params = got["params"], ref["params"]
    assert set(params) == set(ref_params)
    if precision == "fp32":
        err = max((params[k] - ref_params[k]).abs().max().item() for k in params)
        assert err <= PARAM_ATOL, err
        return
    fp32 = reference("fp32", fsdp, data, max_grad_norm=max_grad_norm)["params"]
    init = {k: v.float() for k, v in build_model("gpt").state_dict().items()}

    def distance(a: dict, b: dict) -> float:
        return sum(((a[k] - b[k]) ** 2).sum().item() for k in params) ** 0.5

    moved = distance(ref_params, init)
    noise = distance(ref_params, fp32) / moved
    assert 0 < noise < 0.2  # the low precision is really in use
    assert distance(params, ref_params) / moved <= 2 * noise


def test_zero_offload_bf16_steps_on_the_host_during_backward_and_checkpoints(nccl, tmp_path):
    """ZeRO-Offload in bf16: pinned fp32 masters, gradients copied down ``non_blocking`` in FSDP2's
    reduce stream, every block stepped on the host thread during the backward after its copies' events,
    parameters copied back on a side stream. Then the CUDA-side state paths: ``full_state_dict`` gives
    the fp32 masters (gathered on the device), ``save`` / ``load`` into a fresh model resumes them
    exactly, and ``trace_memory`` reads the CUDA allocator."""
    data = batches(GLOBAL_BATCH, STEPS)
    pm = lower("zero_offload bf16", "bf16", data, optimizer_tier="cpu")
    assert pm.host_optimizer is not None and pm.host_optimizer.cuda
    got = train(pm, data)
    host = pm.host_optimizer
    assert host.queued_in_backward == len(host.blocks) > 0  # all stepped during the backward
    check(got, "bf16", True, data)
    full = pm.full_state_dict()
    assert full and all(v.dtype == torch.float32 and v.device.type == "cpu" for v in full.values())
    pm.save(tmp_path / "ckpt")
    again = lower("zero_offload bf16", "bf16", data, optimizer_tier="cpu")
    again.load(tmp_path / "ckpt")
    loaded = again.full_state_dict()
    assert all(torch.equal(loaded[k], full[k]) for k in full)
    x, y = data[0]
    assert again.train_step(x, y).item() == pm.train_step(x, y).item()  # the same state, the same step

    import whalepy

    trace = whalepy.trace_memory(again, x, y)
    allocated = [e.allocated_bytes for e in trace.events]
    assert allocated and all(a is not None and a > 0 for a in allocated)
    assert sum(trace.activation_bytes.values()) > 0


def test_zero_offload_fp16_clipped_steps_jointly_after_backward(nccl):
    """fp16 with clipping: the host steps after the backward (``JointStep``): the scaler's "found inf"
    over a device and a host sentinel (the host flag all-reduced through the device under NCCL), one
    clipping norm over device and host gradients (host sums moved to the device for NCCL)."""
    data = batches(GLOBAL_BATCH, STEPS)
    pm = lower("zero_offload fp16 clipped", "fp16", data, optimizer_tier="cpu", max_grad_norm=0.05)
    assert pm._joint is not None and not pm.host_optimizer.step_in_backward
    check(train(pm, data), "fp16", True, data, max_grad_norm=0.05)


def test_host_tier_clipped_and_disk_tiers(nccl, tmp_path):
    """(cpu, cpu) under ZeRO-3 (FSDP2 ``CPUOffloadPolicy`` with pinned shards) with clipping over host
    DTensor gradients of a CUDA mesh; (nvme, nvme) under ZeRO-3 (file-homed shards staged through pinned
    buffers, gradients in files); (gpu, nvme) (device optimizer states staged to the device). fp32;
    the disk tier's directory is gone after ``close``."""
    data = batches(GLOBAL_BATCH, STEPS)
    pm = lower("cpu/cpu z3 clipped", "fp32", data, zero=3, param_tier="cpu", optimizer_tier="cpu", max_grad_norm=0.05)
    check(train(pm, data), "fp32", True, data, max_grad_norm=0.05)
    for name, zero, p, o in (("nvme/nvme z3", 3, "nvme", "nvme"), ("gpu/nvme", 0, "gpu", "nvme")):
        pm = lower(name, "fp32", data, zero=zero, param_tier=p, optimizer_tier=o, nvme_dir=tmp_path / name.replace("/", "-"))
        assert pm.nvme is not None and pm.nvme.engine.pin
        got = train(pm, data)
        directory = pm.nvme.directory
        pm.close()
        assert not directory.exists()
        check(got, "fp32", pm.dp_kind.value == "fsdp2", data)


def test_activation_and_checkpoint_offload_and_tiling(nccl):
    """Saved activations in pinned host memory (copied down ``non_blocking`` on the compute stream and
    back in backward), checkpointed inputs in host memory, and memory-centric tiling (ZeRO-3, 2 tiles per
    linear): fp32 against one process."""
    import dataclasses

    data = batches(GLOBAL_BATCH, STEPS)
    for name, kwargs in (("activation offload", {"activation_offload": True}),
                         ("checkpoint offload", {"checkpoint": True, "checkpoint_offload": True})):
        pm = lower(name, "fp32", data, **kwargs)
        check(train(pm, data), "fp32", pm.dp_kind.value == "fsdp2", data)
    plan = make_case_plan(Case("tiled z3", zero=3, global_batch=GLOBAL_BATCH,
                               extra={"precision": "fp32", "device_type": _device_name()}))
    has = {b.name for b in case_profile("gpt").blocks if b.largest_linear_params}
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, blocks=tuple(
        dataclasses.replace(b, tiles=2 if b.name in has else 1) for b in s.blocks)) for s in plan.stages))
    pm = lower("tiled z3", "fp32", data, plan=plan)
    check(train(pm, data), "fp32", True, data)


def test_meta_model_with_host_and_disk_parameter_tiers(nccl, tmp_path):
    """A meta-device model lowered with its parameters on the host (``(cpu, cpu)``) and in files
    (``(nvme, nvme)``), ZeRO-3: FSDP2's host shards are materialised on the host (FSDP2's
    ``reset_sharded_param`` moves only the shards it pins there, so the disk tier's unpinned ones stayed
    on the GPU and the tier refused them), with the weights ``whalepy.materialize`` gives in one process,
    and train as that model does on the CPU (fp32: losses within 1e-5; the same arithmetic on two
    devices)."""
    from whalepy.runtime.materialize import materialize

    data = batches(GLOBAL_BATCH, STEPS)
    with torch.device("meta"):
        ref = build_model("gpt")
    materialize(ref, "cpu", seed=0)
    init = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref_losses, _ = train_single(ref, data)
    for name, tier in (("cpu/cpu meta", "cpu"), ("nvme/nvme meta", "nvme")):
        with torch.device("meta"):
            model = build_model("gpt")
        pm = lower(name, "fp32", data, model=model, zero=3, param_tier=tier, optimizer_tier=tier,
                   nvme_dir=tmp_path / name.replace("/", "-").replace(" ", "-"))
        before = pm.full_state_dict()
        assert before.keys() <= init.keys() and all(torch.equal(v, init[k]) for k, v in before.items())
        losses = train(pm, data)["losses"]
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= LOSS_TOLERANCE["fp32"] * abs(b), (name, losses, ref_losses)
        pm.close()
