"""Truncated capture of repeated layers: the extrapolated profile equals the full capture's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import whalepy
from whalepy.passes import build_profile, model_fingerprint
from whalepy.passes.truncate import TRACED_REPEATS, plan_truncation

from tiny_hf import tiny_hf_model

transformers = pytest.importorskip("transformers")


def _model(name: str, **kw):
    """Deep enough that truncation applies: GPT-2 with 12 layers, the others with 6 (T5's decoder 5)."""
    layers = 12 if name == "gpt2" else 6
    return tiny_hf_model(name, num_layers=layers, num_decoder_layers=5 if name == "t5" else None, **kw)


def _assert_same(full, fast) -> None:
    assert fast.total_params == full.total_params
    assert fast.param_bytes == full.param_bytes
    assert fast.fingerprint == full.fingerprint
    assert (fast.batch_size, fast.seq_len, fast.dtype) == (full.batch_size, full.seq_len, full.dtype)
    assert [b.name for b in fast.blocks] == [b.name for b in full.blocks]
    for a, b in zip(full.blocks, fast.blocks, strict=True):
        for f in a.__slots__:
            x, y = getattr(a, f), getattr(b, f)
            if isinstance(x, float):
                assert y == pytest.approx(x, rel=1e-9, abs=0), (a.name, f)
            else:
                assert y == x, (a.name, f, x, y)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit"])
def test_truncated_profile_equals_full_capture(name: str) -> None:
    model, inputs = _model(name)
    full = build_profile(model, inputs, truncate_repeated=False)
    fast = build_profile(model, inputs)
    assert full.capture_method == "export"
    assert fast.capture_method == "export+truncated"
    note = fast.graph.meta["whalepy.truncation"]
    assert note["runs"] and "fallback" not in note
    _assert_same(full, fast)
    assert fast.total_params == sum(p.numel() for p in model.parameters())
    assert fast.fingerprint == model_fingerprint(model)
    # the containers were restored
    runs = {r.container: r for r in plan_truncation(model)[0]}
    for r in runs.values():
        assert len(model.get_submodule(r.container)) == len(r.members)
    # the returned graph is the truncated one: only traced layers have nodes
    traced = {n.meta.get("whalepy.module_stack", ("",))[-1] for n in fast.graph.graph.nodes
              if n.meta.get("whalepy.module_stack")}
    for r in runs.values():
        assert not any(p.startswith(r.members[-1] + ".") or p == r.members[-1] for p in traced)
    # block indices on nodes are those of the profile
    for node in fast.graph.graph.nodes:
        b = node.meta.get("whalepy.block")
        if b is not None and node.meta.get("whalepy.module_path", "").startswith(
                fast.blocks[b].name + "."):
            assert fast.blocks[b].kind.value == "layer"


def test_t5_prefix_block_is_traced() -> None:
    model, _ = _model("t5")
    runs, _ = plan_truncation(model)
    assert {(r.container, r.prefix, r.keep) for r in runs} == {
        ("encoder.block", 1, 1 + TRACED_REPEATS), ("decoder.block", 1, 1 + TRACED_REPEATS)}


def test_annotations_on_late_layers_land_on_the_right_blocks() -> None:
    model, inputs = _model("gpt2")
    whalepy.annotate(model, {"transformer.h.{0-5}": whalepy.stage(),
                             "transformer.h.{6-11}": whalepy.stage(),
                             "transformer.h.*.mlp": whalepy.split(2),
                             "transformer.h.7": whalepy.replicate(2)})
    full = build_profile(model, inputs, truncate_repeated=False)
    fast = build_profile(model, inputs)
    assert fast.capture_method == "export+truncated"
    _assert_same(full, fast)
    for i in range(12):
        ann = fast.block(f"transformer.h.{i}").annotations
        assert ann.stage == (0 if i < 6 else 1)
        assert ann.split == 2
        assert ann.replicate == (2 if i == 7 else None)
    assert any("transformer.h.7" in s for s in fast.block("transformer.h.7").annotations.sources)


def test_bad_split_on_an_extrapolated_layer_is_reported() -> None:
    model, inputs = _model("gpt2")
    whalepy.annotate(model, {"transformer.h.9.mlp": whalepy.split(3)})
    with pytest.raises(whalepy.AnnotationError, match="transformer.h.9.mlp.c_fc"):
        build_profile(model, inputs)


def test_tp_rules_are_renamed_per_layer() -> None:
    model, inputs = _model("llama")
    prof = build_profile(model, inputs)
    rules = {r.module for r in prof.block("model.layers.5").tp_rules}
    assert "model.layers.5.self_attn.q_proj" in rules and "model.layers.5.mlp.down_proj" in rules
    assert not any(r.startswith("model.layers.1.") for r in rules)


# --- models that must not be truncated -----------------------------------------------------------


class _Scaled(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = float(i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _IndexedLoop(nn.Module):
    """Identical layers, but the container's loop scales layer i's output by i + 1."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(_Plain() for _ in range(n))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            x = layer(x) * (i + 1)
            if i >= 3:
                x = torch.tanh(x)
        return self.out(x)


class _ScaledModel(_IndexedLoop):
    def __init__(self, n: int = 6) -> None:
        super().__init__(n)
        self.layers = nn.ModuleList(_Scaled(i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class _UniformModel(_ScaledModel):
    def __init__(self, n: int = 6) -> None:
        super().__init__(n)
        self.layers = nn.ModuleList(_Plain() for _ in range(n))


def _x() -> torch.Tensor:
    return torch.zeros(4, 8)


def test_a_uniform_custom_model_is_truncated() -> None:
    model = _UniformModel()
    full = build_profile(model, (_x(),), truncate_repeated=False)
    fast = build_profile(model, (_x(),))
    assert fast.capture_method == "export+truncated"
    _assert_same(full, fast)


def test_per_layer_attribute_is_not_truncated() -> None:
    model = _ScaledModel()
    full = build_profile(model, (_x(),), truncate_repeated=False)
    fast = build_profile(model, (_x(),))
    assert fast.capture_method == "export"
    assert "layers" in fast.graph.meta["whalepy.truncation"]["refused"][0]
    _assert_same(full, fast)


def test_layer_index_in_the_container_loop_falls_back() -> None:
    model = _IndexedLoop()
    assert plan_truncation(model)[0]  # structurally uniform: only the traced graph tells
    full = build_profile(model, (_x(),), truncate_repeated=False)
    fast = build_profile(model, (_x(),))
    assert fast.capture_method == "export"
    assert "differ" in fast.graph.meta["whalepy.truncation"]["fallback"]
    _assert_same(full, fast)
    assert len(model.layers) == 6


@pytest.mark.parametrize("flag", ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"])
def test_gpt2_layer_index_flags_are_not_truncated(flag: str) -> None:
    model, inputs = _model("gpt2", **{flag: True})
    runs, refused = plan_truncation(model)
    assert not runs and flag in refused[0]
    assert build_profile(model, inputs).capture_method == "export"


def test_mixed_layer_types_are_not_truncated() -> None:
    model, _ = _model("llama")
    model.config.layer_types = ["full_attention", "sliding_attention"] * 3
    runs, refused = plan_truncation(model)
    assert not runs and "layer_types" in refused[0]


def test_short_runs_and_option_off() -> None:
    model = _UniformModel(n=3)  # N = K + 1: nothing to gain
    assert not plan_truncation(model)[0]
    assert build_profile(_UniformModel(), (_x(),), truncate_repeated=False).capture_method == "export"
