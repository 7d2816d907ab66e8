"""Single-process checks of deferred initialisation and export (the 8-process ones are in
test_meta_init.py): determinism of the per-module seeds, loading HF safetensors with tied weights,
export of a DCP checkpoint to safetensors that ``from_pretrained`` loads, and the errors."""

from __future__ import annotations

import json

import pytest
import torch

import whalepy
from whalepy.tools.export import export_safetensors, parse_size
from whalepy.models import GPT, GPTConfig

# DCP says it saves and loads in one process: that is what these tests ask of it
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=4, hidden_size=32))


def _gpt2(tied: bool = True):
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  use_cache=False, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel, cfg


def test_initialisation_depends_on_seed_and_module_only():
    a, b, c = _meta_gpt(), _meta_gpt(), _meta_gpt()
    stats = whalepy.materialize(a, seed=7)
    whalepy.materialize(b, seed=7)
    whalepy.materialize(c, seed=8)
    for (k, va), vb, vc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(va, vb), k
        if k.endswith("proj.weight"):
            assert not torch.equal(va, vc), k
    # the model's own scheme: GPT._init_weights (normal, std 0.02) after LayerNorm.reset_parameters
    assert abs(a.transformer.h[0].attn.q_proj.weight.std().item() - 0.02) < 0.003
    assert torch.equal(a.transformer.ln_f.weight, torch.ones(32))
    # two blocks of the same shape get different values (seeded by module path)
    assert not torch.equal(a.transformer.h[0].mlp.fc_in.weight, a.transformer.h[1].mlp.fc_in.weight)
    assert stats.share_bytes == sum(p.nbytes for p in a.parameters())
    assert stats.largest_unit_bytes == max(m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
                                           for m in a.modules() if isinstance(m, torch.nn.Linear))


def test_init_fn_replaces_the_model_scheme():
    m = _meta_gpt()

    def ones(module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            p.fill_(1.0)

    whalepy.materialize(m, init_fn=ones)
    assert all(bool((p == 1).all()) for p in m.parameters())


def test_safetensors_with_tied_weights_and_export_roundtrip(tmp_path):
    import torch.distributed.checkpoint as dcp

    cls, cfg = _gpt2(tied=True)
    torch.manual_seed(0)
    real = cls(cfg).eval()
    real.save_pretrained(tmp_path / "hf")  # one file; lm_head.weight left out (tied)
    with torch.device("meta"):
        meta = cls(cfg)
    whalepy.materialize(meta, checkpoint=tmp_path / "hf")
    assert meta.lm_head.weight is meta.transformer.wte.weight
    for k, v in real.state_dict().items():
        assert torch.equal(meta.state_dict()[k], v), k

    # a DCP checkpoint as ParallelModel.save lays it out ("model." keys, config.json beside)
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": dict(real.state_dict())}, checkpoint_id=str(ckpt), no_dist=True)
    real.config.to_json_file(str(ckpt / "config.json"))
    files = export_safetensors(ckpt, tmp_path / "out", max_shard_size="20KB")
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # stored once, as save_pretrained does
    back = cls.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, real(x).logits, rtol=0, atol=0)


def test_errors_are_one_line_and_early(tmp_path):
    from whalepy.runtime import parallelize

    with pytest.raises(whalepy.WhalepyError, match="neither a torch.distributed.checkpoint"):
        parallelize(_meta_gpt(), None, example_inputs=(torch.zeros(2, 16, dtype=torch.long),),
                    loss_fn=lambda o, t: o.sum(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1),
                    global_batch=8, checkpoint=tmp_path / "missing")
    torch.manual_seed(0)
    real = GPT(GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=4, hidden_size=32))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(whalepy.WhalepyError, match="already holds its weights"):
        parallelize(real, None, example_inputs=(torch.zeros(2, 16, dtype=torch.long),),
                    loss_fn=lambda o, t: o.sum(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1),
                    global_batch=8, checkpoint=tmp_path)
    with pytest.raises(whalepy.WhalepyError, match="needs a model with tensors on the meta device"):
        whalepy.materialize(real)
    with pytest.raises(whalepy.WhalepyError, match="not a checkpoint directory written by ParallelModel.save"):
        export_safetensors(tmp_path, tmp_path / "out")


def test_export_refuses_a_config_of_another_model(tmp_path):
    import torch.distributed.checkpoint as dcp

    cls, cfg = _gpt2(tied=False)
    dcp.save({"model": dict(cls(cfg).state_dict())}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    other = _gpt2(tied=False)[1]
    other.n_layer = 3
    other.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(whalepy.WhalepyError, match=r"does not match GPT2LMHeadModel: it lacks"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "out", config=other)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(10) == 10
    with pytest.raises(whalepy.WhalepyError, match="is not a positive size"):
        parse_size("lots")


def test_export_of_whalepy_gpt_with_the_config_save_writes(tmp_path):
    """whalepy's own GPT (tied embeddings): the config.json ParallelModel.save writes for it
    (``saved_config``) lets ``whalepy export`` check the names and write every tensor, and the
    safetensors load back into ``GPT`` as it is (logits equal)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from whalepy.runtime.model_config import build_whalepy_model, saved_config
    from whalepy.tools.cli import main

    cfg = GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=4, hidden_size=32, tie_embeddings=True)
    torch.manual_seed(0)
    real = GPT(cfg).eval()
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": dict(real.state_dict())}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "config.json").write_text(json.dumps(saved_config(real.config, type(real))))
    assert main(["export", str(ckpt), "--to", str(tmp_path / "out"), "-q"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    back = build_whalepy_model(config).eval()
    back.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")))
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(x), real(x), rtol=0, atol=0)
    assert saved_config(real.config, torch.nn.Linear) is None  # not a whalepy model: export needs --config
