"""Built-in models by name: HuggingFace configs built on the meta device (no weights), dropout off,
``use_cache=False`` (a KV cache output breaks ``torch.export``), with example inputs.

``build("llama3-8b", batch=1, seq_len=8192)`` -> ``(model, example_inputs)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from whalepy._errors import WhalepyError

_NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def _gpt2(n_layer: int, n_embd: int, n_head: int, n_positions: int = 1024) -> Callable[[], Any]:
    def cfg() -> Any:
        from transformers import GPT2Config

        return "causal", GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                                    **_NO_DROPOUT_GPT2)
    return cfg


def _llama(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, positions: int) -> Callable[[], Any]:
    def cfg() -> Any:
        from transformers import LlamaConfig

        return "causal", LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                     num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                                     max_position_embeddings=positions, use_cache=False, attention_dropout=0.0)
    return cfg


def _t5_3b() -> Any:
    from transformers import T5Config

    return "seq2seq", T5Config(d_model=1024, d_ff=16384, d_kv=128, num_layers=24, num_decoder_layers=24,
                               num_heads=32, vocab_size=32128, dropout_rate=0.0, use_cache=False)


def _bert_large() -> Any:
    from transformers import BertConfig

    return "masked", BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)


MODELS: dict[str, tuple[Callable[[], Any], int]] = {
    # name: (config factory, default sequence length)
    "gpt2": (_gpt2(12, 768, 12), 1024),
    "gpt2-xl": (_gpt2(48, 1600, 25), 1024),
    "gpt3-175b": (_gpt2(96, 12288, 96, 2048), 2048),
    "llama-7b": (_llama(4096, 32, 32, 32, 11008, 32000, 2048), 2048),
    "llama-70b": (_llama(8192, 80, 64, 8, 28672, 32000, 4096), 4096),
    "llama3-8b": (_llama(4096, 32, 32, 8, 14336, 128256, 8192), 8192),
    "t5-3b": (_t5_3b, 512),
    "bert-large": (_bert_large, 512),
}
"""Built-in model names and their default sequence lengths."""


def build(name: str, *, batch: int = 1, seq_len: int | None = None) -> tuple[Any, Any]:
    """``(model on the meta device, example inputs)`` for a built-in model name."""
    import torch

    key = name.strip().lower()
    if key not in MODELS:
        raise WhalepyError(f"unknown built-in model {name!r}; built-in models are: {', '.join(MODELS)} "
                           "(or give package.module:function returning (model, example_inputs))")
    factory, default_seq = MODELS[key]
    seq = default_seq if seq_len is None else seq_len
    if batch < 1 or seq < 1:
        raise WhalepyError(f"batch ({batch}) and seq_len ({seq}) must be positive")
    kind, cfg = factory()
    from transformers import AutoModelForCausalLM, BertForMaskedLM, T5ForConditionalGeneration

    with torch.device("meta"):
        if kind == "causal":
            if hasattr(cfg, "n_positions") and seq > cfg.n_positions:
                cfg.n_positions = seq
            if hasattr(cfg, "max_position_embeddings") and seq > cfg.max_position_embeddings:
                cfg.max_position_embeddings = seq
            model = AutoModelForCausalLM.from_config(cfg)
        elif kind == "seq2seq":
            model = T5ForConditionalGeneration(cfg)
        else:
            if seq > cfg.max_position_embeddings:
                cfg.max_position_embeddings = seq
            model = BertForMaskedLM(cfg)
    model.eval()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    if kind == "seq2seq":
        return model, {"input_ids": ids, "decoder_input_ids": ids}
    return model, (ids,)


__all__ = ["MODELS", "build"]
