"""Data parallelism and ZeRO over the plan's ``dp`` mesh axis.

=========  ======================================================================================
ZeRO-3     FSDP2 ``fully_shard`` per block, then the root, ``reshard_after_forward=True``.
ZeRO-2     the same with ``reshard_after_forward=False`` (parameters stay gathered until backward).
ZeRO-1     DDP + ``ZeroRedundancyOptimizer`` (optimizer states sharded, gradients all-reduced).
ZeRO-0     DDP.
=========  ======================================================================================

DDP does not compose with DTensor tensor parallelism, and a pipeline stage is simplest to keep under
one wrapper, so with ``tp > 1`` or ``pp > 1`` ZeRO-0/1 are lowered to FSDP2 with
``reshard_after_forward=False`` (ZeRO-2 behaviour: same numerics, less memory) and a log line says
so. A block whose ``param_tier`` or ``optimizer_tier`` is ``cpu`` gets FSDP2's
``CPUOffloadPolicy`` (``pin_memory`` only with CUDA); such blocks are always lowered to FSDP2.
``optimizer_tier = nvme`` needs nothing here (any kind): the optimizer's states of those blocks are
kept in files by :mod:`whalepy.runtime.nvme`. ``param_tier = nvme`` is not supported and raises
:class:`~whalepy.WhalepyError`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from whalepy._errors import WhalepyError
from whalepy.plan import BlockPlan, Tier, ZeroStage

__all__ = ["DataParallelKind", "apply_data_parallel", "build_optimizer", "needs_offload_policy"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class DataParallelKind:
    NONE = "none"
    DDP = "ddp"
    ZERO1 = "ddp+zero_redundancy_optimizer"
    FSDP = "fsdp2"


def needs_offload_policy(blocks: Iterable[BlockPlan]) -> bool:
    """Whether any block asks for FSDP2's CPU offload (a ``cpu`` tier; ``nvme`` optimizer states are
    handled around the optimizer, ``nvme`` parameters are refused)."""
    return any(Tier.CPU in (b.param_tier, b.optimizer_tier) for b in blocks)


def choose_kind(zero: ZeroStage, dp: int, *, tp: int, pp: int, offload: bool) -> str:
    if dp == 1 and not offload:
        return DataParallelKind.NONE
    if zero >= ZeroStage.GRADIENTS or tp > 1 or pp > 1 or offload:
        return DataParallelKind.FSDP
    return DataParallelKind.ZERO1 if zero == ZeroStage.OPTIMIZER else DataParallelKind.DDP


def apply_data_parallel(
    module: nn.Module,
    blocks: Sequence[tuple[BlockPlan, Sequence[nn.Module]]],
    dp_mesh: DeviceMesh,
    *,
    kind: str,
    zero: ZeroStage,
    device_type: str,
) -> nn.Module:
    """Wrap ``module`` for data parallelism of kind ``kind``; return the module to call.

    ``blocks`` pairs each block plan with the submodules it covers (sharded one FSDP unit each)."""
    for bp, _ in blocks:
        if bp.param_tier is Tier.NVME:
            raise WhalepyError(
                f"block {bp.name!r}: plan field param_tier = 'nvme' is not supported by the runtime "
                "(only optimizer_tier supports 'nvme'; FSDP2 offloads parameters to CPU only); set the "
                "block's param_tier to 'cpu' or 'gpu' (its optimizer_tier may stay 'nvme')"
            )
    if kind == DataParallelKind.NONE:
        return module
    if kind in (DataParallelKind.DDP, DataParallelKind.ZERO1):
        return DDP(module, process_group=dp_mesh.get_group(), device_ids=None)
    reshard = zero >= ZeroStage.PARAMETERS
    shared = _shared_params(module, [m for _, mods in blocks for m in mods])
    for bp, mods in blocks:
        policy = _offload_policy(bp, device_type)
        for m in mods:
            if m is module:
                continue
            if any(id(p) in shared for p in m.parameters()):
                # a tied parameter must sit in one FSDP group: the root's (FSDP2's rule for
                # parameters shared between modules)
                log.info("whalepy: %s shares a parameter with another module; it is sharded with the "
                         "root instead of as its own FSDP unit", type(m).__name__)
                continue
            kwargs = {"offload_policy": policy} if policy is not None else {}
            fully_shard(m, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs)
    root_policy = next((p for p in (_offload_policy(bp, device_type) for bp, _ in blocks) if p), None)
    kwargs = {"offload_policy": root_policy} if root_policy is not None else {}
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs)
    return module


def _shared_params(root: nn.Module, units: Sequence[nn.Module]) -> set[int]:
    """Ids of parameters that a unit shares with anything outside it (tied weights)."""
    shared: set[int] = set()
    for m in units:
        inside = {id(p) for p in m.parameters()}
        owners = {id(p) for _, p in root.named_parameters(remove_duplicate=False)
                  if id(p) in inside}
        for mod_name, sub in root.named_modules():
            if sub is m:
                prefix = mod_name + "." if mod_name else ""
                outside = {id(p) for n, p in root.named_parameters(remove_duplicate=False)
                           if not n.startswith(prefix)}
                shared |= owners & outside
                break
    return shared


def _offload_policy(bp: BlockPlan, device_type: str) -> CPUOffloadPolicy | None:
    if Tier.CPU in (bp.param_tier, bp.optimizer_tier):
        if bp.param_tier is Tier.GPU:
            # FSDP2 has one policy for parameters, gradients and optimizer states together.
            log.warning(
                "block %r: the plan keeps parameters on the GPU and optimizer states on the CPU; FSDP2's "
                "CPUOffloadPolicy offloads both, so its parameters also rest on the CPU between uses "
                "(less GPU memory, more host-link traffic than the plan predicts)", bp.name)
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return None


def build_optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter], *, kind: str, dp_mesh: DeviceMesh | None
) -> torch.optim.Optimizer:
    """Call the user's factory; under ZeRO-1 rebuild the same optimizer class and hyper-parameters
    inside ``ZeroRedundancyOptimizer``."""
    opt = factory(params)
    if kind != DataParallelKind.ZERO1:
        return opt
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_mesh.get_group(),
                                   **defaults)
