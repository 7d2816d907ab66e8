"""Pipeline parallelism: cut the local model into stage modules and run them with PyTorch's schedules.

``split_stages`` (implemented in ``_stage_split``) turns the model into one module per planned stage,
keeping the original eager blocks and parameter names, so tensor parallelism, FSDP2 and activation
checkpointing apply to a stage exactly as to the local model. ``build_pipeline_schedule`` wraps the
stages this rank runs in ``torch.distributed.pipelining.PipelineStage`` and builds the planned schedule.

Loss scaling: a schedule applies ``loss_fn`` to each micro-batch's output and runs backward on each of
those losses, so parameter gradients are the SUM over micro-batches of what ``loss_fn`` returns. The
schedules here are built with PyTorch's own ``scale_grads`` turned off, so all scaling is in the loss:
wrap a mean-reducing loss with :func:`microbatch_mean_loss` to get the gradient of the mean over the
whole (per-replica) batch, as one process computing the loss on the full batch would. A data-parallel
caller with uneven batch shares folds its own factor into the same wrapper (``scale=``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.errors import LaunchError
from whalepy.ir.plan import Schedule
from whalepy.runtime._stage_split import retarget_device, reuse_traces, split_stages, tied_parameters
from whalepy.runtime._torch_compat import match_pipeline_mode, pipeline_step_options

__all__ = [
    "MicrobatchMeanLoss",
    "build_pipeline_schedule",
    "microbatch_mean_loss",
    "retarget_device",
    "reuse_traces",
    "run_pipeline_step",
    "split_stages",
    "tied_parameters",
]


class MicrobatchMeanLoss:
    """``loss_fn(output, target) * scale / num_microbatches``: summed over the micro-batches of a step,
    the per-micro-batch mean losses become the mean over the whole batch (times ``scale``)."""

    sums_to_batch_mean = True
    """Read by :func:`run_pipeline_step` (also through wrappers that forward attributes, such as
    fp16 loss scaling): the step's loss is the sum of the micro-batch losses, not their mean."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], num_microbatches: int, scale: float = 1.0):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        self.scale = scale

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * (self.scale / self.num_microbatches)


def microbatch_mean_loss(
    loss_fn: Callable[..., torch.Tensor], num_microbatches: int, *, scale: float = 1.0
) -> MicrobatchMeanLoss:
    """Wrap a mean-reducing ``loss_fn`` so a pipeline step's gradient is the global-batch mean's."""
    return MicrobatchMeanLoss(loss_fn, num_microbatches, scale)


