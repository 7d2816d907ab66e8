"""Gradient clipping by the global norm, under every layout whalepy lowers.

``torch.nn.utils.clip_grad_norm_`` handles plain tensors and DTensors on one mesh. A whalepy rank
holds a mix: plain gradients (DDP, ZeRO-1, no data parallelism), FSDP2 shards on the dp mesh, and
tensor-parallel x FSDP2 shards on the 2-D mesh; and a pipeline stage holds only its own layers. The
global norm is assembled here:

1. per gradient, the sum of squares of this rank's local tensor;
2. summed over the mesh dimensions on which it is sharded (``Shard`` / strided shard placements; a
   replicated dimension holds copies and is not summed), one all-reduce per (mesh, sharded dims);
3. summed over the pipeline ranks (the stage totals), with a parameter tied across pipeline stages
   (its copies hold the same summed gradient) counted once.

Every rank then scales its local gradients by ``min(1, max_norm / (norm + 1e-6))``, as
``clip_grad_norm_`` does. Gradients must already be unscaled (fp16).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["clip_grad_norm"]

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""


def _local_sq(g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """This rank's sum of squares of ``g`` and the key of the reduction it still needs."""
    from torch.distributed.tensor import DTensor

    if not isinstance(g, DTensor):
        return g.detach().float().pow(2).sum(), ()
    if any(p.is_partial() for p in g.placements):
        from torch.distributed.tensor import Replicate

        g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
    # sharded dims: Shard and FSDP2's strided shard (not a Shard subclass in every torch version)
    dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
    return g._local_tensor.detach().float().pow(2).sum(), (g.device_mesh, dims) if dims else ()


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, *, device: torch.device,
                   pp_group: dist.ProcessGroup | None = None,
                   tied: Sequence[tuple[Sequence[nn.Parameter], int]] = ()) -> torch.Tensor:
    """Clip the gradients of ``params`` (this rank's) to a global 2-norm of ``max_norm``; return the
    norm before clipping (a 0-dim float32 tensor on ``device``, the same on every rank).

    ``pp_group``: the pipeline ranks of this rank's (dp, tp) coordinate, whose stage totals are summed.
    ``tied``: (copies of one tied parameter on this rank, number of copies in the whole pipeline)."""
    weight = {id(p): 1.0 / n for copies, n in tied for p in copies if n > 1}
    sums: dict[object, torch.Tensor] = {}
    meshes: dict[object, tuple] = {}
    grads: list[torch.Tensor] = []
    for p in {id(p): p for p in params}.values():
        if p.grad is None:
            continue
        sq, key = _local_sq(p.grad)
        sq = sq.to(device) * weight.get(id(p), 1.0)
        k = (id(key[0]), key[1]) if key else ()
        meshes[k] = key
        sums[k] = sums[k] + sq if k in sums else sq
        grads.append(p.grad)
    total = torch.zeros((), device=device, dtype=torch.float32)
    for k, s in sums.items():
        if meshes[k]:
            mesh, dims = meshes[k]
            for d in dims:
                dist.all_reduce(s, group=mesh.get_group(d))
        total = total + s
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + EPS), max=1.0)
    from torch.distributed.tensor import DTensor

    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in locals_:
        by_device.setdefault(t.device, []).append(t)
    for dev, ts in by_device.items():
        torch._foreach_mul_(ts, coef.to(dev))
    return norm
