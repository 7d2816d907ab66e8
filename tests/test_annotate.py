"""whalepy.annotate: the external spec keyed by module-path globs, on small models and HF GPT-2."""

from __future__ import annotations

import copy

import pytest
import torch.nn as nn

from whalepy.ir.annotations import expand_braces, match_modules
from whalepy.errors import AnnotationError
from whalepy.primitives import (
    Split,
    Stage,
    annotate,
    cluster,
    module_annotations,
    replicate,
    resolve_annotations,
    split,
    stage,
)

NAMES = [
    "",
    "embed",
    "h",
    *(f"h.{i}" for i in range(12)),
    *(f"h.{i}.{part}" for i in range(12) for part in ("attn", "mlp", "mlp.fc", "mlp.proj")),
    "head",
]


def assert_error(fn, *needles: str) -> str:
    with pytest.raises(AnnotationError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and "Fix" in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


@pytest.fixture(scope="module")
def gpt2_class():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=32, use_cache=False
    )
    return lambda: transformers.GPT2LMHeadModel(config)


# ------------------------------------------------------------------------------------------ globs


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("", [""]),
        ("embed", ["embed"]),
        ("h.*.mlp", [f"h.{i}.mlp" for i in range(12)]),
        ("h.3-5", ["h.3", "h.4", "h.5"]),
        ("h.7-7.mlp.fc", ["h.7.mlp.fc"]),
        ("h.{0,11}", ["h.0", "h.11"]),
        ("h.{0-1,10-11}.attn", ["h.0.attn", "h.1.attn", "h.10.attn", "h.11.attn"]),
        ("{embed,head}", ["embed", "head"]),
        ("{head,h.1.mlp.*,embed}", ["embed", "h.1.mlp.fc", "h.1.mlp.proj", "head"]),
        ("h.{**,1}", NAMES[2:3] + [n for n in NAMES if n.startswith("h.")]),
        ("**.proj", [f"h.{i}.mlp.proj" for i in range(12)]),
        ("h.1.**", ["h.1", "h.1.attn", "h.1.mlp", "h.1.mlp.fc", "h.1.mlp.proj"]),
        ("h.1.mlp.*", ["h.1.mlp.fc", "h.1.mlp.proj"]),
        ("h.1?", ["h.10", "h.11"]),
        ("h.2.m*", ["h.2.mlp"]),
    ],
)
def test_glob_matches(pattern, expected):
    assert match_modules(pattern, NAMES) == expected


def test_double_star_matches_everything_and_star_one_segment():
    assert match_modules("**", NAMES) == NAMES
    assert match_modules("*", NAMES) == ["embed", "h", "head"]


@pytest.mark.parametrize(
    "pattern, needles",
    [
        ("h..mlp", ["empty segment"]),
        (".h", ["empty segment"]),
        ("h.5-3", ["range 5-3 runs backwards", "write 3-5"]),
        ("h.{0,1", ["a '{' without its '}'"]),
        ("h.0,1}", ["a '}' without its '{'"]),
        ("h.{a,{b,c}}", ["nested braces"]),
        ("h.{}", ["empty braces"]),
        ("h.{,0}", ["empty segment"]),
    ],
)
def test_malformed_patterns(pattern, needles):
    assert_error(lambda: match_modules(pattern, NAMES), repr(pattern), "malformed", *needles)


def test_unknown_path_names_pattern_and_closest_paths():
    assert_error(
        lambda: match_modules("h.*.mlpp", NAMES, "Toy"),
        "pattern 'h.*.mlpp' matches no module of Toy",
        "closest module paths: h.*.mlp",
    )
    assert_error(lambda: match_modules("haed", NAMES), "closest module paths: head")


