"""Per-rank worker for tests/test_lower_steps.py: lowering steps of whalepy.runtime.lower called one by
one, without ParallelModel (no tests here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from runtime_cases import SEQ, VOCAB, adamw, batches, lm_loss

BLOCKS = {"embed": ("transformer.wte", "transformer.wpe", "transformer.drop"),
          "transformer.h.0": ("transformer.h.0",), "transformer.h.1": ("transformer.h.1",),
          "head": ("transformer.ln_f", "lm_head")}
"""The blocks whalepy.profile finds in the test GPT, by module path (given here: no tracing)."""


class BlockMap:
    """What lowering reads of a profile: each block's module paths."""

    def block(self, name: str) -> Any:
        return SimpleNamespace(modules=BLOCKS[name])


def _gpt(tied: bool) -> torch.nn.Module:
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, num_layers=2, num_heads=4, hidden_size=32,
                         tie_embeddings=tied))


def _context(x: torch.Tensor) -> Any:
    from whalepy.runtime.parts import LowerContext

    return LowerContext(device_type="cpu", cluster_spec=None, example_inputs=(x,), loss_fn=lm_loss,
                        optimizer_factory=adamw, profile=BlockMap())


def tied_over_two_stages() -> dict[str, Any]:
    """A GPT with its embedding tied to its head, over pp = 2: split_pipeline gives this rank its stage and the
    tie's group, tie_across_stages finds its copy, sync_tied_grads sums the copies' gradients."""
    from whalepy.runtime.lower import check_lowerable, choose_dp_kind, place_weights, split_pipeline
    from whalepy.runtime.mesh import build_meshes, make_plan
    from whalepy.runtime.tied import sync_tied_grads, tie_across_stages

    x = batches(4, 1)[0][0][:2]
    plan = make_plan(list(BLOCKS), pp=2, num_microbatches=2, global_batch=4)
    model = _gpt(tied=True)
    reference = model.transformer.wte.weight.detach().clone()
    ctx = _context(x)
    blocks = check_lowerable(model, plan, ctx)
    meshes = build_meshes(plan, "cpu")
    assert place_weights(model, meshes, ctx) is None  # a model holding its weights: no skeleton
    kind = choose_dp_kind(plan, meshes)
    parts, ties = split_pipeline(model, plan, meshes, kind, blocks, on_meta=False, ctx=ctx)
    tied = tie_across_stages(parts, ties)
    copies = [p for t in tied for p in t.params]
    same = all(torch.equal(p.detach(), reference) for p in copies)
    for p in copies:
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    sync_tied_grads(tied, meshes.device)
    return {"kind": kind.value, "stages": [p.index for p in parts], "num_tied": len(tied),
            "copies": len(copies), "same_as_model": same,
            "grads": sorted({float(v) for p in copies for v in p.grad.unique()})}


def zero_offload_without_stages() -> dict[str, Any]:
    """GPT over dp = 2 with ZeRO-Offload: parallelize_part shards the one part (FSDP2), build_optimizers
    puts every parameter under exactly one optimizer, the host's."""
    from torch.distributed.tensor import DTensor

    from whalepy.runtime.lower import (check_lowerable, choose_dp_kind, materialize_parts, parallelize_part,
                                       place_weights, split_pipeline)
    from whalepy.runtime.mesh import build_meshes, make_plan
    from whalepy.runtime.optimizers import build_optimizers

    x = batches(4, 1)[0][0][:2]
    plan = make_plan(list(BLOCKS), dp=2, zero_stage=2, optimizer_tier="cpu", global_batch=4)
    model = _gpt(tied=False)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    ctx = _context(x)
    blocks = check_lowerable(model, plan, ctx)
    meshes = build_meshes(plan, "cpu")
    skeleton = place_weights(model, meshes, ctx)
    kind = choose_dp_kind(plan, meshes)
    (part,), ties = split_pipeline(model, plan, meshes, kind, blocks, on_meta=False, ctx=ctx)
    part = parallelize_part(part, plan, meshes, kind, blocks, ctx, on_meta=False, record={})
    (part,), stats = materialize_parts([part], skeleton, meshes, kind, ctx)
    params = dict(part.module.named_parameters())
    sharded = all(isinstance(p, DTensor) for p in params.values())
    whole = all(torch.equal(p.full_tensor(), full[k]) for k, p in params.items())
    optim = build_optimizers([part], plan, meshes, kind, [], ctx)
    on_host = [id(p) for p in optim.host.params] if optim.host is not None else []
    on_device = [id(p) for g in optim.optimizer.param_groups for p in g["params"]] if optim.optimizer else []
    return {"kind": kind.value, "ties": len(ties), "stats": stats, "sharded": sharded, "whole": whole,
            "each_once": sorted(on_host + on_device) == sorted(id(p) for p in params.values()),
            "host": len(on_host), "joint": optim.joint is not None}


def run_steps() -> list[dict[str, Any]]:
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return [tied_over_two_stages(), zero_offload_without_stages()]
