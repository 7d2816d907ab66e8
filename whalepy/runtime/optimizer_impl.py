"""The optimizer implementation a plan lowers (``Plan.optimizer_impl``): the user's factory decides the
algorithm and its hyper-parameters, whalepy the kernel that runs it.

torch ships three implementations of most of its optimizers: a loop over the parameters, ``foreach``
(one multi-tensor kernel per element-wise operation of the update: AdamW reads and writes every state
about seven times) and ``fused`` (the whole update in one kernel per group of tensors, each state read and
written once). They compute the same update; torch's own tests hold ``fused`` to ``foreach`` within
their default tolerances (``test/test_optim.py``, ``test_fused_matches_forloop``). Which one runs is
chosen by the constructor's ``fused`` / ``foreach`` flags, and torch never picks ``fused`` by itself
(``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``), so a plain ``AdamW(params)`` runs
``foreach`` on CUDA and the loop on CPU.

Under ``OptimizerImpl.FUSED`` each optimizer the factory builds is rebuilt with ``fused=True`` (its class,
its param groups and hyper-parameters; :func:`~whalepy.runtime.host_optimizer.fused_variant`) where its
class has a fused kernel for the devices and dtypes of its parameters (:data:`FUSED_KERNELS`); otherwise,
or where the user asked for ``fused`` or ``differentiable`` themselves, the factory's optimizer is kept.
The state layout is the same (``step``, ``exp_avg``, ...; torch moves a loaded ``step`` to the device a
fused optimizer keeps it on), and a checkpoint load keeps the loading optimizer's kernel flags
(``checkpointing.set_train_state``), so checkpoints load across the two. ``OptimizerImpl.AS_GIVEN`` keeps
the factory's optimizer exactly (apart from host-resident parameters, which always step with the fused
CPU kernel: ``host_optimizer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from whalepy.ir.types import OptimizerImpl
from whalepy.log import info_once
from whalepy.runtime.host_optimizer import fused_variant

__all__ = ["FUSED_KERNELS", "describe", "fused_supported", "optimizer_factory_for"]

log = logging.getLogger("whalepy.runtime")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _fused_devices(cuda: bool = True) -> frozenset[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return frozenset(d for d in _get_fused_kernels_supported_devices() if cuda or d != "cuda")


FUSED_KERNELS: dict[type, Callable[[], frozenset[str]]] = {
    torch.optim.Adam: _fused_devices,
    torch.optim.AdamW: _fused_devices,
    torch.optim.SGD: _fused_devices,
    torch.optim.Adagrad: lambda: _fused_devices(cuda=False),
}
"""Optimizer classes with a ``fused=True`` kernel, and the device types it runs on: the list torch's own
check uses (``torch/optim/optimizer.py``, ``_device_dtype_check_for_fused``), without CUDA for Adagrad
(its constructor passes ``cuda_unsupported=True``). The exact classes only: a subclass may change
``step``."""


def fused_supported(opt: torch.optim.Optimizer) -> str | None:
    """Why ``opt`` cannot step with torch's fused kernel, or None when it can."""
    devices = FUSED_KERNELS.get(type(opt))
    if devices is None:
        return f"torch has no fused {type(opt).__name__}"
    ok = devices()
    from torch.distributed.tensor import DTensor

    kinds = set()
    for g in opt.param_groups:
        if g.get("differentiable"):
            return "differentiable=True has no fused kernel"
        for p in g["params"]:
            if p.device.type not in ok:
                return f"no fused {type(opt).__name__} kernel on {p.device.type}"
            if not torch.is_floating_point(p):
                return f"fused kernels need floating-point parameters, got {p.dtype}"
            kinds.add(isinstance(p, DTensor))
    # DTensor runs a fused step only over a list of DTensors, and has sharding rules for the fused Adam
    # and AdamW kernels only (torch.distributed.tensor's pointwise ops): a mix of sharded and plain
    # parameters (a block left whole beside FSDP2 / TP ones), or DTensor parameters under another class,
    # steps as the factory built it
    if kinds == {True, False}:
        return "its parameters mix DTensor shards and plain tensors, which one fused step cannot take"
    if True in kinds and not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return f"DTensor has no sharding rule for the fused {type(opt).__name__} kernel"
    return None


def describe(opt: torch.optim.Optimizer) -> str:
    """The implementation ``opt`` steps with, as torch chooses it from its flags and parameters."""
    g = opt.param_groups[0] if opt.param_groups else {}
    if g.get("fused"):
        return "fused"
    if g.get("foreach"):
        return "foreach"
    if g.get("foreach") is None and "foreach" in g:
        params = [p for grp in opt.param_groups for p in grp["params"]]
        return "foreach" if params and all(p.device.type == "cuda" for p in params) else "for-loop"
    return "for-loop"


def optimizer_factory_for(factory: OptimizerFactory, impl: OptimizerImpl | str) -> OptimizerFactory:
    """The factory the runtime calls for a plan with ``impl``: the user's, whose optimizers are swapped
    for their fused variant under ``fused`` (module docstring). The first optimizer built is logged (rank
    0, once per job): its class and the implementation that runs."""
    impl = OptimizerImpl(impl)

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        opt = factory(params)
        why = None
        if impl is OptimizerImpl.FUSED and isinstance(opt, torch.optim.Optimizer):
            why = fused_supported(opt)
            if why is None:
                opt = fused_variant(opt)
        if isinstance(opt, torch.optim.Optimizer):
            _log_once(opt, impl, why)
        return opt

    return build


def _log_once(opt: torch.optim.Optimizer, impl: OptimizerImpl, why: str | None) -> None:
    name = f"{type(opt).__module__}.{type(opt).__qualname__}"
    how = describe(opt)
    if impl is OptimizerImpl.AS_GIVEN:
        reason = "optimizer_impl='as_given': as the factory built it"
    elif why is not None:
        reason = f"as the factory built it: {why}"
    else:
        reason = "torch's fused kernel of the same algorithm and hyper-parameters (optimizer_impl='fused')"
    devices = sorted({p.device.type for g in opt.param_groups for p in g["params"]}) or ["no parameters"]
    info_once("optimizer-impl", "whalepy: optimizer %s steps %s on %s (%s)", name, how, "/".join(devices), reason,
              log=log)
