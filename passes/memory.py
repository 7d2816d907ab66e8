"""Memory figures per node: traffic, parameters read, activations saved for backward.

Writes on every computing node:

- ``whalepy.bytes``: bytes read + written by the forward op: every distinct tensor input (weights
  included) plus the output. Views (``view``, ``transpose``, ``split``, ...) and no-op casts move
  nothing; creation ops only write; an embedding reads the rows it gathers, not the whole table.
- ``whalepy.param_bytes``: bytes of the parameters the op reads (whole tables).
- ``whalepy.saved_bytes``: activation bytes the op's backward keeps alive, counted once per storage
  and block (the first op of a block, in execution order, that saves a storage pays for it; when the
  blocks pass has not run, once per storage over the graph). A small tensor saved by every layer
  (Llama's rotary ``cos``/``sin``) is thus charged to each layer that keeps it, so identical layers
  get identical figures.

The saved-for-backward rule is an honest approximation of what PyTorch's autograd formulas save
(``tools/autograd/derivatives.yaml``), applied only to ops whose output requires grad:

- matmul-like ops save each activation operand whose partner needs a gradient (``linear`` saves its
  input when the weight trains; ``q @ k^T`` saves both); parameters are not activations.
- attention saves q, k, v, the output and the per-row log-sum-exp (flash / memory-efficient
  kernels; the score matrix is not kept).
- layer / RMS norm save the input and per-row statistics (fp32); softmax saves its output.
- ``gelu``, ``silu``, ``pow``, ``log``, ``sin``/``cos``, ``erf`` save their input; ``relu``, ``tanh``,
  ``sigmoid``, ``exp``, ``sqrt``, ``rsqrt`` their output; ``mul`` / ``div`` the other operand.
- dropout saves a 1-byte mask per element; embedding, gather, index, where and masked_fill save their
  indices or mask; cross entropy saves its log-probabilities.
- ``add``, ``sub``, ``neg``, reductions to a mean or sum, casts, copies, concatenation and views save
  nothing; any op not listed saves all its activation inputs (an upper bound).

A saved view keeps its base storage alive, so storage is what is counted: saving q, k and v split
from GPT-2's fused ``c_attn`` output costs that output once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from whalepy.passes.manager import PassContext
from whalepy.passes.shapes import (
    CREATION_OPS,
    NO_DATA_OPS,
    VIEW_OPS,
    nbytes,
    numel,
    op_name,
    requires_grad,
    storage_bytes,
    view_base,
)

_SAVES_NOTHING = frozenset({
    "add", "sub", "neg", "sum", "mean", "cat", "stack", "to", "contiguous", "clone", "pad",
    "constant_pad_nd", "expand", "repeat", "copy", "copy_", "wrap_with_set_grad_enabled",
    "wrap_with_autocast", "getitem", "alias", "flip", "roll", "tril", "triu", "zero_", "fill_",
    "scalar_tensor", "call_module", "cumsum", "repeat_interleave",
}) | VIEW_OPS | NO_DATA_OPS | CREATION_OPS
_SAVES_INPUT = frozenset({"gelu", "silu", "pow", "log", "sin", "cos", "erf", "log1p", "abs",
                          "mish", "softplus", "elu", "leaky_relu", "hardswish", "hardsigmoid"})
_SAVES_OUTPUT = frozenset({"relu", "tanh", "sigmoid", "exp", "sqrt", "rsqrt", "softmax",
                           "log_softmax", "reciprocal", "relu6", "threshold"})
_STAT_BYTES = 4  # norms keep fp32 per-row statistics


def _nodes(*xs: Any) -> list[fx.Node]:
    return [x for x in xs if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]


def _partner_saves(a: Any, b: Any) -> list[fx.Node]:
    return _nodes(a if requires_grad(b) else None, b if requires_grad(a) else None)


def saved_items(node: fx.Node, name: str) -> tuple[list[fx.Node], list[tuple[Any, int]]]:
    """What ``node``'s backward keeps: activation nodes, and synthetic ``(key, bytes)`` extras."""
    args = node.args
    out = node.meta.get("val")
    if name == "linear":
        return _nodes(args[0] if requires_grad(args[1]) else None), []
    if name in ("mm", "bmm", "matmul"):
        return _partner_saves(args[0], args[1]), []
    if name in ("addmm", "baddbmm"):
        return _partner_saves(args[1], args[2]), []
    if name == "conv":
        return _nodes(args[0] if requires_grad(args[1]) else None), []
    if name == "einsum":
        ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return _nodes(*ops), []
    if name == "sdpa":
        q = args[0].meta["val"]
        lse = math.prod(q.shape[:-1]) * _STAT_BYTES
        return _nodes(args[0], args[1], args[2], node), [((node, "lse"), lse)]
    if name in ("layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"):
        x = args[0]
        shape = args[1] if name in ("layer_norm", "rms_norm") and len(args) > 1 else None
        width = math.prod(shape) if isinstance(shape, (list, tuple)) else 1
        rows = numel(x.meta.get("val")) // max(width, 1)
        stats = (2 if name == "layer_norm" else 1) * rows * _STAT_BYTES
        return _nodes(x), [((node, "stats"), stats)]
    if name in _SAVES_INPUT:
        return _nodes(args[0]), []
    if name in _SAVES_OUTPUT:
        return [node], []
    if name == "mul":
        return _partner_saves(args[0], args[1]), []
    if name == "div":
        a, b = args[0], args[1]
        return _nodes(b, a if requires_grad(b) else None), []
    if name == "dropout":
        train = args[2] if len(args) > 2 else node.kwargs.get("train", True)
        p = args[1] if len(args) > 1 else node.kwargs.get("p", 0.5)
        return [], ([((node, "mask"), numel(out))] if train and p else [])
    if name == "embedding":
        return [a for a in _nodes(*args[:2]) if not a.meta["val"].is_floating_point()], []
    if name in ("index", "gather", "index_select", "where", "masked_fill", "nll_loss"):
        return [a for a in _nodes(*args[:3]) if not a.meta["val"].is_floating_point()], []
    if name == "cross_entropy":
        return _nodes(args[1]), [((node, "logprobs"), nbytes(args[0].meta.get("val")))]
    if name in _SAVES_NOTHING:
        return [], []
    return _nodes(*node.all_input_nodes), []


