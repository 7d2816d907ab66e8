"""Data parallelism and ZeRO over the plan's ``dp`` mesh axis, in the plan's precision.

=========  ======================================================================================
ZeRO-3     FSDP2 ``fully_shard`` per block, then the root, ``reshard_after_forward=True``.
ZeRO-2     the same with ``reshard_after_forward=False`` (parameters stay gathered until backward).
ZeRO-1     DDP + ``ZeroRedundancyOptimizer`` (optimizer states sharded, gradients all-reduced).
ZeRO-0     DDP.
=========  ======================================================================================

DDP does not compose with DTensor tensor parallelism, and a pipeline stage is simplest to keep under
one wrapper, so with ``tp > 1`` or ``pp > 1`` ZeRO-0/1 are lowered to FSDP2 with
``reshard_after_forward=False`` (ZeRO-2 behaviour: same numerics, less memory) and a log line says
so. The kind is decided by :func:`whalepy.ir.rules.choose_lowering_kind`, which the memory
model consults too. A block whose parameters are on the ``cpu`` tier gets FSDP2's ``CPUOffloadPolicy``
(parameters, gradients and optimizer states on the host; ``pin_memory`` only with CUDA), and with
``param_tier`` cpu or nvme FSDP2's explicit prefetching fetches the next ``prefetch_depth`` blocks
(:func:`set_prefetch`). ``param_tier = nvme`` is the same lowering, the host shards then being homed in
files by :mod:`whalepy.runtime.nvme`. A block with parameters on the device and optimizer states on
the ``cpu`` tier (ZeRO-Offload) is sharded like any other here and
:mod:`whalepy.runtime.host_optimizer` takes its gradients and steps it on the host. A stage with any
such tier is always lowered to FSDP2. ``optimizer_tier = nvme`` needs nothing here (any kind): the
optimizer's states of those blocks are kept in files by :mod:`whalepy.runtime.nvme`. Tier combinations the runtime does not
lower (:func:`whalepy.ir.rules.state_option_error`) raise :class:`~whalepy.WhalepyError`.
A tiled block (``BlockPlan.tiles``, :mod:`whalepy.runtime.tiling`) has each tile of its linears and embeddings
sharded as its own unit before the block itself; :func:`fsdp_units` lists them with the block's
units (the disk tier homes their shards with the block) and :func:`set_prefetch` prefetches a tiled
block by its first tile only.

Precision: under FSDP2 every unit gets ``MixedPrecisionPolicy(param_dtype=<bf16|fp16>,
reduce_dtype=float32)``: fp32 sharded parameters (the master weights), gradients and optimizer
states, low-precision all-gathers and compute, fp32 gradient reduce-scatter. DDP / ZeRO-1 / no
wrapper keep fp32 parameters and the step runs under ``torch.autocast`` (``parallel_model``).
DDP uses ``gradient_as_bucket_view=True``, so its reduction buckets are the gradients (no second copy).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from whalepy.ir.rules import (LoweringKind, choose_lowering_kind, offloads_to_host, shared_unit_tiers_error,
                              state_option_error, uses_cpu_offload_policy)
from whalepy.errors import WhalepyError
from whalepy.ir.plan import BlockPlan, Precision, Tier, ZeroStage
from whalepy.runtime._torch_compat import fsdp_param_groups
from whalepy.runtime.tiling import tile_modules

__all__ = ["LoweringKind", "apply_data_parallel", "build_optimizer", "cast_sharded_params", "check_root_tiers",
           "choose_lowering_kind", "wrap_ddp", "compute_dtype", "fsdp_units", "offloads_any_block", "root_blocks", "set_prefetch"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def compute_dtype(precision: Precision) -> torch.dtype | None:
    """The low-precision compute dtype of ``precision``; None for fp32 (nothing to cast)."""
    return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(Precision(precision))


def offloads_any_block(blocks: Iterable[BlockPlan]) -> bool:
    """Whether any block keeps states off the device through the host (a ``cpu`` tier: FSDP2's
    ``CPUOffloadPolicy`` or the host optimizer; or ``nvme`` parameters: host shards homed in files;
    ``nvme`` optimizer states alone are handled around the optimizer)."""
    return any(offloads_to_host(b.param_tier, b.optimizer_tier) for b in blocks)


def wrap_ddp(module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """DDP over ``dp_mesh``. Its constructor reads every parameter (shape check, broadcast from rank 0,
    buckets), so a model built on the meta device is wrapped only after it is materialised."""
    return DDP(module, process_group=dp_mesh.get_group(), device_ids=None, gradient_as_bucket_view=True)


def apply_data_parallel(
    module: nn.Module,
    blocks: Sequence[tuple[BlockPlan, Sequence[nn.Module]]],
    dp_mesh: DeviceMesh,
    *,
    kind: str,
    zero: ZeroStage,
    device_type: str,
    precision: Precision = Precision.FP32,
) -> nn.Module:
    """Wrap ``module`` for data parallelism of kind ``kind``; return the module to call.

    ``blocks`` pairs each block plan with the submodules it covers (sharded one FSDP unit each)."""
    for bp, _ in blocks:
        reason = state_option_error(zero, bp.param_tier, bp.optimizer_tier, precision=precision)
        if reason is not None:
            raise WhalepyError(f"block {bp.name!r}: the plan's {reason}")
    check_root_tiers(module, blocks)
    if kind == LoweringKind.NONE:
        return module
    if kind in (LoweringKind.DDP, LoweringKind.ZERO1):
        return wrap_ddp(module, dp_mesh)
    reshard = zero >= ZeroStage.PARAMETERS
    low = compute_dtype(precision)
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)} if low else {}
    shared = _shared_params(module, [m for _, mods in blocks for m in mods])
    for bp, mods in blocks:
        policy = _offload_policy(bp, device_type)
        for m in mods:
            kwargs = {"offload_policy": policy} if policy is not None else {}
            for tile in tile_modules(m):  # memory-centric tiling: each tile its own unit, inside the block's
                fully_shard(tile, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs, **mp)
            if m is module:
                continue
            if any(id(p) in shared for p in m.parameters()):
                # a tied parameter must sit in one FSDP group: the root's (FSDP2's rule for
                # parameters shared between modules)
                log.info("whalepy: %s shares a parameter with another module; it is sharded with the "
                         "root instead of as its own FSDP unit", type(m).__name__)
                continue
            fully_shard(m, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs, **mp)
    owners = root_blocks(module, blocks)
    root_policy = _offload_policy(owners[0], device_type) if owners else None
    kwargs = {"offload_policy": root_policy} if root_policy is not None else {}
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs, **mp)
    set_prefetch(module, blocks)
    return module


def cast_sharded_params(modules: Iterable[nn.Module], params: Iterable[nn.Parameter],
                        dtype: torch.dtype) -> dict[int, nn.Parameter]:
    """Give FSDP2's sharded parameters ``params`` the dtype ``dtype`` (ZeRO-Offload: the device keeps
    its parameters in the compute dtype, the host the fp32 masters), before the first forward.

    FSDP2 supports parameters whose dtype changes between ``fully_shard`` and the first forward (its
    ``reset_sharded_param`` re-pads the new local tensor, its mixed-precision dtypes are set lazily):
    each parameter is replaced on its module(s) by a cast copy and FSDP2 re-reads it. A parameter
    group (one FSDP unit) is cast whole or not at all, as FSDP2 wants one original dtype per unit.
    Returns old parameter id -> new parameter for those cast."""
    from torch.distributed.fsdp import FSDPModule

    wanted = {id(p) for p in params}
    out: dict[int, nn.Parameter] = {}
    seen: set[int] = set()
    for root in modules:
        for m in root.modules():
            if not isinstance(m, FSDPModule) or id(m) in seen:
                continue
            seen.add(id(m))
            for group in fsdp_param_groups(m):
                fps = group.fsdp_params
                if not fps or not all(id(fp.sharded_param) in wanted for fp in fps):
                    continue
                with torch.no_grad():
                    for fp in fps:
                        old = fp.sharded_param
                        new = nn.Parameter(old.detach().to(dtype), requires_grad=old.requires_grad)
                        info = fp._module_info
                        for mod, name in [(info.module, info.param_name),
                                          *zip(info.shared_modules, info.shared_param_names)]:
                            setattr(mod, name, new)
                        fp.reset_sharded_param()
                        out[id(old)] = new
    return out


def root_blocks(module: nn.Module, blocks: Sequence[tuple[BlockPlan, Sequence[nn.Module]]]) -> list[BlockPlan]:
    """The blocks whose parameters the root unit of ``module`` holds: a block that is ``module`` itself,
    and a block with a module sharing a parameter with another module (a tied weight: FSDP2 keeps it in
    one unit, the root's, and :func:`apply_data_parallel` leaves such a module to the root whole)."""
    shared = _shared_params(module, [m for _, mods in blocks for m in mods])
    return [bp for bp, mods in blocks
            if any(m is module or any(id(p) in shared for p in m.parameters()) for m in mods)]


def check_root_tiers(module: nn.Module, blocks: Sequence[tuple[BlockPlan, Sequence[nn.Module]]]) -> None:
    """Refuse (:class:`WhalepyError`) blocks of different tiers whose parameters the root unit would hold
    together (:func:`whalepy.ir.rules.shared_unit_tiers_error`); cheap, before any sharding. The
    root's offload policy is then that of these blocks (none when there are none: parameters in no
    block stay on the device, where the plan, which places none of them, counts nothing)."""
    owners = root_blocks(module, blocks)
    reason = shared_unit_tiers_error(((b.param_tier, b.optimizer_tier) for b in owners),
                                     names=(b.name for b in owners))
    if reason is not None:
        raise WhalepyError(f"the plan's tiers cannot be lowered: {reason}")


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
    if uses_cpu_offload_policy(bp.param_tier, bp.optimizer_tier):
        # FSDP2 has one policy for parameters, gradients and optimizer states together (which is why
        # state_option_error refuses a cpu tier for only one of them). NVMe parameters: the shards'
        # home is a file and the pinned memory is the disk tier's staging buffers (runtime.nvme)
        return CPUOffloadPolicy(pin_memory=device_type == "cuda" and bp.param_tier is not Tier.NVME)
    return None


def fsdp_units(module: nn.Module, mods: Sequence[nn.Module]) -> list[nn.Module]:
    """The FSDP2 units of a block: its modules (not the root, which every block shares), then the tiles
    of its tiled linears and embeddings (:mod:`whalepy.runtime.tiling`), in forward order."""
    from torch.distributed.fsdp import FSDPModule

    outer = [m for m in mods if m is not module and isinstance(m, FSDPModule)]
    return outer + [t for m in mods for t in tile_modules(m) if isinstance(t, FSDPModule)]


def _heads(module: nn.Module, mods: Sequence[nn.Module], *, forward: bool) -> list[nn.Module]:
    """The units of a block another block prefetches: all but the tiles, and of the tiles only the one
    used first (the first in forward, the last in backward), so prefetching keeps one tile's working set."""
    from torch.distributed.fsdp import FSDPModule

    tiles = [t for m in mods for t in tile_modules(m) if isinstance(t, FSDPModule)]
    outer = [m for m in mods if m is not module and isinstance(m, FSDPModule)]
    return outer + (tiles[:1] if forward else tiles[-1:])


def set_prefetch(module: nn.Module, blocks: Sequence[tuple[BlockPlan, Sequence[nn.Module]]]) -> int:
    """FSDP2's explicit prefetching for blocks whose parameters are off the device: the last unit of
    block ``i`` all-gathers the units of the next ``prefetch_depth`` blocks in forward
    (``set_modules_to_forward_prefetch``) and of the previous ones in backward
    (``set_modules_to_backward_prefetch``). NVMe blocks prefetch one block this way (host to device);
    their disk reads ``prefetch_depth`` ahead are the disk tier's. A tiled block is prefetched by its
    first tile only (:func:`_heads`); inside it FSDP2 gathers tile after tile. Returns the blocks
    configured."""
    units = [fsdp_units(module, mods) for _, mods in blocks]
    fwd = [_heads(module, mods, forward=True) for _, mods in blocks]
    bwd = [_heads(module, mods, forward=False) for _, mods in blocks]
    n = 0
    for i, (bp, _) in enumerate(blocks):
        if bp.param_tier is Tier.GPU or not units[i]:
            continue
        depth = 1 if bp.param_tier is Tier.NVME else max(1, bp.prefetch_depth)
        ahead = [u for us in fwd[i + 1: i + 1 + depth] for u in us]
        behind = [u for us in bwd[max(0, i - depth): i][::-1] for u in us]
        if ahead:
            units[i][-1].set_modules_to_forward_prefetch(ahead)
        if behind:
            units[i][0].set_modules_to_backward_prefetch(behind)
        n += 1
    return n


def build_optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter], *, kind: str, dp_mesh: DeviceMesh | None
) -> torch.optim.Optimizer:
    """Call the user's factory; under ZeRO-1 rebuild the same optimizer class and hyper-parameters
    inside ``ZeroRedundancyOptimizer``."""
    opt = factory(params)
    if kind != LoweringKind.ZERO1:
        return opt
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    # parameters packed into one bucket per rank and device: after the step each rank broadcasts its
    # partition as one message (world size broadcasts), not one per parameter (one per tensor: about a
    # hundred collectives for a small GPT, each paying the link's latency; docs/runtime.md)
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_mesh.get_group(),
                                   parameters_as_bucket_view=True, **defaults)
