"""FLOPs per node, forward and backward: ``node.meta["whalepy.flops_fwd"]`` / ``["whalepy.flops_bwd"]``.

One multiply-add counts as 2 FLOPs (matmul ``[m,k] @ [k,n]`` = ``2*m*k*n``), as in Narayanan et al.
(SC'21), whose closed form the tests check against.

Backward rules (no activation recomputation):

- matmul-like ops (``linear``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul``, ``einsum``,
  convolutions) cost one forward-sized product per operand that needs a gradient: ``2x`` forward for
  a layer whose input and weight both need one, ``1x`` for a first layer fed by data (ViT's patch
  convolution), ``0`` for frozen weights on data.
- attention (``scaled_dot_product_attention`` and its fused variants) with ``q [.., L, E]``,
  ``k [.., S, E]``, ``v [.., S, Ev]``: forward ``2*B*L*S*(E + Ev)`` (``4*b*h*s*s*d``; the softmax is
  not counted); backward ``dV, dP = dO V^T, dQ, dK``, i.e. ``2x`` forward when q, k and v need
  gradients. Flash kernels recompute ``Q K^T`` in backward (another ``0.5x``); that is kernel
  efficiency and belongs to the compute cost model, not to the FLOP count.
- norms and softmax: ``5*numel`` (layer norm, softmax), ``4*numel`` (RMS norm) forward, ``2x`` that
  backward; other elementwise ops: ``numel`` forward and ``numel`` backward when they need a gradient.
- embedding lookups, views, copies, concatenation, creation ops: 0 forward; an embedding whose table
  is trained costs ``numel(out)`` backward (accumulating rows into the table's gradient).

Ops inside higher-order ops (export's ``wrap_with_set_grad_enabled`` region for rotary embeddings)
are not counted; they run once per step under ``no_grad`` and are small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from whalepy.passes.manager import PassContext
from whalepy.passes.shapes import (
    CREATION_OPS,
    NO_DATA_OPS,
    VIEW_OPS,
    numel,
    op_name,
    requires_grad,
)

_ZERO_FLOP_OPS = frozenset({
    "to", "contiguous", "clone", "cat", "stack", "pad", "constant_pad_nd", "index", "gather",
    "index_select", "copy", "copy_", "repeat", "repeat_interleave", "tril", "triu", "roll",
    "flip", "wrap_with_set_grad_enabled", "wrap_with_autocast", "call_module", "masked_select",
    "_assert_is_none", "_assert", "scatter", "zero_", "fill_", "diff", "cumsum",
})

Rule = Callable[[fx.Node, Any], tuple[float, float]]


def _shape(x: Any) -> tuple[int, ...]:
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else ()


def _val_of(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _arg(node: fx.Node, i: int, name: str) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name)


def _linear(node: fx.Node, out: Any) -> tuple[float, float]:
    x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    n = numel(out)
    f = 2.0 * n * _shape(w)[-1]
    bias = n if isinstance(b, fx.Node) else 0
    bwd = f * (requires_grad(x) + requires_grad(w)) + (bias if requires_grad(b) else 0)
    return f + bias, bwd


def _mm(node: fx.Node, out: Any) -> tuple[float, float]:
    a, b = node.args[0], node.args[1]
    (m, k), n = _shape(a), _shape(b)[-1]
    f = 2.0 * m * k * n
    return f, f * (requires_grad(a) + requires_grad(b))


def _addmm(node: fx.Node, out: Any) -> tuple[float, float]:
    c, a, b = node.args[0], node.args[1], node.args[2]
    sa, n = _shape(a), _shape(b)[-1]
    f = 2.0 * math.prod(sa) * n
    bias = numel(out)
    bwd = f * (requires_grad(a) + requires_grad(b)) + (bias if requires_grad(c) else 0)
    return f + bias, bwd


def _bmm(node: fx.Node, out: Any) -> tuple[float, float]:
    a, b = node.args[0], node.args[1]
    f = 2.0 * numel(out) * _shape(a)[-1]
    return f, f * (requires_grad(a) + requires_grad(b))


def _baddbmm(node: fx.Node, out: Any) -> tuple[float, float]:
    c, a, b = node.args[0], node.args[1], node.args[2]
    f = 2.0 * numel(out) * _shape(a)[-1]
    bias = numel(out)
    return f + bias, f * (requires_grad(a) + requires_grad(b)) + (bias if requires_grad(c) else 0)


def _matmul(node: fx.Node, out: Any) -> tuple[float, float]:
    a, b = node.args[0], node.args[1]
    sa = _shape(a)
    k = sa[-1] if sa else 1
    f = 2.0 * max(numel(out), 1) * k
    return f, f * (requires_grad(a) + requires_grad(b))


def _einsum(node: fx.Node, out: Any) -> tuple[float, float]:
    eq = node.args[0]
    ops = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) \
        else node.args[1:]
    lhs = eq.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for spec, op in zip(lhs, ops):
        for letter, d in zip(spec.replace("...", ""), _shape(op)[-len(spec.replace("...", "")):]):
            sizes[letter] = d
    f = (2.0 if len(ops) > 1 else 1.0) * math.prod(sizes.values())
    return f, f * sum(requires_grad(o) for o in ops)


def _conv(node: fx.Node, out: Any) -> tuple[float, float]:
    x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    sw = _shape(w)
    target = str(getattr(node.target, "__name__", node.target))
    # aten.convolution(input, weight, bias, stride, padding, dilation, transposed, ...)
    transposed = "transpose" in target or (len(node.args) > 6 and node.args[6] is True)
    per_out = math.prod(sw[1:])
    f = 2.0 * (numel(x.meta.get("val")) if transposed else numel(out)) * per_out
    bias = numel(out) if isinstance(b, fx.Node) else 0
    bwd = f * (requires_grad(x) + requires_grad(w)) + (bias if requires_grad(b) else 0)
    return f + bias, bwd


def _sdpa(node: fx.Node, out: Any) -> tuple[float, float]:
    q, k, v = node.args[0], node.args[1], node.args[2]
    sq, sk, sv = _shape(q), _shape(k), _shape(v)
    batch = math.prod(sq[:-2])
    length, source = sq[-2], sk[-2]
    qk = 2.0 * batch * length * source * sq[-1]
    pv = 2.0 * batch * length * source * sv[-1]
    gq, gk, gv = requires_grad(q), requires_grad(k), requires_grad(v)
    bwd = (pv if gv else 0) + (pv if gq or gk else 0) + (qk if gq else 0) + (qk if gk else 0)
    return qk + pv, bwd


def _per_element(factor: float, bwd_factor: float) -> Rule:
    def rule(node: fx.Node, out: Any) -> tuple[float, float]:
        x = node.args[0] if node.args else None
        n = numel(x.meta.get("val")) if isinstance(x, fx.Node) else numel(out)
        f = factor * n
        return f, (bwd_factor * f if requires_grad(node) else 0.0)

    return rule


def embedding_weight(node: fx.Node) -> Any:
    """The table of an embedding node: ``aten.embedding(weight, idx)`` / ``F.embedding(idx, weight)``."""
    for a in node.args[:2]:
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return a
    return None


def _embedding(node: fx.Node, out: Any) -> tuple[float, float]:
    return 0.0, float(numel(out)) if requires_grad(embedding_weight(node)) else 0.0


def _loss(node: fx.Node, out: Any) -> tuple[float, float]:
    x = node.args[0]
    n = numel(x.meta.get("val"))
    return 5.0 * n, (2.0 * n if requires_grad(node) else 0.0)


_RULES: dict[str, Rule] = {
    "linear": _linear, "mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm,
    "matmul": _matmul, "einsum": _einsum, "conv": _conv, "sdpa": _sdpa,
    "layer_norm": _per_element(5, 2), "group_norm": _per_element(5, 2),
    "batch_norm": _per_element(5, 2), "instance_norm": _per_element(5, 2),
    "rms_norm": _per_element(4, 2), "softmax": _per_element(5, 1),
    "log_softmax": _per_element(5, 1), "embedding": _embedding,
    "cross_entropy": _loss, "nll_loss": lambda n, o: (float(numel(_val_of(_arg(n, 1, "target")))), 0.0),
}


def count_flops(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Write ``whalepy.flops_fwd`` and ``whalepy.flops_bwd`` on every computing node."""
    for node in ctx.nodes(gm):
        if node.op not in ("call_function", "call_method"):
            continue
        name = op_name(node)
        out = node.meta.get("val")
        rule = _RULES.get(name)
        if rule is not None:
            fwd, bwd = rule(node, out)
        elif (name in VIEW_OPS or name in NO_DATA_OPS or name in CREATION_OPS
              or name in _ZERO_FLOP_OPS or not isinstance(out, torch.Tensor)):
            fwd = bwd = 0.0
        else:
            fwd = float(numel(out))
            bwd = fwd if requires_grad(node) else 0.0
        node.meta["whalepy.flops_fwd"] = float(fwd)
        node.meta["whalepy.flops_bwd"] = float(bwd)
