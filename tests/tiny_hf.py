"""Tiny HuggingFace models of the five reference architectures, built on the meta device, with inputs."""

from __future__ import annotations

from typing import Any

import torch


def ids(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long)


def tiny_hf_model(name: str, *, num_layers: int = 2, num_decoder_layers: int | None = None,
                  **config: Any) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``(model, keyword inputs)`` for ``name`` in gpt2, llama, bert, t5, vit; ``config`` goes to the
    HF config (e.g. flags a test wants set)."""
    import transformers

    with torch.device("meta"):
        if name == "gpt2":
            cfg = transformers.GPT2Config(n_layer=num_layers, n_embd=64, n_head=4, vocab_size=512,
                                          n_positions=64, use_cache=False, **config)
            return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids(2, 16)}
        if name == "llama":
            cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           vocab_size=512, use_cache=False, **config)
            return transformers.LlamaForCausalLM(cfg), {"input_ids": ids(2, 16)}
        if name == "bert":
            cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=256, **config)
            return transformers.BertForMaskedLM(cfg), {"input_ids": ids(2, 16)}
        if name == "t5":
            cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=num_layers,
                                        num_decoder_layers=num_decoder_layers or num_layers,
                                        num_heads=2, d_kv=16, vocab_size=256, use_cache=False, **config)
            return (transformers.T5ForConditionalGeneration(cfg),
                    {"input_ids": ids(2, 16), "decoder_input_ids": ids(2, 8)})
        if name == "vit":
            cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
                                         intermediate_size=64, image_size=32, patch_size=8, num_labels=10,
                                         **config)
            return transformers.ViTForImageClassification(cfg), {"pixel_values": torch.zeros(2, 3, 32, 32)}
    raise ValueError(f"no tiny model named {name!r}")
