"""A T5 v1.1 / mT5 encoder-decoder in plain PyTorch, for the built-in ``mt5-*`` and ``t5-v1_1-*`` models.

Same parameters and the same FLOPs as HuggingFace's ``T5ForConditionalGeneration`` / ``MT5ForConditionalGeneration``
with a gated-GELU feed-forward and an untied head (the T5 v1.1 / mT5 recipe; Xue et al., "mT5: A
Massively Multilingual Pre-trained Text-to-Text Transformer", NAACL 2021), and HF's module paths
(``shared``, ``encoder.block.3``, ``decoder.final_layer_norm``, ``lm_head``), without importing
transformers, so building the 13B mT5-XXL on the meta device takes a fraction of a second.

Differences from HF that change neither parameters nor FLOPs: the relative position bias of each stack
is a module of its own (``encoder.relative_attention_bias``) computed once before the blocks and
passed to every block (HF keeps it in block 0 and passes the result along), so all blocks of a stack
are alike; both token embeddings are looked up in one call (HF calls ``shared`` twice), so
data parallelism gathers the embedding once. No dropout (the study trains without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from whalepy.models import GPT

__all__ = ["T5", "T5Config", "T5_SIZES"]


@dataclass(frozen=True, kw_only=True, slots=True)
class T5Config:
    d_model: int
    d_ff: int
    num_heads: int
    d_kv: int = 64
    """Width of one attention head (64 in every published T5 v1.1 / mT5 size)."""
    num_layers: int
    """Encoder layers; the decoder has as many."""
    vocab_size: int
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6


T5_SIZES: dict[str, T5Config] = {
    # mT5 (Xue et al. 2021, Table 1 sizes; configs of google/mt5-*): 580M, 1.2B, 3.7B, 13B parameters
    "mt5-base": T5Config(d_model=768, d_ff=2048, num_heads=12, num_layers=12, vocab_size=250112),
    "mt5-large": T5Config(d_model=1024, d_ff=2816, num_heads=16, num_layers=24, vocab_size=250112),
    "mt5-xl": T5Config(d_model=2048, d_ff=5120, num_heads=32, num_layers=24, vocab_size=250112),
    "mt5-xxl": T5Config(d_model=4096, d_ff=10240, num_heads=64, num_layers=24, vocab_size=250112),
    # T5 v1.1 (configs of google/t5-v1_1-*): the same shapes with T5's 32128-token vocabulary
    "t5-v1_1-xl": T5Config(d_model=2048, d_ff=5120, num_heads=32, num_layers=24, vocab_size=32128),
    "t5-v1_1-xxl": T5Config(d_model=4096, d_ff=10240, num_heads=64, num_layers=24, vocab_size=32128),
    # not published: small enough to train on CPU (``whalepy study zero t5-tiny --measure``, the tests)
    "t5-tiny": T5Config(d_model=64, d_ff=128, num_heads=4, d_kv=16, num_layers=2, vocab_size=256),
}
"""Configurations by the name ``whalepy.models.zoo.build`` knows them under."""


class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        inner = cfg.num_heads * cfg.d_kv
        self.d_kv = cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.d_kv).transpose(1, 2)
        k = self.k(kv).view(b, kv.shape[1], -1, self.d_kv).transpose(1, 2)
        v = self.v(kv).view(b, kv.shape[1], -1, self.d_kv).transpose(1, 2)
        # T5 does not scale the scores by 1/sqrt(d_kv) (its initialisation accounts for it)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class GatedGelu(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class Block(nn.Module):
    def __init__(self, cfg: T5Config, *, decoder: bool) -> None:
        super().__init__()
        self.ln_self = RMSNorm(cfg.d_model, cfg.eps)
        self.self_attn = Attention(cfg)
        self.decoder = decoder
        if decoder:
            self.ln_cross = RMSNorm(cfg.d_model, cfg.eps)
            self.cross_attn = Attention(cfg)
        self.ln_ff = RMSNorm(cfg.d_model, cfg.eps)
        self.ff = GatedGelu(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_self(x)
        x = x + self.self_attn(h, h, bias)
        if self.decoder:
            x = x + self.cross_attn(self.ln_cross(x), memory, None)
        return x + self.ff(self.ln_ff(x))


class RelativeBias(nn.Module):
    """T5's bucketed relative position bias, one scalar per (bucket, head) (Raffel et al., JMLR 2020)."""

    def __init__(self, cfg: T5Config, *, bidirectional: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_buckets, cfg.num_heads))
        nn.init.normal_(self.weight, std=0.02)
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, cfg.num_buckets, cfg.max_distance

    def forward(self, length: int, like: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(length, device=like.device)
        rel = pos[None, :] - pos[:, None]  # key - query
        n = self.num_buckets
        bucket = torch.zeros_like(rel)
        if self.bidirectional:
            n //= 2
            bucket = bucket + (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        exact = n // 2
        large = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
                         * (n - exact)).long()
        bucket = bucket + torch.where(rel < exact, rel, torch.clamp(large, max=n - 1))
        bias = F.embedding(bucket, self.weight).permute(2, 0, 1).unsqueeze(0).to(like.dtype).contiguous()  # [1, heads, q, k]
        if not self.bidirectional:
            causal = torch.ones(length, length, dtype=torch.bool, device=like.device).tril()
            bias = bias.masked_fill(~causal, torch.finfo(bias.dtype).min)
        return bias


class Stack(nn.Module):
    def __init__(self, cfg: T5Config, *, decoder: bool) -> None:
        super().__init__()
        self.relative_attention_bias = RelativeBias(cfg, bidirectional=not decoder)
        self.block = nn.ModuleList(Block(cfg, decoder=decoder) for _ in range(cfg.num_layers))
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.eps)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.relative_attention_bias(x.shape[1], x)
        for blk in self.block:
            x = blk(x, bias, memory)
        return self.final_layer_norm(x)


class T5(nn.Module):
    """``forward(input_ids [b, s], decoder_input_ids [b, t]) -> logits [b, t, vocab]``."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Stack(cfg, decoder=False)
        self.decoder = Stack(cfg, decoder=True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    _init_weights = staticmethod(GPT._init_weights)
    """Normal(0, 0.02) weights, as whalepy's GPT (what ``parallelize`` calls when materialising)."""

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        emb = self.shared(torch.cat([input_ids, decoder_input_ids], dim=1))
        memory = self.encoder(emb[:, :s])
        return self.lm_head(self.decoder(emb[:, s:], memory))


def build_t5(name: str, *, batch: int, seq_len: int) -> tuple[T5, tuple[torch.Tensor, torch.Tensor]]:
    """``(model on the meta device, (input_ids, decoder_input_ids))`` of a :data:`T5_SIZES` entry, with
    ``seq_len`` tokens on each side."""
    with torch.device("meta"):
        model = T5(T5_SIZES[name])
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    return model, (ids, ids)
