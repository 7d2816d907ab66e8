"""``parallelize``: lower a :class:`~whalepy.Plan` onto this rank and train it.

Lowering order for this rank (see docs/runtime.md):

1. launch checks (world size, model fingerprint, device type of this rank);
2. meshes from the plan's rank grid (``mesh.build_meshes``);
3. pipeline split into this rank's stage module(s), original module paths kept (``pipeline.py``);
4. tensor parallelism from the plan's TP rules (``tensor_parallel.apply_tensor_parallel``);
5. memory-centric tiling of the blocks with ``tiles > 1`` (``tiling.py``), then activation
   checkpointing (its input kept on the device, or in host memory), or activation offload to host
   memory, of the blocks the plan marks (``_activations.py``);
6. DDP / ZeRO / FSDP2 over the ``dp`` axis, per block then root (``data_parallel``); a model built on
   the meta device has gone through 3-6 without memory and only now gets this rank's shards,
   initialised or loaded (``materialize``);
7. the optimizer from the user's factory over this rank's (now sharded) parameters;
8. the pipeline schedule over the stage modules.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.ir.rules import (LoweringKind, check_pipeline, choose_lowering_kind, host_steps_after_backward,
                              steps_on_host)
from whalepy.errors import ArgumentError, LaunchError, PlanError, WhalepyError
from whalepy.log import info_once, is_rank0, warn_once
from whalepy.runtime.pseudo_record import PseudoBuild, record_pseudo
from whalepy.frontend.checks import check_token_ids, max_positions, token_vocab
from whalepy.ir.plan import Plan, Tier, TPStyle
from whalepy.runtime.checkpointing import (
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_checkpoint_offload,
    gather_full_state_dict,
    get_train_state,
    load_train_state,
    master_weights,
    save_train_state,
    set_train_state,
)
from whalepy.runtime.data_parallel import (
    apply_data_parallel,
    build_optimizer,
    cast_sharded_params,
    check_root_tiers,
    compute_dtype,
    offloads_any_block,
    wrap_ddp,
)
from whalepy.runtime.materialize import (
    InitFn,
    MaterializeStats,
    checkpoint_kind,
    has_meta_tensors,
    materialize_modules,
    snapshot,
)
from whalepy.runtime.mesh import RankMeshes, build_meshes, check_world
from whalepy.runtime._amp import AmpContext
from whalepy.runtime.model_config import saved_config
from whalepy.runtime._report import StepReporter, plan_log_lines
from whalepy.runtime._train_state import check_loader, job_state, job_template, restore_job_state
from whalepy.runtime.data import ShardedBatchSampler, dataset_length, local_share, take_local
from whalepy.runtime.metrics import check_job_options
from whalepy.runtime._joint_step import JointStep, host_grad_params
from whalepy.runtime.held import offloaded_params
from whalepy.runtime.host_optimizer import HostOptimizer, fused_variant
from whalepy.runtime.nvme import NvmeTier, build_nvme_tier
from whalepy.runtime.optimizer_impl import optimizer_factory_for
from whalepy.runtime.compile_blocks import CompileStats, compile_blocks
from whalepy.runtime.launch_errors import install_error_hook
from whalepy.runtime.tensor_parallel import apply_tensor_parallel
from whalepy.runtime.tiling import check_tiles, plan_tiling, tile_model
from whalepy.runtime._pm_setup import (
    _check_arguments,
    _check_lowering_options,
    _check_training_options,
    _explain_fsdp_view_warning,
    _init_process_group,
    _plan_once,
)
from whalepy.runtime._pm_helpers import (  # noqa: F401 - _checked_loss: tests import it from here
    LossFn,
    _checked_loss,
    _check_reduce_every_microbatch,
    _Null,
    _sync_context,
    _full,
    _as_tuple,
    _resize_batch,
    _broadcast_weights,
    _profile_or_none,
    _pipeline_chunks,
    _resolve_block_modules,
    _check_device,
    _check_plan_cluster,
)

__all__ = ["ParallelModel", "UnlaunchedModel", "is_distributed_launch", "parallelize"]

log = logging.getLogger("whalepy.runtime")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

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
    when the caller already has it (block -> module mapping and fingerprint check); otherwise it is
    computed when needed. ``loss_parallel=True`` keeps an LM head's logits vocab-sharded and runs
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
    from whalepy.frontend.checks import as_cluster, check_example_inputs, check_nvme_dir, check_positive_int

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
    if any(Tier.NVME in (b.param_tier, b.optimizer_tier) for b in mine.blocks):
        check_nvme_dir(nvme_dir, nvme_keep, on_node=True, needed_bytes=mine.cost.nvme_state_bytes)
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
    return ParallelModel(model, plan, cluster_spec=cluster_spec, example_inputs=inputs,
                         loss_fn=loss_fn, optimizer_factory=optimizer, profile=profile,
                         device_type=device_type, loss_parallel=loss_parallel,
                         sync_initial_weights=sync_initial_weights, nvme_dir=nvme_dir,
                         init_fn=init_fn, seed=seed, checkpoint=checkpoint,
                         max_grad_norm=max_grad_norm, log_every=log_every, nvme_keep=nvme_keep,
                         lr_scheduler=lr_scheduler, total_steps=total_steps, metrics=metrics)


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


class ParallelModel:
    """This rank's part of the model, its optimizer and the step that trains them.

    Every rank passes :meth:`train_step` the full global batch (each replica takes its contiguous slice,
    ``batch_shares`` in replica order, so scripts stay the same as single-process ones) or only its
    replica's share (:attr:`local_share`, :meth:`batch_sampler`; docs/training.md).
    """

    def __init__(self, model: nn.Module, plan: Plan, *, cluster_spec: Any, example_inputs: tuple,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, profile: Any,
                 device_type: str, loss_parallel: bool, sync_initial_weights: bool,
                 nvme_dir: str | os.PathLike[str] | None = None, init_fn: InitFn | None = None,
                 seed: int = 0, checkpoint: str | os.PathLike[str] | None = None,
                 max_grad_norm: float | None = None, log_every: int | None = None,
                 nvme_keep: bool = False, lr_scheduler: SchedulerFactory | None = None,
                 total_steps: int | None = None, metrics: Sequence[Any] = ()) -> None:
        check_pipeline(plan.schedule, num_stages=plan.pp_degree, virtual_stages=plan.virtual_stages,
                       num_microbatches=plan.num_microbatches,
                       sequence_parallel=any(r.style is TPStyle.SEQUENCE for r in plan.tensor_parallel),
                       where="the plan cannot be lowered (whalepy.plan never makes such a plan: re-plan)")
        _check_reduce_every_microbatch(plan)
        block_modules = _resolve_block_modules(model, plan, profile)
        if plan.pp_degree == 1:  # blocks of different tiers sharing a weight: refused before any work
            check_root_tiers(model, [(b, [model.get_submodule(p) for p in block_modules[b.name]])
                                     for b in plan.stages[0].blocks])
        tiling = plan_tiling(model, plan, block_modules)  # block -> {module: tiles}; checked here
        self.plan = plan
        self.loss_fn = _checked_loss(loss_fn)
        self._example_shapes = [tuple(x.shape[1:]) for x in example_inputs if isinstance(x, torch.Tensor)]
        self._num_inputs = len(example_inputs)
        self._max_positions = max_positions(model)
        first = example_inputs[0] if example_inputs else None  # token ids (integers) in, token ids checked
        self._vocab = (token_vocab(model) if isinstance(first, torch.Tensor) and not first.is_floating_point()
                       else None)  # before lowering shards the embedding
        self.loss_parallel = loss_parallel
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        if is_rank0():
            for line in plan_log_lines(plan):
                log.info("%s", line)
        # a pseudo model (layers tied by whalepy.pseudo_to_real): what whalepy.delink builds the real
        # model from (a meta copy made before lowering changes ``model``)
        self.pseudo: PseudoBuild | None = record_pseudo(
            model, cluster_spec=cluster_spec, example_inputs=example_inputs,
            optimizer_factory=optimizer_factory, nvme_dir=nvme_dir)
        self.meshes: RankMeshes = build_meshes(plan, device_type)
        m = self.meshes
        device = m.device
        # a meta-device model is lowered as it is and materialised shard by shard afterwards
        skeleton = snapshot(model) if has_meta_tensors(model) else None
        self._hf_config = getattr(model, "config", None), type(model)  # what save() writes as config.json
        if skeleton is None:
            model.to(device)
            if sync_initial_weights:
                _broadcast_weights(model)
        stage = m.stage
        self.block_modules = block_modules  # block name -> module paths (whalepy.trace_memory)
        start = sum(plan.batch_shares[: m.replica])
        self._slice = slice(start, start + plan.batch_shares[m.replica])
        dp, tp, pp = plan.dp_degree, stage.tp_degree, plan.pp_degree
        self.loss_scale = plan.batch_shares[m.replica] * dp / plan.global_batch
        offload = offloads_any_block(stage.blocks)
        self.dp_kind = choose_lowering_kind(stage.zero_stage, dp, tp=tp, pp=pp, offload=offload)
        if self.dp_kind == LoweringKind.FSDP and stage.zero_stage < 2 and dp > 1:
            # shards more than planned (less memory, the same gradient traffic): said, not silent; once
            # per job (rank 0), not once per stage or per call
            why = "tensor parallelism" if tp > 1 else "pipeline stages" if pp > 1 else "host offload"
            warn_once(f"fsdp-lowering-{why}",
                      "whalepy: ZeRO-0/1 stages lowered to FSDP2 (reshard_after_forward=False): DDP does not "
                      "compose with %s (same numerics; states sharded over the replicas)", why, log=log)
        if self.dp_kind == LoweringKind.FSDP and tp > 1:
            _explain_fsdp_view_warning()

        v = plan.virtual_stages
        self.num_stages = pp * v  # pipeline stages; physical stage s holds s, s + pp, ...
        self._tied: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]] = []
        tied_names: list[tuple[list[tuple[int, str]], dist.ProcessGroup | None]] = []
        if pp > 1:
            from whalepy.runtime.pipeline import retarget_device, split_stages, tied_parameters

            chunks = _pipeline_chunks(plan)  # BlockPlans of each pipeline stage, in model order
            stage_blocks = [[mod for b in c for mod in block_modules[b.name]] for c in chunks]
            mb = plan.batch_shares[m.replica] // plan.num_microbatches
            self._example_mb = tuple(_resize_batch(x, mb) for x in example_inputs)
            # a meta model is traced with meta inputs, so every device the glue records (HF's
            # arange(..., device=inputs_embeds.device)) is meta and is retargeted to this rank's
            trace_mb = self._example_mb if skeleton is None else tuple(
                x.to("meta") if isinstance(x, torch.Tensor) else x for x in self._example_mb)
            all_stages = split_stages(model, trace_mb, {}, stage_blocks)
            self.stage_indices = [stage.index + j * pp for j in range(v)]
            local = [all_stages[g] for g in self.stage_indices]
            for stage_module in local:
                # before TP / FSDP2: recompiling a GraphModule whose class FSDP2 has subclassed
                # recurses without end in torch.fx's call wrapper
                retarget_device(stage_module, device)
            local_chunks = [chunks[g] for g in self.stage_indices]
            tied_names = self._tied_groups(tied_parameters(all_stages), dp_kind=self.dp_kind, tp=tp)
        else:
            self.stage_indices = [0]
            local = [model]
            local_chunks = [list(stage.blocks)]

        self._modules: list[nn.Module] = []
        self.compile_stats: CompileStats | None = None
        """Compiled blocks on this rank (``plan.compile``): modules, fallbacks, first-call seconds."""
        self.checkpoint_host_bytes: dict[nn.Module, int] = {}
        """Per module of a block with ``checkpoint_offload``: host bytes its last forward kept."""
        nvme_blocks: list[tuple[Any, nn.Module, list[nn.Module]]] = []
        host_blocks: list[tuple[Any, list[nn.Module]]] = []
        defer_ddp = skeleton is not None and self.dp_kind in (LoweringKind.DDP, LoweringKind.ZERO1)
        for mod, chunk in zip(local, local_chunks):
            tile_model(mod, {p: t for b in chunk for p, t in tiling.get(b.name, {}).items()})
            blocks = [(b, [mod.get_submodule(p) for p in block_modules[b.name]]) for b in chunk]
            if tp > 1:
                apply_tensor_parallel(mod, plan.tensor_parallel, m.tp_mesh, loss_parallel=loss_parallel)
            ckpt = [x for b, mods in blocks if b.checkpoint and not b.checkpoint_offload for x in mods]
            if ckpt:
                apply_activation_checkpointing(ckpt)
            ckpt_host = [x for b, mods in blocks if b.checkpoint_offload for x in mods]
            if ckpt_host:
                apply_checkpoint_offload(ckpt_host, device, record=self.checkpoint_host_bytes)
            offloaded = [x for b, mods in blocks if b.activation_offload for x in mods]
            if offloaded:
                apply_activation_offload(offloaded, device)
            if plan.compile:  # each block's modules compiled, inside FSDP2 / DDP (compile_blocks.py)
                self.compile_stats = compile_blocks(blocks, stats=self.compile_stats)
            self._modules.append(apply_data_parallel(mod, blocks, m.dp_mesh,
                                                     kind=LoweringKind.NONE if defer_ddp else self.dp_kind,
                                                     zero=stage.zero_stage, device_type=device_type,
                                                     precision=plan.precision))
            nvme_blocks += [(b, self._modules[-1], mods) for b, mods in blocks
                            if Tier.NVME in (b.optimizer_tier, b.param_tier)]
            host_blocks += [(b, mods) for b, mods in blocks if steps_on_host(b.param_tier, b.optimizer_tier)]
        self.init_stats: MaterializeStats | None = None
        if skeleton is not None:
            self.init_stats = materialize_modules(self._modules, skeleton, device, seed=seed,
                                                  init_fn=init_fn, checkpoint=checkpoint)
        if defer_ddp:  # DDP reads its parameters when built: wrapped once they hold values
            wrapped = {id(mod): wrap_ddp(mod, m.dp_mesh) for mod in self._modules}
            self._modules = [wrapped[id(mod)] for mod in self._modules]
            nvme_blocks = [(b, wrapped[id(root)], mods) for b, root, mods in nvme_blocks]
        # names of each tied parameter across stages (checkpoints carry its state under all of them)
        self._tied_aliases = [[n for _, n in holders] for holders, _ in tied_names]
        self._tied_aliases_holders = [holders for holders, _ in tied_names]
        # tied parameters by name, after TP / FSDP2 replaced them with DTensors
        for holders, group in tied_names:
            found = {id(p): p for i, g in enumerate(self.stage_indices) for k, name in holders if k == g
                     for p in [self._modules[i].get_parameter(name)]}
            self._tied.append((list(found.values()), group))
        # ZeRO-Offload blocks: their optimizer steps on the host during backward (after materialising,
        # so the hooks sit on the final shards); parameters tied across pipeline stages stay with the
        # device optimizer, their gradients are summed over the stages only after the backward
        self.host_optimizer: HostOptimizer | None = None
        after_backward = host_steps_after_backward(plan.precision, max_grad_norm is not None)
        if host_blocks:
            tied = {id(p) for ps, _ in self._tied for p in ps}
            low = compute_dtype(plan.precision)
            modules = self._modules
            self.host_optimizer = HostOptimizer(
                optimizer_factory, [(b.name, [p for mod in mods for p in mod.parameters() if id(p) not in tied])
                                    for b, mods in host_blocks], device,
                cast=(lambda ps: cast_sharded_params(modules, ps, low)) if low is not None else None,
                step_in_backward=not after_backward)
            info_once("zero-offload",
                      "whalepy: the optimizer of %d blocks steps on the host %s (ZeRO-Offload)",
                      len(self.host_optimizer.blocks),
                      "after backward (fp16 loss scaling / gradient clipping)" if after_backward else "during backward",
                      log=log)
        # read after the host optimizer, which under bf16 replaces its parameters on the modules by cast ones
        on_host = {id(p) for p in self.host_optimizer.params} if self.host_optimizer is not None else set()
        params = list({id(p): p for mod in self._modules for p in mod.parameters() if id(p) not in on_host}.values())
        self.optimizer = (build_optimizer(optimizer_factory_for(optimizer_factory, plan.optimizer_impl), params,
                                          kind=self.dp_kind, dp_mesh=m.dp_mesh)  # fused or as given: optimizer_impl.py
                          if params or self.host_optimizer is None else None)
        if self.optimizer is not None and offloaded_params(self._modules):
            # FSDP2 keeps these shards in host memory and the optimizer steps them there: its fused CPU
            # kernel, as the host optimizer does (cost_models/offload.py prices both at its rate)
            self.optimizer = fused_variant(self.optimizer)
        # the disk tier (after TP / FSDP2 and materialisation, so its files hold this rank's shards)
        self.nvme: NvmeTier | None = None
        if nvme_blocks:
            self.nvme = build_nvme_tier(self.optimizer, nvme_blocks, rank=m.rank, nvme_dir=nvme_dir,
                                        keep=nvme_keep, pin=device_type == "cuda",
                                        planned_file_bytes=stage.cost.nvme_state_bytes)
            log.info("whalepy: %d blocks keep parameters and / or optimizer states in files under %s",
                     len(nvme_blocks), self.nvme.directory)
        self.amp = AmpContext(plan.precision, device)
        # fp16, or ZeRO-Offload stepping after backward anywhere in the plan: every rank steps its
        # optimizers as one, with gradients on the same devices for the scaler (see _joint_step.py)
        self._joint: JointStep | None = None
        if self.amp.scaler is not None or (after_backward and any(
                steps_on_host(b.param_tier, b.optimizer_tier) for st in plan.stages for b in st.blocks)):
            self._joint = JointStep(self.optimizer, self.host_optimizer, device)
        self.schedule = None
        if pp > 1:
            from whalepy.runtime.pipeline import build_pipeline_schedule, microbatch_mean_loss

            schedule = plan.schedule
            self.schedule = build_pipeline_schedule(
                self._modules, self.stage_indices, num_stages=self.num_stages,
                schedule=schedule.value, num_microbatches=plan.num_microbatches,
                loss_fn=self.amp.scaled_loss(microbatch_mean_loss(self.loss_fn, plan.num_microbatches,
                                                                  scale=self.loss_scale)),
                group=m.pp_group, device=device, example_microbatch=self._example_mb,
                compute_dtype=self.amp.dtype)
        # contributions to the reported loss: one rank per replica (last stage, TP index 0)
        self._reports_loss = stage.index == pp - 1 and m.tp_index == 0
        self.reporter = StepReporter(plan, device, log_every, sinks=metrics, total_steps=total_steps)
        self.step = 0
        """Optimizer steps taken (restored by :meth:`load`)."""
        opts = [self.optimizer] + (self.host_optimizer.optimizers if self.host_optimizer is not None else [])
        self.lr_schedulers: list[Any] = [lr_scheduler(o) for o in opts if o is not None] if lr_scheduler else []
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
        return [params for params, _ in self._tied]

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
        if len(inputs) != self._num_inputs:
            raise ArgumentError(f"train_step: got {len(inputs)} model inputs, the example inputs had "
                                f"{self._num_inputs}; pass the inputs as a tuple like example_inputs and the "
                                "targets separately: train_step(inputs, targets)")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                continue
            if x.device.type == "meta":
                raise ArgumentError(f"train_step: inputs[{i}] is on the meta device (no data); pass real tensors")
            if i < len(self._example_shapes) and x.dim() != len(self._example_shapes[i]) + 1:
                raise ArgumentError(
                    f"train_step: inputs[{i}] has shape {tuple(x.shape)}, {x.dim()} dims where the example input had "
                    f"{len(self._example_shapes[i]) + 1} (batch, {', '.join(map(str, self._example_shapes[i]))}); "
                    "pass batches shaped like the example inputs")
            if i == 0:
                check_token_ids(x, self._vocab, "train_step", "inputs[0]")
            if x.dim() < 2:
                continue
            if self._max_positions and not x.is_floating_point() and x.shape[1] > self._max_positions[0]:
                raise ArgumentError(
                    f"train_step: inputs[{i}] has {x.shape[1]} tokens per sample but the model has "
                    f"{self._max_positions[0]} positions ({self._max_positions[1]}); shorten the sequences")
            if self.schedule is not None and i < len(self._example_shapes) \
                    and tuple(x.shape[1:]) != self._example_shapes[i]:
                raise ArgumentError(
                    f"train_step: inputs[{i}] has per-sample shape {tuple(x.shape[1:])}, the pipeline was built "
                    f"for {self._example_shapes[i]} (the example inputs); pass batches of that shape, or "
                    "parallelize with example inputs of this one")

    def _clip_grads(self, max_norm: float) -> torch.Tensor:
        from whalepy.runtime._clip import clip_grad_norm

        params: list[Any] = [p for mod in self._modules for p in mod.parameters()]
        params += host_grad_params(self.host_optimizer)
        tied = [(copies, max(len({k % self.plan.pp_degree for k, _ in holders}), 1))
                for (copies, _), holders in zip(self._tied, self._tied_aliases_holders)]
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
        """What the plan check saw (:class:`whalepy.runtime._report.ObservedStep`: mean step time of
        steps 3-5 and the allocator's peak, next to the plan's predictions), or None before step 5."""
        return self.reporter.observed

    def close(self) -> None:
        """Finish an asynchronous save and the disk tier's writes, remove the disk tier's files (kept
        with ``nvme_keep``) and close the metrics sinks."""
        self.wait_for_save()
        self.reporter.close()
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None

    # -- tied parameters -----------------------------------------------------------------------

    def _tied_groups(self, tied: list[list[tuple[int, str]]], *, dp_kind: str, tp: int
                     ) -> list[tuple[list[tuple[int, str]], dist.ProcessGroup | None]]:
        """For each parameter shared by several pipeline stages (tied weights), the process group of
        the pipeline ranks holding a copy, for this rank's ``(dp, tp)`` coordinate (Megatron-LM's
        embedding group). Groups are created on every rank in the same order (``dist.new_group`` is
        collective); entries this rank holds no copy of are dropped."""
        plan, pp = self.plan, self.plan.pp_degree
        me = self.meshes
        out = []
        for holders in tied:
            physical = sorted({k % pp for k, _ in holders})
            names = [n for _, n in holders]
            if len(physical) == 1 and len(holders) > 1 and (tp > 1 or dp_kind != LoweringKind.NONE):
                raise WhalepyError(
                    f"tied parameter {names[0]!r} (also {names[1:]}) sits in {len(holders)} virtual "
                    f"stages {[k for k, _ in holders]} of the same rank; with tensor or data "
                    "parallelism each would be sharded separately and the tie lost. Put the blocks "
                    "that share it in one virtual stage, or untie the weights")
            group = None
            if len(physical) > 1:
                for d in range(plan.dp_degree):
                    for t in range(plan.stages[0].tp_degree):
                        ranks = sorted(plan.stages[s].ranks[d][t] for s in physical)
                        g = dist.new_group(ranks)
                        if me.replica == d and me.tp_index == t and me.rank in ranks:
                            group = g
            if any(k in self.stage_indices for k, _ in holders):
                out.append((holders, group))
        return out

    def _sync_tied_grads(self) -> None:
        """Sum the gradient of each tied parameter over the pipeline ranks holding a copy, so every
        copy takes the same optimizer step (the copies are sharded alike by TP / FSDP2, so the local
        shards line up)."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for params, group in self._tied:
                if group is None and len(params) < 2:
                    continue
                grads = []
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
                        # a vocab-parallel embedding's gradient comes back whole (Replicate) where the
                        # column-parallel head's copy is sharded: bring it to the parameter's layout
                        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                    grads.append(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
                # copies in several virtual stages of this rank (interleaved schedules) are summed here
                # first, so every rank of the group makes one all-reduce per tied parameter
                total = grads[0].to(self.device, copy=True)
                for g in grads[1:]:
                    total += g.to(self.device)
                if group is not None:  # on the host tier NCCL has no CPU tensors: reduced on the device
                    dist.all_reduce(total, group=group)
                for g in grads:
                    g.copy_(total)

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
            self._sync_tied_grads()
        if total is None:
            return torch.zeros((), device=self.device)
        return total / (self.loss_scale * loss_scale)  # the schedule's losses carry the share scale
