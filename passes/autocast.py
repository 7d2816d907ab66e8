"""What a block's memory-bound kernels move as the runtime runs them: forward and backward bytes, and,
under ``torch.autocast`` over fp32 parameters (the DDP and single-device paths in 16-bit), the bytes of
each tensor in the dtype autocast gives it and the casts autocast adds. Read by
:mod:`whalepy.passes.kernels`, after the ``memory`` pass (``whalepy.bytes``).

**Autocast's dtypes** (PyTorch, "Automatic Mixed Precision package", CUDA op reference): GEMMs,
convolutions and ``scaled_dot_product_attention`` run in 16-bit and cast their fp32 inputs (weights
included) to it; ``layer_norm``, ``group_norm``, ``rms_norm``, softmax, ``pow``, ``rsqrt``, ``exp``,
``log``, sums and the losses run in fp32 and upcast 16-bit inputs; every other op follows its inputs
(the widest floating input wins: an fp32 residual plus a 16-bit branch is fp32). Parameters, buffers,
embeddings and explicit ``.float()`` are fp32. Autocast caches the cast of a parameter for the forward
(one cast per parameter), not of an activation (each consuming GEMM casts it again: the three
projections of one attention each cast the norm's output, as the H200 trace shows).

**Backward** bytes per node (forward bytes ``f``): a residual ``add`` / ``sub`` passes its gradient on
(no kernel); a norm moves ``NORM_BACKWARD_RATIO f``; any other kernel
:data:`~whalepy.cost_models.compute.MEMORY_BOUND_BACKWARD_RATIO` ``f``. Also charged: the gradient
accumulation where a tensor feeds several ops that need its gradient (``k`` users: ``k - 1`` adds of
three tensors), and a linear layer's bias gradient (a reduction that reads ``dY``).
A dropout of probability 0 runs no kernel (``torch.dropout`` returns its input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from whalepy.ir.profile import MemoryBound
from whalepy.passes.shapes import (
    CREATION_OPS,
    NO_DATA_OPS,
    VIEW_OPS,
    nbytes,
    numel,
    op_name,
    requires_grad,
    view_base,
)

AUTOCAST_LOW_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "conv", "sdpa"})
"""Ops autocast runs in 16-bit (it casts their fp32 inputs)."""

AUTOCAST_FP32_OPS = frozenset({"layer_norm", "group_norm", "rms_norm", "softmax", "log_softmax", "cross_entropy",
                               "nll_loss", "pow", "rsqrt", "exp", "log", "log1p", "reciprocal", "sum", "cumsum",
                               "norm", "mse_loss", "embedding"})
"""Ops that run in fp32 under autocast (``embedding``: its fp32 table, not an autocast op)."""

NORM_OPS = frozenset({"layer_norm", "group_norm", "rms_norm", "batch_norm", "instance_norm"})

NORM_BACKWARD_RATIO = 2.5
"""Backward bytes of a normalisation kernel per forward byte: the input-gradient kernel reads ``dy``
and ``x`` and writes ``dx`` (three tensors), the weight / bias-gradient kernel reads ``dy`` and ``x``
again (two), against the forward's read and write (two). PyTorch's ``layer_norm_backward`` runs both
kernels (``layer_norm_grad_input_kernel``, ``GammaBetaBackward``: 64 us against 28 us forward per
``(4096, 2048)`` fp32 call on the H200 trace, a ratio of 2.3)."""

_PASS_THROUGH = frozenset({"add", "sub"})
"""Ops whose backward launches no kernel of its own (the gradient flows to both inputs as is)."""

LOW_BYTES = 2


def _is_param(node: Any) -> bool:
    while isinstance(node, fx.Node):
        if "whalepy.param" in node.meta or "whalepy.buffer" in node.meta:
            return True
        if op_name(node) not in VIEW_OPS or not node.args:
            return False
        node = node.args[0]
    return False


def _float_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in dict.fromkeys(node.all_input_nodes)
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()]


def autocast_low(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Per floating node: True where autocast runs it (its output) in 16-bit, False in fp32."""
    low: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        out = node.meta.get("val")
        if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
            if isinstance(out, (tuple, list)) and node.op in ("call_function", "call_method"):
                low[node] = op_name(node) in AUTOCAST_LOW_OPS  # multi-output ops (split, sdpa variants)
            continue
        name = op_name(node)
        ins = _float_inputs(node) if node.op in ("call_function", "call_method") else []
        if node.op != "call_function" and node.op != "call_method" or _is_param(node) and name in VIEW_OPS:
            low[node] = False  # placeholders, parameters, buffers
        elif name in AUTOCAST_LOW_OPS:
            low[node] = True
        elif name in AUTOCAST_FP32_OPS:
            low[node] = False
        elif name == "to":
            low[node] = out.dtype in (torch.float16, torch.bfloat16) or (
                out.dtype == ins[0].meta["val"].dtype and low.get(ins[0], False) if ins else False)
        elif name in CREATION_OPS or not ins:
            low[node] = out.dtype in (torch.float16, torch.bfloat16)
        elif name in VIEW_OPS or name == "getitem":
            low[node] = low.get(ins[0], False)
        else:
            low[node] = all(low.get(n, False) for n in ins)
    return low


