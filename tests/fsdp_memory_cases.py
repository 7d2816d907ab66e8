"""Rank side of tests/test_fsdp_memory.py: each plan trained two steps, then one traced (the peak)."""
from __future__ import annotations

import torch

from ddp_memory_cases import GLOBAL_BATCH, loss_fn


def build(seq: int):  # type: ignore[no-untyped-def]
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, block_size=seq, num_layers=2, num_heads=8, hidden_size=256))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (GLOBAL_BATCH, seq), generator=g)
    y = torch.randint(0, 1024, (GLOBAL_BATCH, seq), generator=g)
    return model, x, y


def traced_peaks(cases, cluster) -> list[int]:  # type: ignore[no-untyped-def]
    """``cases``: ``(plan, sequence length)`` pairs; this rank's traced peak of each."""
    import whalepy

    out = []
    for plan, seq in cases:
        model, x, y = build(seq)
        pm = whalepy.parallelize(model, cluster, plan=plan, example_inputs=(x[:1],), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=GLOBAL_BATCH)
        for _ in range(2):
            pm.train_step((x,), y)
        out.append(whalepy.trace_memory(pm, (x,), y).peak_bytes)
        pm.close()
    return out
