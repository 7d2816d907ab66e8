"""Per-block timing of one training step, for the closed loop (issue 21, item 5).

After the plan check (:mod:`whalepy.runtime._report`), one step, :data:`SAMPLED_STEP`, runs with
hooks on the planner's blocks of this rank; they are removed at its end, and they return nothing, so
numerics do not change. Each hook stamps the time (CUDA events on a GPU, read once at the end of the
step; ``time.perf_counter`` on the CPU) and the step is cut into intervals between consecutive stamps:

- forward: from a block module's forward pre-hook to its first forward hook (the glue between a
  block's modules and the waits before a module, such as an FSDP2 all-gather or a pipeline receive,
  are outside). The loss is the last block's (``CheckedLoss.observer``), as in measured planning.
- backward: per module of the block, from the gradient of its output (a pre-hook on the autograd
  node that made it, which runs after the output's tensor hooks, FSDP2's gathering one among them) to
  the gradient of its input (a tensor hook: before FSDP2's post-backward reduce-scatter, which wrapped
  that input) or of the preceding module's output (a tensor hook registered before FSDP2's); where no input
  needs a gradient (the embedding), to the gradients of the block's parameters
  (``register_multi_grad_hook``). The last block's starts with the loss's backward.
- recomputation (a checkpointed block): a module's forward while autograd runs a backward; its
  forward hook resumes the block's backward.
- the optimizer step of the device optimizer (``register_step_pre_hook`` / ``post_hook``).

Per block the sums are divided by the micro-batches this rank runs: times per micro-batch, per this
rank's TP shard. A block's backward includes what runs inside its modules, the TP all-reduces of a
tensor-parallel block among it; FSDP2's gathers and reduce-scatters stay outside. The records of
every rank are gathered (``all_gather_object``) into :class:`StepTiming`: per block (the mean over the ranks and the
identical blocks that ran it), per stage (compute, optimizer, and the rest of the step: exposed
communication, bubble and host work, which cannot be told apart from inside the step), and the
measured costs (:class:`~whalepy.ir.measured.MeasuredCosts`) that ``pm.measured_profile()`` merges
into the profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.frontend.measure import grad_tensors
from whalepy.ir.measured import MeasuredCosts, block_signature
from whalepy.ir.plan import Plan
from whalepy.ir.rules import tp_splits

__all__ = ["BlockTimer", "BlockTiming", "StageTiming", "StepTiming", "build_block_timer", "build_step_timing",
           "gather_records", "merge_measured"]

_OPTIMIZER = -1
"""The block index the optimizer step's interval is filed under."""


@dataclass(frozen=True, kw_only=True)
class BlockTiming:
    """One block's measured seconds per micro-batch on one rank of its stage (the mean over the ranks
    that ran it)."""

    name: str
    stage: int
    forward_s: float
    backward_s: float
    recompute_s: float


@dataclass(frozen=True, kw_only=True)
class StageTiming:
    """One pipeline stage over the sampled step, its slowest rank's figures, next to the plan's."""

    stage: int
    step_s: float
    """The sampled step's wall time on the stage's ranks (hooks included)."""
    compute_s: float
    """Forward, backward and recomputation of its blocks, all micro-batches."""
    optimizer_s: float | None
    """The device optimizer's step (None: no device optimizer on this stage)."""
    rest_s: float
    """``step_s - compute_s - optimizer_s``: exposed communication, pipeline bubble and host work."""
    predicted_compute_s: float
    """The plan's compute of the stage, all micro-batches."""
    predicted_rest_s: float
    """The plan's step time less its compute of the stage."""


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """What the sampled step measured, every rank's records merged (the same on every rank)."""

    step: int
    blocks: tuple[BlockTiming, ...]
    stages: tuple[StageTiming, ...]
    measured: MeasuredCosts | None
    """Block times and the optimizer rate as measured costs of the device type of rank 0 (None:
    no model profile to key them by)."""

    @property
    def step_s(self) -> float:
        """The sampled step's wall time, the slowest stage's."""
        return max((s.step_s for s in self.stages), default=0.0)


