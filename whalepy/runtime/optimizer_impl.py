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
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn

from whalepy.ir.types import OptimizerImpl
from whalepy.log import info_once
from whalepy.runtime.host_optimizer import fused_variant

__all__ = ["FUSED_KERNELS", "describe", "fused_supported", "optimizer_factory_for", "split_mixed_groups"]

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
            kinds.add(isinstance(p, DTensor))  # a group of both kinds steps as two (split_mixed_groups)
    # DTensor has sharding rules for the fused Adam and AdamW kernels only (torch.distributed.tensor's
    # pointwise ops): DTensor parameters under another class step as the factory built it
    if True in kinds and not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return f"DTensor has no sharding rule for the fused {type(opt).__name__} kernel"
    return None


def split_mixed_groups(opt: torch.optim.Optimizer) -> bool:
    """Make ``opt`` step each param group that holds both DTensor and plain parameters as two groups,
    plain parameters first, with the group's own hyper-parameters; True when some group mixes them.

    Tensor parallelism without data parallelism (no FSDP2, which makes every parameter a DTensor)
    leaves the modules it does not shard (norms, a block left whole) with plain parameters beside the
    sharded DTensor ones. torch's multi-tensor steps (``foreach``, its default on CUDA, and ``fused``)
    group a param group's tensors by device and dtype only, so one list holds both kinds and DTensor
    refuses the mixed ``_foreach_*`` call ("got mixed torch.Tensor and DTensor") at the first step.
    The update of a parameter depends only on its own tensors and its group's options, so the split
    groups compute the same step. They exist only during ``step``: ``param_groups`` (what schedulers
    change and what ``state_dict`` and checkpoints hold) keep the user's structure, so checkpoints load
    across plans that mix and plans that do not."""
    from torch.distributed.tensor import DTensor

    def mixed(g: dict) -> bool:
        kinds = {isinstance(p, DTensor) for p in g["params"]}
        return len(kinds) == 2

    if not any(mixed(g) for g in opt.param_groups) or getattr(opt, "_whalepy_split_groups", False):
        return False
    inner = opt.step  # bound, with torch's hooks and profiling wrapper

    def step(self: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
        groups = self.param_groups
        split: list[dict] = []
        for g in groups:
            if mixed(g):
                split += [{**g, "params": [p for p in g["params"] if not isinstance(p, DTensor)]},
                          {**g, "params": [p for p in g["params"] if isinstance(p, DTensor)]}]
            else:
                split.append(g)
        self.param_groups = split
        try:
            return inner(*args, **kwargs)
        finally:
            self.param_groups = groups

    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]  # bound: LR schedulers wrap step.__func__
    opt._whalepy_split_groups = True  # type: ignore[attr-defined]
    return True


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
