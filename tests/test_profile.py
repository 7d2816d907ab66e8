"""build_profile: parameter counts, training FLOPs against closed forms, blocks, annotations, table."""

from __future__ import annotations

import pytest
import torch

import whalepy
from whalepy.passes import build_profile, model_fingerprint
from whalepy.ir.profile import BlockAnnotations, BlockKind

from tiny_hf import ids as _ids
from tiny_hf import tiny_hf_model

transformers = pytest.importorskip("transformers")


def _model(name: str):
    """Small configs of the five reference architectures, on the meta device, with their inputs."""
    return tiny_hf_model(name, num_layers=2)


@pytest.fixture(scope="module")
def gpt2_profile():
    model, inputs = _model("gpt2")
    return model, build_profile(model, inputs)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit"])
def test_parameter_counts_are_exact(name: str) -> None:
    model, inputs = _model(name)
    prof = build_profile(model, inputs)
    expected = sum(p.numel() for p in model.parameters())
    assert prof.total_params == expected
    assert sum(b.num_params for b in prof.blocks) == expected
    assert sum(b.param_bytes for b in prof.blocks) == prof.param_bytes
    assert [b.index for b in prof.blocks] == list(range(len(prof.blocks)))
    assert prof.capture_method == "export"


def test_tied_lm_head_belongs_to_the_embedding_block(gpt2_profile) -> None:
    model, prof = gpt2_profile
    embed, head = prof.block("embed"), prof.block("head")
    assert embed.num_params == 512 * 64 + 64 * 64  # wte (= lm_head) + wpe
    assert head.num_params == 2 * 64  # ln_f only
    assert embed.kind is BlockKind.EMBEDDING and head.kind is BlockKind.HEAD


def test_batch_seq_fingerprint_and_block_io(gpt2_profile) -> None:
    model, prof = gpt2_profile
    assert (prof.batch_size, prof.seq_len) == (2, 16)
    assert prof.fingerprint == model_fingerprint(model)
    other, _ = _model("llama")
    assert model_fingerprint(other) != prof.fingerprint
    layer = prof.block("transformer.h.1")
    hidden = 2 * 16 * 64 * 4
    # a layer reads the hidden state and the attention mask, and hands on the hidden state
    assert layer.input_bytes == hidden + 2 * 16 * 16
    assert layer.output_bytes == hidden
    assert prof.block("embed").input_bytes == 2 * 16 * 8
    assert layer.bwd_flops == pytest.approx(2 * layer.fwd_flops, rel=0.03)
    assert layer.activation_bytes > 0 and layer.bytes_moved > layer.param_bytes
    assert prof.graph is not None


def test_vit_has_no_seq_len() -> None:
    model, inputs = _model("vit")
    prof = build_profile(model, inputs)
    assert (prof.batch_size, prof.seq_len) == (2, None)


