"""A Llama-style decoder in plain PyTorch (no transformers import), for checks and benchmarks at
Llama's sizes on the meta device.

The architecture of Llama 2 (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat
Models", section 2.2 and Table 1): pre-normalisation with RMSNorm (Zhang and Sennrich 2019), a SwiGLU
feed-forward (Shazeer 2020) ``down(silu(gate(x)) * up(x))``, rotary position embeddings (Su et al.
2021) and grouped-query attention (Ainslie et al. 2023; 8 key/value heads in the 70B model), no biases,
an untied output head. Module paths are HF ``LlamaForCausalLM``'s (``model.embed_tokens``,
``model.layers.3.self_attn.q_proj``, ``model.layers.3.mlp.gate_proj``, ``model.norm``, ``lm_head``), so
plans and annotations read the same for both. Attention reshapes with ``view(..., -1, head_dim)`` and
repeats key/value heads by the local ratio, so tensor parallelism can shard the projections by columns
(the local query and key/value heads keep their ratio where the degree divides the key/value heads).

``transformers``' model is the reference for numerics; this one exists so that a Llama-70B-shaped
model can be built, profiled and lowered (``whalepy check``) without that optional dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LLAMA_70B", "Llama", "LlamaConfig"]


@dataclass(kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 256
    """Number of token ids."""
    hidden_size: int = 64
    intermediate_size: int = 128
    """Width of the SwiGLU feed-forward (gate and up projections)."""
    num_layers: int = 2
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides ``num_heads``."""
    max_positions: int = 64
    """Longest sequence (rows of the rotary tables)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Su et al. 2021; Llama 2 uses 10,000)."""
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must divide by num_heads {self.num_heads}, and "
                             f"num_heads by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


LLAMA_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                 num_kv_heads=8, max_positions=4096)
"""Llama 2 70B's shape (Touvron et al. 2023, Table 1; the published ``config.json``): pass as
``LlamaConfig(**LLAMA_70B)``."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Each key/value head repeated for the query heads of its group: ``[b, kv, t, d] -> [b, heads, t, d]``."""
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, heads // kv, t, d).reshape(b, heads, t, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its local heads
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Llama(nn.Module):
    """Decoder-only Llama: ``forward(idx [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.lm_head.weight.is_meta:  # on meta there is nothing to fill (materialisation initialises)
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t, d = idx.shape[1], self.config.head_dim
        # the rotary tables from constants, not a buffer: nothing to initialise on a model built on meta,
        # and each pipeline stage recomputes them
        inv_freq = self.config.rope_theta ** (-torch.arange(0, d, 2, device=idx.device, dtype=torch.float32) / d)
        freqs = torch.outer(torch.arange(t, device=idx.device, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))
