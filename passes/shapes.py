"""Shapes, dtypes and op names of captured nodes, shared by the analysis passes.

Both capture paths leave a tensor (a FakeTensor or a meta tensor) in ``node.meta["val"]``:
``torch.export`` does it itself, the ``symbolic_trace`` fallback gets it from
:func:`propagate_fake_shapes`. Everything else in ``whalepy.passes`` reads shapes from there.

Op names are normalised so that one table serves both capture paths: ``aten.linear.default``,
``torch.nn.functional.linear`` and ``Tensor.linear`` all read ``"linear"``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from whalepy.passes.manager import PassContext

# Canonical names for ops that have several spellings (aten overloads, functional, methods,
# Python operators). Names not listed here are used as they are.
_ALIASES = {
    "truediv": "div", "true_divide": "div", "div_": "div", "floordiv": "floor_divide",
    "iadd": "add", "add_": "add", "isub": "sub", "sub_": "sub", "imul": "mul", "mul_": "mul",
    "rsub": "sub", "_softmax": "softmax", "_log_softmax": "log_softmax", "softmax_": "softmax",
    "native_layer_norm": "layer_norm", "_fused_rms_norm": "rms_norm",
    "native_dropout": "dropout", "feature_dropout": "dropout", "alpha_dropout": "dropout",
    "_unsafe_view": "view", "_reshape_alias": "view", "view_as": "view", "reshape_as": "view",
    "reshape": "view", "flatten": "view", "unflatten": "view", "squeeze": "view",
    "unsqueeze": "view", "view_copy": "view", "expand_as": "expand",
    "swapaxes": "transpose", "swapdims": "transpose", "numpy_T": "t",
    "_to_copy": "to", "type_as": "to", "float": "to", "half": "to", "bfloat16": "to",
    "double": "to", "type": "to", "_assert_tensor_metadata": "assert",
    "_assert_scalar": "assert", "sym_constrain_range_for_size": "assert",
    "convolution": "conv", "_convolution": "conv", "conv1d": "conv", "conv2d": "conv",
    "conv3d": "conv", "conv_transpose1d": "conv", "conv_transpose2d": "conv",
    "conv_transpose3d": "conv",
    "_scaled_dot_product_flash_attention": "sdpa",
    "_scaled_dot_product_efficient_attention": "sdpa",
    "_scaled_dot_product_cudnn_attention": "sdpa",
    "_scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "_scaled_dot_product_fused_attention_overrideable": "sdpa",
    "scaled_dot_product_attention": "sdpa", "_flash_attention_forward": "sdpa",
    "_efficient_attention_forward": "sdpa",
    "cross_entropy_loss": "cross_entropy", "nll_loss_forward": "nll_loss",
    "nll_loss_nd": "nll_loss", "nll_loss2d": "nll_loss", "__and__": "logical_and",
    "__or__": "logical_or", "bitwise_and": "logical_and", "bitwise_or": "logical_or",
    "masked_fill_": "masked_fill", "lift_fresh_copy": "clone", "detach_": "detach",
}

VIEW_OPS = frozenset({
    "view", "expand", "transpose", "t", "permute", "movedim", "alias", "slice", "select",
    "split", "split_with_sizes", "chunk", "unbind", "getitem", "detach", "as_strided",
    "diagonal", "narrow", "unfold",
})
"""Ops that return views: no memory traffic, no FLOPs; a saved view keeps its base alive."""

NO_DATA_OPS = frozenset({"assert", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
                         "size", "dim", "_set_grad_enabled", "output"})
"""Ops that move no tensor data at all."""

CREATION_OPS = frozenset({
    "arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full",
    "new_empty", "zeros_like", "ones_like", "full_like", "empty_like", "scalar_tensor",
    "rand", "randn", "rand_like", "randn_like", "tensor", "linspace", "eye", "tril_indices",
    "empty_strided", "lift_fresh",
})
"""Ops whose output does not depend on their tensor inputs' values (write-only, no grad)."""

_NO_GRAD_OPS = frozenset({"detach", "argmax", "argmin", "sort_indices", "bucketize"})

