"""Property: for any GPT shape and any contiguous cut into stages, the chained stage modules compute the
eager model's logits and parameter gradients (single process, so each example is cheap)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from whalepy.models import GPT, GPTConfig
from whalepy.runtime.pipeline import split_stages


@st.composite
def gpt_and_cut(draw):  # type: ignore[no-untyped-def]
    num_layers = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = heads * draw(st.sampled_from([4, 8]))
    cfg = GPTConfig(vocab_size=draw(st.sampled_from([16, 37])), block_size=8, num_layers=num_layers,
                    num_heads=heads, hidden_size=hidden, bias=draw(st.booleans()))
    blocks = [["transformer.wte", "transformer.wpe"]] + [[f"transformer.h.{i}"] for i in range(num_layers)]
    blocks.append(["transformer.ln_f", "lm_head"])
    num_stages = draw(st.integers(1, len(blocks)))
    cuts = sorted(draw(st.sets(st.integers(1, len(blocks) - 1), min_size=num_stages - 1,
                               max_size=num_stages - 1)))
    bounds = [0, *cuts, len(blocks)]
    stages = [[p for b in blocks[a:z] for p in b] for a, z in zip(bounds, bounds[1:])]
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(2, 8))
    return cfg, stages, batch, seq


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpt_and_cut())
def test_chained_stages_match_eager(case) -> None:  # type: ignore[no-untyped-def]
    cfg, stages, batch, seq = case
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    expected = model(ids)
    expected.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    modules = split_stages(model, (ids,), None, stages)
    assert len(modules) == len(stages)
    out: tuple = (ids,)
    for m in modules:
        res = m(*out)
        out = res if isinstance(res, tuple) else (res,)
    logits = out[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    logits.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=1e-6, msg=n)
