"""``parallelize``: lower a :class:`~whalepy.Plan` onto this rank and train it.

``parallelize`` checks its arguments and the launch, plans (or takes a plan), and hands the model to
:func:`whalepy.runtime.lower.lower`, whose steps build this rank's part of the plan (docs/runtime.md,
docs/architecture.md); :class:`ParallelModel` receives the result and trains, evaluates, saves and loads.

Loss semantics: ``loss_fn(outputs, targets)`` returns the mean loss of the samples it is given.
Replica ``r`` runs ``batch_shares[r]`` samples; its loss is scaled by ``b_r * dp / B`` before
backward so that the data-parallel averaging (which divides by ``dp``) yields the gradient of the
global-batch mean, whatever the shares. ``train_step`` returns that global-batch mean on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.errors import ArgumentError, LaunchError, PlanError, WhalepyError
from whalepy.frontend.checks import check_token_ids
from whalepy.ir.plan import Plan
from whalepy.planner.check import check_plan_cluster as _check_plan_cluster
from whalepy.runtime._amp import AmpContext
from whalepy.runtime._joint_step import JointStep, host_grad_params
from whalepy.runtime._pm_helpers import (  # noqa: F401 - _checked_loss: tests import it from here
    LossFn,
    _as_tuple,
    _check_device,
    _checked_loss,
    _full,
    _Null,
    _profile_or_none,
    _sync_context,
)
from whalepy.runtime._pm_setup import (
    _check_arguments,
    _check_lowering_options,
    _check_training_options,
    _init_process_group,
    _plan_once,
)
from whalepy.runtime._block_timing import build_block_timer, merge_measured
from whalepy.runtime._report import ObservedStep, StepReporter
from whalepy.runtime._train_state import check_loader, job_state, job_template, restore_job_state
from whalepy.runtime.checkpointing import (
    gather_full_state_dict,
    get_train_state,
    load_train_state,
    master_weights,
    save_train_state,
    set_train_state,
)
from whalepy.runtime.data import ShardedBatchSampler, dataset_length, local_share, take_local
from whalepy.runtime.disk_space import check_plan_disk_space, stage_has_disk_tier
from whalepy.runtime.host_optimizer import HostOptimizer
from whalepy.runtime.launch_errors import install_error_hook
from whalepy.runtime.lower import lower, share_scale
from whalepy.runtime.materialize import InitFn, MaterializeStats, checkpoint_kind, has_meta_tensors
from whalepy.runtime.mesh import check_world
from whalepy.runtime.metrics import check_job_options
from whalepy.runtime.model_config import saved_config
from whalepy.runtime.nvme import NvmeTier
from whalepy.runtime.parts import LowerContext, Lowered, OptimizerFactory, SchedulerFactory, Tied
from whalepy.runtime.pseudo_record import PseudoBuild
from whalepy.runtime.tied import sync_tied_grads
from whalepy.runtime.tiling import check_tiles

__all__ = ["ParallelModel", "UnlaunchedModel", "is_distributed_launch", "parallelize"]

log = logging.getLogger("whalepy.runtime")

_hint_printed = False


def is_distributed_launch() -> bool:
    """True inside torchrun / ``whalepy run`` (env ``RANK`` and ``WORLD_SIZE``) or when a default
    process group is already initialised."""
    if dist.is_available() and dist.is_initialized():
        return True
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_hint(world_size: int) -> str:
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "script.py"
    return (f"this plan needs {world_size} processes; launch with `torchrun --nproc-per-node "
            f"{world_size} {script}` or `whalepy run -n {world_size} {script}`")


def parallelize(
    model: nn.Module,
    cluster_spec: Any,
    *,
    example_inputs: Any,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    global_batch: int,
    plan: Plan | None = None,
    profile: Any = None,
    loss_parallel: bool = False,
    sync_initial_weights: bool = True,
    nvme_dir: str | os.PathLike[str] | None = None,
    nvme_keep: bool = False,
    init_fn: InitFn | None = None,
    seed: int = 0,
    checkpoint: str | os.PathLike[str] | None = None,
    max_grad_norm: float | None = None,
    log_every: int | None = None,
    lr_scheduler: SchedulerFactory | None = None,
    total_steps: int | None = None,
    metrics: Sequence[Any] = (),
    **options: Any,
) -> ParallelModel | UnlaunchedModel:
    """Plan ``model`` for ``cluster_spec`` (unless ``plan`` is given) and, inside a distributed launch,
    rewrite it for this rank.

    ``optimizer`` is a factory ``params -> Optimizer`` (parameters are replaced by shards, so the
    optimizer must be built afterwards). ``profile`` is the model's :class:`~whalepy.ModelProfile`
    when the caller already has it (block -> module mapping and fingerprint check; without ``plan``, the
    plan is made from it, its measured tables included, as :func:`whalepy.plan_from_profile` does);
    otherwise it is computed when needed. ``loss_parallel=True`` keeps an LM head's logits vocab-sharded and runs
    ``loss_fn`` under ``torch.distributed.tensor.parallel.loss_parallel`` (``loss_fn`` must then be a
    cross-entropy over DTensor logits). ``sync_initial_weights`` broadcasts rank 0's weights first, so
    ranks need not seed identically. ``nvme_dir`` is where blocks with an ``nvme`` tier keep their
    parameters and / or optimizer states (this rank's files go in a subdirectory
    ``whalepy-nvme-<pid>-rank<r>``, removed at :meth:`ParallelModel.close` and at exit; default: under
    :func:`tempfile.gettempdir`); :class:`WhalepyError` before training if it is not writable or lacks
    the space. ``nvme_keep=True`` keeps the files (subdirectory ``whalepy-nvme-rank<r>``) and, when it
    already holds a committed step of the same model and plan (a run that crashed), resumes the
    parameters and optimizer states from it. Other ``options`` go to the planner.

    A model built on the meta device is lowered as it is and only this rank's shards are then
    allocated (:mod:`whalepy.runtime.materialize`): filled from ``checkpoint`` (a DCP directory or HF
    safetensors) when given, else initialised by ``init_fn(module)`` or each module's own
    ``reset_parameters()`` and the model's ``_init_weights``, seeded per module from ``seed``, so the
    weights are the same under every plan (and as ``whalepy.materialize(model, seed=seed)``).

    ``max_grad_norm`` clips the gradients to that global 2-norm before each optimizer step (the norm
    over the whole model, whatever the layout; :attr:`ParallelModel.last_grad_norm`). ``log_every``
    reports step, loss, step time, tokens/s, MFU and peak memory every that many steps on rank 0
    (logger ``"whalepy"``; a ``rich`` progress line on a terminal when ``rich`` is installed). The plan
    being lowered is logged on rank 0 in any case, one line per stage. ``metrics``: sinks that receive
    each report's record (:mod:`whalepy.runtime.metrics`: ``JsonlSink``, ``TensorBoardSink``,
    ``WandbSink``; rank 0); ``total_steps`` adds an ETA to it.

    ``lr_scheduler`` is a factory ``optimizer -> LRScheduler`` (any ``torch.optim.lr_scheduler``), applied
    to each optimizer this rank builds and stepped after every optimizer step; its state, the step count,
    RNG states and a loader's position go into :meth:`ParallelModel.save` (docs/training.md).
    """
    from whalepy.frontend.checks import (as_cluster, check_example_inputs, check_nvme_dir, check_positive_int,
                                         check_profile_of_model)

    launched = is_distributed_launch()
    if launched:
        install_error_hook()  # a user error below prints once and ends every rank (runtime/launch_errors.py)
    if cluster_spec is not None:  # None works with a given plan; planning without one says so
        cluster_spec = as_cluster(cluster_spec, "whalepy.parallelize()")
    if launched:
        _init_process_group(cluster_spec)  # first: the hook then counts failures in the job's store
        install_error_hook()
    _check_arguments(model, loss_fn, optimizer)
    _check_training_options(max_grad_norm, log_every)
    check_job_options(lr_scheduler, total_steps, metrics)
    _check_lowering_options(loss_parallel=loss_parallel, sync_initial_weights=sync_initial_weights, seed=seed,
                            init_fn=init_fn, profile=profile, checkpoint=checkpoint)
    check_profile_of_model(profile, model, "parallelize(profile=...)")
    check_nvme_dir(nvme_dir, nvme_keep, on_node=launched and nvme_dir is not None)
    check_positive_int(global_batch, "global_batch", "whalepy.parallelize()")
    check_example_inputs(model, example_inputs, "whalepy.parallelize()")
    if plan is not None and not isinstance(plan, Plan):
        raise ArgumentError(f"parallelize(plan=...) takes a whalepy.Plan, got {type(plan).__name__}; load one "
                            "with whalepy.Plan.load('plan.json', model=model)")
    inputs = _as_tuple(example_inputs)
    if checkpoint is not None:
        checkpoint_kind(checkpoint)  # a bad path fails here, before planning and lowering
        if not has_meta_tensors(model):
            raise WhalepyError("parallelize(checkpoint=...) fills a model built on the meta device; this "
                               "model already holds its weights. Build it under `with "
                               "torch.device('meta'):`, or call .load(path) on the result (DCP)")
    if plan is None and os.environ.get("WHALEPY_PLAN"):
        plan = Plan.load(os.environ["WHALEPY_PLAN"])  # from `whalepy run --plan`
    if plan is None:
        from whalepy.planner import plan as make_plan_

        clip = options.get("clip_gradients", max_grad_norm is not None)
        if clip is not (max_grad_norm is not None) and isinstance(clip, bool):
            raise ArgumentError(
                f"parallelize(clip_gradients={clip}, max_grad_norm={max_grad_norm!r}): the planner's "
                "clip_gradients follows max_grad_norm (clipping makes ZeRO-Offload step after the backward); "
                "drop clip_gradients and set max_grad_norm (or None) instead")
        if max_grad_norm is not None:  # ZeRO-Offload then steps after the backward (costed so)
            options.setdefault("clip_gradients", True)

        def solve() -> Plan:
            if profile is not None and (getattr(profile, "measured", None) is not None or not options.get("measure")):
                # the caller's profile (measured with profile(..., measure=True), or captured once) is what
                # the plan is made from (whalepy.plan(profile=...)): the model is not captured again
                return make_plan_(model, cluster_spec, global_batch=global_batch, profile=profile,
                                  **{k: v for k, v in options.items() if k != "measure"})
            return make_plan_(model, cluster_spec, example_inputs=example_inputs, global_batch=global_batch,
                              **options)

        if is_distributed_launch():
            _init_process_group(cluster_spec)
            plan = _plan_once(solve)
        else:
            plan = solve()
    elif options:
        raise ArgumentError(f"parallelize() got planner options {sorted(options)} together with a plan; the "
                            "plan is used as it is: drop the options, or drop plan= to re-plan with them")
    if plan.global_batch != global_batch:
        raise PlanError(f"the plan is for a global batch of {plan.global_batch}, parallelize() was "
                        f"given global_batch={global_batch}; re-plan or pass the plan's batch")
    if not is_distributed_launch():
        _check_plan_cluster(plan, cluster_spec)
        global _hint_printed
        if not _hint_printed:
            print(f"whalepy: {launch_hint(plan.world_size)}", file=sys.stderr)
            _hint_printed = True
        return UnlaunchedModel(plan=plan, module=model)

    device_type = _init_process_group(cluster_spec)
    rank = dist.get_rank()
    check_world(plan)  # the launch against the plan first: its message says how to launch
    _check_plan_cluster(plan, cluster_spec)
    check_tiles(plan)  # memory-centric tiling only where it is lowered, before profiling
    mine = next(st for st in plan.stages if rank in st.all_ranks)  # the disk tier's space, before any lowering
    if stage_has_disk_tier(mine):
        check_nvme_dir(nvme_dir, nvme_keep, on_node=True)
    check_plan_disk_space(plan, rank, nvme_dir)  # collective: the files of every rank on a file system, summed
    _check_device(plan, cluster_spec, rank)
    if plan.model_fingerprint != "unchecked":
        profile = profile if profile is not None else _profile_or_none(model, example_inputs, plan)
        if profile is not None:
            try:
                plan.check_model(profile.fingerprint)
            except PlanError as e:
                raise LaunchError(str(e)) from None
    if profile is not None:
        from whalepy.planner.check import check_plan

        check_plan(plan, profile, model)  # a hand-edited plan fails here, not inside torch
    if plan.costs_stale and rank == 0:
        log.warning("whalepy: the plan was edited after its costs were computed; its predicted figures are "
                    "stale (re-run `whalepy plan` or `whalepy estimate` to update them)")
    ctx = LowerContext(device_type=device_type, cluster_spec=cluster_spec, example_inputs=inputs,
                       loss_fn=_checked_loss(loss_fn), optimizer_factory=optimizer, profile=profile,
                       loss_parallel=loss_parallel, sync_initial_weights=sync_initial_weights, nvme_dir=nvme_dir,
                       nvme_keep=nvme_keep, init_fn=init_fn, seed=seed, checkpoint=checkpoint,
                       max_grad_norm=max_grad_norm, log_every=log_every, lr_scheduler=lr_scheduler,
                       total_steps=total_steps, metrics=metrics)
    return ParallelModel(lower(model, plan, ctx), plan, ctx)


@dataclass
class UnlaunchedModel:
    """What ``parallelize`` returns outside a distributed launch: the plan, and a ``train_step`` that
    says how to launch."""

    plan: Plan
    module: nn.Module

    @property
    def optimizer(self) -> None:
        return None

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise LaunchError(f"not inside a distributed launch: {launch_hint(self.plan.world_size)}")

    state_dict = save = load = load_state_dict = evaluate = full_state_dict = train_step  # type: ignore[assignment]
    batch_sampler = local_batch = train_step  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        """Any other part of :class:`ParallelModel` (``measured_profile``, ``close``, ``device``...) says how
        to launch too, rather than an AttributeError naming this class."""
        if not name.startswith("_") and hasattr(ParallelModel, name):
            raise LaunchError(f"ParallelModel.{name} is not available: not inside a distributed launch: "
                              f"{launch_hint(self.plan.world_size)}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class ParallelModel:
    """This rank's part of the model, its optimizer and the step that trains them.

    Every rank passes :meth:`train_step` the full global batch (each replica takes its contiguous slice,
    ``batch_shares`` in replica order, so scripts stay the same as single-process ones) or only its
    replica's share (:attr:`local_share`, :meth:`batch_sampler`; docs/training.md).
    """

    def __init__(self, lowered: Lowered, plan: Plan, ctx: LowerContext) -> None:
        """Take over what :func:`~whalepy.runtime.lower.lower` built for this rank (it builds nothing)."""
        m = self.meshes = lowered.meshes
        self.plan = plan
        self.loss_fn = ctx.loss_fn
        self.loss_parallel = ctx.loss_parallel
        self.max_grad_norm = ctx.max_grad_norm
        self.last_grad_norm: float | None = None
        self._batch = lowered.batch  # what train_step checks a batch against
        self.pseudo: PseudoBuild | None = lowered.pseudo  # what whalepy.delink builds the real model from
        self._hf_config = lowered.config  # what save() writes as config.json
        self.block_modules = lowered.blocks.modules  # block name -> module paths (whalepy.trace_memory)
        self.compile_stats = lowered.compiled  # plan.compile: modules, fallbacks, first-call seconds
        start = sum(plan.batch_shares[: m.replica])
        self._slice = slice(start, start + plan.batch_shares[m.replica])
        self.loss_scale = share_scale(plan, m)
        self.dp_kind = lowered.kind
        self.num_stages = plan.pp_degree * plan.virtual_stages  # physical stage s holds s, s + pp, ...
        self.stage_indices = [part.index for part in lowered.parts]
        self._modules: list[nn.Module] = [part.module for part in lowered.parts]
        self._tied: list[Tied] = lowered.tied
        # names of each tied parameter across stages (checkpoints carry its state under all of them)
        self._tied_aliases = [[n for _, n in t.holders] for t in lowered.tied]
        self.checkpoint_host_bytes: dict[nn.Module, int] = lowered.checkpoint_host_bytes
        """Per module of a block with ``checkpoint_offload``: host bytes its last forward kept."""
        self.init_stats: MaterializeStats | None = lowered.stats
        self.optimizer: torch.optim.Optimizer | None = lowered.optim.optimizer
        self.host_optimizer: HostOptimizer | None = lowered.optim.host
        self.nvme: NvmeTier | None = lowered.optim.nvme
        self.amp: AmpContext = lowered.optim.amp
        self._joint: JointStep | None = lowered.optim.joint
        self.schedule = lowered.schedule
        # contributions to the reported loss: one rank per replica (last stage, TP index 0)
        self._reports_loss = m.stage.index == plan.pp_degree - 1 and m.tp_index == 0
        self.reporter = StepReporter(plan, m.device, ctx.log_every, sinks=ctx.metrics, total_steps=ctx.total_steps,
                                     timer=build_block_timer(lowered, plan, ctx))
        self._profile = ctx.profile  # what measured_profile() merges this run's block times into
        self.step = 0
        """Optimizer steps taken (restored by :meth:`load`)."""
        opts = [self.optimizer] + (self.host_optimizer.optimizers if self.host_optimizer is not None else [])
        self.lr_schedulers: list[Any] = [ctx.lr_scheduler(o) for o in opts if o is not None] if ctx.lr_scheduler else []
        self.local_share = local_share(plan, m.replica, self.stage_indices, self.num_stages)
        """What this rank reads of each global batch (:class:`~whalepy.runtime.data.LocalShare`)."""
        self._pending_save: Any = None
        self._pending_commit: Any = None

    # -- public --------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module | list[nn.Module]:
        """This rank's module (the wrapped model), or its list of pipeline stage modules."""
        return self._modules if self.plan.pp_degree > 1 else self._modules[0]

    @property
    def tied_parameters(self) -> list[list[nn.Parameter]]:
        """This rank's copies of parameters tied across pipeline stages (their gradients are summed
        over the pipeline ranks holding a copy before each optimizer step)."""
        return [t.params for t in self._tied]

    @property
    def device(self) -> torch.device:
        return self.meshes.device

    def train_step(self, inputs: Any, targets: torch.Tensor | None) -> torch.Tensor:
        """One optimizer step on the global batch; returns its mean loss. Pass the whole global batch
        ``(inputs, targets)`` or this rank's share of it (:attr:`local_share`; ``None`` for what this
        rank's pipeline stage does not use)."""
        self.reporter.step_started()
        inputs, targets = self._local_batch("train_step", inputs, targets)
        if self.host_optimizer is not None:
            self.host_optimizer.start_step()
        if self.schedule is not None:
            local = self._pipeline_step(inputs, targets)
        else:
            local = self._accumulate(inputs, targets)
        if self.host_optimizer is not None:
            self.host_optimizer.finish()
        optimizer = self._joint if self._joint is not None else self.optimizer
        scale_before = self.amp.loss_scale()
        if optimizer is not None:
            max_norm = self.max_grad_norm
            # clipping, or a report's grad norm (max_norm inf: the norm alone, gradients unchanged)
            clip = ((lambda: self._clip_grads(max_norm if max_norm is not None else float("inf")))
                    if max_norm is not None or self.reporter.reports_next() else None)
            norm = self.amp.clip_and_step(optimizer, clip)  # type: ignore[arg-type]
            if norm is not None:
                self.last_grad_norm = float(norm)
            optimizer.zero_grad(set_to_none=True)
        for scheduler in self.lr_schedulers:
            scheduler.step()
        self.step += 1
        report = self._mean_loss(local)
        self.reporter.step_done(report, self._tokens(inputs), extra=self._step_metrics(scale_before))
        return report

    def _step_metrics(self, scale_before: float) -> dict[str, Any]:
        """The record fields only the model knows (:mod:`whalepy.runtime.metrics`)."""
        opt = self.optimizer or (self.host_optimizer.optimizers[0] if self.host_optimizer is not None else None)
        return {"grad_norm": self.last_grad_norm, "lr": float(opt.param_groups[0]["lr"]) if opt else None,
                "loss_scale": scale_before if self.amp.scaler is not None else None,
                "skipped": self.amp.scaler is not None and self.amp.loss_scale() < scale_before}

    # -- data ----------------------------------------------------------------------------------

    def batch_sampler(self, dataset: Any, *, shuffle: bool = True, seed: int = 0) -> ShardedBatchSampler:
        """A ``batch_sampler`` yielding the dataset indices of this rank's share of each global batch
        (``DataLoader(dataset, batch_sampler=pm.batch_sampler(dataset))``); ``dataset`` may be its length.
        The same order on every rank, a function of ``seed`` and the epoch; resumable (its state is its
        position). See :mod:`whalepy.runtime.data`."""
        return ShardedBatchSampler(dataset_length(dataset), self.local_share, shuffle=shuffle, seed=seed)

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This replica's rows of global-batch tensors (what :meth:`train_step` takes of them)."""
        return tuple(self.local_share.slice(t) for t in tensors)

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of ``loss_fn`` on the global batch ``(inputs, targets)``, forward only: no
        gradients, no update, modules in eval mode (dropout off) for the call. Every rank passes the
        whole batch, as to :meth:`train_step`; the same micro-batches and pipeline schedule run
        forward."""
        inputs, targets = self._local_batch("evaluate", inputs, targets)
        was_training = [(mod, mod.training) for root in self._modules for mod in root.modules()]
        for root in self._modules:
            root.eval()
        try:
            if self.schedule is not None:
                local = self._pipeline_step(inputs, targets, train=False)
            else:
                n = self.plan.num_microbatches
                chunks = list(zip(*(x.chunk(n) for x in inputs), strict=True)) if inputs else [()] * n
                total = torch.zeros((), device=self.device)
                with self._loss_context():
                    for xs, y in zip(chunks, targets.chunk(n), strict=True):
                        with self.amp.autocast():
                            loss = self.loss_fn(self._modules[0](*xs), y)
                        total = total + _full(loss).detach().float()
                local = total / n
        finally:
            for mod, flag in was_training:
                mod.training = flag
        return self._mean_loss(local)

    def _local_batch(self, what: str, inputs: Any, targets: Any) -> tuple[tuple, torch.Tensor | None]:
        """Check a global batch or a local share and take this replica's share, on this rank's device."""
        inputs, targets = take_local(what, inputs, targets, self.local_share, self._check_batch)
        return (tuple(x.to(self.device) for x in inputs),
                targets.to(self.device) if targets is not None else None)

    def _mean_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss on every rank, from this rank's share of it."""
        share = self.plan.batch_shares[self.meshes.replica] / self.plan.global_batch
        report = (local.detach().float() * share if self._reports_loss
                  else torch.zeros((), device=self.device))
        dist.all_reduce(report)
        return report

    def _tokens(self, local_inputs: tuple) -> int | None:
        """Tokens in one global batch: the plan's sequence length, else dim 1 of integer (token id)
        inputs; None when the inputs are not token sequences."""
        if self.plan.seq_len:
            return self.plan.global_batch * self.plan.seq_len
        x = local_inputs[0] if local_inputs else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
            return self.plan.global_batch * int(x.shape[1])
        return None

    def _check_batch(self, inputs: tuple) -> None:
        """Inputs a pipeline can run (the shapes it was built for) and the model can take (as many as the
        example inputs, with as many dims, its positions and its token ids)."""
        shapes = self._batch.example_shapes
        if len(inputs) != self._batch.num_inputs:
            raise ArgumentError(f"train_step: got {len(inputs)} model inputs, the example inputs had "
                                f"{self._batch.num_inputs}; pass the inputs as a tuple like example_inputs and the "
                                "targets separately: train_step(inputs, targets)")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                continue
            if x.device.type == "meta":
                raise ArgumentError(f"train_step: inputs[{i}] is on the meta device (no data); pass real tensors")
            if i < len(shapes) and x.dim() != len(shapes[i]) + 1:
                raise ArgumentError(
                    f"train_step: inputs[{i}] has shape {tuple(x.shape)}, {x.dim()} dims where the example input had "
                    f"{len(shapes[i]) + 1} (batch, {', '.join(map(str, shapes[i]))}); "
                    "pass batches shaped like the example inputs")
            if i == 0:
                check_token_ids(x, self._batch.vocab, "train_step", "inputs[0]")
            if x.dim() < 2:
                continue
            if self._batch.max_positions and not x.is_floating_point() and x.shape[1] > self._batch.max_positions[0]:
                raise ArgumentError(
                    f"train_step: inputs[{i}] has {x.shape[1]} tokens per sample but the model has "
                    f"{self._batch.max_positions[0]} positions ({self._batch.max_positions[1]}); shorten the sequences")
            if self.schedule is not None and i < len(shapes) \
                    and tuple(x.shape[1:]) != shapes[i]:
                raise ArgumentError(
                    f"train_step: inputs[{i}] has per-sample shape {tuple(x.shape[1:])}, the pipeline was built "
                    f"for {shapes[i]} (the example inputs); pass batches of that shape, or "
                    "parallelize with example inputs of this one")

    def _clip_grads(self, max_norm: float) -> torch.Tensor:
        from whalepy.runtime._clip import clip_grad_norm

        params: list[Any] = [p for mod in self._modules for p in mod.parameters()]
        params += host_grad_params(self.host_optimizer)
        tied = [(t.params, max(len({k % self.plan.pp_degree for k, _ in t.holders}), 1)) for t in self._tied]
        return clip_grad_norm(params, max_norm, device=self.device,
                              pp_group=self.meshes.pp_group if self.plan.pp_degree > 1 else None, tied=tied)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state by original module paths (DTensors; ZeRO-Offload: the host tensors
        themselves, the fp32 masters as weights) and under fp16 the loss scaler's (``"loss_scaler"``)."""
        return {**get_train_state(self._modules, self._optimizers()), **self.amp.state_dict()}

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers a checkpoint covers: the device one and the host optimizer's state view."""
        view = self.host_optimizer.state_view() if self.host_optimizer is not None else None
        return [o for o in (self.optimizer, view) if o is not None]

    def _after_load(self, state: dict[str, Any], source: str) -> None:
        self.amp.load_state_dict(state, source)
        if self.host_optimizer is not None:
            self.host_optimizer.after_load()
        if self.nvme is not None:
            self.nvme.offload()  # loaded states are fresh tensors: back into their files

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_train_state(self._modules, self._optimizers(), state)
        self._after_load(state, "the state dict")

    def full_state_dict(self, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's unsharded state dict (original names; ZeRO-Offload's fp32 masters) on rank 0,
        ``{}`` elsewhere, gathered one tensor at a time (to the CPU with ``cpu_offload``). Collective."""
        stage_ranks = [[r for row in s.ranks for r in row] for s in self.plan.stages]
        return gather_full_state_dict(self._modules, stage_ranks=stage_ranks, cpu_offload=cpu_offload,
                                      masters=master_weights(self._modules, self._optimizers()))

    def save(self, path: str | Path, *, loader: Any = None, async_save: bool = False) -> Any:
        """Write a distributed checkpoint (DCP) directory; loadable under any plan for this model.
        It holds the model, the optimizer, the fp16 loss scaler, the step, the LR schedulers, every rank's
        RNG states and ``loader``'s ``state_dict()`` (its position; docs/training.md). An HF model's
        config goes along as ``config.json`` (for ``whalepy export``). Crash-safe: the directory is
        written beside ``path`` and renamed into place once complete and checksummed
        (:mod:`whalepy.runtime.commit`); an existing checkpoint at ``path`` is replaced only then.
        ``async_save``: staged in memory, written in the background by ``dcp.async_save``, checksummed
        and committed at the next :meth:`wait_for_save` (the next save, a load, :meth:`close`); returns
        its future. Until then the last complete checkpoint is what a crash leaves."""
        from whalepy.runtime.commit import begin_commit, finish_commit, save_committed
        from whalepy.runtime.dcp_files import check_save_path

        check_save_path(path)
        check_loader(loader, "save")
        self.wait_for_save()
        extra = {**self.amp.state_dict(), **job_state(step=self.step, schedulers=self.lr_schedulers,
                                                      loader=loader, device=self.device)}
        files = {}
        saved = saved_config(*self._hf_config)
        if dist.get_rank() == 0 and saved is not None:
            # an HF config as save_pretrained writes it (with the model class), or a whalepy model's
            files["config.json"] = (json.dumps(saved, indent=2, sort_keys=True) + "\n").encode()
        if async_save:
            partial = begin_commit(path)
            future = save_train_state(partial, self._modules, self._optimizers(), aliases=self._tied_aliases,
                                      extra=extra, async_save=True)
            self._pending_save = future
            self._pending_commit = lambda: finish_commit(path, partial, files)
        else:
            save_committed(path, lambda directory: save_train_state(
                directory, self._modules, self._optimizers(), aliases=self._tied_aliases, extra=extra), files)
        self.reporter.not_waiting_for_data()
        return self._pending_save

    def wait_for_save(self) -> None:
        """Block until the last asynchronous :meth:`save` has been written, then checksum and commit it
        (collective: every rank calls it, as every rank called :meth:`save`)."""
        if self._pending_save is not None:
            self._pending_save.result()
            self._pending_save = None
        if self._pending_commit is not None:
            commit, self._pending_commit = self._pending_commit, None
            commit()

    def load(self, path: str | Path, *, loader: Any = None) -> None:
        """Restore what :meth:`save` wrote (written under any plan): model, optimizer, loss scaler, step,
        LR schedulers, RNG states, and ``loader``'s position when given."""
        from whalepy.runtime.dcp_files import read_metadata

        check_loader(loader, "load")
        self.wait_for_save()
        template = job_template(set(read_metadata(path).state_dict_metadata))
        extra = load_train_state(path, self._modules, self._optimizers(), extra={**self.amp.state_dict(), **template})
        self._after_load(extra, f"the checkpoint {path}")
        step = restore_job_state(extra, schedulers=self.lr_schedulers, loader=loader, device=self.device,
                                 source=f"the checkpoint {path}")
        if step is not None:
            self.step = self.reporter.steps = step

    def measured_profile(self) -> Any:
        """The model profile the run was lowered with (a copy), with the block times and optimizer rate
        this run measured on its sampled step merged in as measured costs
        (:class:`~whalepy.ir.measured.MeasuredCosts`, for rank 0's device type; complete on every rank):
        ``whalepy.plan(model, cluster, profile=pm.measured_profile(), global_batch=...)`` re-plans from
        them. None before that step (:data:`~whalepy.runtime._report.SAMPLED_STEP`, the 6th) has run."""
        timing = self.reporter.timing
        if timing is None:
            return None
        if timing.measured is None or self._profile is None:
            raise WhalepyError("measured_profile(): this run has no model profile to key its block times by (the "
                               "plan's fingerprint is 'unchecked'); pass profile=whalepy.profile(model, "
                               "example_inputs) to whalepy.parallelize")
        return merge_measured(self._profile, timing.measured)

    @property
    def observed(self) -> ObservedStep | None:
        """What the plan check measured against the plan's predictions (steps 3-5), with the sampled
        step's per-block and per-stage times (``timing``) once it has run; None before step 5."""
        return self.reporter.observed

    def close(self) -> None:
        """Finish an asynchronous save and the disk tier's writes, remove the disk tier's files (kept
        with ``nvme_keep``) and close the metrics sinks."""
        self.wait_for_save()
        self.reporter.close()
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None

    # -- steps ---------------------------------------------------------------------------------

    def _loss_context(self) -> Any:
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return _Null()

    def _accumulate(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        n = self.plan.num_microbatches
        module = self._modules[0]
        chunks = list(zip(*(x.chunk(n) for x in inputs), strict=True)) if inputs else [()] * n
        tchunks = targets.chunk(n)
        total = torch.zeros((), device=self.device)
        for i, (xs, y) in enumerate(zip(chunks, tchunks, strict=True)):
            last = i == n - 1
            # reduce_every_microbatch: FSDP2 reduce-scatters every micro-batch into the sharded gradients
            sync = last or self.plan.stages[self.stage_indices[0]].reduce_every_microbatch
            with _sync_context(module, self.dp_kind, sync), self._loss_context():
                with self.amp.autocast():
                    loss = self.loss_fn(module(*xs), y)
                self.amp.scale(loss * (self.loss_scale / n)).backward()
            total = total + _full(loss).detach()
        return total / n

    def _pipeline_step(self, inputs: tuple, targets: torch.Tensor, train: bool = True) -> torch.Tensor:
        from whalepy.runtime.pipeline import run_pipeline_step

        first = 0 in self.stage_indices
        last = self.num_stages - 1 in self.stage_indices
        loss_scale = self.amp.loss_scale()  # fp16: the dynamic scale the schedule's losses carry
        with self.amp.autocast():
            total = run_pipeline_step(self.schedule, first, last, inputs, targets, train=train)
        if train:
            sync_tied_grads(self._tied, self.device)
        if total is None:
            return torch.zeros((), device=self.device)
        return total / (self.loss_scale * loss_scale)  # the schedule's losses carry the share scale