_NAME_CACHE: dict[Any, str] = {}


def op_name(node: fx.Node) -> str:
    """Canonical name of what ``node`` computes (``""`` for placeholders, get_attr and output)."""
    if node.op == "call_method":
        return _ALIASES.get(node.target, node.target)
    if node.op == "call_module":
        return "call_module"
    if node.op != "call_function":
        return node.op if node.op == "output" else ""
    target = node.target
    try:
        return _NAME_CACHE[target]
    except (KeyError, TypeError):
        pass
    if isinstance(target, torch._ops.OpOverload):
        raw = target._opname
    elif isinstance(target, torch._ops.HigherOrderOperator):
        raw = target.name()
    elif target is operator.getitem:
        raw = "getitem"
    else:
        raw = getattr(target, "__name__", str(target))
    name = _ALIASES.get(raw, raw)
    try:
        _NAME_CACHE[target] = name
    except TypeError:
        pass
    return name


def val(node: Any) -> Any:
    """The example value recorded for ``node`` (a tensor, a tuple of them, a scalar) or None."""
    if isinstance(node, fx.Node):
        return node.meta.get("val")
    return None


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def nbytes(t: Any) -> int:
    """Bytes of a tensor or of every tensor in a (nested) tuple/list; 0 for anything else."""
    if isinstance(t, torch.Tensor):
        return int(t.numel()) * t.element_size()
    if isinstance(t, (tuple, list)):
        return sum(nbytes(x) for x in t)
    return 0


