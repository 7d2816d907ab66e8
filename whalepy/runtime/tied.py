"""Weights shared by pipeline stages (a tied embedding and LM head): the process group of the pipeline
ranks holding a copy (Megatron-LM's embedding group), this rank's copies once lowered, and the sum of
their gradients before each optimizer step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from whalepy.errors import WhalepyError
from whalepy.ir.plan import Plan
from whalepy.ir.rules import LoweringKind
from whalepy.runtime.mesh import RankMeshes
from whalepy.runtime.parts import StagePart, Tied

__all__ = ["TieGroup", "sync_tied_grads", "tie_across_stages", "tie_groups"]

TieGroup = tuple[list[tuple[int, str]], "dist.ProcessGroup | None"]
"""``(stage, parameter name)`` of every copy of one tied parameter, and this rank's group for it."""


def tie_groups(tied: list[list[tuple[int, str]]], plan: Plan, meshes: RankMeshes, *, stage_indices: Sequence[int],
               dp_kind: str, tp: int) -> list[TieGroup]:
    """Needs: the holders of each tied parameter (``pipeline.tied_parameters``) and this rank's stages.
    Gives: for each parameter shared by several pipeline stages, the process group of the pipeline ranks
    holding a copy, for this rank's ``(dp, tp)`` coordinate (Megatron-LM's embedding group). Groups are
    created on every rank in the same order (``dist.new_group`` is collective); entries this rank holds
    no copy of are dropped."""
    pp = plan.pp_degree
    me = meshes
    out = []
    for holders in tied:
        physical = sorted({k % pp for k, _ in holders})
        names = [n for _, n in holders]
        if len(physical) == 1 and len(holders) > 1 and (tp > 1 or dp_kind != LoweringKind.NONE):
            raise WhalepyError(
                f"tied parameter {names[0]!r} (also {names[1:]}) sits in {len(holders)} virtual "
                f"stages {[k for k, _ in holders]} of the same rank; with tensor or data "
                "parallelism each would be sharded separately and the tie lost. Put the blocks "
                "that share it in one virtual stage, or untie the weights")
        group = None
        if len(physical) > 1:
            for d in range(plan.dp_degree):
                for t in range(plan.stages[0].tp_degree):
                    ranks = sorted(plan.stages[s].ranks[d][t] for s in physical)
                    g = dist.new_group(ranks)
                    if me.replica == d and me.tp_index == t and me.rank in ranks:
                        group = g
        if any(k in stage_indices for k, _ in holders):
            out.append((holders, group))
    return out


def tie_across_stages(parts: Sequence[StagePart], groups: Sequence[TieGroup]) -> list[Tied]:
    """Needs: the parts after TP / FSDP2 and materialising (their parameters are final DTensors) and
    :func:`tie_groups`. Gives: this rank's copies of each tied parameter, found by name."""
    out = []
    for holders, group in groups:
        found = {id(p): p for part in parts for k, name in holders if k == part.index
                 for p in [part.module.get_parameter(name)]}
        out.append(Tied(list(found.values()), group, list(holders)))
    return out


def sync_tied_grads(tied: Sequence[Tied], device: torch.device) -> None:
    """Sum the gradient of each tied parameter over the pipeline ranks holding a copy, so every
    copy takes the same optimizer step (the copies are sharded alike by TP / FSDP2, so the local
    shards line up)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in tied:
            params, group = t.params, t.group
            if group is None and len(params) < 2:
                continue
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
                    # a vocab-parallel embedding's gradient comes back whole (Replicate) where the
                    # column-parallel head's copy is sharded: bring it to the parameter's layout
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                grads.append(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
            # copies in several virtual stages of this rank (interleaved schedules) are summed here
            # first, so every rank of the group makes one all-reduce per tied parameter
            total = grads[0].to(device, copy=True)
            for g in grads[1:]:
                total += g.to(device)
            if group is not None:  # on the host tier NCCL has no CPU tensors: reduced on the device
                dist.all_reduce(total, group=group)
            for g in grads:
                g.copy_(total)