def _is_activation(node: fx.Node) -> bool:
    meta = view_base(node).meta
    return not ("whalepy.param" in meta or "whalepy.buffer" in meta or "whalepy.constant" in meta)


def count_bytes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Write ``whalepy.bytes``, ``whalepy.param_bytes`` and ``whalepy.saved_bytes`` (see module doc)."""
    saved: set[Any] = set()
    for node in ctx.nodes(gm):
        if node.op not in ("call_function", "call_method"):
            continue
        meta = node.meta
        name = op_name(node)
        out = meta.get("val")
        inputs = [n for n in dict.fromkeys(node.all_input_nodes)
                  if isinstance(n.meta.get("val"), torch.Tensor)]
        params = [n for n in inputs if "whalepy.param" in view_base(n).meta]
        meta["whalepy.param_bytes"] = sum(nbytes(n.meta["val"]) for n in params)
        if name in VIEW_OPS or name in NO_DATA_OPS or not isinstance(out, (torch.Tensor, tuple, list)):
            traffic = 0
        elif name == "to" and inputs and _same_layout(inputs[0].meta["val"], out):
            traffic = 0
        elif name in CREATION_OPS:
            traffic = nbytes(out)
        elif name == "embedding":
            traffic = 2 * nbytes(out) + sum(nbytes(n.meta["val"]) for n in inputs
                                            if not n.meta["val"].is_floating_point())
        else:
            traffic = sum(nbytes(n.meta["val"]) for n in inputs) + nbytes(out)
        meta["whalepy.bytes"] = traffic

        kept = 0
        if meta.get("whalepy.requires_grad"):
            nodes, extras = saved_items(node, name)
            block = meta.get("whalepy.block")
            for n in nodes:
                if not _is_activation(n):
                    continue
                key = (block, view_base(n))
                if key not in saved:
                    saved.add(key)
                    kept += storage_bytes(n)
            for key, size in extras:
                key = (block, key)
                if key not in saved:
                    saved.add(key)
                    kept += size
        meta["whalepy.saved_bytes"] = kept


def _same_layout(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.device == b.device)
