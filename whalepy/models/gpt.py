"""A small GPT-style language model in plain PyTorch, for examples, tests and benchmarks.

Module paths follow the nanoGPT / HF GPT-2 layout (``transformer.wte``, ``transformer.h.3.attn``,
``lm_head``) so annotations and plans read the same as for HF models. Attention reshapes with
``view(..., -1, head_dim)``, so the number of heads is whatever the projection's output width gives:
tensor parallelism can shard ``q_proj`` / ``k_proj`` / ``v_proj`` by columns without touching any
attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids."""
    block_size: int = 64
    """Longest sequence (positional embedding rows)."""
    num_layers: int = 2
    num_heads: int = 4
    hidden_size: int = 64
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``hidden_size``."""
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False
    """``lm_head`` shares ``transformer.wte``'s weight (GPT-2 and GPT-3 do; the runtime keeps the two
    copies equal when they land in different pipeline stages)."""
    gelu_approximate: str = "none"
    """``nn.GELU``'s ``approximate``: ``"tanh"`` is GPT-2's ``gelu_new``."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(h, h, bias=cfg.bias)
        self.k_proj = nn.Linear(h, h, bias=cfg.bias)
        self.v_proj = nn.Linear(h, h, bias=cfg.bias)
        self.o_proj = nn.Linear(h, h, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its local heads
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size, bias=cfg.bias)
        self.act = nn.GELU(approximate=cfg.gelu_approximate)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                wpe=nn.Embedding(cfg.block_size, cfg.hidden_size),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers)),
                ln_f=nn.LayerNorm(cfg.hidden_size),
            )
        )
        # untied by default: a tied head makes the embedding and the head one pipeline-crossing parameter
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.lm_head.weight.is_meta:  # on meta there is nothing to fill; materialisation runs
            self.apply(self._init_weights)   # _init_weights per module (whalepy.runtime.materialize)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
