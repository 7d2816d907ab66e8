"""One optimizer step over the device optimizer and ZeRO-Offload's host optimizer, after the backward.

Under fp16 or with gradient clipping ZeRO-Offload's host optimizer steps after the whole backward
(:func:`whalepy.ir.rules.host_steps_after_backward`): the fp16 loss scaler must decide from every
gradient, device and host, whether to skip the step, and the clipping norm is one norm over all of
them. :class:`JointStep` presents both optimizers to ``torch.amp``'s scaler as one optimizer, so that
``ShardedGradScaler.unscale_`` unscales the host gradients (fp32 CPU tensors, the masters' ``.grad``)
in the same call as the device ones, all-reduces one "found inf" over the world, and ``scaler.step``
steps both or neither.

The scaler all-reduces one flag per device its gradients are on. So that every rank issues the same
collectives whatever it holds (a pipeline stage without device parameters, or without host blocks; a
stage whose FSDP2 ``CPUOffloadPolicy`` blocks have host gradients beside another's device gradients),
the joint optimizer carries a zero one-element gradient on the compute device first and, on an
accelerator, one on the host: every rank then has flags for the same devices in the same order.
Every rank steps through a :class:`JointStep` under fp16, and with clipping as soon as any stage of the
plan has ZeRO-Offload blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from whalepy.runtime.host_optimizer import HostOptimizer, as_shard_of, local_tensor

__all__ = ["JointStep", "host_grad_params"]


class _Grad:
    """What the scaler reads of a parameter: ``.grad``, a plain tensor."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


class JointStep:
    """The device optimizer (or None) and the host optimizer (or None) as one optimizer: what
    ``GradScaler.unscale_`` / ``step`` read (``param_groups``), ``step`` and ``zero_grad``. Call
    :meth:`HostOptimizer.finish` before using it in a training step."""

    def __init__(self, device_optimizer: torch.optim.Optimizer | None, host: HostOptimizer | None,
                 device: torch.device) -> None:
        self.device_optimizer = device_optimizer
        self.host = host
        self._sentinels = [torch.zeros(1, device=device)] + (
            [torch.zeros(1)] if device.type != "cpu" else [])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """One group of this step's gradients, each as a plain tensor: the sentinels, the device
        optimizer's (a DTensor's local shard: unscaling is element-wise, and the scaler all-reduces
        "found inf" over the world, which covers every shard; torch's DTensor rule for the unscale
        would instead reduce it over the first gradient's mesh, and cannot take plain tensors of the
        same device and dtype in the same call), the host's (:meth:`HostOptimizer.host_grads`)."""
        grads = list(self._sentinels)
        if self.device_optimizer is not None:
            grads += [local_tensor(p.grad) for g in self.device_optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
        if self.host is not None and not self.host.step_in_backward:
            grads += [g for _, g in self.host.host_grads()]
        return [{"params": [_Grad(g) for g in grads]}]

    def step(self) -> None:
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        if self.host is not None:
            self.host.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.device_optimizer is not None:
            self.device_optimizer.zero_grad(set_to_none=set_to_none)
        if self.host is not None:
            self.host.zero_grad()


class _HostGrad:
    """What the clipping reads of a ZeRO-Offload parameter: its host gradient as ``.grad``, a DTensor laid
    out like the device shard (so the norm sums it over the mesh dimensions the shard is split on)
    whose local tensor is the host buffer itself (so clipping scales the buffer in place)."""

    def __init__(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grad = as_shard_of(param, grad)


def host_grad_params(host: HostOptimizer | None) -> list[Any]:
    """The host gradients of ``host`` (after :meth:`HostOptimizer.finish`, stepping after backward) for
    :func:`whalepy.runtime._clip.clip_grad_norm`; none when ``host`` is None or steps during backward."""
    if host is None or host.step_in_backward:
        return []
    return [_HostGrad(p, g) for p, g in host.host_grads()]
