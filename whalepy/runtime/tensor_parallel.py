"""Lower the plan's tensor-parallel rules onto DTensor.

Each :class:`~whalepy.ir.plan.TPRule` names a module and a :class:`~whalepy.ir.plan.TPStyle`; the rules
come from the front end's FX pattern pass, so nothing here knows a particular model. The mapping:

========== ===================================================================================
COLWISE    ``ColwiseParallel``. When the rule ``feeds_rowwise`` (or, in plans without that field,
           its parent module also holds a ROWWISE module), the output stays sharded (the usual column -> row pair of an MLP or attention). Otherwise
           the module ends a sharded region on its own (an LM head): its output is gathered
           (``output_layouts=Replicate()``), or left ``Shard(-1)`` for ``loss_parallel`` when
           ``loss_parallel=True``.
ROWWISE    ``RowwiseParallel`` (output all-reduced).
VOCAB      ``RowwiseParallel(input_layouts=Replicate())`` on an ``nn.Embedding`` (vocab sharded).
SEQUENCE   sequence parallelism (below); a plan without SEQUENCE rules runs norms replicated.
REPLICATE  nothing: the module's parameters stay whole on every TP rank.
========== ===================================================================================

A rule with ``copy_output`` (the captured graph modifies the module's output in place: Falcon's
``mlp_output += attention_output``) hands on a copy of DTensor's local output, which is a view autograd
refuses to modify in place.

**Sequence parallelism** (Korthikanti et al. 2022), when the rules hold SEQUENCE rules (the pattern
pass adds them only with ``build_profile(..., sequence_parallel=True)``). Between blocks the residual
stream is a local ``[batch, seq / t, hidden]`` tensor, sharded along the sequence (``Shard(1)``):

- the SEQUENCE rule on a module that contains other ruled modules (the first TP layer) is the
  *entry*: its first input is scattered ``Replicate() -> Shard(1)`` by a forward pre-hook (the first
  positional argument, else the forward's first parameter passed by keyword);
- a SEQUENCE norm is ``SequenceParallel()`` (parameters replicated, computed on the local sequence
  shard) whose output is all-gathered ``Shard(1) -> Replicate()`` and handed on as a local tensor, so
  the column-parallel layers (and an LM head) it feeds see the whole sequence. This is torchtitan's
  ``PrepareModuleInput(Shard(1) -> Replicate())`` on the attention / MLP module moved onto the norm's
  output: the same one all-gather, but independent of how the block calls the module (HF Llama
  passes ``hidden_states=`` by keyword);
- a ROWWISE module paired with a COLWISE sibling is ``RowwiseParallel(output_layouts=Shard(1))``
  (reduce-scatter instead of all-reduce); the residual adds run on the shards.

The token embedding stays ``RowwiseParallel(input_layouts=Replicate())`` (output all-reduced) and is
scattered at the entry: models compute positions and masks from the embedding output's length (HF
Llama's ``cache_position``), which must stay whole. Every SEQUENCE rule must name a module of this
model part: sequence parallelism across pipeline stages raises ``PlanError``.

HF ``Conv1D`` (weight ``[in, out]``) is not an ``nn.Linear`` and DTensor's styles reject it; its
parameters are distributed by hand (``distribute_tensor`` with the transposed placements) and its
``forward`` is replaced by one that works on local shards with Megatron's identity/all-reduce pair.
The parameter names and shapes stay those of the original model, so checkpoints move between plans.

**Fused projections.** A COLWISE rule with ``parts = k > 1`` (the pattern pass saw the model split the
module's output into ``k`` equal pieces: HF GPT-2's ``c_attn`` is ``[q | k | v]``, Phi-3's
``gate_up_proj`` ``[gate | up]``) is sharded piece by piece, so each rank holds ``[q_r | k_r | v_r]``
(``_StridedShard(split_factor=k)``, or a whole weight each rank slices; see ``_shard_by_hand``). Layouts
the pass cannot see as equal pieces (unequal splits, slices) are never ruled: those modules stay whole.

**Head-count attributes.** Attention code that reshapes with a stored head count (``num_heads``) or
splits by a stored width (``split_size``) must see the local value. For the parent module of every
COLWISE module that is paired with a ROWWISE sibling, the integer attributes named in
:data:`LOCAL_COUNT_ATTRIBUTES` are divided by the TP degree; one that does not divide raises
:class:`~whalepy.PlanError` naming the module and attribute.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from whalepy.errors import PlanError
from whalepy.ir.rules import LOCAL_COUNT_ATTRIBUTES, is_conv1d, localize_counts
from whalepy.ir.plan import TPRule, TPStyle

__all__ = ["LOCAL_COUNT_ATTRIBUTES", "apply_tensor_parallel"]

log = logging.getLogger(__name__)

# the shapes TP gives a module are rules measured planning applies too (whalepy.frontend.measure)
_localize_counts, _is_conv1d = localize_counts, is_conv1d



def apply_tensor_parallel(
    module: nn.Module,
    rules: Sequence[TPRule],
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool = False,
) -> list[str]:
    """Shard ``module``'s submodules named by ``rules`` over ``tp_mesh`` in place.

    Rules naming modules absent from ``module`` (another pipeline stage's) are skipped. Returns the
    names of the modules that were sharded.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return []
    present = {name: m for name, m in module.named_modules()}
    seq_rules = [r for r in rules if r.style is TPStyle.SEQUENCE]
    sequence_parallel = bool(seq_rules)
    if sequence_parallel:
        missing = [r.module for r in seq_rules if r.module not in present]
        if missing:
            raise PlanError(
                f"sequence parallelism: {missing[0]} is not in this part of the model (another "
                "pipeline stage's); the sequence-sharded residual stream cannot cross pipeline "
                "stages. Profile without sequence_parallel=True for a plan with pipeline parallelism")
    entries = {r.module for r in seq_rules
               if any(o.module.startswith(r.module + ".") for o in rules)}
    rules = [r for r in rules if r.module in present]
    tied = _tied_names(module)
    rowwise_parents = {_parent(r.module) for r in rules if r.style is TPStyle.ROWWISE}

    fused_by_rule = {r.module: r.parts if r.style is TPStyle.COLWISE else 1 for r in rules}
    styles: dict[str, ParallelStyle] = {}
    done: list[str] = []
    adjusted: set[str] = set()
    for rule in rules:
        m = present[rule.module]
        parent_name = _parent(rule.module)
        parent = present.get(parent_name, module)
        paired = parent_name in rowwise_parents or rule.feeds_rowwise
        if rule.style is TPStyle.COLWISE and paired and parent_name not in adjusted:
            _localize_counts(parent, parent_name, tp)
            adjusted.add(parent_name)
        if rule.style is TPStyle.REPLICATE:
            continue
        if rule.style is TPStyle.SEQUENCE:
            styles[rule.module] = (_ScatterSequence() if rule.module in entries
                                   else _sequence_norm(m, rule.module))
            done.append(rule.module)
            continue
        fused = fused_by_rule[rule.module]
        scatter = sequence_parallel and rule.style is TPStyle.ROWWISE and paired
        if _is_conv1d(m) or fused > 1:
            if rule.style not in (TPStyle.COLWISE, TPStyle.ROWWISE):
                raise PlanError(f"{rule.module}: style {rule.style.value} is not supported on "
                                f"{type(m).__name__}; only colwise and rowwise are")
            _shard_by_hand(m, rule.module, rule.style, tp_mesh, fused=fused, gather=not paired,
                           scatter=scatter)
        elif scatter:
            styles[rule.module] = RowwiseParallel(output_layouts=Shard(1))
        else:
            styles[rule.module] = _dtensor_style(m, rule, paired=paired, loss_parallel=loss_parallel)
        done.append(rule.module)
    if styles:
        parallelize_module(module, tp_mesh, styles)
        for rule in rules:
            if rule.copy_output and rule.module in styles:
                present[rule.module].register_forward_hook(_copy_output)
        if not sequence_parallel:
            _share_replicated_inputs(module, present, styles, tp_mesh)
    _retie(module, tied)
    return done


def _share_replicated_inputs(module: nn.Module, present: dict[str, nn.Module], styles: dict[str, ParallelStyle],
                             tp_mesh: DeviceMesh) -> None:
    """One gradient all-reduce for column-parallel siblings that read the same tensor.

    ``ColwiseParallel`` turns its input into a ``Replicate`` DTensor (``DTensor.from_local``); in backward
    that conversion all-reduces the input's gradient, the partial sums ``W_r^T dy_r`` of the rank's shard.
    Attention with separate ``q_proj`` / ``k_proj`` / ``v_proj`` (HF Llama, whalepy's GPT) thus all-reduces
    the same input's gradient three times, where Megatron-LM sums the three locally and all-reduces once
    (Shoeybi et al. 2019, the ``f`` operator before the attention). Here a forward pre-hook on each such
    sibling (run before DTensor's own) makes the DTensor once per tensor per call of their parent and hands
    the same one to every sibling that reads that tensor: their partial gradients add up in the DTensor,
    and its one conversion all-reduces them once. The parent's own code never sees a DTensor; siblings
    reading different tensors (cross-attention's ``k`` / ``v`` from the encoder) convert their own, as
    before. Numerics: the same sum in another order."""
    groups: dict[str, list[str]] = {}
    for name, style in styles.items():
        if type(style) is ColwiseParallel:
            groups.setdefault(_parent(name), []).append(name)
    for parent_name, names in groups.items():
        if len(names) < 2:
            continue
        parent = present.get(parent_name, module)
        shared: dict[int, tuple[torch.Tensor, DTensor]] = {}
        parent.register_forward_pre_hook(lambda m, a, c=shared: c.clear())
        parent.register_forward_hook(lambda m, a, o, c=shared: c.clear())
        for name in names:
            present[name].register_forward_pre_hook(
                lambda m, args, c=shared: _shared_replicate(args, c, tp_mesh), prepend=True)


def _shared_replicate(args: tuple, cache: dict[int, tuple[torch.Tensor, DTensor]], mesh: DeviceMesh) -> tuple | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return None
    hit = cache.get(id(x))
    if hit is None or hit[0] is not x:
        hit = (x, DTensor.from_local(x, mesh, [Replicate()], run_check=False))
        cache[id(x)] = hit
    return (hit[1], *args[1:])


def _copy_output(module: nn.Module, args: Any, output: Any) -> Any:
    # DTensor's local output is a view made inside an autograd Function, which autograd refuses to
    # modify in place; the model does (TPRule.copy_output), so it gets a tensor of its own
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        return output.clone()
    return output


def _tied_names(module: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: nn.Module, tied: list[list[str]]) -> None:
    """Sharding replaces each module's parameters with new DTensor parameters, which unties weights
    shared by two modules (an embedding and an LM head). Tie them again when the sharded sides agree
    (vocab-parallel embedding and column-parallel head are both ``Shard(0)`` of the ``[vocab, hidden]``
    table). A side left whole because its module has no rule (T5's ``shared`` embedding, never called;
    BERT's ``cls.predictions.bias``, used only through the decoder it is tied to) follows the sharded
    side; should such a module be called after all, it raises. Sharded sides that disagree cannot
    share one tensor and are refused."""
    for names in tied:
        params = [module.get_parameter(n) for n in names]
        first = params[0]
        if all(p is first for p in params):
            continue

        def layout(p: torch.Tensor) -> tuple:
            return ("dtensor", tuple(p.placements), p.device_mesh, tuple(p.shape))

        sharded = [(n, p) for n, p in zip(names, params) if isinstance(p, DTensor)]
        if len({layout(p) for _, p in sharded}) > 1:
            raise PlanError(
                f"tied parameters {names} are sharded differently by the tensor-parallel rules "
                f"({[str(getattr(p, 'placements', 'whole')) for p in params]}); give the modules "
                "that share them matching rules (vocab-parallel embedding with a column-parallel "
                "head, or both replicated), or untie the weights")
        lead = sharded[0][1] if sharded else first
        for n in names:
            owner_name, _, field_name = n.rpartition(".")
            owner = module.get_submodule(owner_name)
            if sharded and not isinstance(module.get_parameter(n), DTensor):
                _refuse_calls(owner, owner_name or type(module).__name__, n, sharded[0][0])
            owner.register_parameter(field_name, lead)


def _refuse_calls(owner: nn.Module, owner_name: str, name: str, lead: str) -> None:
    """``owner`` holds ``name`` only as a copy of the sharded ``lead`` it is tied to; whalepy's capture
    saw it never use it directly. A leaf that does compute with it would mix a shard with whole tensors."""
    if any(True for _ in owner.children()):
        return

    def hook(mod: nn.Module, args: Any) -> None:
        raise PlanError(
            f"{owner_name} ({type(mod).__name__}) was called, but its parameter {name} is tied to "
            f"{lead}, which tensor parallelism shards; whalepy's capture did not see it called. Give "
            "it the same tensor-parallel rule, or untie the weights")

    owner.register_forward_pre_hook(hook)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _dtensor_style(m: nn.Module, rule: TPRule, *, paired: bool, loss_parallel: bool) -> ParallelStyle:
    if rule.style is TPStyle.COLWISE:
        if paired:
            return ColwiseParallel()
        if loss_parallel:
            return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(output_layouts=Replicate())
    if rule.style is TPStyle.ROWWISE:
        return RowwiseParallel()
    if rule.style is TPStyle.VOCAB:
        if not isinstance(m, nn.Embedding):
            raise PlanError(f"{rule.module}: vocab-parallel needs an nn.Embedding, found "
                            f"{type(m).__name__}")
        return RowwiseParallel(input_layouts=Replicate())
    raise PlanError(f"{rule.module}: unknown tensor-parallel style {rule.style!r}")


class _GatheredSequenceParallel(SequenceParallel):
    """``SequenceParallel`` whose output is all-gathered along the sequence and handed on local."""

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
        if not isinstance(outputs, DTensor):
            raise PlanError(f"sequence parallelism: {type(mod).__name__} returned "
                            f"{type(outputs).__name__}, not one tensor")
        return outputs.redistribute(device_mesh, [Replicate()]).to_local()


def _sequence_norm(m: nn.Module, name: str) -> ParallelStyle:
    if any(True for _ in m.children()):
        raise PlanError(f"sequence parallelism: {name} ({type(m).__name__}) has submodules; a "
                        "SEQUENCE rule names a norm (LayerNorm / RMSNorm) or the first "
                        "tensor-parallel layer")
    return _GatheredSequenceParallel()


class _ScatterSequence(ParallelStyle):
    """Entry of the sequence-parallel region: scatter the module's hidden-state input (its first
    positional argument, else its forward's first parameter given by keyword) from ``Replicate()``
    to ``Shard(1)`` and hand on the local shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        import inspect

        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        first = params[0].name if params else None

        def scatter(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor) or not isinstance(x, torch.Tensor) or x.ndim < 2:
                raise PlanError(f"sequence parallelism: {type(module).__name__}'s first input is "
                                f"not a [batch, seq, ...] tensor ({type(x).__name__})")
            if x.shape[1] % device_mesh.size():
                raise PlanError(f"sequence parallelism: sequence length {x.shape[1]} is not "
                                f"divisible by the tensor-parallel degree {device_mesh.size()}")
            d = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return d.redistribute(device_mesh, [Shard(1)]).to_local()

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if torch._C._current_graph_task_id() != -1:
                # inside backward the module runs only as an activation checkpoint's recompute, on the
                # inputs the checkpoint saved after this hook had scattered them
                return None
            if args:
                return (scatter(args[0]), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: scatter(kwargs[first])}
            raise PlanError(f"sequence parallelism: {type(mod).__name__} was called without its "
                            f"hidden-state input {first!r}")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module




# -- manual sharding: HF Conv1D and fused projections ---------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce the gradient (the input was used by every TP rank)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum of partial products); identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        n = dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[r].contiguous(), None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class _ReduceScatterSeqFromTP(torch.autograd.Function):
    """Sum the partial products and keep this rank's sequence shard (dim 1) forward; all-gather the
    gradient along dim 1 backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n, dim=1)[r].contiguous()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None