def test_gpt2_training_flops_match_narayanan() -> None:
    """72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (Narayanan et al., SC'21, no recomputation)."""
    B, s, l, h, V = 8, 1024, 4, 768, 50257
    cfg = transformers.GPT2Config(n_layer=l, n_embd=h, n_head=12, vocab_size=V, n_positions=s,
                                  use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    prof = build_profile(model, {"input_ids": _ids(B, s)})
    expected = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert prof.train_flops == pytest.approx(expected, rel=0.02)


def test_llama_training_flops_match_closed_form() -> None:
    """An independent count for a gated-MLP, GQA model, written from the config:

    training FLOPs = 3 * forward (backward = 2 * forward), forward =
      2 * tokens * (matmul parameters per layer * l + LM head h*V)   (each weight once per token)
      + l * 4 * B * s^2 * h                                          (Q K^T and P V, all heads)
    with matmul parameters per layer = 2*h*h (q, o) + 2*h*kv*d (k, v) + 3*h*f (gate, up, down).
    Norms, rotary embedding, SiLU and residual adds are left out: they are O(h) per token against
    O(h^2) for the matmuls, well under the 2% tolerance for this shape.
    """
    B, s, l, h, f, a, kv, V = 4, 1024, 4, 1024, 2816, 16, 4, 32000
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=l,
                                   num_attention_heads=a, num_key_value_heads=kv, vocab_size=V,
                                   max_position_embeddings=s, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    prof = build_profile(model, {"input_ids": _ids(B, s)})
    d = h // a
    per_layer = 2 * h * h + 2 * h * kv * d + 3 * h * f
    forward = 2 * B * s * (l * per_layer + h * V) + l * 4 * B * s * s * h
    assert prof.fwd_flops == pytest.approx(forward, rel=0.02)
    assert prof.train_flops == pytest.approx(3 * forward, rel=0.02)


def test_profile_table() -> None:
    model, inputs = _model("llama")
    prof = whalepy.profile(model, inputs, model_name="tiny-llama")
    text = str(prof)
    assert text.startswith("ModelProfile tiny-llama")
    assert "params" in text and "TFLOPs/step" in text and "captured by export" in text
    for column in ("block", "kind", "fwd GFLOP", "bwd GFLOP", "act MiB", "TP", "annotations"):
        assert column in text
    assert "model.layers.0 .. model.layers.1 (x2)" in text
    assert "colx5 rowx2" in text


def test_stage_annotations_land_on_blocks() -> None:
    model, inputs = _model("gpt2")
    whalepy.annotate(model, {"transformer.h.0": whalepy.stage(), "transformer.h.1": whalepy.stage()})
    prof = build_profile(model, inputs)
    assert prof.block("transformer.h.0").annotations.stage == 0
    assert prof.block("transformer.h.1").annotations.stage == 1
    assert prof.block("embed").annotations.stage is None


def test_stage_boundary_inside_a_layer_is_refused() -> None:
    model, inputs = _model("gpt2")
    whalepy.annotate(model, {"transformer.h.0.attn": whalepy.stage(), "transformer.h.0.mlp": whalepy.stage()})
    with pytest.raises(whalepy.AnnotationError, match="must fall on a block boundary") as info:
        build_profile(model, inputs)
    msg = str(info.value)
    assert "block transformer.h.0 contains modules of different stages" in msg
    assert "embed (transformer.wte, transformer.wpe, transformer.drop)" in msg


def test_stage_scopes_outside_layers_open_blocks() -> None:
    """Stage scopes that would share a block outside the repeated layers (the embedding's two tables;
    a model without repeated layers at all) make their modules blocks of their own."""
    model, inputs = _model("gpt2")
    whalepy.annotate(model, {"transformer.wte": whalepy.stage(), "transformer.{wpe,h.0-1}": whalepy.stage()})
    prof = build_profile(model, inputs)
    assert prof.block("transformer.wte").annotations.stage == 0
    assert prof.block("transformer.wpe").annotations.stage == 1
    assert prof.block("transformer.wte").kind is BlockKind.OTHER
    assert sum(b.num_params for b in prof.blocks) == sum(p.numel() for p in model.parameters())

    class Net(torch.nn.Module):  # the README's class-decorator example
        def __init__(self) -> None:
            super().__init__()
            with whalepy.stage():
                self.embed = torch.nn.Embedding(64, 32)
            with whalepy.stage(), whalepy.replicate():
                self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.embed(x))

    @whalepy.split(4)
    class MLP(torch.nn.Sequential):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))

    prof = build_profile(Net(), (torch.zeros(2, 8, dtype=torch.long),))
    assert [(b.name, b.annotations.stage, b.annotations.split) for b in prof.blocks] == [
        ("embed", 0, None), ("mlp", 1, 4)]
    plan = whalepy.plan_from_profile(prof, whalepy.ClusterSpec.local(8), global_batch=8)
    assert plan.pp_degree == 2 and plan.stages[1].tp_degree == 4  # replicate() over split(4): DP of TP


def test_explicit_annotations_argument() -> None:
    model, inputs = _model("gpt2")
    ann = {"transformer.h.0.mlp": BlockAnnotations(
        split=2, sources=("split(2) on transformer.h.0.mlp",))}
    prof = build_profile(model, inputs, annotations=ann)
    block = prof.block("transformer.h.0")
    assert block.annotations.split == 2 and 2 in block.tp_degrees
    assert prof.block("transformer.h.1").annotations.is_empty
