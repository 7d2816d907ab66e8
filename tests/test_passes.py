"""Analysis passes: pass manager, FLOPs, bytes, saved activations, blocks."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import whalepy
from whalepy.passes import analysis_passes, capture, find_runs, run_passes
from whalepy.passes.manager import PassContext
from whalepy.ir.profile import BlockKind

transformers = pytest.importorskip("transformers")


def _analysed(model: nn.Module, inputs, method: str = "auto") -> fx.GraphModule:
    gm = capture(model, inputs, method=method)
    run_passes(gm, analysis_passes(model, {}))
    return gm


def _calls(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


class TwoLinears(nn.Module):
    def __init__(self, k: int = 16, n: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(k, n)
        self.b = nn.Linear(n, k, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# -- pass manager ----------------------------------------------------------------------------


def test_manager_names_the_failing_pass_and_node() -> None:
    gm = capture(TwoLinears(), (torch.zeros(2, 16),), method="symbolic_trace")

    def boom(gm: fx.GraphModule, ctx: PassContext) -> None:
        for node in ctx.nodes(gm):
            if node.op == "call_function":
                raise KeyError("no rule")

    with pytest.raises(whalepy.CaptureError, match=r"pass boom failed at node linear .*no rule") as info:
        run_passes(gm, [("ok", lambda gm, ctx: None), ("boom", boom)])
    assert isinstance(info.value.__cause__, KeyError)


def test_manager_lets_user_errors_through_and_times_passes() -> None:
    gm = capture(TwoLinears(), (torch.zeros(2, 16),), method="symbolic_trace")

    def bad_annotation(gm: fx.GraphModule, ctx: PassContext) -> None:
        raise whalepy.AnnotationError("split(3) does not divide")

    with pytest.raises(whalepy.AnnotationError):
        run_passes(gm, [("annot", bad_annotation)])
    times = run_passes(gm, [("noop", lambda gm, ctx: None)])
    assert set(times) == {"noop"} and gm.meta["whalepy.pass_times"]["noop"] >= 0


# -- FLOPs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["export", "symbolic_trace"])
def test_linear_flops_forward_and_backward(method: str) -> None:
    b, m, k, n = 2, 8, 16, 32
    gm = _analysed(TwoLinears(k, n).to("meta"), (torch.zeros(b, m, k),), method)
    first, second = _calls(gm, "linear")
    # first layer: its input is data, so backward only computes dW (and db)
    assert first.meta["whalepy.flops_fwd"] == 2 * b * m * k * n + b * m * n
    assert first.meta["whalepy.flops_bwd"] == 2 * b * m * k * n + b * m * n
    # second layer: dX and dW
    assert second.meta["whalepy.flops_fwd"] == 2 * b * m * n * k
    assert second.meta["whalepy.flops_bwd"] == 2 * 2 * b * m * n * k
    gelu = _calls(gm, "gelu")[0]
    assert gelu.meta["whalepy.flops_fwd"] == b * m * n


def test_frozen_weights_on_data_cost_no_backward() -> None:
    model = TwoLinears().to("meta").requires_grad_(False)
    gm = _analysed(model, (torch.zeros(2, 16),))
    assert all(n.meta.get("whalepy.flops_bwd", 0) == 0 for n in gm.graph.nodes)
    assert all(n.meta.get("whalepy.saved_bytes", 0) == 0 for n in gm.graph.nodes)


def test_attention_flops() -> None:
    b, h, s, d = 2, 4, 32, 16
    q = torch.zeros(b, h, s, d, requires_grad=True)
    gm = _analysed(Attention(), (q, q.clone(), q.clone()))
    node = _calls(gm, "scaled_dot_product_attention")[0]
    assert node.meta["whalepy.flops_fwd"] == 4 * b * h * s * s * d
    # user inputs do not require grad in the graph's view: no activation gradients
    assert node.meta["whalepy.flops_bwd"] == 0


def test_attention_backward_is_twice_forward_inside_a_model() -> None:
    gm = _analysed(_gpt2(), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    for node in _calls(gm, "scaled_dot_product_attention"):
        assert node.meta["whalepy.flops_fwd"] == 4 * 2 * 4 * 16 * 16 * 16
        assert node.meta["whalepy.flops_bwd"] == 2 * node.meta["whalepy.flops_fwd"]


def test_convolution_flops_first_layer() -> None:
    conv = nn.Conv2d(3, 8, kernel_size=4, stride=4).to("meta")
    gm = _analysed(conv, (torch.zeros(2, 3, 16, 16),))
    node = next(n for n in gm.graph.nodes if n.meta.get("whalepy.flops_fwd"))
    out = 2 * 8 * 4 * 4
    assert node.meta["whalepy.flops_fwd"] == 2 * out * 3 * 4 * 4 + out
    assert node.meta["whalepy.flops_bwd"] == 2 * out * 3 * 4 * 4 + out  # dW + db only


def test_embedding_is_bytes_only() -> None:
    emb = nn.Embedding(100, 8).to("meta")
    gm = _analysed(emb, (torch.zeros(2, 5, dtype=torch.long),))
    node = _calls(gm, "embedding")[0]
    assert node.meta["whalepy.flops_fwd"] == 0
    assert node.meta["whalepy.bytes"] == 2 * 2 * 5 * 8 * 4 + 2 * 5 * 8
    assert node.meta["whalepy.param_bytes"] == 100 * 8 * 4


# -- bytes and saved activations ---------------------------------------------------------------


def test_views_move_no_bytes_and_linear_reads_weights() -> None:
    gm = _analysed(_gpt2(), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    for node in _calls(gm, "aten.view") + _calls(gm, "aten.transpose"):
        assert node.meta["whalepy.bytes"] == 0
    addmm = next(n for n in _calls(gm, "addmm")
                 if n.meta["whalepy.module_path"] == "transformer.h.0.mlp.c_fc")
    x, w, bias, out = 32 * 64 * 4, 64 * 256 * 4, 256 * 4, 32 * 256 * 4
    assert addmm.meta["whalepy.bytes"] == x + w + bias + out
    assert addmm.meta["whalepy.param_bytes"] == w + bias


def test_saved_bytes_rules() -> None:
    b, m, k, n = 2, 8, 16, 32
    gm = _analysed(TwoLinears(k, n).to("meta"), (torch.zeros(b, m, k),))
    first, second = _calls(gm, "linear")
    gelu = _calls(gm, "gelu")[0]
    assert first.meta["whalepy.saved_bytes"] == b * m * k * 4  # its input, to compute dW
    assert gelu.meta["whalepy.saved_bytes"] == b * m * n * 4  # its input (= first's output)
    assert second.meta["whalepy.saved_bytes"] == b * m * n * 4  # gelu's output


def test_fused_qkv_saved_once_and_dropout_mask_is_one_byte() -> None:
    gm = _analysed(_gpt2(dropout=0.1), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    sdpa = _calls(gm, "scaled_dot_product_attention")[0]
    tokens, hidden = 2 * 16, 64
    lse = 2 * 4 * 16 * 4
    # q, k and v are views of c_attn's output: one storage of 3*hidden, plus the output and lse
    assert sdpa.meta["whalepy.saved_bytes"] == tokens * 3 * hidden * 4 + tokens * hidden * 4 + lse
    dropout = [n for n in _calls(gm, "dropout") if n.meta["whalepy.module_path"] == "transformer.drop"]
    assert dropout[0].meta["whalepy.saved_bytes"] == tokens * hidden


# -- blocks ------------------------------------------------------------------------------------


def _gpt2(dropout: float = 0.0, layers: int = 2):
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=512,
                                  n_positions=64, use_cache=False, resid_pdrop=dropout,
                                  embd_pdrop=dropout, attn_pdrop=dropout)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def test_find_runs_picks_top_most_repeated_siblings() -> None:
    runs = find_runs(_gpt2(layers=3))
    assert [(r.container, r.members) for r in runs] == [
        ("transformer.h", ("transformer.h.0", "transformer.h.1", "transformer.h.2"))]
    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=32, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=2, d_kv=16,
            vocab_size=128, use_cache=False))
    assert [r.container for r in find_runs(t5)] == ["encoder.block", "decoder.block"]
    assert find_runs(nn.Linear(2, 2)) == []


def test_gpt2_blocks() -> None:
    gm = _analysed(_gpt2(), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    blocks = gm.meta["whalepy.blocks"]
    assert [(b.name, b.kind) for b in blocks] == [
        ("embed", BlockKind.EMBEDDING), ("transformer.h.0", BlockKind.LAYER),
        ("transformer.h.1", BlockKind.LAYER), ("head", BlockKind.HEAD)]
    assert blocks[0].modules == ("transformer.wte", "transformer.wpe", "transformer.drop")
    assert blocks[3].modules == ("transformer.ln_f", "lm_head")
    assert blocks[1].repeat_group == blocks[2].repeat_group is not None
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all("whalepy.block" in n.meta for n in calls)
    # the attention mask is built in GPT2Model.forward before the layers: it runs in "embed"
    mask = [n for n in calls if n.meta["whalepy.module_path"] == "transformer"
            and "arange" in str(n.target)]
    assert mask and all(n.meta["whalepy.block"] == 0 for n in mask)


def test_loss_at_the_root_goes_to_the_head_block() -> None:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, vocab_size=128, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(2, 8, dtype=torch.long)
    gm = _analysed(model, {"input_ids": ids, "labels": ids})
    head = len(gm.meta["whalepy.blocks"]) - 1
    loss = _calls(gm, "cross_entropy")
    assert loss and loss[0].meta["whalepy.module_path"] == ""
    assert loss[0].meta["whalepy.block"] == head


def test_t5_blocks_have_glue_between_runs_and_block0_its_own_group() -> None:
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=32, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=2, d_kv=16,
            vocab_size=128, use_cache=False))
    ids = torch.zeros(2, 8, dtype=torch.long)
    gm = _analysed(model, {"input_ids": ids, "decoder_input_ids": ids})
    blocks = gm.meta["whalepy.blocks"]
    assert [b.name for b in blocks] == [
        "embed", "encoder.block.0", "encoder.block.1", "encoder.block.2", "glue.0",
        "decoder.block.0", "decoder.block.1", "head"]
    assert blocks[4].kind is BlockKind.OTHER
    assert "encoder.final_layer_norm" in blocks[4].modules
    assert "decoder.embed_tokens" in blocks[4].modules
    groups = [b.repeat_group for b in blocks]
    assert groups[2] == groups[3] != groups[1]  # block 0 owns the relative-position bias
    assert groups[5] != groups[2]


def test_model_without_repeats_is_one_block() -> None:
    gm = _analysed(TwoLinears().to("meta"), (torch.zeros(2, 16),))
    blocks = gm.meta["whalepy.blocks"]
    assert [(b.name, b.kind, b.modules) for b in blocks] == [("model", BlockKind.OTHER, ("a", "b"))]