def test_range_beyond_the_model_raises():
    assert_error(
        lambda: match_modules("h.0-15", NAMES, "Toy"),
        "range 0-15 names indices 12-15 that match no module of Toy (matched: 0-11)",
    )
    assert_error(lambda: match_modules("h.{0-1,20-21}", NAMES), "'h.20-21' (from 'h.{0-1,20-21}')")
    assert_error(lambda: match_modules("h.{0-1,11-12}", NAMES), "indices 12 ")
    assert_error(
        lambda: match_modules("{embed,haed}", NAMES), "pattern 'haed' (from '{embed,haed}') matches no"
    )
    assert_error(lambda: expand_braces(3), "spec key 3 is a int")


# --------------------------------------------------------------------------------- small models


def toy() -> nn.Module:
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(4))
    return nn.ModuleDict({"embed": nn.Linear(4, 4), "h": blocks, "head": nn.Linear(4, 4)})


@pytest.mark.parametrize(
    "ann, field, value",
    [(replicate(2), "replicate", 2), (split(4), "split", 4), (cluster("T4"), "cluster_gpu", "T4")],
)
def test_each_primitive_through_annotate(ann, field, value):
    model = toy()
    assert annotate(model, {"h.1": ann}) is model
    got = resolve_annotations(model)
    assert getattr(got["h.1"], field) == value and getattr(got["h.1.0"], field) == value
    assert got["h.0"].is_empty and got["h.2.1"].is_empty
    assert got["h.1.1"].sources == (f"{ann} on h.1",)


def test_one_stage_per_pattern_even_over_a_range():
    model = annotate(toy(), {"{embed,h.0-1}": stage(), "h.2-3": stage()})
    got = resolve_annotations(model)
    assert [got[p].stage for p in ("embed", "h", "h.0", "h.1.0", "h.2", "h.3.1", "head")] == [
        0, None, 0, 0, 1, 1, None,
    ]
    assert module_annotations(model["h"][0]) == module_annotations(model["h"][1])


def test_per_layer_stages_by_comprehension():
    model = annotate(toy(), {f"h.{i}": stage() for i in range(4)})
    assert [resolve_annotations(model)[f"h.{i}.0"].stage for i in range(4)] == [0, 1, 2, 3]


def test_list_values_and_natural_nesting_order_whatever_the_dict_order():
    model = annotate(toy(), {"h.*": split(2), "h.0-3": [replicate(), stage()], "h": cluster("A100-80GB")})
    assert [a.kind for a in module_annotations(model["h"][2])] == ["stage", "replicate", "split"]
    got = resolve_annotations(model)["h.2.1"]
    assert (got.cluster_gpu, got.stage, got.replicate, got.split) == ("A100-80GB", 0, 0, 2)


def test_annotate_on_top_of_scopes_and_decorators():
    @split(2)
    class Block(nn.Sequential):
        pass

    model = nn.ModuleList([Block(nn.Linear(2, 2)), Block(nn.Linear(2, 2))])
    annotate(model, {"0": stage(), "1": stage()})  # the stage goes outside the class's split
    got = resolve_annotations(model)
    assert (got["0.0"].stage, got["0.0"].split, got["1"].stage) == (0, 2, 1)


@pytest.mark.parametrize(
    "value, needles",
    [
        (4, ["value for pattern 'h.0' is 4, not an annotation"]),
        ("split(4)", ["is 'split(4)', not an annotation"]),
        (split, ["call it: whalepy.split()"]),
        (Stage, ["call it: whalepy.stage()"]),
        ([stage(), "x"], ["is 'x'"]),
        ([], ["is empty"]),
    ],
)
def test_bad_values(value, needles):
    assert_error(lambda: annotate(toy(), {"h.0": value}), *needles)


def test_bad_model_or_spec():
    assert_error(lambda: annotate(object(), {}), "expected an nn.Module")
    assert_error(lambda: annotate(toy(), [("h.0", split())]), "must be a dict")
    assert_error(lambda: annotate(toy(), {("h", 0): split()}), "spec key ('h', 0)")