def _bytes(node: fx.Node, low: dict[fx.Node, bool], amp: bool) -> float:
    v = node.meta.get("val")
    if not amp or not (isinstance(v, torch.Tensor) and v.is_floating_point()):
        return float(nbytes(v))
    return float(numel(v) * (LOW_BYTES if low.get(node, False) else 4))


def _dropout_noop(node: fx.Node) -> bool:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return not train or p == 0


def _grad_users(node: fx.Node) -> list[fx.Node]:
    """Ops that consume ``node`` (through views) and need its gradient, in graph order."""
    out: list[fx.Node] = []
    for u in node.users:
        if op_name(u) in VIEW_OPS:
            out += _grad_users(u)
        elif requires_grad(u):
            out.append(u)
    return out


def memory_bound(gm: fx.GraphModule, num_blocks: int, is_memory_node) -> list[MemoryBound]:  # type: ignore[no-untyped-def]
    """Per block, its :class:`MemoryBound` (module docstring). ``is_memory_node(node)``: whether the node is
    one of the block's memory-bound kernels (not a GEMM or attention call)."""
    from whalepy.cost_models.compute import MEMORY_BOUND_BACKWARD_RATIO

    low = autocast_low(gm)
    out = [MemoryBound() for _ in range(num_blocks)]
    cast_params: set[tuple[int, fx.Node]] = set()
    saved: set[Any] = set()
    for node in gm.graph.nodes:
        b = node.meta.get("whalepy.block")
        if b is None or node.op not in ("call_function", "call_method"):
            continue
        m = out[b]
        name = op_name(node)
        grad = requires_grad(node)
        if name in VIEW_OPS or name in NO_DATA_OPS:
            pass
        elif name == "dropout" and _dropout_noop(node):
            pass
        elif is_memory_node(node) and node.meta.get("whalepy.bytes", 0) > 0:
            f = float(node.meta["whalepy.bytes"])
            ins = [n for n in dict.fromkeys(node.all_input_nodes) if isinstance(n.meta.get("val"), torch.Tensor)]
            if name == "to":  # under autocast, a cast between the dtypes autocast gives (or none)
                src = ins[0] if ins else None
                same = src is not None and low.get(src, False) == low.get(node, False)
                fa = 0.0 if same else float(numel(node.meta.get("val")) * (4 + LOW_BYTES))
            elif name in CREATION_OPS:
                fa = _bytes(node, low, True)
            elif name == "embedding":
                fa = f  # fp32 table rows, written fp32
            else:
                fa = sum(_bytes(n, low, True) for n in ins) + _bytes(node, low, True)
            ratio = (0.0 if name in _PASS_THROUGH else NORM_BACKWARD_RATIO if name in NORM_OPS
                     else MEMORY_BOUND_BACKWARD_RATIO) if grad else 0.0
            m.fwd += f
            m.amp_fwd += fa
            m.bwd += ratio * f
            m.amp_bwd += ratio * fa
        # autocast's casts around this op
        ins = _float_inputs(node)
        if name in AUTOCAST_LOW_OPS:
            for n in ins:
                if low.get(n, False):
                    continue
                if _is_param(n):
                    if (b, n) not in cast_params:
                        cast_params.add((b, n))
                        m.cast_param += numel(n.meta["val"])
                        m.cast_launches_fwd += 1
                        if requires_grad(n):
                            m.cast_param_grad += numel(n.meta["val"])
                            m.cast_launches_bwd += 1
                else:
                    m.cast_act += numel(n.meta["val"])
                    m.cast_launches_fwd += 1
                    if requires_grad(n):
                        m.cast_act_grad += numel(n.meta["val"])
                        m.cast_launches_bwd += 1
        elif name in AUTOCAST_FP32_OPS and name != "embedding":
            for n in ins:
                if low.get(n, False):
                    m.upcast_act += numel(n.meta["val"])
                    m.cast_launches_fwd += 1
                    m.cast_launches_bwd += int(requires_grad(n))
        elif grad and not low.get(node, True) and name not in VIEW_OPS and name != "to":
            for n in ins:  # a 16-bit input of an fp32 element-wise op: its gradient is cast down
                if low.get(n, False) and requires_grad(n):
                    m.mixed_grad_casts += numel(n.meta["val"])
                    m.cast_launches_bwd += 1
        if not grad:
            continue
        m.amp_saved += _amp_saved(node, name, b, low, saved)
        # bias gradient of a linear layer: a reduction over dY
        if name in ("linear", "addmm"):
            bias = (node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")) if name == "linear" \
                else node.args[0]
            if isinstance(bias, fx.Node) and requires_grad(bias):
                m.bwd += float(nbytes(node.meta.get("val")))
                m.amp_bwd += float(numel(node.meta.get("val")) * LOW_BYTES)
        # gradient accumulation over several users: each user past the first adds its gradient in its
        # own backward, so each is charged to its own block (a layer's output is accumulated in the next
        # layer's backward; T5's position bias in every layer that reads it): every layer of a run is
        # then charged alike, whatever block precedes or follows it
        users = _grad_users(node)
        if len(users) > 1 and name not in VIEW_OPS:
            one, one_amp = 3.0 * nbytes(node.meta.get("val")), 3.0 * _bytes(node, low, True)
            for u in users[1:]:
                ub = u.meta.get("whalepy.block")
                acc = out[ub] if isinstance(ub, int) and 0 <= ub < num_blocks else m
                acc.bwd += one
                acc.amp_bwd += one_amp
    return out



def _amp_saved(node: fx.Node, name: str, block: int, low: dict[fx.Node, bool], seen: set[Any]) -> float:
    from whalepy.passes.memory import _is_activation, saved_items

    nodes, extras = saved_items(node, name)
    kept = 0.0
    for n in nodes:
        if not _is_activation(n):
            continue
        if name in AUTOCAST_LOW_OPS and n is not node and not low.get(n, False):
            kept += numel(n.meta["val"]) * LOW_BYTES  # the op's own cast copy
            continue
        base = view_base(n)
        key = (block, base)
        if key not in seen:
            seen.add(key)
            v = base.meta.get("val")
            kept += (numel(v) * (LOW_BYTES if low.get(base, False) else 4)
                     if isinstance(v, torch.Tensor) and v.is_floating_point() else nbytes(v))
    for key, size in extras:
        key = (block, key)
        if key not in seen:
            seen.add(key)
            kept += size
    return kept
