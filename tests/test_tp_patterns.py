"""Tensor-parallel patterns found from dataflow: GPT-2, Llama (GQA), BERT, eager attention, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import whalepy
from whalepy.passes import build_profile
from whalepy.passes.shapes import reshape_dim
from whalepy.passes.tp_patterns import BlockTP, check_split_degrees
from whalepy.ir.plan import TPRule, TPStyle
from whalepy.ir.profile import BlockAnnotations

transformers = pytest.importorskip("transformers")

COL, ROW, VOCAB, REP = TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.VOCAB, TPStyle.REPLICATE


def _styles(block) -> dict[str, TPStyle]:
    return {r.module: r.style for r in block.tp_rules}


def _gpt2(n_embd: int = 64, n_head: int = 4, vocab: int = 512):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                  n_positions=64, use_cache=False)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def _ids(batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(batch, seq, dtype=torch.long)}


@pytest.fixture(scope="module")
def gpt2_profile():
    return build_profile(_gpt2(), _ids())


def test_gpt2_patterns(gpt2_profile) -> None:
    prof = gpt2_profile
    assert _styles(prof.block("transformer.h.1")) == {
        "transformer.h.1.attn.c_attn": COL, "transformer.h.1.attn.c_proj": ROW,
        "transformer.h.1.mlp.c_fc": COL, "transformer.h.1.mlp.c_proj": ROW}
    assert _styles(prof.block("embed")) == {"transformer.wte": VOCAB, "transformer.wpe": REP}
    assert _styles(prof.block("head")) == {"lm_head": COL}
    layer = prof.block("transformer.h.0")
    # 4 heads, 64 features per fused q/k/v chunk, 256 MLP features: degrees up to 4
    assert layer.tp_degrees == (1, 2, 4)
    # forward all-reduces the outputs of attn.c_proj and mlp.c_proj: 2 x [tokens, hidden] fp32
    assert layer.tp_comm_bytes == 2 * (2 * 16 * 64 * 4)
    assert prof.block("embed").tp_degrees == (1, 2, 4, 8, 16, 32, 64)  # vocab 512
    assert prof.block("embed").tp_comm_bytes == 2 * 16 * 64 * 4
    nodes = [n for n in prof.graph.graph.nodes if n.meta.get("whalepy.tp_style") is COL]
    assert {n.meta["whalepy.module_path"] for n in nodes} >= {"transformer.h.0.attn.c_attn", "lm_head"}


def test_gpt2_real_vocab_limits_embedding_degrees() -> None:
    prof = build_profile(_gpt2(vocab=50257), _ids())
    assert prof.block("embed").tp_degrees == (1,)  # 50257 = 29 * 1733
    assert prof.block("head").tp_degrees == (1,)
    assert prof.block("transformer.h.0").tp_degrees == (1, 2, 4)


@pytest.mark.parametrize("heads,kv_heads,degrees", [(4, 2, (1, 2)), (8, 8, (1, 2, 4, 8))])
def test_llama_matches_hf_tp_plan(heads: int, kv_heads: int, degrees: tuple[int, ...]) -> None:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   vocab_size=512, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    prof = build_profile(model, _ids())
    for i in range(2):
        found = {m.removeprefix(f"model.layers.{i}."): s.value
                 for m, s in _styles(prof.block(f"model.layers.{i}")).items()}
        expected = {k.removeprefix("layers.*."): v for k, v in cfg.base_model_tp_plan.items()}
        assert found == expected
        assert prof.block(f"model.layers.{i}").tp_degrees == degrees
    assert _styles(prof.block("embed")) == {"model.embed_tokens": VOCAB}
    assert _styles(prof.block("head")) == {"lm_head": COL}


def test_bert_patterns() -> None:
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=512)
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(cfg)
    ids = _ids()["input_ids"]
    inputs = {"input_ids": ids, "token_type_ids": ids, "attention_mask": torch.ones_like(ids)}
    prof = build_profile(model, inputs)
    p = "bert.encoder.layer.0."
    assert _styles(prof.block("bert.encoder.layer.0")) == {
        p + "attention.self.query": COL, p + "attention.self.key": COL,
        p + "attention.self.value": COL, p + "attention.output.dense": ROW,
        p + "intermediate.dense": COL, p + "output.dense": ROW}
    embed = _styles(prof.block("embed"))
    assert embed["bert.embeddings.word_embeddings"] is VOCAB
    assert embed["bert.embeddings.position_embeddings"] is REP
    # indexed by a model input too, but not the largest table: not the vocabulary
    assert embed["bert.embeddings.token_type_embeddings"] is REP
    assert prof.block("embed").tp_degrees == (1, 2, 4, 8, 16, 32, 64)
    # the MLM transform is followed by a LayerNorm over its output: it stays replicated
    assert _styles(prof.block("head")) == {"cls.predictions.decoder": COL}


class EagerAttention(nn.Module):
    """Attention written with matmul / softmax, q/k/v as separate linears, plus a residual."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.norm(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, w // self.heads).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        p = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        out = (p @ v).transpose(1, 2).reshape(b, s, w)
        return x + self.o(out)