def _in_backward() -> bool:
    """Inside a backward pass of the autograd engine (a checkpointed block's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class BlockTimer:
    """The hooks of one sampled step on this rank (module docstring): :meth:`start`, then :meth:`finish`."""

    def __init__(self, plan: Plan, device: torch.device, parts: Sequence[Any], *, profile: Any,
                 optimizer: torch.optim.Optimizer | None, loss_fn: Any, stage: int, micro_batch: float) -> None:
        self.plan = plan
        self.device = device
        self.profile = profile
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.loss_fn = loss_fn
        self.stage = stage
        self.micro_batch = micro_batch
        names = [b.name for b in profile.blocks] if profile is not None else None
        # (block index, its modules in model order); the index is the profile's, else the order met
        self.blocks: list[tuple[int, str, list[nn.Module]]] = []
        for part in parts:
            for bp, mods in part.blocks:
                idx = names.index(bp.name) if names is not None and bp.name in names else len(self.blocks)
                self.blocks.append((idx, bp.name, list(mods)))
        last = names[-1] if names else (plan.stages[-1].blocks[-1].name if plan.stages else None)
        self.loss_block = next((i for i, n, _ in self.blocks if n == last), None)
        self.cuda = device.type == "cuda"
        self.events: list[tuple[Any, int | None, str]] = []
        self.handles: list[Any] = []
        self.active = False

    # -- stamps ----------------------------------------------------------------------------------

    def _now(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def mark(self, block: int | None, phase: str) -> None:
        """The interval from here to the next stamp belongs to ``(block, phase)`` (None: to nothing)."""
        if self.events and self.events[-1][1] == block and self.events[-1][2] == phase:
            return
        self.events.append((self._now(), block, phase))

    def close_backward(self) -> None:
        """End the open backward interval, a block's or the loss's, if one is open."""
        if self.events and self.events[-1][2] in ("b", "l"):
            self.events.append((self._now(), None, ""))

    # -- hooks -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.events, self.handles, self.active = [], [], True
        self.mark(None, "start")
        for idx, _, mods in self.blocks:
            for j, mod in enumerate(mods):
                self.handles.append(mod.register_forward_pre_hook(self._pre_hook(idx, first=j == 0), with_kwargs=True))
                # the first forward hook: before FSDP2's, which hooks the outputs for its pre-backward gather
                self.handles.append(mod.register_forward_hook(self._post_hook(idx), prepend=True))
        if self.optimizer is not None:
            self.handles.append(self.optimizer.register_step_pre_hook(lambda *_: self.mark(_OPTIMIZER, "o")))
            self.handles.append(self.optimizer.register_step_post_hook(lambda *_: self.mark(None, "")))
        if self.loss_block is not None and hasattr(self.loss_fn, "observer"):
            self.loss_fn.observer = self

    def _pre_hook(self, idx: int, *, first: bool) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            if _in_backward():
                self.mark(idx, "r")
                return
            self.mark(idx, "f")
            # the gradient of a module's input ends its backward (before FSDP2's post-backward, which
            # wrapped these inputs: its reduce-scatter stays outside)
            inputs = grad_tensors(args) + grad_tensors(kwargs)
            for t in inputs:
                self.handles.append(t.register_hook(lambda g: self.close_backward()))
            if inputs or not first:
                return
            # no input gradient ends this block's backward (the embedding): its parameters' gradients do
            # (the parameters in use now: FSDP2's unsharded ones; removed at finish)
            params = [p for m in self._modules_of(idx) for p in m.parameters() if p.requires_grad]
            if params:
                from torch.autograd.graph import register_multi_grad_hook

                self.handles.append(register_multi_grad_hook(params, lambda _g: self.close_backward()))
        return hook

    def _post_hook(self, idx: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if _in_backward():
                self.mark(idx, "b")  # the recomputation is done: the block's backward resumes
                return
            self.mark(None, "")
            for t in grad_tensors(out):
                # the gradient of an output ends what ran after this module (a tensor hook, before
                # FSDP2's gathering one) and starts this module's backward (a pre-hook on the node
                # that made it: those run after all tensor hooks, so the gather stays outside)
                self.handles.append(t.register_hook(lambda g: self.close_backward()))
                start = (lambda g: self.mark(idx, "b"))
                node = t.grad_fn
                self.handles.append(node.register_prehook(start) if node is not None else t.register_hook(start))
        return hook

    def _modules_of(self, idx: int) -> list[nn.Module]:
        return next(mods for i, _, mods in self.blocks if i == idx)

    def loss_started(self) -> None:
        if self.loss_block is not None:
            self.mark(self.loss_block, "f")

    def loss_done(self, loss: torch.Tensor) -> None:
        if self.loss_block is None:
            return
        self.mark(None, "")
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            idx = self.loss_block
            self.handles.append(loss.register_hook(lambda g: self.mark(idx, "l")))  # the loss's backward

    # -- the record ------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Remove the hooks and return this rank's record (plain data, for ``all_gather_object``)."""
        self.mark(None, "end")
        for h in self.handles:
            h.remove()
        self.handles, self.active = [], False
        if hasattr(self.loss_fn, "observer"):
            self.loss_fn.observer = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        sums: dict[tuple[int, str], float] = {}
        for (t0, b, p), (t1, _, _) in zip(self.events, self.events[1:]):
            if b is not None:
                sums[(b, p)] = sums.get((b, p), 0.0) + self._seconds(t0, t1)
        step_s = self._seconds(self.events[0][0], self.events[-1][0])

        def t(block: int, phase: str) -> float:
            return sums.get((block, phase), 0.0)

        m = self.plan.num_microbatches
        params = 0
        if self.optimizer is not None:
            # the parameters it steps: ZeroRedundancyOptimizer's inner optimizer holds this rank's share
            inner = getattr(self.optimizer, "optim", None)
            stepped = inner if isinstance(inner, torch.optim.Optimizer) else self.optimizer
            params = sum(_local_numel(p) for g in stepped.param_groups for p in g["params"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.events = []
        return {"rank": rank, "stage": self.stage, "device_type": self.plan.rank_device_types[rank],
                "device_name": torch.cuda.get_device_name(self.device) if self.cuda else "CPU",
                "micro_batch": self.micro_batch, "step_s": step_s,
                "optimizer_s": sums.get((_OPTIMIZER, "o")) if self.optimizer is not None else None,
                "optimizer_params": params,
                "optimizer": _optimizer_name(self.optimizer),
                "blocks": {name: (t(i, "f") / m, (t(i, "b") + t(i, "l")) / m, t(i, "r") / m)
                           for i, name, _ in self.blocks}}


def _optimizer_name(opt: torch.optim.Optimizer | None) -> str:
    if opt is None:
        return ""
    d = opt.defaults
    return f"{type(opt).__name__} {'fused' if d.get('fused') else 'foreach' if d.get('foreach') else 'default'}"


def _local_numel(p: torch.Tensor) -> int:
    local = getattr(p, "_local_tensor", None)
    return int((local if local is not None else p).numel())


def gather_records(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record (collective)."""
    if not dist.is_initialized():
        return [record]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def build_step_timing(records: list[dict[str, Any]], plan: Plan, profile: Any, step: int) -> StepTiming:
    """Merge every rank's record (:meth:`BlockTimer.finish`) into a :class:`StepTiming`."""
    per_block: dict[str, list[tuple[float, float, float]]] = {}
    stage_of: dict[str, int] = {}
    for r in records:
        for name, t in r["blocks"].items():
            per_block.setdefault(name, []).append(tuple(t))
            stage_of[name] = r["stage"]
    order = [b.name for b in profile.blocks] if profile is not None else list(per_block)
    blocks = tuple(BlockTiming(name=n, stage=stage_of[n], **dict(zip(("forward_s", "backward_s", "recompute_s"),
                                                                     _mean(per_block[n]))))
                   for n in order if n in per_block)
    m = plan.num_microbatches
    stages = []
    for st in plan.stages:
        mine = [r for r in records if r["stage"] == st.index]
        if not mine:
            continue

        def compute(r: dict[str, Any]) -> float:
            return m * sum(sum(t) for t in r["blocks"].values())

        opts = [r["optimizer_s"] for r in mine if r["optimizer_s"] is not None]
        step_s = max(r["step_s"] for r in mine)
        comp = max(compute(r) for r in mine)
        opt = max(opts) if opts else None
        predicted = m * st.cost.compute_s
        stages.append(StageTiming(stage=st.index, step_s=step_s, compute_s=comp, optimizer_s=opt,
                                  rest_s=max(r["step_s"] - compute(r) - (r["optimizer_s"] or 0.0) for r in mine),
                                  predicted_compute_s=predicted,
                                  predicted_rest_s=max(plan.cost.step_time_s - predicted, 0.0)))
    measured = _measured_costs(records, plan, profile, step) if profile is not None else None
    return StepTiming(step=step, blocks=blocks, stages=tuple(stages), measured=measured)


def _mean(rows: list[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(sum(c) / len(rows) for c in zip(*rows))


def _measured_costs(records: list[dict[str, Any]], plan: Plan, profile: Any, step: int) -> MeasuredCosts:
    """The block times and the optimizer's rate, keyed as measured planning keys them (by block signature,
    precision, TP degree and micro-batch size), for rank 0's device type: a mixed cluster's other types
    keep their modelled costs. Blocks that tensor parallelism splits are left out: their times hold the
    TP all-reduces, which measured planning times apart (sharded shapes on one device) and the planner
    adds from its communication model; a TP stage's blocks that run whole are kept, at TP 1."""
    device_type = records[0]["device_type"]
    precision = plan.precision.value
    by_name = {b.name: b for b in profile.blocks}
    samples: dict[str, dict[tuple[str, int, float], list[tuple[float, float]]]] = {}
    names: dict[str, str] = {}
    rates = []
    for r in records:
        if r["device_type"] != device_type:
            continue
        tp = plan.stages[r["stage"]].tp_degree
        for name, (f, b, _rc) in r["blocks"].items():
            blk = by_name.get(name)
            if blk is None:
                continue
            if tp_splits(blk, tp):
                continue  # its time holds the TP collectives, which the planner adds from its model
            sig = block_signature(profile, blk)
            key = (precision, 1, float(r["micro_batch"]))
            samples.setdefault(sig, {}).setdefault(key, []).append((f, b))
            names.setdefault(sig, name)
        if r["optimizer_s"] is not None and r["optimizer_params"]:
            rates.append(r["optimizer_s"] / r["optimizer_params"])
    times = {s: {k: _mean(v) for k, v in d.items()} for s, d in samples.items()}
    # the optimizer step as measured planning files it: per block over its parameters (unsharded), at
    # the slowest rank's seconds per local parameter (the rate the planner reads back)
    rate = max(rates) if rates else None
    updates = {} if rate is None else {block_signature(profile, b): rate * b.num_params for b in profile.blocks}
    opt = next((r["optimizer"] for r in records if r["optimizer"]), "")
    threads = torch.get_num_threads() if device_type == "CPU" else None
    return MeasuredCosts(device_type=device_type, device_name=records[0]["device_name"], threads=threads,
                         source=f"whalepy run: step {step} of a plan for {plan.model_name} on {plan.world_size} "
                                f"ranks, torch {torch.__version__}",
                         optimizer=opt, times=times, updates=updates, names=names)  # type: ignore[arg-type]


def build_block_timer(lowered: Any, plan: Plan, ctx: Any) -> BlockTimer:
    """The timer of this rank's blocks (``lowered``: :class:`~whalepy.runtime.parts.Lowered`)."""
    m = lowered.meshes
    return BlockTimer(plan, m.device, lowered.parts, profile=ctx.profile, optimizer=lowered.optim.optimizer,
                      loss_fn=ctx.loss_fn, stage=m.stage.index,
                      micro_batch=plan.batch_shares[m.replica] / plan.num_microbatches)


def merge_measured(profile: Any, measured: MeasuredCosts) -> Any:
    """``profile`` (copied) with ``measured`` merged into its measured costs: over those of the same device
    type (the run's win where both timed a block), in place of another type's (a profile holds one)."""
    from dataclasses import replace

    own = profile.measured
    if own is not None and own.device_type == measured.device_type:
        measured = own.merged(measured)
    return replace(profile, measured=measured)
