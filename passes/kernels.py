"""What each block's forward runs on the device: GEMM shapes, attention shapes, memory-bound bytes and
kernel launches (:class:`~whalepy.ir.profile.BlockKernels`), for the shape-dependent compute model.

Read after the ``flops``, ``blocks``, ``memory`` and ``tp_patterns`` passes: a node is a GEMM when the
FLOP rules cost it as one (``linear``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul``), an attention
call when it is ``scaled_dot_product_attention`` (any fused variant); every other node that moves
bytes (``whalepy.bytes``) is a memory-bound kernel. A GEMM whose weight belongs to a module with a
column-parallel (row-parallel) TP rule is marked as sharding ``n`` (``k``); a batched product of two
activations in a block with such rules (``Q K^T`` of unfused attention) as sharding its batch (heads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from whalepy.passes.autocast import memory_bound
from whalepy.passes.shapes import VIEW_OPS, op_name, requires_grad
from whalepy.ir.plan import TPStyle
from whalepy.ir.profile import AttentionShape, BlockKernels, GemmShape

_GEMM_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"})
_SHARD = {TPStyle.COLWISE: "n", TPStyle.ROWWISE: "k"}


def _shape(x: Any) -> tuple[int, ...]:
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else ()


def _param_module(x: Any) -> str | None:
    """Module path of the parameter ``x`` reads, through views and casts (autocast's ``to``)."""
    while isinstance(x, fx.Node):
        fqn = x.meta.get("whalepy.param")
        if fqn is not None:
            return str(fqn).rsplit(".", 1)[0]
        if op_name(x) not in VIEW_OPS and op_name(x) != "to" or not x.args:
            return None
        x = x.args[0]
    return None


def _gemm(node: fx.Node, name: str, styles: dict[str, TPStyle]) -> GemmShape | None:
    if name == "linear":
        x, w = node.args[0], node.args[1]
        k, n = _shape(w)[-1], _shape(w)[0]
        m = math.prod(_shape(x)[:-1])
        batch = 1
    else:
        a, w = (node.args[1], node.args[2]) if name in ("addmm", "baddbmm") else (node.args[0], node.args[1])
        sa, sb = _shape(a), _shape(w)
        if len(sa) < 2 or len(sb) < 1:
            return None
        k, n = sa[-1], (sb[-1] if len(sb) > 1 else 1)
        if name in ("mm", "addmm") or len(sb) == 2:  # a right operand without batch dims: fold a's into m
            m, batch = math.prod(sa[:-1]), 1
        else:
            m, batch = sa[-2], math.prod(sa[:-2])
        x = a
    module = _param_module(w)
    if module is None:  # activation x activation (unfused attention): runs on the rank's own heads
        shard = "batch" if batch > 1 and any(st in _SHARD for st in styles.values()) else ""
    else:
        style = styles.get(module)
        shard = _SHARD.get(style, "") if style else ""
    return GemmShape(m=int(m), k=int(k), n=int(n), batch=int(batch), grad_input=requires_grad(x),
                     grad_weight=requires_grad(w), shard=shard)


def _attention(node: fx.Node) -> AttentionShape | None:
    q, k, v = node.args[0], node.args[1], node.args[2]
    sq, sk, sv = _shape(q), _shape(k), _shape(v)
    if len(sq) < 2:
        return None
    target = str(getattr(node.target, "__name__", node.target))
    # aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...); the fused
    # aten variants (_scaled_dot_product_flash_attention[_for_cpu]) take (q, k, v, dropout_p, is_causal)
    pos = 5 if target.startswith("scaled_dot_product_attention") or "attn_mask" in node.kwargs else 4
    causal = node.kwargs.get("is_causal", node.args[pos] if len(node.args) > pos else False)
    mask = node.kwargs.get("attn_mask", node.args[3] if pos == 5 and len(node.args) > 3 else None)
    if not causal and sq[-2] == sk[-2] and isinstance(mask, fx.Node) and _positional(mask):
        # a mask built from positions alone (HF's causal mask without padding): transformers passes
        # ``is_causal=True`` and no mask to SDPA when the mask is purely causal (``sdpa_mask``'s
        # ``allow_is_causal_skip``), and a sliding window skips at least as many tiles
        causal = True
    return AttentionShape(batch_heads=int(math.prod(sq[:-2])), q_len=sq[-2], kv_len=sk[-2], head_dim=sq[-1],
                          v_dim=sv[-1], causal=bool(causal),
                          needs_grad=requires_grad(q) or requires_grad(k) or requires_grad(v))


def _positional(mask: fx.Node) -> bool:
    """Whether ``mask`` depends on no data input of the model (only on shapes, positions, constants)."""
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and "whalepy.param" not in n.meta and "whalepy.buffer" not in n.meta:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                return False
        todo.extend(n.all_input_nodes)
    return True


def _grad_inputs(node: fx.Node) -> int:
    """Backward launches of a node: one per distinct tensor input that needs a gradient (``dX``, ``dW``
    and the bias reduction of a linear layer; a residual add's two branches are accumulated)."""
    if not requires_grad(node):
        return 0
    return max(1, sum(1 for a in dict.fromkeys(node.all_input_nodes) if requires_grad(a)))


def block_kernels(gm: fx.GraphModule, num_blocks: int, rules: Sequence[Sequence[Any]]) -> list[BlockKernels]:
    """One :class:`BlockKernels` per block; ``rules[b]`` are block ``b``'s TP rules."""
    styles = [{r.module: r.style for r in rs} for rs in rules]
    gemms: list[list[GemmShape]] = [[] for _ in range(num_blocks)]
    attn: list[list[AttentionShape]] = [[] for _ in range(num_blocks)]
    fwd_ops = [0] * num_blocks
    bwd_ops = [0] * num_blocks
    for node in gm.graph.nodes:
        b = node.meta.get("whalepy.block")
        if b is None or node.op not in ("call_function", "call_method"):
            continue
        name = op_name(node)
        traffic = node.meta.get("whalepy.bytes", 0)
        if name in _GEMM_OPS:
            g = _gemm(node, name, styles[b])
            if g is not None:
                gemms[b].append(g)
                fwd_ops[b] += 1
                bwd_ops[b] += _grad_inputs(node)
                continue
        if name == "sdpa":
            a = _attention(node)
            if a is not None:
                attn[b].append(a)
                fwd_ops[b] += 1
                bwd_ops[b] += _grad_inputs(node)
                continue
        if traffic > 0:
            fwd_ops[b] += 1
            bwd_ops[b] += _grad_inputs(node)
    mb = memory_bound(gm, num_blocks, lambda n: op_name(n) not in _GEMM_OPS and op_name(n) != "sdpa")
    return [BlockKernels(gemms=tuple(g), attention=tuple(a), memory_bytes=m.fwd, memory_bytes_bwd=m.bwd, amp=m,
                         ops_fwd=f, ops_bwd=bw)
            for g, a, m, f, bw in zip(gemms, attn, mb, fwd_ops, bwd_ops)]