def numel(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return int(t.numel())
    if isinstance(t, (tuple, list)):
        return sum(numel(x) for x in t)
    return 0


def tensor_inputs(node: fx.Node) -> Iterator[fx.Node]:
    """Distinct input nodes of ``node`` whose value is a tensor, in argument order."""
    seen: set[fx.Node] = set()
    for n in node.all_input_nodes:
        if n not in seen and isinstance(n.meta.get("val"), torch.Tensor):
            seen.add(n)
            yield n


def is_param(node: Any) -> bool:
    return isinstance(node, fx.Node) and "whalepy.param" in node.meta


def view_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` is a view of (``node`` itself when it is not a view).

    ``getitem`` is a view only of a view op's result (``split``); an item of a tuple that an op
    computed (``native_layer_norm``'s outputs) is its own storage.
    """
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        name = op_name(node)
        if name not in VIEW_OPS:
            break
        src = node.args[0]
        if name == "getitem" and op_name(src) not in VIEW_OPS:
            break
        node = src
    return node


def storage_bytes(node: fx.Node) -> int:
    """Bytes of the storage that ``node``'s value (possibly a view) keeps alive."""
    return nbytes(view_base(node).meta.get("val"))


# --- recognising layers ----------------------------------------------------------------------

INDEX_VIEWS = frozenset({"view", "expand", "to", "clone", "contiguous", "alias", "slice",
                          "select", "detach", "getitem", "transpose", "permute"})
"""Ops an embedding's indices may pass through and still be "the model's token input"."""


def param_fqn(node: Any) -> str | None:
    return view_base(node).meta.get("whalepy.param") if isinstance(node, fx.Node) else None


def owner(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def weight_module(node: fx.Node, weight: fx.Node) -> str:
    """The module whose weight ``node`` uses: of the weight's aliases (tied weights have several),
    the one owned by the module ``node`` runs in, else the first one owned below it, else the
    weight's own FQN owner."""
    base = view_base(weight)
    fqn = base.meta["whalepy.param"]
    owners = [owner(a) for a in base.meta.get("whalepy.param_aliases", (fqn,))]
    here = node.meta.get("whalepy.module_path", "")
    if here in owners:
        return here
    below = [o for o in owners if here and o.startswith(here + ".")]
    return below[0] if below else owner(fqn)


def as_linear(node: fx.Node) -> tuple[fx.Node, int, int, str, int] | None:
    """``(input, in_features, out_features, module, contraction dim of input)`` for a weight matmul."""
    name = op_name(node)
    if name == "linear":
        x, w = node.args[0], node.args[1]
        fqn, wv = param_fqn(w), val(w)
        if fqn and isinstance(wv, torch.Tensor) and wv.ndim == 2:
            return x, int(wv.shape[1]), int(wv.shape[0]), weight_module(node, w), val(x).ndim - 1
    elif name in ("addmm", "mm", "matmul"):
        x, w = (node.args[1], node.args[2]) if name == "addmm" else (node.args[0], node.args[1])
        fqn, wv = param_fqn(w), val(w)
        if fqn and isinstance(wv, torch.Tensor) and wv.ndim == 2 and param_fqn(x) is None:
            return x, int(wv.shape[0]), int(wv.shape[1]), weight_module(node, w), val(x).ndim - 1
    return None


def embedding_parts(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    weight = indices = None
    for a in node.args[:2]:
        v = val(a)
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                weight = a
            else:
                indices = a
    if weight is None or indices is None or not param_fqn(weight):
        return None
    return weight, indices


def is_token_input(idx: fx.Node) -> bool:
    """Whether embedding indices are (a view of) an integer model input."""
    node = idx
    while node.op == "call_function" and op_name(node) in INDEX_VIEWS and node.args:
        if not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return node.op == "placeholder" and "whalepy.input" in node.meta


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of ``node``: aten, functional and method forms alike."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def reshape_dim(a: tuple[int, ...], b: tuple[int, ...], d: int) -> tuple[int | None, int | None]:
    """Where dim ``d`` of shape ``a`` goes when viewed as ``b``: ``(new dim, size of a new split-off
    outer dim or None)``; ``(None, None)`` when the sharding cannot follow (it would become strided)."""
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            gi.append(i); pa *= a[i]; i += 1  # noqa: E702
        if j < len(b):
            gj.append(j); pb *= b[j]; j += 1  # noqa: E702
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i); pa *= a[i]; i += 1  # noqa: E702
            elif pb < pa and j < len(b):
                gj.append(j); pb *= b[j]; j += 1  # noqa: E702
            else:
                return None, None
        if d in gi:
            big_a = [k for k in gi if a[k] != 1]
            big_b = [k for k in gj if b[k] != 1]
            if not big_a or big_a[0] != d or not big_b:
                return None, None
            return big_b[0], (b[big_b[0]] if len(big_b) > 1 else None)
    return None, None


def mark_requires_grad(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Write ``node.meta["whalepy.requires_grad"]``: whether autograd tracks the node's output.

    Trainable parameters start it; it flows through every differentiable op whose output is a
    floating-point tensor; ``torch.no_grad`` regions (export's ``wrap_with_set_grad_enabled``
    with ``False``), ``detach`` and creation ops stop it.
    """
    for node in ctx.nodes(gm):
        meta = node.meta
        if node.op in ("placeholder", "get_attr"):
            meta["whalepy.requires_grad"] = bool(meta.get("whalepy.param_requires_grad", False))
            continue
        if node.op == "output":
            continue
        name = op_name(node)
        out = meta.get("val")
        if name == "getitem":
            src = node.args[0]
            meta["whalepy.requires_grad"] = bool(
                isinstance(src, fx.Node) and src.meta.get("whalepy.requires_grad")
                and _floating(out))
            continue
        if name in _NO_GRAD_OPS or name in CREATION_OPS or not _floating(out):
            meta["whalepy.requires_grad"] = False
            continue
        if name == "wrap_with_set_grad_enabled" and node.args and node.args[0] is False:
            meta["whalepy.requires_grad"] = False
            continue
        meta["whalepy.requires_grad"] = any(
            n.meta.get("whalepy.requires_grad", False) for n in node.all_input_nodes)


def requires_grad(node: Any) -> bool:
    return isinstance(node, fx.Node) and bool(node.meta.get("whalepy.requires_grad", False))


def _floating(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, (tuple, list)):
        return any(_floating(x) for x in out)
    return False


def propagate_fake_shapes(gm: fx.GraphModule, inputs: list[Any]) -> None:
    """Fill ``node.meta["val"]`` on a ``symbolic_trace`` graph by running it on fake tensors.

    Real parameters are converted to fake ones, so nothing is computed and nothing is allocated;
    meta-device models work as they are.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
