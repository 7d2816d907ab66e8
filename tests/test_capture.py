"""Capture: torch.export on fake/meta tensors, the symbolic_trace fallback, numerics, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import whalepy
from whalepy.passes import capture, normalize_inputs, run_captured

transformers = pytest.importorskip("transformers")


def _gpt2(device: str = "meta", **kw):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                  use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, **kw)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(cfg)


def _llama(device: str = "meta"):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   use_cache=False)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


def _ids(batch: int = 2, seq: int = 16, device: str = "meta") -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device=device)


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.h = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 100)

    def forward(self, ids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.h:
            x = block(x)
        return self.out(x)


def test_normalize_inputs() -> None:
    t = torch.zeros(2)
    assert normalize_inputs(t) == ((t,), {})
    assert normalize_inputs((t, t)) == ((t, t), {})
    assert normalize_inputs({"x": t}) == ((), {"x": t})


def test_export_on_meta_records_paths_params_and_inputs() -> None:
    model = _gpt2()
    gm = capture(model, {"input_ids": _ids()})
    assert gm.meta["whalepy.capture_method"] == "export"
    assert gm.meta["whalepy.capture_time_s"] > 0
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls and all("whalepy.module_path" in n.meta for n in calls)
    paths = {n.meta["whalepy.module_path"] for n in calls}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= paths
    addmm = next(n for n in calls if n.meta["whalepy.module_path"] == "transformer.h.0.attn.c_attn"
                 and "addmm" in str(n.target))
    assert addmm.meta["whalepy.module_stack"][:2] == ("transformer", "transformer.h.0")
    assert addmm.meta["whalepy.module_class"] == "Conv1D"
    params = {n.meta["whalepy.param"] for n in gm.graph.nodes if "whalepy.param" in n.meta}
    assert "transformer.h.0.attn.c_attn.weight" in params
    inputs = [n.meta["whalepy.input"] for n in gm.graph.nodes if "whalepy.input" in n.meta]
    assert inputs == ["input_ids"]
    # nothing was materialised
    assert all(p.device.type == "meta" for p in model.parameters())


def test_cpu_inputs_for_a_meta_model_are_moved_to_meta() -> None:
    gm = capture(_gpt2(), {"input_ids": _ids(device="cpu")})
    assert gm.meta["whalepy.capture_method"] == "export"


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit"])
def test_hf_models_trace_unmodified(name: str) -> None:
    with torch.device("meta"):
        if name == "gpt2":
            model, inputs = _gpt2(), {"input_ids": _ids()}
        elif name == "llama":
            model, inputs = _llama(), {"input_ids": _ids()}
        elif name == "bert":
            model = transformers.BertForMaskedLM(transformers.BertConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                vocab_size=256))
            inputs = {"input_ids": _ids()}
        elif name == "t5":
            model = transformers.T5ForConditionalGeneration(transformers.T5Config(
                d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16,
                vocab_size=256, use_cache=False))
            inputs = {"input_ids": _ids(), "decoder_input_ids": _ids(seq=8)}
        else:
            model = transformers.ViTForImageClassification(transformers.ViTConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                image_size=32, patch_size=8, num_labels=10))
            inputs = {"pixel_values": torch.zeros(2, 3, 32, 32)}
    gm = capture(model, inputs)
    assert gm.meta["whalepy.capture_method"] == "export"
    assert any(n.meta.get("whalepy.module_path") for n in gm.graph.nodes)


def test_exported_graph_computes_what_the_model_computes() -> None:
    torch.manual_seed(0)
    for model in (_gpt2("cpu").eval(), _llama("cpu").eval()):
        ids = torch.randint(0, 512, (2, 12))
        gm = capture(model, {"input_ids": ids})
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            got = run_captured(gm, model, {"input_ids": ids})[0]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_symbolic_trace_capture_and_numerics() -> None:
    torch.manual_seed(0)
    model = Toy()
    ids = torch.randint(0, 100, (2, 5))
    gm = capture(model, (ids,), method="symbolic_trace")
    assert gm.meta["whalepy.capture_method"] == "symbolic_trace"
    linear = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert [n.meta["whalepy.module_path"] for n in linear] == ["h.0.fc", "h.0.proj", "h.1.fc",
                                                                 "h.1.proj", "out"]
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in linear)
    torch.testing.assert_close(run_captured(gm, model, (ids,)), model(ids))


def test_falls_back_to_symbolic_trace_when_export_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("export says no")

    monkeypatch.setattr(torch.export, "export", broken)
    gm = capture(Toy().to("meta"), (torch.zeros(2, 5, dtype=torch.long),))
    assert gm.meta["whalepy.capture_method"] == "symbolic_trace"
    assert "export says no" in gm.meta["whalepy.export_error"]


def test_capture_error_names_both_tracers_and_the_fixes() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # Python control flow on a tensor value: neither tracer handles it
                return self.lin(x)
            return x

    with pytest.raises(whalepy.CaptureError) as info:
        capture(DataDependent().to("meta"), (torch.ones(2, 4),))
    msg = str(info.value)
    assert "torch.export.export" in msg and "symbolic_trace" in msg
    assert "dict of keyword arguments" in msg and "torch.where" in msg  # (a KV cache is turned off by capture itself)
    assert info.value.__cause__ is not None


def test_unknown_method_is_refused() -> None:
    with pytest.raises(whalepy.CaptureError, match="unknown capture method"):
        capture(Toy(), (torch.zeros(1, 2, dtype=torch.long),), method="dynamo")
