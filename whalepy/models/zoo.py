"""Built-in models by name, built on the meta device (no weights), dropout off, with example inputs.

The GPT-2 / GPT-3 family is whalepy's own :class:`whalepy.models.GPT` in GPT-2's exact shape (tied
embeddings, biases, tanh GELU, vocabulary 50257): the same parameters and FLOPs as transformers'
``GPT2LMHeadModel`` (``tests/test_zoo.py`` checks both against it, block by block) without importing
transformers, which takes seconds. One difference is deliberate: transformers writes GPT-2's tanh GELU
as eight elementwise ops, each saving its input for backward, where whalepy calls one fused GELU (as
Megatron-LM trains GPT-3), so the built-in's activation memory per layer is about 45% lower than that
of the eager HF model (48 vs 87 MiB for gpt2 at seq 1024, fp32). The others are HuggingFace configs (``use_cache=False``: a KV cache output breaks
``torch.export``). The T5 v1.1 / mT5 family (``mt5-base`` ... ``mt5-xxl``,
``t5-v1_1-xl``, ``t5-v1_1-xxl``) is whalepy's own encoder-decoder (:mod:`whalepy.models.t5`, no transformers
import).

``build("llama3-8b", batch=1, seq_len=8192)`` -> ``(model, example_inputs)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from whalepy.errors import WhalepyError

GPT2_VOCAB = 50257
"""GPT-2's BPE vocabulary (Radford et al. 2019), which GPT-3 kept (Brown et al. 2020, section 2.1)."""


def _gpt2(n_layer: int, n_embd: int, n_head: int, n_positions: int = 1024) -> Callable[[], Any]:
    def cfg() -> Any:
        from whalepy.models import GPTConfig

        return "gpt", GPTConfig(vocab_size=GPT2_VOCAB, block_size=n_positions, num_layers=n_layer,
                                num_heads=n_head, hidden_size=n_embd, tie_embeddings=True,
                                gelu_approximate="tanh")
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

T5_DEFAULT_SEQ_LEN = 512
"""Tokens per sample on each side of the built-in T5 v1.1 / mT5 models (whalepy's own encoder-decoder,
:mod:`whalepy.models.t5`; no transformers import): the input length of T5's and mT5's pre-training."""


@dataclass(frozen=True, slots=True)
class PublishedBatch:
    """The global batch a model was trained with, as its paper gives it."""

    sequences: int
    """Samples (sequences) per optimizer step."""
    seq_len: int
    """Tokens per sequence the batch was published at; at another ``seq_len`` it does not apply."""
    family: str
    """What the plan text calls the model (``"GPT-3"``)."""
    source: str
    """The paper and the place in it."""


PUBLISHED_BATCHES: dict[str, PublishedBatch] = {
    # "a larger batchsize of 512 is used" with a 1,024-token context, for every GPT-2 size
    "gpt2": PublishedBatch(512, 1024, "GPT-2", "Radford et al. 2019, Language Models are Unsupervised "
                                               "Multitask Learners, section 2.3"),
    "gpt2-xl": PublishedBatch(512, 1024, "GPT-2", "Radford et al. 2019, section 2.3"),
    # 3.2M tokens of 2,048: 1,536 sequences (3,145,728 tokens)
    "gpt3-175b": PublishedBatch(1536, 2048, "GPT-3", "Brown et al. 2020, Language Models are Few-Shot Learners, "
                                                     "Table 2.1"),
    # 4M tokens for every LLaMA size, 2,048-token context: 2,048 sequences (4,194,304 tokens)
    "llama-7b": PublishedBatch(2048, 2048, "LLaMA", "Touvron et al. 2023, LLaMA: Open and Efficient Foundation "
                                                    "Language Models, Table 2"),
    # "All models are trained with a global batch-size of 4M tokens", 4,096-token context: 1,024 sequences
    "llama-70b": PublishedBatch(1024, 4096, "Llama 2", "Touvron et al. 2023, Llama 2: Open Foundation and "
                                                       "Fine-Tuned Chat Models, Table 1"),
    # the released models: 2^11 sequences of 512 tokens for 1M steps
    "t5-3b": PublishedBatch(2048, 512, "T5", "Raffel et al. 2020, Exploring the Limits of Transfer Learning "
                                             "with a Unified Text-to-Text Transformer, section 3.7"),
    # 256 sequences of 512 tokens (90% of the steps ran at 128 tokens)
    "bert-large": PublishedBatch(256, 512, "BERT", "Devlin et al. 2019, BERT: Pre-training of Deep Bidirectional "
                                                   "Transformers, appendix A.2"),
    # "batches of 1024 length-1024 input sequences": at --seq-len 1024 (the built-ins default to 512)
    **{f"mt5-{size}": PublishedBatch(1024, 1024, "mT5", "Xue et al. 2021, mT5: A Massively Multilingual "
                                                       "Pre-trained Text-to-Text Transformer, section 3")
       for size in ("base", "large", "xl", "xxl")},
}
"""Built-in models whose training batch is published, at that batch's sequence length. Not listed, as
none is published per model: llama3-8b (the Llama 3 paper gives the 405B model's batch schedule only),
t5-v1_1-xl / -xxl (T5 v1.1 has checkpoints, not a paper) and t5-tiny."""


def published_batch(name: str, seq_len: int | None) -> PublishedBatch | None:
    """The published batch of built-in model ``name`` planned at ``seq_len`` tokens (None: its default),
    or None where none is published or it was published at another sequence length."""
    key = name.strip().lower()
    pub = PUBLISHED_BATCHES.get(key)
    if pub is None:
        return None
    seq = seq_len if seq_len is not None else (MODELS[key][1] if key in MODELS else T5_DEFAULT_SEQ_LEN)
    return pub if seq == pub.seq_len else None


def build(name: str, *, batch: int = 1, seq_len: int | None = None) -> tuple[Any, Any]:
    """``(model on the meta device, example inputs)`` for a built-in model name."""
    import torch

    from whalepy.models.t5 import T5_SIZES, build_t5

    key = name.strip().lower()
    if key in T5_SIZES:
        seq = seq_len or T5_DEFAULT_SEQ_LEN
        if batch < 1 or seq < 1:
            raise WhalepyError(f"batch ({batch}) and seq_len ({seq}) must be positive")
        return build_t5(key, batch=batch, seq_len=seq)
    if key not in MODELS:
        raise WhalepyError(f"unknown built-in model {name!r}; built-in models are: "
                           f"{', '.join([*MODELS, *T5_SIZES])} "
                           "(or give package.module:function returning (model, example_inputs))")
    factory, default_seq = MODELS[key]
    seq = default_seq if seq_len is None else seq_len
    if batch < 1 or seq < 1:
        raise WhalepyError(f"batch ({batch}) and seq_len ({seq}) must be positive")
    kind, cfg = factory()
    if kind == "gpt":
        from whalepy.models import GPT

        cfg.block_size = max(cfg.block_size, seq)
        with torch.device("meta"):
            model = GPT(cfg)
        return model.eval(), (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)
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


__all__ = ["MODELS", "PUBLISHED_BATCHES", "PublishedBatch", "build", "published_batch"]
