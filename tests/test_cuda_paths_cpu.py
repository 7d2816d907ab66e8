"""What CPU runs can check of the three failures the first GPU run found (docs/runtime.md, "CUDA paths").

On CPU with gloo the "device" and the host are the same memory, so a host tensor wrapped for, or
moved onto, a device tensor's place shows no difference there. These tests give the device side its
own identity without a GPU:

- the disk tier's optimizer states of device parameters (``(gpu, nvme)``): the "device" copy the step
  uses is its own tensor on a CPU run too (``device_params=True``), so a test sees which tensor the
  optimizer steps and which one the swap engine moves (``tests/test_cuda_tiers.py``: ``Tensor.set_``
  of a CUDA state onto a host slot);
- ZeRO-Offload's host state behind a device mesh: the mesh is labelled ``cuda`` over PyTorch's fake
  process group (one process, no collective runs; the tensors stay on the host), so the wrappers the
  checkpoint and the clipping go through are built exactly as on a CUDA mesh. ``DTensor.from_local``
  moves a host local tensor to a ``cuda`` mesh's device (a copy, so loads and clips missed the host
  tensors); here that is an error, not a silent copy;
- the fp16 joint step's order (unscale, clip, step, update) against ``torch.amp.GradScaler``'s contract,
  with an SGD whose update is proportional to the gradient (Adam's first steps hardly see a scale).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from whalepy.runtime.nvme import NvmeOptimizerStates, prepare_nvme_dir


@pytest.fixture
def fake_cuda_mesh():
    """A 2-rank mesh labelled ``cuda`` over the fake process group (this process is rank 0)."""
    if dist.is_initialized():
        pytest.skip("needs an uninitialised torch.distributed")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DeviceMesh("cuda", torch.arange(2))
    finally:
        dist.destroy_process_group()


def _host_shard(mesh, full: tuple[int, int], dtype: torch.dtype, seed: int) -> nn.Parameter:
    """This rank's row shard of a ``full``-shaped parameter, a DTensor on ``mesh`` whose local tensor is
    on the host (as FSDP2 builds its ``CPUOffloadPolicy`` shards)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    g = torch.Generator().manual_seed(seed)
    local = torch.randn(full[0] // 2, full[1], generator=g).to(dtype)
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size(full), (full[1], 1), dtype))
    return nn.Parameter(DTensor(local, spec, requires_grad=True))  # type: ignore[call-arg]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- (gpu, nvme): device states are stepped as device copies, never installed under host views ---


