"""split_stages: chaining the stage modules computes what the model computes, with the model's own
parameters under their own names, for whalepy's GPT, HF GPT-2 and HF Llama (GQA)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from whalepy import CaptureError
from whalepy.models import GPT, GPTConfig
from whalepy.runtime.pipeline import retarget_device, split_stages

VOCAB, SEQ, LAYERS = 64, 8, 3


def build_model(kind: str, seed: int = 0) -> tuple[nn.Module, list[tuple[str, ...]]]:
    """A tiny model and its blocks in execution order: embeddings, one per layer, head."""
    torch.manual_seed(seed)
    layers = range(LAYERS)
    if kind == "gpt":
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, num_layers=LAYERS, num_heads=4,
                              hidden_size=32))
        embed = ("transformer.wte", "transformer.wpe", "transformer.drop")
        head = ("transformer.ln_f", "lm_head")
        return model, [embed, *[(f"transformer.h.{i}",) for i in layers], head]
    import transformers

    warnings.filterwarnings("ignore", module="transformers")
    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=LAYERS, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
        )
        model = transformers.GPT2LMHeadModel(cfg)
        embed = ("transformer.wte", "transformer.wpe", "transformer.drop")
        return model, [embed, *[(f"transformer.h.{i}",) for i in layers], ("transformer.ln_f", "lm_head")]
    if kind.startswith("llama"):
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
            tie_word_embeddings=False, attention_dropout=0.0,
            attn_implementation="eager" if kind == "llama_eager" else "sdpa",
        )
        model = transformers.LlamaForCausalLM(cfg)
        # "llama": the rotary embedding runs in stage 0 and cos/sin are passed along the pipeline;
        # "llama_glue": it is in no block, so every stage recomputes cos/sin from its inv_freq buffer
        embed = ("model.embed_tokens",) + (() if kind == "llama_glue" else ("model.rotary_emb",))
        return model, [embed, *[(f"model.layers.{i}",) for i in layers], ("model.norm", "lm_head")]
    raise ValueError(kind)


# stage layouts over the blocks [embed, L0, L1, L2, head]
LAYOUTS = {
    "2": [[0, 1, 2], [3, 4]],
    "3": [[0, 1], [2], [3, 4]],
    "uneven": [[0, 1], [2, 3, 4]],
    "4": [[0, 1], [2], [3], [4]],
}


def stage_paths(blocks: list[tuple[str, ...]], layout: list[list[int]]) -> list[list[str]]:
    return [[p for b in stage for p in blocks[b]] for stage in layout]


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def run_chain(stages, *inputs):
    x = inputs
    for s in stages:
        x = s(*x)
        x = x if isinstance(x, tuple) else (x,)
    assert len(x) == 1
    return x[0]


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


MODELS = ["gpt", "gpt2", "llama", "llama_glue", "llama_eager"]


@pytest.mark.parametrize("kind", MODELS)
def test_chained_stages_match_eager_forward_and_backward(kind):
    model, blocks = build_model(kind)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(model)
    ref_logits = logits_of(reference(ids))
    loss_of(ref_logits, targets).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    # every layout for the three models; one for the Llama variants (rotary as glue, eager attention)
    layouts = LAYOUTS if kind in ("gpt", "gpt2", "llama") else {"3": LAYOUTS["3"]}
    for name, layout in layouts.items():
        stages = split_stages(model, (ids,), None, stage_paths(blocks, layout))
        assert len(stages) == len(layout)
        model.zero_grad(set_to_none=True)
        logits = run_chain(stages, ids)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6, msg=f"layout {name}")
        loss_of(logits, targets).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=0, atol=1e-6,
                                       msg=f"layout {name}: grad of {n}")


def test_a_model_with_its_kv_cache_on_captures_and_splits_and_keeps_its_setting():
    """HuggingFace configs default to ``use_cache=True``, and transformers 5.x then returns a
    ``DynamicCache`` from a training forward, which ``torch.export`` cannot flatten: ``whalepy.profile``
    and the stage split failed on such a model ("Found <class ...DynamicCache> in output"). Both now
    trace with the cache off (``whalepy.models.hf_compat.no_kv_cache``) and leave the user's setting as
    it was; the chained stages still compute the model's logits and gradients."""
    import whalepy

    model, blocks = build_model("llama")
    model.config.use_cache = True
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    prof = whalepy.profile(model, {"input_ids": ids})
    assert len(prof.blocks) >= LAYERS and model.config.use_cache is True
    reference = copy.deepcopy(model)
    ref_logits = logits_of(reference(ids))
    loss_of(ref_logits, targets).backward()
    stages = split_stages(model, (ids,), None, stage_paths(blocks, LAYOUTS["2"]))
    assert model.config.use_cache is True
    logits = run_chain(stages, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    loss_of(logits, targets).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, dict(reference.named_parameters())[n].grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", MODELS)
def test_stages_own_the_models_parameters_under_original_names(kind):
    model, blocks = build_model(kind)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    paths = stage_paths(blocks, LAYOUTS["3"])
    stages = split_stages(model, (ids,), None, paths)
    originals = dict(model.named_parameters())

    names = [n for s in stages for n, _ in s.named_parameters()]
    assert len(names) == len(set(names)), "a parameter sits in two stages"
    assert set(names) == set(originals)
    for s in stages:
        for n, p in s.named_parameters():
            assert p is originals[n], f"{n} is a copy, not the model's parameter"
    # per-stage order follows the model's
    order = list(originals)
    for s in stages:
        own = [n for n, _ in s.named_parameters()]
        assert own == sorted(own, key=order.index)

    keys = [k for s in stages for k in s.state_dict()]
    assert set(keys) == set(model.state_dict())
    # the blocks are the eager modules themselves (real Linear / Embedding / Conv1D)
    for s, stage in zip(stages, paths):
        for p in stage:
            assert s.get_submodule(p) is model.get_submodule(p)


def test_llama_stages_carry_the_rotary_buffer_they_use():
    model, blocks = build_model("llama_glue")
    stages = split_stages(model, (torch.randint(0, VOCAB, (2, SEQ)),), None,
                          stage_paths(blocks, LAYOUTS["3"]))
    inv_freq = model.get_buffer("model.rotary_emb.inv_freq")
    for s in stages:  # every stage recomputes cos/sin, from the model's own (non-persistent) buffer
        assert s.get_buffer("model.rotary_emb.inv_freq") is inv_freq
        assert "model.rotary_emb.inv_freq" not in s.state_dict()


def test_stage0_takes_keyword_inputs_positionally():
    model, blocks = build_model("gpt2")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :2] = 0
    stages = split_stages(model, (ids,), {"attention_mask": mask}, stage_paths(blocks, LAYOUTS["3"]))
    torch.testing.assert_close(run_chain(stages, ids, mask), model(ids, attention_mask=mask).logits,
                               rtol=0, atol=1e-6)