def test_contradictions_raise_and_leave_the_model_unchanged():
    model = annotate(toy(), {"h.0": split(4)})
    before = {name: module_annotations(m) for name, m in model.named_modules()}
    assert_error(lambda: annotate(model, {"h.*": split(2)}), "split(2) on h.0 is nested inside split(4)")
    assert_error(lambda: annotate(model, {"h.0.*": stage()}), "stage#", "on h.0.0", "inside split(4) on h.0")
    assert_error(lambda: annotate(model, {"h.{0,2}": stage(), "h.1": stage()}), "contiguous", "on h.2")
    assert {name: module_annotations(m) for name, m in model.named_modules()} == before


# ------------------------------------------------------------------------------------- HF GPT-2


def test_gpt2_spec_from_the_readme(gpt2_class):
    model = gpt2_class()
    first, second = stage(), stage()
    spec = {"transformer.h.*.mlp": split(4), "transformer.h.0-1": first, "transformer.h.2-3": second}
    assert annotate(model, spec) is model
    got = resolve_annotations(model)
    assert list(got) == [name for name, _ in model.named_modules(remove_duplicate=False)]
    for i in range(4):
        assert got[f"transformer.h.{i}"].stage == i // 2
        assert got[f"transformer.h.{i}.mlp.c_fc"].split == 4
        assert got[f"transformer.h.{i}.mlp.c_fc"].sources == (
            f"{first if i < 2 else second} on transformer.h.{i}",
            f"split(4) on transformer.h.{i}.mlp",
        )
        assert got[f"transformer.h.{i}.attn.c_attn"].split is None
    for path in ("", "transformer", "transformer.wte", "transformer.h", "transformer.ln_f", "lm_head"):
        assert got[path].is_empty
    assert module_annotations(model.transformer.h[0].mlp) == (Split(4),)


def test_gpt2_first_stage_spans_embeddings_and_layers(gpt2_class):
    spec = {"transformer.{wte,wpe,h.0-1}": stage(), "transformer.{h.2-3,ln_f}": stage()}
    model = annotate(gpt2_class(), spec)
    got = resolve_annotations(model)
    assert [got[f"transformer.{p}"].stage for p in ("wte", "wpe", "drop", "h.1.mlp", "h.2", "ln_f")] == [
        0, 0, None, 0, 1, 1,
    ]
    assert got["lm_head"].stage is None


def test_gpt2_cluster_and_replicate(gpt2_class):
    model = annotate(
        gpt2_class(),
        {"transformer.h.0-1": cluster("V100-32GB"), "transformer.h.2-3": cluster("T4"),
         "transformer.h.**.attn": replicate(2)},
    )
    got = resolve_annotations(model)
    assert got["transformer.h.1.attn.c_proj"].cluster_gpu == "V100-32GB"
    assert got["transformer.h.3.attn.c_proj"].replicate == 2
    assert got["transformer.h.3.mlp"].cluster_gpu == "T4" and got["transformer.h.3.mlp"].replicate is None


def test_gpt2_errors(gpt2_class):
    model = gpt2_class()
    assert_error(
        lambda: annotate(model, {"transformer.h.*.mlpp": split(2)}),
        "matches no module of GPT2LMHeadModel", "transformer.h.*.mlp",
    )
    assert_error(lambda: annotate(model, {"transformer.h.0-11": stage()}), "indices 4-11", "matched: 0-3")
    assert_error(
        lambda: annotate(model, {"transformer.blocks.*": split(2)}), "closest module paths: transformer.h.*"
    )
    assert all(block.is_empty for block in resolve_annotations(model).values())


def test_gpt2_annotations_survive_deepcopy_and_meta(gpt2_class):
    model = annotate(gpt2_class(), {"transformer.h.*.mlp": split(2), "transformer.h.0-3": stage()})
    expected = resolve_annotations(model)
    clone = copy.deepcopy(model).to("meta")
    assert resolve_annotations(clone) == expected
    assert list(clone.state_dict()) == list(model.state_dict())