def test_disk_tier_steps_device_states_as_copies_and_keeps_host_views(tmp_path: Path):
    """Every tensor the swap engine installs (``Item.point_at``) is a host view over a host storage; the
    optimizer steps the device copies (``Item.on_device``, on the parameters' device), not the views;
    between steps its state entries are the views over the files; the result is the plain optimizer's."""
    from whalepy.runtime import _swap

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nv = NvmeOptimizerStates(opt, model.parameters(), prepare_nvme_dir(tmp_path / "nvme"), device_params=True,
                             fsync=False)
    params = list(model.parameters())
    installed: list[tuple[str, torch.device, torch.device]] = []
    point_at = _swap.Item.point_at

    def recording(item, storage, elem_offset=0):
        installed.extend((item.name, v.tensor.device, storage.device) for v in item.views)
        return point_at(item, storage, elem_offset)

    seen_in_step: list[bool] = []

    def in_step(optimizer, args, kwargs):  # the block's step: its states are the staged device copies
        items = {it.name: it for b in nv.engine.blocks for it in b.items}
        for k, p in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq"):
                it = items.get(f"s{k}.{key}")
                if it is None:  # the first step creates them
                    continue
                s = optimizer.state[p][key]
                seen_in_step.append(s is it.on_device and s.device == p.device
                                    and not any(_same_storage(s, v.tensor) for v in it.views))

    hook = opt.register_step_pre_hook(in_step)
    _swap.Item.point_at = recording
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 6, generator=g)
            for m, o in ((ref, ref_opt), (model, opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad(set_to_none=True)
            views = {it.name: it.views[0].tensor for b in nv.engine.blocks for it in b.items}
            for k, p in enumerate(params):  # between steps: the host views (over a slot being written)
                assert all(opt.state[p][key] is views[f"s{k}.{key}"] for key in ("exp_avg", "exp_avg_sq"))
        nv.engine.flush()  # the write-backs landed: the views are over the files
        assert all(nv.is_mapped(opt.state[p][key]) for p in params for key in ("exp_avg", "exp_avg_sq"))
    finally:
        _swap.Item.point_at = point_at
        hook.remove()
    assert installed and all(t == s == torch.device("cpu") for _, t, s in installed)
    assert len(seen_in_step) == 2 * len(params) * 2 and all(seen_in_step)  # steps 2 and 3
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(params, ref.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
    nv.close()


def test_swap_engine_refuses_a_storage_on_another_device():
    """The guard the CUDA failure lacked: a view is never re-pointed across devices (``Tensor.set_``
    on CUDA refuses it deep inside the step; here it is the engine's own message, naming the item)."""
    from whalepy.runtime._swap import Item, View

    t = torch.empty(4, device="meta")
    item = Item("s0.exp_avg", torch.float32, 4, [View.of(t)], kind="state")
    with pytest.raises(RuntimeError, match="s0.exp_avg.*cannot be moved onto a storage on cpu"):
        item.point_at(torch.zeros(4).untyped_storage())


# -- ZeRO-Offload: the state a checkpoint writes and reads IS the host state ---------------------


def test_zero_offload_checkpoint_state_is_the_host_state_on_a_device_mesh(fake_cuda_mesh):
    """``state_view`` / ``get_train_state`` give the host masters and Adam states themselves (same
    storage, on the host) behind DTensors of the device mesh; what a DCP load writes into them in
    place, and what ``set_train_state`` copies from other tensors, reaches the host optimizer, and
    ``master_weights`` (what ``full_state_dict`` gathers) then gives the loaded masters."""
    from whalepy.runtime.checkpointing import get_train_state, master_weights, set_train_state
    from whalepy.runtime.host_optimizer import MASTER_KEY, HostOptimizer

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = _host_shard(fake_cuda_mesh, (8, 4), torch.bfloat16, seed=0)

    model = Block()
    host = HostOptimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3), [("b", [model.w])], torch.device("cpu"))
    b = host.blocks[0]
    master, states = b.masters[0], b.optimizer
    view = host.state_view()
    entries = view.state[model.w]
    assert _same_storage(entries[MASTER_KEY], master)
    assert all(_same_storage(entries[k], states.state[master][k]) for k in ("exp_avg", "exp_avg_sq"))
    saved = get_train_state([model], [view])
    assert _same_storage(saved["model"]["w"], master)  # the weight a checkpoint holds: the fp32 master
    with torch.no_grad():  # a DCP load fills the template in place
        saved["model"]["w"]._local_tensor.fill_(0.5)
        saved["optim"]["state"]["w"]["exp_avg"]._local_tensor.fill_(0.25)
    set_train_state([model], [host.state_view()], saved)
    host.after_load()
    assert torch.equal(master, torch.full_like(master, 0.5))
    assert torch.equal(states.state[master]["exp_avg"], torch.full_like(master, 0.25))
    assert torch.equal(model.w._local_tensor, torch.full_like(model.w._local_tensor, 0.5))  # cast down
    assert torch.equal(master_weights([model], [host.state_view()])["w"]._local_tensor, master)
    # a state dict of other tensors (``load_state_dict``): copied into the host tensors
    other = {"model": {"w": saved["model"]["w"].detach().clone() * 0 + 2.0}, "optim": saved["optim"]}
    set_train_state([model], [host.state_view()], other)
    assert torch.equal(master, torch.full_like(master, 2.0))
    host.close()


# -- fp16 joint step: unscale, clip, step, update ------------------------------------------------


def test_fp16_joint_step_clips_the_host_gradients_it_steps(fake_cuda_mesh):
    """``AmpContext.clip_and_step`` over a ``JointStep`` of ZeRO-Offload's host optimizer (stepping after
    the backward) on a device mesh: the host gradients are unscaled once, clipped in place, stepped
    (SGD: the update is the gradient), and the scale updated; a step with an inf is skipped and the
    scale halved. Against the same arithmetic written out."""
    from whalepy.runtime._amp import AmpContext
    from whalepy.runtime._clip import EPS, clip_grad_norm
    from whalepy.runtime._joint_step import JointStep, host_grad_params
    from whalepy.runtime.host_optimizer import HostOptimizer

    device = torch.device("cpu")
    w = _host_shard(fake_cuda_mesh, (8, 4), torch.float32, seed=0)
    lr, max_norm = 0.1, 0.05
    host = HostOptimizer(lambda ps: torch.optim.SGD(ps, lr=lr), [("b", [w])], device, step_in_backward=False)
    amp = AmpContext("fp16", device)
    joint = JointStep(None, host, device)
    expected = host.blocks[0].masters[0].detach().clone()
    g = torch.Generator().manual_seed(3)
    for step, blow_up in enumerate((False, True, False)):
        scale = amp.loss_scale()
        grad = torch.randn(w._local_tensor.shape, generator=g)
        scaled = grad * scale
        if blow_up:
            scaled[0, 0] = float("inf")
        w.grad = type(w)(scaled, w._spec, requires_grad=False)  # type: ignore[call-arg]
        host._on_grad(w)  # FSDP2's post-reduce point: the gradient goes to the host buffer
        host.finish()
        norm = amp.clip_and_step(joint, lambda: clip_grad_norm(host_grad_params(host), max_norm, device=device))
        joint.zero_grad()
        if blow_up:
            assert amp.loss_scale() == scale / 2, step
            continue
        assert amp.loss_scale() == scale
        ref_norm = grad.pow(2).sum().sqrt()  # the fake group's all-reduce leaves this rank's sum
        assert torch.allclose(norm, ref_norm, rtol=1e-6), (norm, ref_norm)
        expected -= lr * grad * min(1.0, max_norm / (float(ref_norm) + EPS))
        got = host.blocks[0].masters[0].detach()
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7), (step, (got - expected).abs().max())
        assert torch.equal(w._local_tensor, got)  # copied back to the device shard
    host.close()