class Layers(nn.Module):
    def __init__(self, layer: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer(), layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ResidualOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))  # no second linear: nothing to pair with


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_eager_attention_pattern(method: str) -> None:
    prof = build_profile(Layers(EagerAttention).to("meta"), (torch.zeros(2, 8, 32),),
                         capture_method=method)
    assert _styles(prof.block("layers.0")) == {
        "layers.0.q": COL, "layers.0.k": COL, "layers.0.v": COL, "layers.0.o": ROW}
    assert prof.block("layers.0").tp_degrees == (1, 2, 4)


def test_linear_into_residual_is_not_a_pattern() -> None:
    prof = build_profile(Layers(ResidualOnly).to("meta"), (torch.zeros(2, 8, 32),))
    assert prof.block("layers.0").tp_rules == ()
    assert prof.block("layers.0").tp_degrees == (1, 2, 4, 8, 16, 32, 64)


def test_split_3_on_a_256_wide_mlp_is_refused() -> None:
    model = _gpt2()  # n_embd 64: the MLP is 256 wide
    whalepy.annotate(model, {"transformer.h.0.mlp": whalepy.split(3)})
    with pytest.raises(whalepy.AnnotationError) as info:
        build_profile(model, _ids())
    msg = str(info.value)
    assert msg.startswith("split(3) on transformer.h.0.mlp: transformer.h.0.mlp.c_fc has 256 "
                          "output features, not divisible by 3")
    assert "valid degrees are 1, 2, 4" in msg


def test_valid_split_is_accepted() -> None:
    model = _gpt2()
    whalepy.annotate(model, {"transformer.h.*": whalepy.split(4)})
    prof = build_profile(model, _ids())
    assert prof.block("transformer.h.1").annotations.split == 4


def test_split_on_a_block_without_pattern_is_refused() -> None:
    model = Layers(ResidualOnly).to("meta")
    whalepy.annotate(model, {"layers.0": whalepy.split(2)})
    with pytest.raises(whalepy.AnnotationError, match="no tensor-parallel pattern"):
        build_profile(model, (torch.zeros(2, 8, 32),))


def test_split_around_the_whole_model_leaves_patternless_blocks_replicated() -> None:
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, image_size=32, patch_size=8, num_labels=10)
    with torch.device("meta"):
        model = transformers.ViTForImageClassification(cfg)
    whalepy.annotate(model, {"": whalepy.split(2)})
    prof = build_profile(model, {"pixel_values": torch.zeros(2, 3, 32, 32)})
    assert prof.block("embed").tp_rules == () and prof.block("embed").annotations.split == 2
    # transformers 5.x names ViT's layers vit.layers.N, 4.x vit.encoder.layer.N
    first_layer = "vit.layers.0" if hasattr(model.vit, "layers") else "vit.encoder.layer.0"
    assert 2 in prof.block(first_layer).tp_degrees


def test_check_split_degrees_unit() -> None:
    tp = BlockTP(rules=(TPRule(module="mlp.fc", style=COL), TPRule(module="mlp.proj", style=ROW)),
                 dims=(("mlp.fc", "output features", 96), ("mlp.proj", "input features", 96)),
                 degrees=(1, 2, 4, 8, 16, 32))
    assert check_split_degrees("b", BlockAnnotations(), tp) == tp.degrees
    assert check_split_degrees("b", BlockAnnotations(split=0), tp) == tp.degrees
    assert 3 in check_split_degrees("b", BlockAnnotations(split=3), tp)
    msg = "mlp.fc has 96 output features, not divisible by 64"
    with pytest.raises(whalepy.AnnotationError, match=msg):
        check_split_degrees("b", BlockAnnotations(split=64, sources=("split(64) on mlp",)), tp)


def test_reshape_dim_mapping() -> None:
    assert reshape_dim((2, 16, 64), (2, 16, 4, 16), 2) == (2, 4)  # split into heads
    assert reshape_dim((2, 16, 4, 16), (2, 16, 64), 2) == (2, None)  # merge, outermost
    assert reshape_dim((2, 16, 4, 16), (2, 16, 64), 3) == (None, None)  # would be strided
    assert reshape_dim((2, 16, 64), (32, 64), 2) == (1, None)
    assert reshape_dim((2, 2, 1, 16, 8), (2, 2, 16, 8), 1) == (1, None)
