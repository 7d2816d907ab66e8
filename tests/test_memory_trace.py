"""whalepy.trace_memory (PatrickStar's warm-up trace): one real iteration's saved-for-backward bytes per
module and operator, against the profile's estimate, and the planner taking the measured bytes."""

from __future__ import annotations

import pytest
import torch

import whalepy
from whalepy._errors import WhalepyError
from whalepy.models import GPT, GPTConfig
from whalepy.profile import profile


@pytest.fixture(scope="module")
def small_gpt():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=128, num_layers=2, num_heads=4, hidden_size=128))
    x = torch.randint(0, 512, (4, 128))
    return model, x, profile(model, (x,))


def test_trace_matches_the_estimated_activations(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = small_gpt
    trace = whalepy.trace_memory(model, x)
    # the profile estimates each block's saved bytes from the captured graph; the trace measures the
    # storages autograd really packs. Both count the same tensors, so they agree to the byte on this
    # fp32 CPU model; 1% leaves room for a torch version that saves one small extra tensor.
    for b in prof.blocks:
        assert trace.saved_bytes_of(b.modules) == pytest.approx(b.activation_bytes, rel=0.01), b.name
    assert trace.peak_saved_bytes == pytest.approx(sum(b.activation_bytes for b in prof.blocks), rel=0.01)
    # the timeline: every operator of forward and backward, attributed to modules, saved bytes rising
    # through the forward to the peak
    fwd = [e for e in trace.events if e.phase == "forward"]
    assert fwd and any(e.phase == "backward" for e in trace.events)
    assert [e.saved_bytes for e in fwd] == sorted(e.saved_bytes for e in fwd)
    assert fwd[-1].saved_bytes == trace.peak_saved_bytes
    assert any(e.module.startswith("transformer.h.1.attn") and "mm" in e.op for e in fwd)
    assert all(p.grad is None for p in model.parameters())  # the warm-up leaves no gradients behind


def test_planner_takes_the_measured_bytes(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, x, prof = small_gpt
    trace = whalepy.trace_memory(model, x[:2].clone())  # half the profile's batch: apply() scales it up
    measured = trace.apply(prof)
    for a, b in zip(prof.blocks, measured.blocks):
        if a.kind.value == "layer" or a.name == "head":
            assert b.activation_bytes == pytest.approx(a.activation_bytes, rel=0.01), a.name
    # the embedding saves its token ids (per sample) and position ids (per sequence, not per sample):
    # linear scaling in the batch overstates the latter, here 1 KiB
    emb = prof.blocks[0]
    assert measured.blocks[0].activation_bytes - emb.activation_bytes == 1024


def test_trace_refuses_a_meta_model() -> None:
    with torch.device("meta"):
        meta = GPT(GPTConfig(vocab_size=512, block_size=128, num_layers=2, num_heads=4, hidden_size=128))
    with pytest.raises(WhalepyError, match="meta device"):
        whalepy.trace_memory(meta, torch.zeros(2, 128, dtype=torch.long))


def test_chunked_placement_by_hand() -> None:
    """Belady's rule on a hand-checked sequence: units a, b, c of 4 bytes, chunks of 4, room for two
    chunks; forward a b c, backward c b a (no activations). Static keeps a and b (first used) and
    fetches c twice = 8; chunked, in steady state, evicts the chunk used furthest ahead: in forward it
    must fetch c (evicting a, used last), then in backward c, b are resident and a comes back (evicting
    c): 8 as well; with room for all three nothing moves."""
    from whalepy._chunk_placement import Access, chunk_traffic, static_block_traffic

    acc = [Access(u, 0) for u in "abccba"]
    sizes = {"a": 4, "b": 4, "c": 4}
    assert static_block_traffic(acc, sizes, budget=12) == 8  # a, b resident + one staging buffer
    assert chunk_traffic(acc, sizes, budget=8, chunk_bytes=4) == 8
    assert chunk_traffic(acc, sizes, budget=12, chunk_bytes=4) == 0


def test_chunked_placement_moves_less_than_static_blocks(small_gpt) -> None:  # type: ignore[no-untyped-def]
    """On the traced GPT with room for the activation peak and half the parameters, trace-driven chunks
    (room grows as activations are freed, units split across chunks) fetch less than fixed blocks."""
    from whalepy._chunk_placement import block_module_accesses, chunk_traffic, static_block_traffic

    model, x, prof = small_gpt
    trace = whalepy.trace_memory(model, x)
    acc, sizes = block_module_accesses(model, prof, trace)
    budget = trace.peak_saved_bytes + sum(sizes.values()) // 2
    static = static_block_traffic(acc, sizes, budget)
    chunked = chunk_traffic(acc, sizes, budget, chunk_bytes=max(sizes.values()) // 2)
    assert 0 < chunked < static