def _shard_by_hand(m: nn.Module, name: str, style: TPStyle, mesh: DeviceMesh, *, fused: int,
                   gather: bool, scatter: bool = False) -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    from whalepy.runtime._torch_compat import allow_split_factor_strided_shards

    allow_split_factor_strided_shards()  # torch 2.11 cannot redistribute the _StridedShard below
    conv = _is_conv1d(m)
    if not conv and not isinstance(m, nn.Linear):
        raise PlanError(f"{name}: cannot shard a fused {type(m).__name__}; only nn.Linear and HF "
                        "Conv1D are supported")
    out_dim = 1 if conv else 0  # weight dim of the output features
    in_dim = 1 - out_dim
    tp, tp_rank = mesh.size(), mesh.get_local_rank()
    # A fused projection's pieces are interleaved across ranks ([q_r | k_r | v_r]). That is a
    # _StridedShard, which FSDP2 cannot compose with when it shards the same dim (it does for biases
    # and for nn.Linear's dim 0), so such tensors stay whole (Replicate) and each rank slices its
    # part, with the gradient summed over the TP group. Conv1D's fused weight (pieces on dim 1, FSDP
    # on dim 0) is sharded for real.
    slice_w = fused > 1 and out_dim == 0
    if style is TPStyle.COLWISE:
        if fused > 1:
            w_place = Replicate() if slice_w else _StridedShard(out_dim, split_factor=fused)
            b_place = Replicate()
        else:
            w_place, b_place = Shard(out_dim), Shard(0)
    else:
        w_place, b_place = Shard(in_dim), Replicate()
    m.weight = nn.Parameter(distribute_tensor(m.weight.data, mesh, [w_place]))
    if getattr(m, "bias", None) is not None:
        m.bias = nn.Parameter(distribute_tensor(m.bias.data, mesh, [b_place]))
    group = mesh.get_group()

    def local_part(t: torch.Tensor, dim: int) -> torch.Tensor:
        # whole fused tensor -> this rank's [piece_0_r | piece_1_r | ...] along dim
        t = _CopyToTP.apply(t, group)
        shape = list(t.shape)
        pieces = t.reshape(*shape[:dim], fused, tp, shape[dim] // (fused * tp), *shape[dim + 1:])
        local = pieces.select(dim + 1, tp_rank)
        return local.reshape(*shape[:dim], shape[dim] // tp, *shape[dim + 1:])

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = _local(self.weight)
        b = _local(self.bias) if getattr(self, "bias", None) is not None else None
        if style is TPStyle.COLWISE and fused > 1:
            if slice_w:
                w = local_part(w, out_dim)
            if b is not None:
                b = local_part(b, 0)
        if style is TPStyle.COLWISE:
            x = _CopyToTP.apply(x, group)
        y = x @ w if conv else x @ w.t()
        if style is TPStyle.ROWWISE:
            if scatter:  # sequence parallel: each rank adds the bias to its own sequence shard,
                # so the bias gradient is summed over the shards
                y = _ReduceScatterSeqFromTP.apply(y, group)
                return y if b is None else y + _CopyToTP.apply(b, group)
            y = _ReduceFromTP.apply(y, group)
            return y if b is None else y + b
        if b is not None:
            y = y + b
        if gather:
            if fused > 1:
                raise PlanError(f"{name}: a fused projection must feed a rowwise module")
            y = _GatherFromTP.apply(y, group)
        return y

    m.forward = types.MethodType(forward, m)
