"""The models of ``../shared/calibration/sailor_layer_profiles.json``, built on the meta device for
``whalepy calibrate --import`` (``--model benchmarks.sailor_models:opt_350m``): each returns
``(model, example_inputs)`` with the table's layers in whalepy's block order (embedding, decoder
layers, head). Shapes from the models' published HF configs (facebook/opt-350m, EleutherAI/gpt-neo-2.7B);
sequence length 2048, batch 1."""

from __future__ import annotations

import torch


def opt_350m():
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                    max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False,
                    dropout=0.0, attention_dropout=0.0, use_cache=False)
    with torch.device("meta"):
        model = OPTForCausalLM(cfg)
    return model, {"input_ids": torch.zeros(1, 2048, dtype=torch.long)}


def gpt_neo_2_7b():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(vocab_size=50257, hidden_size=2560, num_layers=32, num_heads=20, max_position_embeddings=2048,
                       attention_types=[[["global", "local"], 16]], window_size=256, embed_dropout=0.0,
                       attention_dropout=0.0, resid_dropout=0.0, use_cache=False)
    with torch.device("meta"):
        model = GPTNeoForCausalLM(cfg)
    return model, {"input_ids": torch.zeros(1, 2048, dtype=torch.long)}