def build_pipeline_schedule(
    stage_modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    *,
    num_stages: int,
    schedule: Schedule | str,
    num_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    example_microbatch: tuple,
    compute_dtype: torch.dtype | None = None,
    stage_owner: dict[int, int] | None = None,
) -> Any:
    """Wrap this rank's stage modules in ``PipelineStage`` and build the planned schedule.
    ``stage_owner``: the group rank holding each stage (the plan's layout); None: gathered from the group.

    ``stage_indices[i]`` is the global index of ``stage_modules[i]``. Stages are laid out round-robin:
    with ``P`` ranks in ``group``, group rank ``r`` holds stages ``r, r + P, r + 2P, ...`` (one stage
    for GPipe and 1F1B, ``num_stages / P`` for interleaved 1F1B). Stage input and output shapes are
    the ones the stages were split for (``whalepy_io``, given to ``PipelineStage`` as ``input_args`` /
    ``output_args``: torch's static mode, no metadata exchanged between neighbours); modules without
    them have their shapes inferred by PyTorch on the first step (its runtime shape inference, which
    exchanges metadata between neighbours once); ``example_microbatch`` is checked against the shapes
    the stages were split for.
    ``loss_fn`` is applied per micro-batch, unscaled (see the module docstring and
    :func:`microbatch_mean_loss`); ``None`` builds a forward-only schedule. Glue ops that create
    tensors are retargeted to ``device`` (:func:`retarget_device`); parameters are not moved here.
    With a ``compute_dtype`` (bf16 / fp16 plans) every stage but the last sends its floating-point
    outputs in that dtype (and so receives its inputs in it), as FSDP2's ``MixedPrecisionPolicy``
    casts a module's inputs: half the bytes on the pipeline links.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    schedule = Schedule(schedule)
    owner = _check_layout(stage_modules, stage_indices, num_stages, schedule, group, stage_owner)
    _check_microbatch(stage_modules, stage_indices, example_microbatch, num_microbatches)
    for module, index in zip(stage_modules, stage_indices):
        if hasattr(module, "whalepy_device"):
            retarget_device(module, device)
        if compute_dtype is not None and index < num_stages - 1:
            module.register_forward_hook(lambda _m, _args, out, dt=compute_dtype: _cast_floating(out, dt))
        if index < num_stages - 1:
            # the schedule sends stage outputs as they are, and gloo sends only contiguous tensors (a
            # transposed or expanded output between stages: whalepy's T5 passes its position bias on)
            module.register_forward_hook(lambda _m, _args, out: _contiguous(out))
    stages = [
        _stage_class(PipelineStage)(module, index, num_stages, device, group=group,
                                    **_static_io(module, index, num_stages, compute_dtype))
        for module, index in zip(stage_modules, stage_indices)
    ]
    for st in stages:  # which group rank holds each stage (the plan's order, not the group's rank order)
        st.stage_index_to_group_rank = dict(owner)
    if schedule is Schedule.INTERLEAVED_1F1B:
        cls, target = ScheduleInterleaved1F1B, stages
    else:
        cls = ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B
        target = stages[0]
    kwargs: dict[str, Any] = {"n_microbatches": num_microbatches, "loss_fn": loss_fn}
    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        kwargs["scale_grads"] = False  # all scaling is in the loss (microbatch_mean_loss)
    return cls(target, **kwargs)


def run_pipeline_step(
    schedule: Any,
    rank_stage_is_first: bool,
    rank_stage_is_last: bool,
    inputs: tuple,
    targets: torch.Tensor | None,
    train: bool = True,
) -> torch.Tensor | None:
    """Run one step (forward and backward of every micro-batch; forward only when not ``train``,
    through the schedule's ``eval``) on this rank.

    ``inputs`` (the batch's model inputs, split into micro-batches along dim 0 by the schedule) are
    used where this rank holds stage 0, ``targets`` where it holds the last stage. Returns, on the
    rank holding the last stage, the step's loss: the sum of the micro-batch losses when the loss is a
    :class:`MicrobatchMeanLoss` (that sum is the batch mean), else their mean; None on other ranks.
    """
    losses: list[torch.Tensor] = []
    args = tuple(inputs) if rank_stage_is_first else ()
    match_pipeline_mode(schedule, train)  # torch 2.11: eval before the first training step
    run = schedule.step if train else schedule.eval
    # the merged outputs are not used (the loss is): without this the last stage keeps every
    # micro-batch's output (the logits) until the step ends, not only the micro-batches in flight
    keep = pipeline_step_options(schedule, train)
    if rank_stage_is_last:
        run(*args, target=targets, losses=losses, **keep)
    else:
        run(*args, **keep)
    if not rank_stage_is_last or not losses:
        return None
    total = torch.stack([loss.detach() for loss in losses]).sum()
    if getattr(getattr(schedule, "_loss_fn", None), "sums_to_batch_mean", False):
        return total
    return total / len(losses)


def _static_io(module: nn.Module, index: int, num_stages: int, compute_dtype: torch.dtype | None) -> dict[str, Any]:
    """``input_args`` / ``output_args`` of ``PipelineStage`` (meta tensors) from the shapes the stage was
    split for (``whalepy_io``, :func:`~whalepy.runtime._stage_split.stage_io`), floating-point values
    between stages in ``compute_dtype``: with every stage's shapes given, torch's schedule skips its
    first-step metadata exchange (objects sent between neighbours), so a step runs where no objects
    travel (``whalepy check``'s fake process group) and the cluster's first step sends no metadata.
    A module split otherwise (no ``whalepy_io``), or a torch without that static mode (2.11): shapes
    inferred by torch on the first step."""
    from torch.distributed.pipelining import PipelineStage

    io = getattr(module, "whalepy_io", None)
    if io is None or not hasattr(PipelineStage, "_warmup_forward_vote"):
        # torch before its static metadata mode (2.11 validates given outputs against the real ones,
        # whose dtype mixed precision may change on the last stage): shapes inferred on the first step
        return {}
    inputs, outputs = io

    def meta(specs: Any, cast: bool) -> tuple[torch.Tensor, ...]:
        out = []
        for shape, dtype, grad in specs:
            low = cast and compute_dtype is not None and dtype.is_floating_point
            t = torch.empty(shape, dtype=compute_dtype if low else dtype, device="meta")
            out.append(t.requires_grad_(True) if grad and t.is_floating_point() else t)
        return tuple(out)

    return {"input_args": meta(inputs, cast=index > 0), "output_args": meta(outputs, cast=index < num_stages - 1)}


def _stage_class(base: type) -> type:
    """``PipelineStage`` whose shape inference feeds integer inputs received from another stage as
    zeros: torch (2.13) makes them with ``torch.empty``, and a stage that looks them up in an embedding
    (HF T5's ``decoder_input_ids``, passed through an earlier stage) reads garbage indices, an
    ``IndexError`` or worse. Floating-point inputs keep torch's handling."""
    if not hasattr(base, "_to_tensor"):
        return base

    class _Stage(base):  # type: ignore[misc, valid-type]
        def _to_tensor(self, arg: Any) -> Any:
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and isinstance(t, torch.Tensor) and not t.is_floating_point() \
                    and type(t) is torch.Tensor:
                with torch.no_grad():
                    t.zero_()
            return t

    return _Stage


def _contiguous(out: Any) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, out)


def _cast_floating(out: Any, dtype: torch.dtype) -> Any:
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_cast_floating(x, dtype) for x in out)
    return out


def _check_layout(
    stage_modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    stage_owner: dict[int, int] | None = None,
) -> dict[int, int]:
    """Checks the stages this rank holds against the others' (``stage_owner``, the plan's
    ``stage index -> group rank``; None: gathered from the group); gives that map."""
    if len(stage_modules) != len(stage_indices) or not stage_modules:
        raise LaunchError(
            f"{len(stage_modules)} stage modules for stage indices {list(stage_indices)}; give one "
            "index per module, at least one"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_stages % size:
        raise LaunchError(f"{num_stages} stages do not divide over the {size} ranks of the pipeline group")
    per_rank = num_stages // size
    if schedule is not Schedule.INTERLEAVED_1F1B and per_rank != 1:
        raise LaunchError(
            f"schedule {schedule.value} runs one stage per rank, but {num_stages} stages are spread over "
            f"{size} ranks; use {Schedule.INTERLEAVED_1F1B.value} for several stages per rank"
        )
    # a plan may put stage 0 on higher global ranks than stage 1 (a mixed cluster's slower GPUs first),
    # and a process group numbers its ranks in global-rank order: gather which group rank holds which
    # stages and tell the stages (PipelineStage.stage_index_to_group_rank); one stage per rank, or for
    # the interleaved schedule (whose per-rank program torch derives from the group rank) round-robin
    if stage_owner is not None:
        owner = dict(stage_owner)
        held: list[Any] = [[g for g in sorted(owner) if owner[g] == r] for r in range(size)]
        if sorted(stage_indices) != held[rank]:
            raise LaunchError(f"pipeline rank {rank} of {size} must hold stages {held[rank]} (the plan's "
                              f"layout), got {list(stage_indices)}")
    else:
        held = [None] * size
        dist.all_gather_object(held, list(stage_indices), group=group)
        owner = {g: r for r, mine in enumerate(held) for g in mine}
    if sorted(owner) != list(range(num_stages)) or sum(len(m) for m in held) != num_stages:
        raise LaunchError(f"pipeline ranks hold stages {held}: every one of the {num_stages} stages must be "
                          "held by exactly one rank of the pipeline group (re-plan)")
    if schedule is Schedule.INTERLEAVED_1F1B:
        expected = [rank + j * size for j in range(per_rank)]
        if list(stage_indices) != expected:
            raise LaunchError(
                f"pipeline rank {rank} of {size} must hold stages {expected} (round-robin), got "
                f"{list(stage_indices)}"
            )
    return owner


def _check_microbatch(
    stage_modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    example_microbatch: tuple,
    num_microbatches: int,
) -> None:
    if num_microbatches < 1:
        raise LaunchError(f"num_microbatches must be at least 1, got {num_microbatches}")
    for module, index in zip(stage_modules, stage_indices):
        expected = getattr(module, "whalepy_input_shapes", None)
        if index != 0 or expected is None:
            continue
        got = tuple(tuple(t.shape) for t in example_microbatch if isinstance(t, torch.Tensor))
        if got != tuple(expected):
            raise LaunchError(
                f"stage 0 was split for micro-batch inputs of shapes {list(expected)}, but the example "
                f"micro-batch has shapes {list(got)}; split the model with one micro-batch "
                "(global batch / data-parallel replicas / micro-batches) as example inputs"
            )