def test_tied_parameter_sits_in_every_stage_that_uses_it():
    """HF GPT-2's default tie_word_embeddings=True: the shared table is held by the first stage (as
    transformer.wte.weight) and the last (as lm_head.weight), the same Parameter object in one
    process; chained stages reproduce the model's logits and the summed gradient."""
    from whalepy.runtime.pipeline import tied_parameters

    untied, blocks = build_model("gpt2")
    cfg = copy.deepcopy(untied.config)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    import transformers

    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(model)
    ref_logits = reference(ids).logits
    loss_of(ref_logits, targets).backward()

    stages = split_stages(model, (ids,), None, stage_paths(blocks, LAYOUTS["3"]))
    assert tied_parameters(stages) == [[(0, "transformer.wte.weight"), (2, "lm_head.weight")]]
    assert stages[0].get_parameter("transformer.wte.weight") is stages[2].get_parameter("lm_head.weight")
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())  # both names, once each
    logits = run_chain(stages, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    loss_of(logits, targets).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference.get_parameter(n).grad, rtol=0, atol=1e-6, msg=n)
    # in one stage a tied pair is simply one parameter
    stages = split_stages(model, (ids,), None, stage_paths(blocks, [[0, 1, 2, 3, 4]]))
    assert len(stages) == 1 and tied_parameters(stages) == []


def test_blocks_out_of_execution_order_are_refused():
    model, blocks = build_model("gpt")
    paths = stage_paths(blocks, [[0, 2], [1, 3, 4]])
    with pytest.raises(CaptureError, match="transformer.h.1.*stage 0.*stage 1|order"):
        split_stages(model, (torch.randint(0, VOCAB, (2, SEQ)),), None, paths)


def test_bad_block_lists_are_refused():
    model, blocks = build_model("gpt")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(CaptureError, match="not a submodule"):
        split_stages(model, (ids,), None, [["transformer.nope"]])
    with pytest.raises(CaptureError, match="nested"):
        split_stages(model, (ids,), None, [["transformer.h.0", "transformer.h.0.mlp"]])
    with pytest.raises(CaptureError, match="no block"):
        split_stages(model, (ids,), None, [["transformer.h.0"], []])


