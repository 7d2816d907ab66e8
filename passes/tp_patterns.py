"""Tensor-parallel patterns found from the graph's dataflow (Megatron-LM's column-then-row split).

For each block, a forward propagation follows "this tensor is sharded along dim d" from every
linear layer whose input is replicated (a candidate **column-parallel** layer: its output features
sharded) through the ops that preserve such a sharding:

- views and reshapes (a sharded feature dim that is split into ``[heads, head_dim]`` moves to the
  heads dim, and the number of heads becomes a divisibility constraint; merges keep it outermost),
  transposes, permutes, full slices, fused-q/k/v ``split`` along the sharded dim (GPT-2's
  ``c_attn``: each chunk's size becomes a constraint);
- elementwise ops whose other operands are scalars, broadcast along the sharded dim (rotary
  ``cos``/``sin``, masks) or sharded the same way (a gating ``silu(gate) * up`` joins the two
  linears into one group);
- attention (``scaled_dot_product_attention`` or eager ``matmul``/``softmax``) with q, k and v
  sharded along the same heads dim (GQA's fewer KV heads add their own constraint);
- a linear layer whose input is sharded along its contraction dim ends the pattern: it is
  **row-parallel**, and its output is what tensor parallelism all-reduces.

Anything else that meets a sharded tensor (a norm or reduction over the sharded dim, a residual add
with a full-width tensor, a block boundary) spoils that group: its linears stay replicated. A group
whose sharded output reaches the logits (a single linear with ``vocab`` output features, ``vocab``
being the size of the token embedding) and then the loss or the graph output is the LM head,
**column-parallel** with the loss computed on vocab shards (``loss_parallel``).

Embeddings: ``aten.embedding`` whose indices are (a view of) an integer model input, with the largest
such table, is the token embedding, sharded along the vocabulary (**VOCAB**); other embeddings
(positions, token types, relative-position buckets) are **REPLICATE**.

GPT-2's ``Conv1D`` (weight ``[in, out]``, lowered to ``aten.addmm``) is recognised like
``nn.Linear``; the rule records the style only, the runtime handles the class.

**Sequence parallelism** (Korthikanti et al. 2022), only with ``sequence_parallel=True``
(``build_profile(..., sequence_parallel=True)``; off by default so existing plans are unchanged): in a
block with a pattern, a **norm** is the set of nodes of one module path that hold ``aten.layer_norm``
/ ``aten.rms_norm`` or the RMS-norm op sequence (``mean`` and ``rsqrt``, as HF's ``LlamaRMSNorm``
traces). A norm whose output (one node) feeds only COLWISE linears sits on the residual stream between
a row-parallel output and the next column-parallel input; it gets a **SEQUENCE** rule and the
sequence length becomes a divisibility constraint. A block with a column-then-row pair in which some
COLWISE input does not come from such a norm (a post-norm block, a colwise layer fed by the residual
stream directly) records why in :attr:`BlockTP.sp_problem`; ``build_profile`` raises ``PlanError``
for it and adds the SEQUENCE rule that marks where the residual stream enters the sequence-parallel
region (the first TP layer's module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from whalepy.errors import AnnotationError
from whalepy.passes.manager import PassContext
from whalepy.passes.shapes import (
    NO_DATA_OPS,
    arg,
    as_linear,
    embedding_parts,
    is_token_input,
    nbytes,
    norm_dim,
    op_name,
    reshape_dim,
    val,
    weight_module,
)
from whalepy.ir.plan import TPRule, TPStyle
from whalepy.ir.profile import BlockAnnotations

TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)

_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "pow", "neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp",
    "log", "sqrt", "rsqrt", "where", "masked_fill", "dropout", "clamp", "clamp_min", "clamp_max",
    "abs", "erf", "sin", "cos", "reciprocal", "square", "maximum", "minimum", "to", "contiguous",
    "clone", "alias", "detach", "logical_and", "logical_or", "eq", "ne", "lt", "le", "gt", "ge",
    "softplus", "mish", "elu", "leaky_relu", "hardswish", "hardsigmoid", "relu6", "log1p",
    "expm1", "sign", "floor_divide", "remainder", "fmod",
})
_KEEP_FEATURES = frozenset({"view", "reshape", "to", "contiguous", "clone", "alias", "detach",
                            "_to_copy", "transpose", "permute", "unsqueeze", "squeeze"})
_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "var", "std", "norm", "max", "min",
                         "logsumexp", "prod"})


@dataclass(slots=True)
class BlockTP:
    """The tensor-parallel pattern of one block."""

    rules: tuple[TPRule, ...] = ()
    comm_bytes: int = 0
    backward_comm_bytes: int = 0
    """Bytes all-reduced per backward: the input gradient of the COLWISE modules (its input is
    replicated over the TP group): once per input that plain ``nn.Linear`` siblings share (q, k and v
    read one), once per call of a fused or Conv1D projection."""
    gather_bytes: int = 0
    """Bytes all-gathered per forward: the output of every COLWISE module no ROWWISE module reads (an
    LM head's logits, gathered to every rank)."""
    dims: tuple[tuple[str, str, int], ...] = ()
    """Sharded dims as ``(module path, what, size)``: every TP degree must divide each size."""
    degrees: tuple[int, ...] = TP_DEGREES
    sp_exit: bool = False
    """A SEQUENCE norm of this block feeds a COLWISE module with no ROWWISE sibling (the LM head): the
    sequence-parallel region ends here (set only with ``sequence_parallel=True``)."""
    sp_problem: str | None = None
    """Why this block's pattern cannot run sequence parallel (only with ``sequence_parallel=True``)."""
    whole: tuple[tuple[str, str], ...] = ()
    """``(module path, why)`` for each module of the block with parameters that no rule shards: no
    pattern, fused layout unsupported, ... (what ``ModelProfile.tp_report()`` lists)."""

    @property
    def has_pattern(self) -> bool:
        return any(r.style in (TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.VOCAB) for r in self.rules)


@dataclass(slots=True)
class _Group:
    sources: list[fx.Node] = field(default_factory=list)
    sinks: list[fx.Node] = field(default_factory=list)
    dims: list[tuple[str, str, int]] = field(default_factory=list)
    bad: str | None = None
    logits: bool = False
    parts: dict[fx.Node, int] = field(default_factory=dict)
    """Fused COLWISE sources: output features split by the model into this many equal pieces."""


class _Groups:
    """Union-find over sharding groups."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.data: list[_Group] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        self.data.append(_Group())
        return len(self.parent) - 1

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def get(self, g: int) -> _Group:
        return self.data[self.find(g)]

    def union(self, gids: list[int]) -> int:
        roots = list(dict.fromkeys(self.find(g) for g in gids))
        root = roots[0]
        for r in roots[1:]:
            self.parent[r] = root
            a, b = self.data[root], self.data[r]
            a.sources += b.sources
            a.sinks += b.sinks
            a.dims += b.dims
            a.bad = a.bad or b.bad
            a.logits = a.logits or b.logits
            a.parts.update(b.parts)
        return root

    def spoil(self, gids: Any, reason: str) -> None:
        for g in gids:
            grp = self.get(g)
            grp.bad = grp.bad or reason


def vocab_sizes(gm: fx.GraphModule) -> set[int]:
    """Vocabulary size of the token embedding(s): the largest table indexed by (a view of) an integer
    model input. Smaller ones indexed by inputs too (BERT's ``token_type_ids``, GPT-2's
    ``position_ids`` when passed) are not vocabularies. Empty when there is none."""
    sizes = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) == "embedding":
            parts = embedding_parts(node)
            if parts and is_token_input(parts[1]):
                sizes.add(int(val(parts[0]).shape[0]))
    return {max(sizes)} if sizes else set()


class _Propagation:
    """Sharding propagation over one block's nodes (see the module docstring)."""

    def __init__(self, block: int, vocab: set[int], ctx: PassContext) -> None:
        self.ctx = ctx
        self.block = block
        self.vocab = vocab
        self.groups = _Groups()
        self.state: dict[fx.Node, tuple[int, int]] = {}
        self.reason: str | None = None
        """Why the last handler refused (set by handlers that know better than the op's name)."""

    def run(self, nodes: list[fx.Node]) -> None:
        for node in nodes:
            self.ctx.node = node
            self.step(node)
        for node, (dim, gid) in self.state.items():
            self.ctx.node = node
            for user in node.users:
                if user.op == "output" or user.meta.get("whalepy.block", self.block) != self.block:
                    if not self._logits(gid, node, dim):
                        self.groups.spoil([gid], f"a sharded {op_name(node)} output leaves the block")

    def _logits(self, gid: int, node: fx.Node, dim: int) -> bool:
        grp = self.groups.get(gid)
        v = val(node)
        if len(grp.sources) != 1 or not isinstance(v, torch.Tensor) or dim != v.ndim - 1:
            return False
        lin = as_linear(grp.sources[0])
        if lin is None or lin[2] not in self.vocab or v.shape[dim] != lin[2]:
            return False
        grp.logits = True
        return True

    def _sharded(self, node: fx.Node) -> list[tuple[fx.Node, int, int]]:
        out = []
        for a in node.all_input_nodes:
            st = self.state.get(a)
            if st is not None:
                out.append((a, st[0], st[1]))
        return out

    def step(self, node: fx.Node) -> None:
        if node.op not in ("call_function", "call_method"):
            return
        lin = as_linear(node)
        if lin is not None:
            self._linear(node, lin)
            return
        ins = self._sharded(node)
        if not ins:
            return
        name = op_name(node)
        gids = [g for _, _, g in ins]
        if name in NO_DATA_OPS:
            return
        handler = getattr(self, f"_op_{name}", None)
        if handler is None and name in _ELEMENTWISE:
            handler = self._elementwise
        if handler is None and name in _REDUCTIONS:
            handler = self._reduction
        self.reason = None
        result = handler(node, ins) if handler is not None else None
        if result is None:
            self.groups.spoil(gids, self.reason or f"{name} does not keep the sharding")
            return
        dim, extra = result
        root = self.groups.union(gids)
        if extra is not None:
            self.groups.get(root).dims.append(extra)
        if dim is not None:
            self.state[node] = (dim, root)

    # -- weight matmuls ---------------------------------------------------------------------

    def _linear(self, node: fx.Node, lin: tuple[fx.Node, int, int, str, int]) -> None:
        x, in_f, out_f, module, cdim = lin
        st = self.state.get(x)
        others = [a for a in node.all_input_nodes if a is not x and a in self.state]
        if others:
            self.groups.spoil([self.state[a][1] for a in others] + ([st[1]] if st else []),
                              f"sharded weight in {op_name(node)}")
            return
        out = val(node)
        if st is None:
            gid = self.groups.new()
            grp = self.groups.get(gid)
            grp.sources.append(node)
            grp.dims.append((module, "output features", out_f))
            self.state[node] = (out.ndim - 1, gid)
        elif st[0] == cdim:
            grp = self.groups.get(st[1])
            grp.sinks.append(node)
            grp.dims.append((module, "input features", in_f))
        elif st[0] < cdim and out.ndim == val(x).ndim:
            self.state[node] = st  # linear over an unsharded dim (per-head projection)
        else:
            self.groups.spoil([st[1]], f"{op_name(node)} sharded on a row dim")

    # -- shape ops ----------------------------------------------------------------------------

    def _op_view(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        a, b = tuple(val(src).shape), tuple(val(node).shape)
        new, split = reshape_dim(a, b, dim)
        if new is None:
            return None
        extra = None
        if split is not None:
            what = "heads" if dim == len(a) - 1 else "split dim"
            extra = (node.meta.get("whalepy.module_path", ""), what, int(split))
        return new, extra

    def _op_expand(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        return dim + val(node).ndim - val(src).ndim, None

    def _op_transpose(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        nd = val(src).ndim
        d0, d1 = norm_dim(arg(node, 1, "dim0"), nd), norm_dim(arg(node, 2, "dim1"), nd)
        return (d1 if dim == d0 else d0 if dim == d1 else dim), None

    def _op_t(self, node: fx.Node, ins: list) -> tuple | None:
        return 1 - ins[0][1], None

    def _op_permute(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        order = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = [norm_dim(d, val(src).ndim) for d in order]
        return dims.index(dim), None

    def _op_slice(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        at = norm_dim(arg(node, 1, "dim", 0), val(src).ndim)
        if at == dim and val(node).shape[dim] != val(src).shape[dim]:
            self.reason = (f"fused layout unsupported: {op_name(node)} takes a part of the sharded features "
                           f"({val(node).shape[dim]} of {val(src).shape[dim]}) by slicing")
            return None
        return dim, None

    def _op_select(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        at = norm_dim(arg(node, 1, "dim"), val(src).ndim)
        if at == dim:
            return None
        return (dim - 1 if at < dim else dim), None

    def _op_split(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, gid = ins[0]
        at = norm_dim(arg(node, 2, "dim", 0), val(src).ndim)
        if at == dim:
            # a fused projection ([q | k | v], [gate | up]) split apart along the sharded features: each
            # piece must be sharded on its own, so the linear that made it is found and marked
            sizes = [int(v.shape[dim]) for v in val(node)]
            source = self._fused_source(src, dim)
            if source is None:
                self.reason = f"fused layout unsupported: {op_name(node)} splits features that no single linear layer produced"
                return None
            if len(set(sizes)) != 1:
                self.reason = (f"fused layout unsupported: {as_linear(source)[3]}'s output is split into unequal pieces "
                                          f"{sizes}")
                return None
            grp = self.groups.get(gid)
            grp.parts[source] = max(grp.parts.get(source, 1), len(sizes))
            path = node.meta.get("whalepy.module_path", "")
            grp.dims.append((path, "features per fused chunk", sizes[0]))
        return dim, None

    def _fused_source(self, node: fx.Node, dim: int) -> fx.Node | None:
        """The linear whose output ``node`` is, through ops that keep the sharded features whole."""
        width = val(node).shape[dim]
        while as_linear(node) is None:
            ins = self._sharded(node)
            if len(ins) != 1 or op_name(node) not in _KEEP_FEATURES:
                return None
            node = ins[0][0]
            if val(node).shape[self.state[node][0]] != width:
                return None
        return node

    _op_split_with_sizes = _op_split
    _op_chunk = _op_split

    def _op_getitem(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        sv, out = val(src), val(node)
        if isinstance(sv, torch.Tensor):  # tensor indexing (symbolic_trace's x[..., :n])
            same = isinstance(out, torch.Tensor) and out.ndim == sv.ndim
            if not same or out.shape[dim] != sv.shape[dim]:
                return None
        return dim, None

    def _op_cat(self, node: fx.Node, ins: list) -> tuple | None:
        tensors = node.args[0]
        nd = val(node).ndim
        at = norm_dim(arg(node, 1, "dim", 0), nd)
        dims = {self.state[t][0] if t in self.state else None for t in tensors}
        if len(dims) != 1 or None in dims or at in dims:
            return None
        return dims.pop(), None

    # -- compute ------------------------------------------------------------------------------

    def _elementwise(self, node: fx.Node, ins: list) -> tuple | None:
        out = val(node)
        if not isinstance(out, torch.Tensor):
            return None
        dims = {d + out.ndim - val(a).ndim for a, d, _ in ins}
        if len(dims) != 1:
            return None
        dim = dims.pop()
        for a in node.all_input_nodes:
            v = val(a)
            if a in self.state or not isinstance(v, torch.Tensor):
                continue
            ad = dim - (out.ndim - v.ndim)
            if ad >= 0 and v.shape[ad] != 1:
                return None  # full-width replicated operand (a residual add)
        return dim, None

    def _reduction(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        nd = val(src).ndim
        dims = arg(node, 1, "dim")
        if dims is None:
            return None
        dims = [norm_dim(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        keep = arg(node, 2, "keepdim", False)
        if dim in dims:
            return None
        return (dim if keep else dim - sum(d < dim for d in dims)), None

    def _op_softmax(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, gid = ins[0]
        at = norm_dim(arg(node, 1, "dim"), val(src).ndim)
        if at == dim:
            return (None, None) if self._logits(gid, src, dim) else None
        return dim, None

    _op_log_softmax = _op_softmax

    def _op_cross_entropy(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, gid = ins[0]
        if src is node.args[0] and self._logits(gid, src, dim):
            return None, None
        return None

    _op_nll_loss = _op_cross_entropy

    def _op_layer_norm(self, node: fx.Node, ins: list) -> tuple | None:
        src, dim, _ = ins[0]
        shape = arg(node, 1, "normalized_shape", ())
        width = len(shape) if isinstance(shape, (list, tuple)) else 1
        if src is not node.args[0] or dim >= val(src).ndim - width:
            return None
        return dim, None

    _op_rms_norm = _op_layer_norm

    def _op_sdpa(self, node: fx.Node, ins: list) -> tuple | None:
        q, k, v = node.args[:3]
        states = [self.state.get(t) for t in (q, k, v)]
        if any(s is None for s in states) or len({s[0] for s in states}) != 1:
            return None
        dim = states[0][0]
        if dim >= val(q).ndim - 2:
            return None
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        mv = val(mask)
        if isinstance(mv, torch.Tensor) and mask not in self.state:
            md = dim - (val(q).ndim - mv.ndim)
            if md >= 0 and mv.shape[md] != 1:
                return None  # a per-head bias that is not sharded (T5's position bias)
        path = node.meta.get("whalepy.module_path", "")
        grp = self.groups.get(states[0][1])
        grp.dims.append((path, "attention heads", int(val(q).shape[dim])))
        if val(k).shape[dim] != val(q).shape[dim]:
            grp.dims.append((path, "key/value heads", int(val(k).shape[dim])))
        return dim, None

    def _op_matmul(self, node: fx.Node, ins: list) -> tuple | None:
        a, b = node.args[0], node.args[1]
        va, vb, out = val(a), val(b), val(node)
        if va.ndim < 2 or vb.ndim < 2:
            return None
        found = set()
        for t, v, row, col in ((a, va, va.ndim - 2, None), (b, vb, None, vb.ndim - 1)):
            st = self.state.get(t)
            if st is None:
                continue
            d = st[0]
            if d == row:
                found.add(out.ndim - 2)
            elif d == col:
                found.add(out.ndim - 1)
            elif d < v.ndim - 2:
                found.add(d + out.ndim - v.ndim)
            else:
                return None  # sharded contraction dim: a partial sum
        if len(found) != 1:
            return None
        dim = found.pop()
        if dim < out.ndim - 2:
            for t, v in ((a, va), (b, vb)):
                if t not in self.state and v.shape[dim - (out.ndim - v.ndim)] != 1:
                    return None
        elif a in self.state and b in self.state:
            return None
        return dim, None

    _op_bmm = _op_matmul


def _degrees(dims: list[tuple[str, str, int]]) -> tuple[int, ...]:
    return tuple(t for t in TP_DEGREES if all(size % t == 0 for _, _, size in dims))


def find_tp_patterns(gm: fx.GraphModule, ctx: PassContext, *, sequence_parallel: bool = False) -> None:
    """Write ``gm.meta["whalepy.tp"]`` (one :class:`BlockTP` per block, in block order) and
    ``node.meta["whalepy.tp_style"]`` on the linear and embedding nodes that have a style.
    ``sequence_parallel=True`` adds SEQUENCE rules for the norms (see the module docstring)."""
    blocks = gm.meta["whalepy.blocks"]
    vocab = vocab_sizes(gm)
    per_block: list[list[fx.Node]] = [[] for _ in blocks]
    for node in ctx.nodes(gm):
        b = node.meta.get("whalepy.block")
        if b is not None:
            per_block[b].append(node)
    result = []
    for index, nodes in enumerate(per_block):
        prop = _Propagation(index, vocab, ctx)
        prop.run(nodes)
        tp = _summarise(prop, nodes, vocab)
        tp = _mark_inplace_outputs(tp, nodes)
        tp = _whole_modules(tp, prop, nodes)
        if sequence_parallel and tp.has_pattern:
            tp = _sequence_rules(tp, nodes)
        result.append(tp)
    gm.meta["whalepy.tp"] = result


def _summarise(prop: _Propagation, nodes: list[fx.Node], vocab: set[int]) -> BlockTP:
    styles: dict[str, TPStyle] = {}
    fused: dict[str, int] = {}
    paired: set[str] = set()
    dims: list[tuple[str, str, int]] = []
    comm = backward = gather = 0
    shared: set[tuple[str, fx.Node]] = set()  # (parent module, input) of plain column-parallel linears
    seen: set[int] = set()
    for gid in range(len(prop.groups.parent)):
        root = prop.groups.find(gid)
        if root in seen:
            continue
        seen.add(root)
        grp = prop.groups.data[root]
        if grp.bad or not (grp.sinks or grp.logits):
            continue
        for node in grp.sources:
            styles.setdefault(as_linear(node)[3], TPStyle.COLWISE)
            x, module = as_linear(node)[0], as_linear(node)[3]
            # the runtime converts an input several plain column-parallel siblings read once, so its
            # gradient is all-reduced once (tensor_parallel._share_replicated_inputs); a fused or
            # Conv1D projection (sharded by hand) all-reduces its own
            key = (module.rpartition(".")[0], x) if op_name(node) == "linear" and grp.parts.get(node, 1) == 1 \
                else None
            if key is None or key not in shared:
                backward += nbytes(val(x))
            if key is not None:
                shared.add(key)
            if not grp.sinks:
                gather += nbytes(val(node))
            if grp.parts.get(node, 1) > 1:
                fused[as_linear(node)[3]] = grp.parts[node]
            if grp.sinks:
                paired.add(as_linear(node)[3])
            node.meta["whalepy.tp_style"] = TPStyle.COLWISE
        for node in grp.sinks:
            styles.setdefault(as_linear(node)[3], TPStyle.ROWWISE)
            node.meta["whalepy.tp_style"] = TPStyle.ROWWISE
            comm += nbytes(val(node))
        dims += grp.dims
    for node in nodes:
        if node.op == "call_function" and op_name(node) == "embedding":
            parts = embedding_parts(node)
            if parts is None:
                continue
            module = weight_module(node, parts[0])
            rows = int(val(parts[0]).shape[0])
            if is_token_input(parts[1]) and rows in vocab:
                styles.setdefault(module, TPStyle.VOCAB)
                node.meta["whalepy.tp_style"] = TPStyle.VOCAB
                dims.append((module, "vocabulary entries", rows))
                comm += nbytes(val(node))
            else:
                styles.setdefault(module, TPStyle.REPLICATE)
                node.meta["whalepy.tp_style"] = TPStyle.REPLICATE
    dims = list(dict.fromkeys(dims))
    rules = tuple(TPRule(module=m, style=s, parts=fused.get(m, 1),
                         feeds_rowwise=s is TPStyle.COLWISE and m in paired) for m, s in styles.items())
    return BlockTP(rules=rules, comm_bytes=comm, backward_comm_bytes=backward, gather_bytes=gather,
                   dims=tuple(dims), degrees=_degrees(dims))


_VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "transpose", "permute", "alias", "slice", "select",
                       "unsqueeze", "squeeze", "t", "expand", "as_strided", "split", "chunk",
                       "split_with_sizes", "getitem", "unflatten", "flatten", "narrow"})


def _whole_modules(tp: BlockTP, prop: _Propagation, nodes: list[fx.Node]) -> BlockTP:
    """Record which parameter-holding modules of the block stay whole under TP, and why."""
    from dataclasses import replace

    ruled = {r.module for r in tp.rules if r.style is not TPStyle.REPLICATE}
    why: dict[str, str] = {}
    for gid in range(len(prop.groups.parent)):
        grp = prop.groups.get(gid)
        reason = grp.bad or (None if grp.sinks or grp.logits else
                             "no pattern: no row-parallel layer reads its output")
        for node in (*grp.sources, *grp.sinks):
            if reason:
                why.setdefault(as_linear(node)[3], reason)
    owners: dict[str, None] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            name = a.meta.get("whalepy.param")
            if name and node.meta.get("whalepy.block") == prop.block:
                # a tied weight is fed under one of its names: name the module of this block holding it
                names = a.meta.get("whalepy.param_aliases", (name,))
                mods = [n.rpartition(".")[0] for n in names]
                if not any(m in ruled for m in mods):
                    owners.setdefault(mods[0] or name, None)
    for node in nodes:  # linears found above are named by their module path
        lin = as_linear(node) if node.op == "call_function" else None
        if lin is not None:
            owners.setdefault(lin[3], None)
    whole = []
    norms = _norm_paths(nodes)
    for m in owners:
        if m in ruled or any(r.startswith(m + ".") for r in ruled) or \
                any(m.startswith(r + ".") for r in ruled):
            continue
        if m in why:
            reason = why[m]
        elif m in norms:
            reason = "norm (replicated; sequence parallelism splits it)"
        elif any(r.module == m for r in tp.rules):
            reason = "replicated embedding (positions, token types)"
        else:
            reason = "no pattern: not a linear layer or token embedding whalepy can split"
        whole.append((m, reason))
    return replace(tp, whole=tuple(whole))


def _writes_first_arg(node: fx.Node) -> bool:
    """An in-place ATen op (``aten.add_``): its schema writes its first argument."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return bool(alias is not None and alias.is_write) and not schema.name.endswith("copy_")


def _mark_inplace_outputs(tp: BlockTP, nodes: list[fx.Node]) -> BlockTP:
    """Mark (``TPRule.copy_output``) the sharded modules whose output, or a view of it, an in-place op of
    the graph modifies (``aten.add_`` and the like): Falcon adds the attention output into the MLP's
    row-parallel output (``mlp_output += attention_output``)."""
    from dataclasses import replace

    ruled = {r.module for r in tp.rules if r.style in (TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.VOCAB)}
    if not ruled:
        return tp
    marked: set[str] = set()
    for node in nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        if not _writes_first_arg(node):
            continue
        base = node.args[0]
        while op_name(base) in _VIEW_OPS and base.args and isinstance(base.args[0], fx.Node):
            if base.meta.get("whalepy.module_path") in ruled:
                break
            base = base.args[0]
        path = base.meta.get("whalepy.module_path")
        if path in ruled:
            marked.add(path)
    if not marked:
        return tp
    return replace(tp, rules=tuple(replace(r, copy_output=True) if r.module in marked else r for r in tp.rules))


_NORM_OPS = frozenset({"layer_norm", "rms_norm"})
_PASS_THROUGH = frozenset({"to", "contiguous", "clone", "alias", "detach", "view"})


def _norm_paths(nodes: list[fx.Node]) -> dict[str, list[fx.Node]]:
    """Module path -> its nodes, for the paths that compute a norm."""
    by_path: dict[str, list[fx.Node]] = {}
    for node in nodes:
        path = node.meta.get("whalepy.module_path")
        if path and node.op == "call_function":
            by_path.setdefault(path, []).append(node)
    out = {}
    for path, ns in by_path.items():
        ops = {op_name(n) for n in ns}
        if ops & _NORM_OPS or {"mean", "rsqrt"} <= ops:
            out[path] = ns
    return out


def _colwise_users(node: fx.Node) -> list[fx.Node] | None:
    """The linears ``node`` feeds (through dtype casts); None if it feeds anything else."""
    out = []
    for user in node.users:
        name = op_name(user) if user.op == "call_function" else ""
        if name == "assert":
            continue
        if name in _PASS_THROUGH:
            more = _colwise_users(user)
            if more is None:
                return None
            out += more
        elif user.meta.get("whalepy.tp_style") is TPStyle.COLWISE and as_linear(user) is not None \
                and as_linear(user)[0] is node:
            out.append(user)
        else:
            return None
    return out


def _sequence_rules(tp: BlockTP, nodes: list[fx.Node]) -> BlockTP:
    from dataclasses import replace

    styles = {r.module: r.style for r in tp.rules}
    parents_with_row = {m.rpartition(".")[0] for m, s in styles.items() if s is TPStyle.ROWWISE}
    fed: set[fx.Node] = set()
    rules: list[TPRule] = []
    dims = list(tp.dims)
    exit_ = False
    for path, ns in _norm_paths(nodes).items():
        inside = set(ns)
        outs = [n for n in ns if any(u not in inside and op_name(u) != "assert" for u in n.users)]
        if not outs:
            continue
        # the last one is the norm's output; an earlier one is its input cast to the compute dtype
        # (RMSNorm's ``x.to(float32)``, the same node as ``x`` when already fp32: the residual)
        out = outs[-1]
        users = _colwise_users(out)
        if not users:
            continue
        x = val(out)
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            continue
        fed.update(users)
        rules.append(TPRule(module=path, style=TPStyle.SEQUENCE))
        dims.append((path, "sequence positions", int(x.shape[1])))
        exit_ = exit_ or any(as_linear(u)[3].rpartition(".")[0] not in parents_with_row
                             for u in users)
    problem = None
    for node in nodes:
        if node.meta.get("whalepy.tp_style") is TPStyle.COLWISE and node not in fed \
                and as_linear(node) is not None:
            x = as_linear(node)[0]
            problem = (f"{as_linear(node)[3]} (column-parallel) reads a tensor of "
                       f"{x.meta.get('whalepy.module_path') or 'glue code'}, not the output of a "
                       "norm that feeds only column-parallel layers (sequence parallelism needs "
                       "pre-norm blocks: norm -> column-parallel -> row-parallel -> residual add)")
            break
    if rules and problem is None:
        dims = list(dict.fromkeys(dims))
        return replace(tp, rules=tp.rules + tuple(rules), dims=tuple(dims), degrees=_degrees(dims),
                       sp_exit=exit_)
    return replace(tp, sp_problem=problem or "no norm on the residual stream feeds its "
                   "column-parallel layers")


def check_split_degrees(
    block: str, annotations: BlockAnnotations, tp: BlockTP, modules: tuple[str, ...] = ()
) -> tuple[int, ...]:
    """Validate a block's ``split(n)`` against its TP pattern; return the block's TP degrees
    (with ``n`` added when it divides every sharded dim but is not a power of two).

    A block with no pattern is an error when the split scope lies in the block; a split inherited
    from an enclosing scope that spans several blocks (``split(8)`` around the whole model) leaves
    such a block replicated.
    """
    n = annotations.split
    if n is None:
        return tp.degrees
    source = next((s for s in annotations.sources if s.startswith("split")),
                  f"split({n or ''}) on {block}")
    scope = source.split(" on ", 1)[1] if " on " in source else block
    scope = "" if scope == "<root>" else scope
    if not tp.has_pattern:
        inside = any(scope == m or scope.startswith(m + ".") for m in (modules or (block,)))
        if not inside:
            return tp.degrees
        raise AnnotationError(
            f"{source}: block {block} has no tensor-parallel pattern (no column-then-row linear "
            f"pair, attention projections or token embedding was found in its graph), so it cannot "
            f"be split. Fix: remove the split annotation or put it on a module with such layers."
        )
    if n == 0:
        return tp.degrees
    bad = [d for d in tp.dims if d[2] % n]
    if bad:
        bad.sort(key=lambda d: not (scope and (d[0] == scope or d[0].startswith(scope + "."))))
        module, what, size = bad[0]
        valid = ", ".join(str(t) for t in tp.degrees)
        raise AnnotationError(
            f"{source}: {module} has {size} {what}, not divisible by {n}; valid degrees are "
            f"{valid}. Fix: use one of those degrees, or change the layer sizes."
        )
    return tp.degrees if n in tp.degrees else tuple(sorted({*tp.degrees, n}))
