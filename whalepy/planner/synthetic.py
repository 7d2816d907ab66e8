"""Analytic transformer profiles: a :class:`~whalepy.ir.profile.ModelProfile` without capturing a model.

Used by tests at scale (a 175B GPT on 4,096 GPUs plans in one process in seconds), by the benchmarks,
and as a cross-check of what capture measures. Per layer, with ``s`` sequence, ``b`` batch, ``h``
hidden, ``a`` heads, ``a_kv`` key/value heads, ``f`` FFN width, ``V`` vocabulary (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, Appendix;
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022):

- parameters: attention ``h*h (q) + 2*h*h*a_kv/a (k, v) + h*h (out)`` plus MLP ``2*h*f`` (``3*h*f``
  gated, Llama), plus biases and norms ``~ 9h`` (4 norm/bias vectors of h, qkv and FFN biases);
  with ``f = 4h`` and ``a_kv = a`` that is ``12h^2 + 13h``.
- forward FLOPs: ``2 * b * s * (matmul parameters)`` for the GEMMs plus ``4 * b * s^2 * h`` for the
  attention scores and the weighted sum; with ``f = 4h``: ``24bsh^2 + 4bs^2h``. Backward is twice that.
- activation bytes saved for backward: ``sbh(34 + 5as/h)`` (Korthikanti et al., no recompute).
- what tensor parallelism leaves whole on every rank (``tp_whole_params``): of a layer's ``9h``, the
  two norms' weights and biases and the two row-parallel biases, ``6h``; the learned positions of the
  embedding; the final norm of the head. A tied head holds a copy of the embedding table
  (``tied_copies``), split like it.
- tensor-parallel traffic: two all-reduces of the ``[s, b, h]`` 16-bit output per forward (attention
  and MLP row-parallel outputs): ``tp_comm_bytes = 2 * 2sbh``.
- embedding and head use the vocabulary padded to a multiple of 128 (Megatron-LM's
  ``--make-vocab-size-divisible-by``), so they split across TP like the layers;
- kernels (for the shape-dependent compute model): the layer's GEMMs with ``m = bs`` (q, k, v and the
  FFN input column-parallel, the output projections row-parallel), one causal attention of ``b a``
  heads, and ``20sbh + 4sbf`` memory-bound bytes (two layer norms and two residual adds on ``[s, b, h]``,
  the activation on ``[s, b, f]``, 16-bit); launches as a captured GPT block (14 forward, 24 backward).
- embedding: ``V*h`` (+ ``s*h`` learned positions); the head runs the ``h x V`` projection,
  ``2bshV`` FLOPs, and keeps 16-bit logits plus their fp32 softmax for the loss: ``6bsV`` bytes.

Bytes moved (the roofline's memory side) is 16-bit weights once plus the saved activations once.
"""

from __future__ import annotations

import hashlib

from whalepy.ir.plan import TPRule, TPStyle
from whalepy.ir.profile import (AttentionShape, BlockAnnotations, BlockKernels, BlockKind, BlockProfile, GemmShape,
                                ModelProfile, TiedCopy)

_BF16 = 2
_TOKEN_ID_BYTES = 8  # int64 token ids


def _pow2_divisors(*values: int, limit: int = 64) -> tuple[int, ...]:
    out, t = [], 1
    while t <= limit and all(v % t == 0 for v in values):
        out.append(t)
        t *= 2
    return tuple(out)