@pytest.mark.filterwarnings("ignore:The tensor attribute")
def test_block_reading_state_outside_its_signature_is_refused():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            self.b.side = h * 2  # handed to the next block behind the module call
            return h

    class Reader(nn.Module):
        def __init__(self, src):
            super().__init__()
            self.src = [src]
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + self.src[0].b.side

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = Leaky()
            self.second = Reader(self.first)

        def forward(self, x):
            return self.second(self.first(x))

    with pytest.raises(CaptureError, match="first"):
        split_stages(Model(), (torch.randn(2, 4),), None, [["first"], ["second"]])


@pytest.mark.parametrize("kind", ["gpt2", "llama_glue"])
def test_retarget_device_moves_the_glue_factories(kind):
    """Glue ops record the trace device (``arange(..., device=cpu)``); a stage run elsewhere (here:
    meta, standing in for a GPU) must create those tensors on its own device."""
    model, blocks = build_model(kind)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    stages = split_stages(model, (ids,), None, stage_paths(blocks, LAYOUTS["3"]))
    for s in stages:
        s.to("meta")
        retarget_device(s, "meta")
        assert "device(type='cpu')" not in s.code
    out = run_chain(stages, ids.to("meta"))
    assert out.device.type == "meta" and out.shape == (2, SEQ, VOCAB)


def test_stage_io_says_which_tensors_between_stages_need_a_gradient():
    """The shapes and gradient flags each stage receives and sends (given to torch's PipelineStage, so
    no metadata travels on the first step) come from running the stages on fake tensors: Falcon's first
    stage sends two rotary tables made from buffers (no gradient) and the hidden state (gradient). A
    data-flow guess over the graph once marked that hidden state as needing none, and the pipeline's
    backward stopped at the stage boundary (the zoo matrix's falcon pp2 x dp2 case hung)."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import whalepy
    from zoo_cases import VOCAB, build

    model = build("falcon")
    x = torch.randint(0, VOCAB, (2, 8))
    prof = whalepy.profile(model, (x,))
    mods = [b.modules for b in prof.blocks]
    half = len(mods) // 2
    stages = split_stages(model, (x,), {}, [[p for m in mods[:half] for p in m], [p for m in mods[half:] for p in m]])
    (ins0, outs0), (ins1, outs1) = stages[0].whalepy_io, stages[1].whalepy_io
    assert ins0 == (((2, 8), torch.int64, False),)
    assert [o[2] for o in outs0] == [False, False, True] and outs0[-1][0] == (2, 8, 32)
    assert ins1 == outs0 and outs1[0][2]
    # and what the stages compute agrees: run them for real, the sent hidden state requires a gradient
    sent = stages[0](x)
    assert [t.requires_grad for t in sent] == [o[2] for o in outs0]
    assert [tuple(t.shape) for t in sent] == [o[0] for o in outs0]


def test_reused_traces_build_each_models_own_stages(monkeypatch):
    """Inside ``reuse_traces()`` a second model of the same structure is not exported again (``whalepy
    check`` lowers rank after rank with fresh copies): its stages hold its own parameters and compute
    what it computes, with the first call's stage shapes; a model of another structure (one more layer,
    another GELU) or other stage blocks is traced anew."""
    from whalepy.runtime import _stage_split
    from whalepy.runtime.pipeline import reuse_traces

    exports = []
    real = _stage_split._export
    monkeypatch.setattr(_stage_split, "_export", lambda *a: exports.append(a[0]) or real(*a))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    first, blocks = build_model("gpt", seed=0)
    layout = stage_paths(blocks, LAYOUTS["3"])
    with reuse_traces():
        split_stages(first, (ids,), None, layout)
        second, _ = build_model("gpt", seed=1)
        stages = split_stages(second, (ids,), None, layout)
        assert exports == [first]
        own = {id(p) for p in second.parameters()}
        assert {id(p) for s in stages for p in s.parameters()} == own
        torch.testing.assert_close(run_chain(stages, ids), second(ids), rtol=0, atol=1e-6)
        assert stages[1].whalepy_io is not None
        other = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, num_layers=LAYERS, num_heads=4, hidden_size=32,
                              gelu_approximate="tanh"))
        split_stages(other, (ids,), None, layout)
        split_stages(second, (ids,), None, stage_paths(blocks, LAYOUTS["2"]))
        assert exports == [first, other, second]
    split_stages(second, (ids,), None, layout)  # outside the context: traced again
    assert len(exports) == 4
