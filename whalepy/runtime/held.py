"""What a rank holds of its model states, measured on the live tensors: bytes of parameters, gradients
and optimizer states by place (the device, the host, files). One function for the tests that compare
held bytes with the memory model's prediction and for ``whalepy study zero --measure``.

Places follow the runtime, not the tensors' device alone: a parameter FSDP2 offloads (its own record,
``FSDPParam.offload_to_cpu``) is on the host even on a CPU device; a tensor that is a view of a disk-tier
file mapping (optimizer states, gradient files: :mod:`whalepy.runtime.nvme`) is in files; ZeRO-Offload's
host master weights, gradients and states are the host optimizer's own tensors. A storage shared by
several tensors is counted once.
"""

from __future__ import annotations

from typing import Any

import torch

from whalepy.runtime._torch_compat import fsdp_param_groups

__all__ = ["held_state_bytes", "offloaded_params", "storage_of"]


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """``(data pointer, bytes)`` of the storage under ``t`` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    from torch._subclasses.fake_tensor import is_fake

    local = t._local_tensor if isinstance(t, DTensor) else t
    st = local.untyped_storage()
    if is_fake(local) or local.is_meta:  # a dry run (whalepy check): no data; the storage's identity
        return -st._cdata, st.nbytes()
    return st.data_ptr(), st.nbytes()


def _elements_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _view_key(ptr: int, t: torch.Tensor) -> tuple[int, int, int]:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return ptr, local.storage_offset(), local.numel()


def offloaded_params(modules: list[torch.nn.Module]) -> set[int]:
    """Ids of the parameters FSDP2 offloads to the host (its ``FSDPParam.offload_to_cpu``)."""
    from torch.distributed.fsdp import FSDPModule

    out: set[int] = set()
    for root in modules:
        for m in root.modules():
            if not isinstance(m, FSDPModule):
                continue
            for fp in (fp for group in fsdp_param_groups(m) for fp in group.fsdp_params):
                if fp.offload_to_cpu:
                    out.add(id(fp.sharded_param))
    return out


def held_state_bytes(pm: Any, *, unpadded: bool = False) -> dict[str, dict[str, int]]:
    """``{kind: {place: bytes}}`` this rank holds now, kinds ``params``, ``grads``, ``optimizer``, places
    ``device``, ``host``, ``files`` (module docstring). ``unpadded``: a tensor's own elements rather than
    its storage's bytes (FSDP2 pads each shard's storage to a multiple of the replicas; the memory model
    counts the elements, ``whalepy check`` compares those exactly)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    modules = pm.module if isinstance(pm.module, list) else [pm.module]
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    offloaded = offloaded_params(modules)
    opt = pm.optimizer.optim if isinstance(pm.optimizer, ZeroRedundancyOptimizer) else pm.optimizer
    # ZeRO-Offload: the host copies are separate tensors (counted below), whatever the device is
    on_cpu_device = pm.device.type == "cpu"
    nvme = getattr(pm, "nvme", None)
    seen: set[Any] = set()
    out = {k: {"device": 0, "host": 0, "files": 0} for k in ("params", "grads", "optimizer")}

    def add(kind: str, t: torch.Tensor, owner: torch.nn.Parameter, mapped: bool = False) -> None:
        ptr, nbytes = storage_of(t)
        if unpadded:  # views of one buffer (FSDP2's reduce-scatter output) each count their own elements
            ptr, nbytes = _view_key(ptr, t), _elements_bytes(t)
        if ptr in seen or nbytes == 0:
            return
        seen.add(ptr)
        if mapped:
            place = "files"
        elif id(owner) in offloaded or (t.device.type == "cpu" and not on_cpu_device):
            place = "host"
        else:
            place = "device"
        out[kind][place] += nbytes

    for p in params:
        add("params", p, p)
        if p.grad is not None:  # the disk tier's gradient files (nvme parameters) are files
            add("grads", p.grad, p, mapped=nvme is not None and nvme.grads.is_file_grad(p))
    for p in params:
        for v in (opt.state.get(p, {}).values() if opt is not None else ()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                add("optimizer", v, p, mapped=nvme is not None and nvme.is_mapped(v))
    host_optimizer = getattr(pm, "host_optimizer", None)
    if host_optimizer is not None:
        for kind, t in host_optimizer.held():
            ptr, nbytes = storage_of(t)
            if unpadded:
                ptr, nbytes = _view_key(ptr, t), _elements_bytes(t)
            if ptr not in seen and nbytes:
                seen.add(ptr)
                out[kind]["host"] += nbytes
    return out