def transformer_profile(
    *,
    num_layers: int,
    hidden: int,
    seq_len: int,
    vocab: int,
    num_heads: int,
    ffn: int | None = None,
    num_kv_heads: int | None = None,
    gated_mlp: bool = False,
    learned_positions: bool = True,
    tied_embeddings: bool = False,
    batch: int = 1,
    name: str = "transformer",
    layer_prefix: str = "h",
    annotations: dict[str, BlockAnnotations] | None = None,
    sequence_parallel: bool = False,
) -> ModelProfile:
    """A GPT/Llama-shaped profile: blocks ``embed``, ``{layer_prefix}.0`` .. ``.{L-1}``, ``head``.

    ``annotations`` maps block names to :class:`BlockAnnotations` (to test the primitives without
    capture). Figures are for ``batch`` samples of ``seq_len`` tokens, like a captured profile.
    """
    if min(num_layers, hidden, seq_len, vocab, num_heads, batch) < 1:
        raise ValueError("num_layers, hidden, seq_len, vocab, num_heads and batch must be positive")
    f = ffn or 4 * hidden
    kv = num_kv_heads or num_heads
    h, s, b, a = hidden, seq_len, batch, num_heads
    V = -(-vocab // 128) * 128
    annotations = annotations or {}

    attn_matmul = h * h + 2 * h * h * kv // a + h * h
    mlp_matmul = (3 if gated_mlp else 2) * h * f
    layer_params = attn_matmul + mlp_matmul + 9 * h
    layer_fwd = 2 * b * s * (attn_matmul + mlp_matmul) + 4 * b * s * s * h
    layer_act = int(s * b * h * (34 + 5 * a * s / h))
    hidden_bytes = _BF16 * s * b * h
    layer_tp = _pow2_divisors(a, kv, f)
    layer_kernels = _layer_kernels(b * s, h, f, a, kv, s, gated_mlp)

    embed_params = V * h + (s * h if learned_positions else 0)
    embed_rows = ((V, h),) + (((s, h),) if learned_positions else ())
    head_params = (0 if tied_embeddings else V * h) + 2 * h
    head_fwd = 2 * b * s * h * V
    logits_bytes = 6 * b * s * V

    def block(index: int, name_: str, kind: BlockKind, **kw: object) -> BlockProfile:
        params = int(kw.pop("params"))  # type: ignore[arg-type]
        act = int(kw.pop("act"))  # type: ignore[arg-type]
        fwd = float(kw.pop("fwd"))  # type: ignore[arg-type]
        return BlockProfile(
            name=name_, index=index, kind=kind, modules=(name_,), num_params=params,
            param_bytes=_BF16 * params, fwd_flops=fwd, bwd_flops=2 * fwd,
            bytes_moved=float(_BF16 * params + act), activation_bytes=act,
            annotations=annotations.get(name_, BlockAnnotations()), **kw)  # type: ignore[arg-type]

    blocks = [block(0, "embed", BlockKind.EMBEDDING, params=embed_params, act=hidden_bytes,
                    fwd=float(b * s * h), input_bytes=_TOKEN_ID_BYTES * b * s, output_bytes=hidden_bytes,
                    tp_rules=(TPRule(module="embed", style=TPStyle.VOCAB),),
                    tp_comm_bytes=hidden_bytes, tp_degrees=_pow2_divisors(V),
                    tp_whole_params=s * h if learned_positions else 0,
                    # memory-centric tiling splits the embeddings' rows (whalepy.ir.tiling); a tied one
                    # is not tiled (its block shares a parameter with the head)
                    linear_params=0 if tied_embeddings else embed_params,
                    largest_linear_params=0 if tied_embeddings else V * h,
                    num_linears=0 if tied_embeddings else len(embed_rows),
                    linear_rows=() if tied_embeddings else embed_rows)]
    for i in range(num_layers):
        p = f"{layer_prefix}.{i}"
        rules = (TPRule(module=f"{p}.attn.qkv", style=TPStyle.COLWISE),
                 TPRule(module=f"{p}.attn.proj", style=TPStyle.ROWWISE),
                 TPRule(module=f"{p}.mlp.fc", style=TPStyle.COLWISE),
                 TPRule(module=f"{p}.mlp.proj", style=TPStyle.ROWWISE))
        if sequence_parallel:  # the two pre-norms run on sequence shards
            rules += (TPRule(module=f"{p}.ln_1", style=TPStyle.SEQUENCE),
                      TPRule(module=f"{p}.ln_2", style=TPStyle.SEQUENCE))
        blocks.append(block(1 + i, p, BlockKind.LAYER, params=layer_params, act=layer_act,
                            fwd=float(layer_fwd), input_bytes=hidden_bytes, output_bytes=hidden_bytes,
                            repeat_group=1, tp_rules=rules, tp_comm_bytes=2 * hidden_bytes, tp_whole_params=6 * h,
                            tp_degrees=layer_tp, kernels=layer_kernels,
                            linear_params=attn_matmul + mlp_matmul,
                            largest_linear_params=max(h * f, h * h + 2 * h * h * kv // a),
                            num_linears=5 if gated_mlp else 4,
                            linear_rows=((h + 2 * h * kv // a, h), (h, h))
                            + (((f, h),) * 2 if gated_mlp else ((f, h),)) + ((h, f),)))
    blocks.append(block(1 + num_layers, "head", BlockKind.HEAD, params=head_params, act=logits_bytes,
                        fwd=float(head_fwd), input_bytes=hidden_bytes, output_bytes=4 * b,
                        tp_rules=(TPRule(module="head", style=TPStyle.COLWISE),),
                        tp_comm_bytes=4 * b * s, tp_degrees=_pow2_divisors(V), tp_whole_params=2 * h,
                        tied_copies=(TiedCopy(owner="embed", parameter="embed.weight", num_params=V * h, tp_split=True),)
                        if tied_embeddings else (),
                        linear_params=0 if tied_embeddings else V * h,
                        largest_linear_params=0 if tied_embeddings else V * h,
                        num_linears=0 if tied_embeddings else 1,
                        linear_rows=() if tied_embeddings else ((V, h),)))
    total = sum(bl.num_params for bl in blocks)
    key = f"{name}|{num_layers}|{h}|{s}|{V}|{a}|{f}|{kv}|{gated_mlp}|{learned_positions}|{tied_embeddings}"
    return ModelProfile(
        model_name=name, fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16], batch_size=b,
        seq_len=s, total_params=total, param_bytes=_BF16 * total, dtype="bfloat16", blocks=tuple(blocks),
        capture_method="synthetic")


def _layer_kernels(tokens: int, h: int, f: int, a: int, kv: int, s: int, gated: bool) -> BlockKernels:
    kvh = h * kv // a
    gemms = (GemmShape(tokens, h, h, shard="n"), GemmShape(tokens, h, kvh, shard="n"),
             GemmShape(tokens, h, kvh, shard="n"), GemmShape(tokens, h, h, shard="k"),
             *((GemmShape(tokens, h, f, shard="n"),) * (2 if gated else 1)), GemmShape(tokens, f, h, shard="k"))
    attention = (AttentionShape(batch_heads=tokens // s * a, q_len=s, kv_len=s, head_dim=h // a, v_dim=h // a,
                                causal=True),)
    return BlockKernels(gemms=gemms, attention=attention, memory_bytes=float(_BF16 * tokens * (10 * h + 2 * f)),
                        ops_fwd=14, ops_bwd=24)


def gpt_profile(name: str, *, seq_len: int | None = None, batch: int = 1, **kw: object) -> ModelProfile:
    """Profiles of well-known shapes by name (``gpt3-175b``, ``gpt3-1.3b``, ``llama3-8b``, ...)."""
    shapes: dict[str, dict[str, object]] = {
        "gpt2": dict(num_layers=12, hidden=768, num_heads=12, vocab=50257, seq_len=1024,
                     tied_embeddings=True),
        "gpt2-xl": dict(num_layers=48, hidden=1600, num_heads=25, vocab=50257, seq_len=1024,
                        tied_embeddings=True),
        "gpt3-1.3b": dict(num_layers=24, hidden=2048, num_heads=16, vocab=50257, seq_len=2048),
        "gpt3-175b": dict(num_layers=96, hidden=12288, num_heads=96, vocab=50257, seq_len=2048),
        "llama-7b": dict(num_layers=32, hidden=4096, num_heads=32, vocab=32000, seq_len=2048,
                         ffn=11008, gated_mlp=True, learned_positions=False),
        "llama3-8b": dict(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, vocab=128256,
                          seq_len=8192, ffn=14336, gated_mlp=True, learned_positions=False),
        "llama-70b": dict(num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8, vocab=32000,
                          seq_len=4096, ffn=28672, gated_mlp=True, learned_positions=False),
    }
    if name not in shapes:
        raise ValueError(f"no synthetic shape {name!r}; known: {', '.join(shapes)}")
    cfg = dict(shapes[name])
    if seq_len is not None:
        cfg["seq_len"] = seq_len
    cfg.update(kw)
    prefix = "model.layers" if name.startswith("llama") else "h"
    return transformer_profile(batch=batch, name=name, layer_prefix=prefix, **cfg)  # type: ignore[arg-type]
