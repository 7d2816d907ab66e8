"""Rank side of tests/test_ddp_memory.py: each plan trained two steps, then one traced (the peak)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

GLOBAL_BATCH = 8


def build():
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, block_size=32, num_layers=2, num_heads=8, hidden_size=256))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (GLOBAL_BATCH, 32), generator=g)
    y = torch.randint(0, 1024, (GLOBAL_BATCH, 32), generator=g)
    return model, x, y


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def traced_peaks(plans, cluster) -> list[int]:
    import whalepy

    out = []
    for plan in plans:
        model, x, y = build()
        pm = whalepy.parallelize(model, cluster, plan=plan, example_inputs=(x[:1],), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=GLOBAL_BATCH)
        for _ in range(2):  # DDP rebuilds its buckets in the second step
            pm.train_step((x,), y)
        out.append(whalepy.trace_memory(pm, (x,), y).peak_bytes)
        pm.close()
    return out
