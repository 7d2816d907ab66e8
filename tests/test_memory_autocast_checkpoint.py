"""Predicted peak memory of a bf16 (autocast) plan against the peak the lowered step really holds, with and
without activation checkpointing: autocast's extra saved tensors (fp32 copies, casts) are kept like a
block's own activations, so a checkpointed block keeps none of them (only the block being recomputed
does). Until this was fixed the planner charged every block's autocast extras whether checkpointed or
not: +12% on the checkpointed plan below, and Megatron-LM's published 1.7B configuration (full
recomputation, micro-batch 16) was predicted not to fit an 80 GB A100 (benchmarks/validate_cost_model.py).

A third case, whose peak is mostly the loss (vocabulary 16384, hidden 64), checks the loss's charge: three
fp32 logit-sized tensors, without the bf16 logits nothing holds in the loss's backward (charging them
too was +14% here, and -11% on the H200's Llama looked like the opposite miss; docs/cost_model.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_harness import run_distributed


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _predicted_and_traced() -> list[tuple[str, float, float]]:
    import whalepy
    from whalepy.models import GPT, GPTConfig
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    cluster = whalepy.ClusterSpec.local(1)
    out = []
    for case, checkpoint, vocab, hidden, layers in (("full", False, 256, 128, 4), ("checkpointed", True, 256, 128, 4),
                                                    ("loss-bound", False, 16384, 64, 2)):
        cfg = GPTConfig(vocab_size=vocab, block_size=64, num_layers=layers, num_heads=4, hidden_size=hidden)
        x = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        model = GPT(cfg)
        est = estimate_from_profile(whalepy.profile(model, (x,)), cluster, ParallelConfig(dp=1, checkpoint=checkpoint),
                                    global_batch=8, precision="bf16")
        pm = whalepy.parallelize(model, cluster, plan=est.plan, example_inputs=(x,), loss_fn=_loss,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=8)
        pm.train_step((x,), x)  # the optimizer's states exist from here on, as in every later step
        out.append((case, float(est.plan.stages[0].cost.memory_bytes),
                    float(whalepy.trace_memory(pm, (x,), x).peak_bytes)))
    return out


def test_bf16_peak_memory_with_and_without_checkpointing_and_at_the_loss_matches_the_trace():
    rows = run_distributed(_predicted_and_traced, 1, timeout=300)[0]
    for case, predicted, traced in rows:
        # measured on this machine: +1.4% without checkpointing, +1.6% with (it was +11.8%), loss-bound +1.6%
        assert abs(predicted / traced - 1) < 0.05, (case, predicted, traced)
    (_, full, full_traced), (_, ckpt, ckpt_traced), _ = rows
    assert ckpt < full and ckpt_traced < full_traced
