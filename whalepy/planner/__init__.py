"""``whalepy.plan``: the fastest hybrid-parallel plan that fits, found by an ILP over the cost model.

Pipeline: profile (capture) -> enumerate outer candidates (:mod:`.search`) -> per candidate an ILP
(:mod:`.ilp`, formulation in its docstring) or exhaustive enumeration (:mod:`.exhaustive`), both costed
by :mod:`.costing` -> :class:`~whalepy.ir.plan.Plan` (:mod:`.build`). See docs/planner.md.
"""

from __future__ import annotations

import inspect
import numbers
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from whalepy.errors import ArgumentError, PlanError
from whalepy.hardware.cluster import ClusterSpec
from whalepy.ir.plan import Plan, Schedule
from whalepy.planner.margin import DEFAULT_MEMORY_MARGIN, MemoryMargin, parse_memory_margin
from whalepy.planner.runtime_costs import check_device_reserve
from whalepy.planner.build import build_alternatives, build_plan, raise_infeasible
from whalepy.planner.ilp import ILP_NODE_LIMIT
from whalepy.planner.search import run_search
from whalepy.planner.space import Hardware, RejectionKind
from whalepy.ir.profile import ModelProfile

SOLVERS = ("highs", "cbc", "exhaustive")


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Options of :func:`plan` (all keyword-only, validated)."""

    solver: str = "highs"
    """``"highs"`` (default; HiGHS in-process through highspy), ``"cbc"`` (CBC where pulp provides it:
    bundled with pulp 3, ``pulp[cbc]`` or a ``cbc`` on PATH with pulp 4; also the fallback, noted in
    ``plan.notes``, when HiGHS is unavailable) or ``"exhaustive"`` (small instances)."""
    ilp_node_limit: int = ILP_NODE_LIMIT
    """Work budget of one candidate's ILP, in branch-and-bound nodes. The search is limited by work, not
    by the clock, so the same inputs give the same plan on an idle and on a loaded machine; an ILP
    stopped by it keeps its best solution, and the plan states the search's proven gap."""
    time_limit_s: float | None = None
    """Wall-clock limit of the whole search, seconds; None (default): none, the search is limited by
    work alone. Where set and reached, the plan says so (notes, alternatives, its status and gap); the
    plan may then depend on the machine's load."""
    ilp_time_limit_s: float | None = None
    """Wall-clock limit of one candidate's ILP, seconds (within ``time_limit_s``); None (default): none.
    An ILP stopped by it keeps its best solution; the plan states the search's proven gap."""
    schedules: tuple[Schedule, ...] = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)
    """Pipeline schedules searched (names or :class:`~whalepy.Schedule` members)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages a pipeline stage may use."""
    allow_checkpointing: bool = True
    """Let the planner recompute activations of chosen blocks in backward."""
    allow_activation_offload: bool = True
    """Let the planner keep the saved activations of chosen blocks in host memory between their forward
    and backward (``BlockPlan.activation_offload``), where the copies cost less than recomputation and
    the node's host memory (``cpu_memory_gb`` of the cluster spec) holds them."""
    allow_checkpoint_offload: bool = False
    """Let the planner keep a checkpointed block's input (the activation checkpoint) in host memory
    between its forward and backward (``BlockPlan.checkpoint_offload``, ZeRO-Infinity's offloaded
    activation checkpoints), where the node's host memory holds them; the copies are charged. Off by
    default: it matters only where even checkpointed inputs do not fit (the planner's "no plan fits"
    message names it then), and its variables made the ILP of the best candidate of a 70B plan on 64
    mixed GPUs stop at its 5 s limit with an 18.4 s/step plan instead of the 17.6 s/step it proves
    without them (docs/benchmarks.md)."""
    allow_offload: bool = True
    """Offload optimizer states (and, under ZeRO-3, parameters) to CPU, or NVMe where a group has it."""
    mixed_tiers: bool = True
    """Let the blocks of one pipeline stage keep their states in different tiers (M6-10T's granular
    offloading: some layers' states on the device, the rest on the host or NVMe), up to
    :data:`~whalepy.planner.space.MAX_OPTIONS_PER_STAGE` tier pairs per stage, where the runtime lowers
    them side by side (FSDP2) and the stage has one chunk (no interleaving). False: one tier pair per
    stage."""
    max_tp: int | None = None
    """Largest TP degree (default: GPUs per node; TP never leaves a node)."""
    precision: str | None = None
    """Training precision, ``bf16``, ``fp16`` or ``fp32``: what the runtime trains in (recorded in
    ``Plan.precision``); selects the device peak and the bytes per activation element. None: resolved
    from the cluster (bf16 where every device type supports it, fp16 on V100 / T4 class GPUs, fp32 on
    CPU device types); a precision a device type cannot run is a PlanError before planning."""
    progress: bool | Callable[[str], None] = False
    """True: a line per phase on stderr; a callable receives the lines."""
    top_k: int = 5
    """Alternatives kept in ``plan.alternatives``."""
    virtual_stages: tuple[int, ...] = (2,)
    """Model chunks per rank tried for the interleaved schedule."""
    max_microbatches: int | None = 256
    """Largest micro-batch count tried per replica (None: up to the replica's batch share)."""
    sequence_parallel: bool = False
    """Run tensor-parallel layers with sequence parallelism (Korthikanti et al. 2022): norms and the
    residual stream split along the sequence, so activations divide fully by the TP degree. ``plan()``
    then profiles with ``sequence_parallel=True`` (the profile gains SEQUENCE rules the runtime lowers);
    ``plan_from_profile`` needs such a profile."""
    homogeneous_baseline: bool = False
    """Plan as if every GPU were the cluster's slowest type (uniform batch shares), then cost that plan
    on the real cluster: the baseline hardware-aware planning is compared against."""
    clip_gradients: bool = False
    """The run clips gradients by their global norm (``parallelize(max_grad_norm=...)`` sets it):
    ZeRO-Offload's host optimizer then steps after the backward (the norm needs every gradient), and its
    CPU step is costed as exposed in full (:func:`whalepy.ir.rules.host_steps_after_backward`)."""
    memory_trace: Any = None
    """A :class:`~whalepy.frontend.trace.MemoryTrace` (or its JSON path) of one warm-up iteration of this model:
    the planner charges its measured activation bytes per block instead of the profile's estimate
    (:func:`whalepy.frontend.trace.apply_memory_trace`)."""
    measure: bool = False
    """Time each distinct block of the model on this machine's device (CUDA GPU or CPU) before planning
    (``whalepy.profile(..., measure=True)``: forward, backward and optimizer step at the micro-batch
    sizes and TP degrees the search considers, saved activations); the planner then prefers these
    measurements for device types of the cluster equal to the local one. :func:`plan` only (a model
    is needed to run)."""
    optimizer_impl: str = "auto"
    """The optimizer implementation the runtime lowers and the cost model charges (``Plan.optimizer_impl``):
    ``"fused"`` (torch's fused kernel of the user's optimizer class, same hyper-parameters and states,
    where it has one for the device and dtype), ``"as_given"`` (the factory's optimizer exactly) or
    ``"auto"`` (default): ``fused`` where every group of the cluster runs on CUDA GPUs, else ``as_given``
    (the runtime still keeps the factory's optimizer where the fused step cannot take the parameters:
    DTensor shards under a class other than Adam / AdamW; DTensor shards beside plain tensors, as tensor
    parallelism without FSDP2 leaves norms, step as two groups: ``optimizer_impl.split_mixed_groups``)."""
    compile: bool | str = "auto"
    """Compile each block with ``torch.compile`` (regional compilation; ``Plan.compile``): True, False or
    ``"auto"`` (default): on where every group runs on CUDA GPUs and torch supports ``torch.compile`` on
    this Python, off on CPU (compiling a block takes seconds to minutes there, for a small gain)."""
    memory_margin: float | str | MemoryMargin = DEFAULT_MEMORY_MARGIN
    """Device memory left unplanned on every device, beside what the cost model already reserves (CUDA
    context, NCCL buffers, allocator fragmentation): room for the memory model's own error. A fraction
    of each device's memory (``0.05``, the default, argued in docs/cost_model.md "Margin"), a percentage
    (``"5%"``) or GiB per device (``"4GiB"``); ``0`` plans to the usable limit. Every feasibility check
    of the search uses it; the plan shows it per stage (``StageCost.margin_bytes``)."""
    notes: tuple[str, ...] = field(default=())
    """Lines copied into ``plan.notes`` (used by callers that adjust options, e.g. a solver fallback)."""

    def __post_init__(self) -> None:
        _check_option_types(self)
        if self.solver not in SOLVERS:
            raise PlanError(f"solver={self.solver!r}: choose one of {', '.join(SOLVERS)}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise PlanError(f"time_limit_s must be positive, got {self.time_limit_s!r}; give the search budget in "
                            "seconds, e.g. time_limit_s=60")
        try:
            scheds = tuple(Schedule(s) for s in self.schedules)
        except ValueError as e:
            raise PlanError(f"unknown schedule in {self.schedules!r}: use "
                            f"{', '.join(s.value for s in Schedule)}") from e
        if not scheds:
            raise PlanError("schedules is empty: give at least one of " + ", ".join(s.value for s in Schedule))
        object.__setattr__(self, "schedules", scheds)
        if self.ilp_time_limit_s is not None and not self.ilp_time_limit_s > 0:
            raise PlanError(f"ilp_time_limit_s must be positive, got {self.ilp_time_limit_s!r}; give seconds per "
                            "candidate, e.g. ilp_time_limit_s=5")
        zs = tuple(self.zero_stages)
        if not zs or any(isinstance(z, bool) or not isinstance(z, numbers.Integral) or z not in (0, 1, 2, 3)
                         for z in zs):
            raise PlanError(f"zero_stages={self.zero_stages!r}: give a non-empty subset of 0, 1, 2, 3, e.g. "
                            "zero_stages=(0, 1, 2, 3)")
        object.__setattr__(self, "zero_stages", tuple(int(z) for z in zs))
        object.__setattr__(self, "memory_margin", parse_memory_margin(self.memory_margin))
        if self.max_tp is not None and (self.max_tp < 1 or self.max_tp & (self.max_tp - 1)):
            raise PlanError(f"max_tp={self.max_tp!r} must be a power of two >= 1, e.g. max_tp=8, or None for "
                            "the GPUs per node")
        if self.precision is not None:  # names in any case, as Precision takes them
            name = self.precision.strip().lower() if isinstance(self.precision, str) else self.precision
            if name not in ("bf16", "fp16", "fp32"):
                raise PlanError(f"precision={self.precision!r}: use bf16, fp16 or fp32")
            object.__setattr__(self, "precision", name)
        if self.optimizer_impl not in ("auto", "fused", "as_given"):
            raise PlanError(f"optimizer_impl={self.optimizer_impl!r}: use 'auto', 'fused' or 'as_given'")
        if self.compile not in (True, False, "auto") or isinstance(self.compile, int) and not isinstance(
                self.compile, bool):
            raise PlanError(f"compile={self.compile!r}: use True, False or 'auto'")
        if self.top_k < 0:
            raise PlanError(f"top_k must be >= 0, got {self.top_k}; give the alternatives to keep, e.g. top_k=5")
        if not self.virtual_stages or any(v < 1 for v in self.virtual_stages):
            raise PlanError(f"virtual_stages must be a non-empty tuple of counts >= 1, got {self.virtual_stages!r}")
        if self.ilp_node_limit < 0:
            raise PlanError(f"ilp_node_limit must be >= 0, got {self.ilp_node_limit}; give branch-and-bound nodes "
                            f"per candidate, e.g. ilp_node_limit={ILP_NODE_LIMIT}")
        if self.max_microbatches is not None and self.max_microbatches < 1:
            raise PlanError(f"max_microbatches must be >= 1, got {self.max_microbatches}; give e.g. "
                            "max_microbatches=64, or None for no limit")


_NUMBER_FIELDS = ("time_limit_s", "ilp_time_limit_s")
_INT_FIELDS = ("top_k", "max_tp", "max_microbatches", "ilp_node_limit")
_BOOL_FIELDS = ("allow_checkpointing", "allow_activation_offload", "allow_checkpoint_offload", "allow_offload",
                "mixed_tiers", "sequence_parallel", "homogeneous_baseline", "clip_gradients", "measure")


def _check_option_types(opts: PlannerOptions) -> None:
    def bad(name: str, want: str) -> PlanError:
        value = getattr(opts, name)
        return PlanError(f"planner option {name}={value!r} is a {type(value).__name__}; give {want}")

    for name in _NUMBER_FIELDS:
        v = getattr(opts, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad(name, "a number of seconds, e.g. 60")
    for name in _INT_FIELDS:
        v = getattr(opts, name)
        if (v is not None or name in ("top_k", "ilp_node_limit")) and (isinstance(v, bool) or not isinstance(v, int)):
            raise bad(name, "an integer" + (" or None" if name not in ("top_k", "ilp_node_limit") else ""))
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(opts, name), bool):
            raise bad(name, "True or False")
    if isinstance(opts.schedules, str) or not isinstance(opts.schedules, (tuple, list)):
        raise bad("schedules", "a tuple of names, e.g. ('1f1b', 'gpipe')")
    if isinstance(opts.zero_stages, (str, int)) or not isinstance(opts.zero_stages, (tuple, list)):
        raise bad("zero_stages", "a tuple of stages, e.g. (0, 1, 2, 3)")
    if not isinstance(opts.virtual_stages, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in opts.virtual_stages):
        raise bad("virtual_stages", "a tuple of integers, e.g. (2,)")
    if not (isinstance(opts.progress, bool) or callable(opts.progress)):
        raise bad("progress", "True, False or a callable taking one line")
    if not isinstance(opts.notes, (tuple, list)) or not all(isinstance(n, str) for n in opts.notes):
        raise bad("notes", "a tuple of lines, e.g. ('planned for the demo',)")
    trace = opts.memory_trace
    if isinstance(trace, (str, os.PathLike)) and not os.path.isfile(trace):  # found before the capture
        raise PlanError(f"memory_trace={os.fspath(trace)!r}: no such file; make one with "
                        "whalepy.trace_memory(model, batch).save(path), or leave memory_trace out")
    if trace is not None and not isinstance(trace, (str, os.PathLike)) and type(trace).__name__ != "MemoryTrace":
        raise bad("memory_trace", "a whalepy.frontend.trace.MemoryTrace or the path of one saved with .save(path)")


def _progress_fn(opt: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(opt):
        return opt
    if not opt:
        return lambda _msg: None
    t0 = time.perf_counter()
    return lambda msg: print(f"[whalepy {time.perf_counter() - t0:6.2f}s] {msg}", file=sys.stderr, flush=True)


def _check_sequence_parallel(profile: ModelProfile, opts: PlannerOptions) -> None:
    from whalepy.planner.costing import has_sequence_rules

    if opts.sequence_parallel and not has_sequence_rules(profile):
        raise PlanError("sequence_parallel=True needs a profile with sequence-parallel rules: make it with "
                        "whalepy.profile(model, example_inputs, sequence_parallel=True)")
    if has_sequence_rules(profile) and not opts.sequence_parallel:
        raise PlanError("the profile carries sequence-parallel rules (made with sequence_parallel=True); "
                        "plan with sequence_parallel=True, or profile without it")


def plan(model: Any, cluster: ClusterSpec, *, example_inputs: Any = None, global_batch: int,
         profile: ModelProfile | None = None, **options: Any) -> Plan:
    """The fastest predicted plan for training ``model`` on ``cluster`` with ``global_batch`` samples per
    step. ``options`` are the fields of :class:`PlannerOptions`. ``profile``: the model's profile made
    already, e.g. ``pm.measured_profile()`` of a run (the closed loop: its measured block times replace
    the model's for its device type); the model is then not captured again and ``example_inputs`` is
    not needed. Raises :class:`~whalepy.InfeasibleError` when nothing fits, saying what runs short and
    what to relax."""
    if profile is not None:
        if not isinstance(profile, ModelProfile):
            raise ArgumentError(f"whalepy.plan(profile=...) takes a whalepy.ModelProfile, got {type(profile).__name__} "
                                "(pm.measured_profile() is None until the run's 6th step)")
        if options.get("measure"):
            raise ArgumentError("whalepy.plan(profile=..., measure=True): the profile is not captured again, so "
                                "nothing is measured; drop measure=True, or drop profile= to measure the model")
        from whalepy.frontend.checks import check_profile_of_model

        check_profile_of_model(profile, model, "whalepy.plan(profile=...)")
        return plan_from_profile(profile, cluster, global_batch=global_batch, **options)
    prof, progress = _planning_profile(model, cluster, example_inputs, global_batch, options)
    return plan_from_profile(prof, cluster, global_batch=global_batch, **{**options, "progress": progress})


def planning_profile(model: Any, cluster: ClusterSpec, *, example_inputs: Any, global_batch: int,
                     **options: Any) -> ModelProfile:
    """The profile :func:`plan` makes and plans from (the same checks, capture and, with ``measure=True``,
    the blocks timed on the local device as that plan times them): to keep or inspect, e.g. its
    ``measured`` tables, and plan from with ``plan(model, cluster, profile=..., ...)``."""
    return _planning_profile(model, cluster, example_inputs, global_batch, options)[0]


def _planning_profile(model: Any, cluster: ClusterSpec, example_inputs: Any, global_batch: int,
                      options: dict[str, Any]) -> tuple[ModelProfile, Callable[[str], None]]:
    from whalepy.frontend.checks import as_cluster, check_example_inputs, check_model

    if example_inputs is None:
        raise ArgumentError("whalepy.plan(): example_inputs is None; pass the model's inputs for one sample to "
                            "capture it, e.g. example_inputs=(torch.zeros(1, 1024, dtype=torch.long),), or "
                            "profile= (a profile made already: whalepy.profile or pm.measured_profile())")
    check_model(model, "whalepy.plan()")
    cluster = as_cluster(cluster, "whalepy.plan()")
    _check_global_batch(global_batch)
    opts = _with_precision(make_options(options), cluster)  # bad options fail before the capture
    check_example_inputs(model, example_inputs, "whalepy.plan()")
    from whalepy.planner.search import check_annotation_degrees

    check_annotation_degrees(model, cluster.world_size)
    if opts.measure:  # before the capture: a model on the meta device cannot be timed
        from whalepy.frontend.measure_checks import check_measurable_model

        check_measurable_model(model, "whalepy.plan(measure=True)")
    progress = _progress_fn(opts.progress)
    progress("capturing the model")
    from whalepy.frontend.profile import profile as build

    prof = build(model, example_inputs, sequence_parallel=opts.sequence_parallel)
    progress(f"captured {len(prof.blocks)} blocks in {prof.capture_time_s:.2f} s ({prof.capture_method})")
    if opts.measure:
        prof = _measured(model, example_inputs, prof, cluster, global_batch, opts, progress)
    return prof, progress


def plan_from_profile(profile: ModelProfile, cluster: ClusterSpec, *, global_batch: int, **options: Any) -> Plan:
    """:func:`plan` for a profile already made (by capture or :mod:`whalepy.planner.synthetic`)."""
    from whalepy.frontend.checks import as_cluster

    if not isinstance(profile, ModelProfile):
        raise PlanError(f"plan_from_profile() takes a whalepy.ModelProfile, got {type(profile).__name__}; make "
                        "one with whalepy.profile(model, example_inputs), or call whalepy.plan(model, ...)")
    cluster = as_cluster(cluster, "whalepy.plan()")
    opts = _with_precision(make_options(options), cluster)
    _check_global_batch(global_batch)
    hw = Hardware(cluster)
    check_device_reserve(hw.groups, hw.world_size)
    if opts.homogeneous_baseline:
        return homogeneous_baseline(profile, cluster, global_batch=global_batch,
                                    **{k: getattr(opts, k) for k in _fields() if k != "homogeneous_baseline"})
    _check_sequence_parallel(profile, opts)
    if opts.memory_trace is not None:
        from whalepy.frontend.trace import apply_memory_trace

        profile = apply_memory_trace(profile, opts.memory_trace)
    progress = _progress_fn(opts.progress)
    result = run_search(profile, hw, global_batch, opts, progress=progress)
    if result.best is None:
        raise_infeasible(result, opts, global_batch)
    best = result.best
    assert best is not None and result.best_result is not None and result.ctx is not None
    notes = list(opts.notes) + result.notes + _annotation_notes(result) + _host_notes(opts, cluster)
    if opts.memory_trace is not None:
        notes.append("activation bytes of the traced blocks are measured (memory_trace), not estimated")
    t0 = time.perf_counter()
    alts = build_alternatives(result, best, opts.top_k, hw)
    result.solve_time_s += time.perf_counter() - t0  # the alternatives' re-solves are part of the search
    # the status and gap are the whole search's (run_search), not the winning candidate's ILP's
    plan_ = build_plan(best, ctx=result.ctx, global_batch=global_batch, result=result,
                       solver_name=result.solver_used, status=result.status, mip_gap=result.gap, notes=notes,
                       alternatives=alts)
    source_notes = result.ctx.cost_source_notes(plan_)
    if source_notes:
        plan_ = replace(plan_, notes=plan_.notes + tuple(source_notes))
    progress(f"plan: {plan_.cost.step_time_s:.4g} s/step, {plan_.cost.samples_per_s:.4g} samples/s")
    return plan_


def _measured(model: Any, example_inputs: Any, prof: ModelProfile, cluster: ClusterSpec, global_batch: int,
              opts: PlannerOptions, progress: Callable[[str], None]) -> ModelProfile:
    """``prof`` with its blocks timed on the local device (``plan(..., measure=True)``) at the
    micro-batch sizes and TP degrees this search may use."""
    from whalepy.frontend.measure import apply_measured_activations, measure_costs, micro_batch_sizes

    t0 = time.perf_counter()
    max_tp = opts.max_tp or max(g.gpus_per_node for g in cluster.groups)
    tps = tuple(1 << k for k in range(max_tp.bit_length()) if (1 << k) <= max_tp)
    measured = measure_costs(model, example_inputs, prof, precision=opts.precision or "fp32",
                             micro_batches=micro_batch_sizes(global_batch),
                             tp_degrees=tps, optimizer=_measured_optimizer(opts.optimizer_impl),
                             compile=bool(opts.compile))
    progress(f"measured {len(measured.times)} distinct blocks on {measured.device_name} in "
             f"{time.perf_counter() - t0:.2f} s")
    if opts.compile and measured.times and not measured.compiled:
        import logging

        logging.getLogger("whalepy.measure").warning(
            "whalepy measure: the plan compiles its blocks but the compiled blocks could not be timed (the log "
            "above says why); their eager times stand in, so the compiled step will run faster than predicted")
    return replace(apply_measured_activations(prof, measured, opts.precision or "fp32", compiled=bool(opts.compile)),
                   measured=measured)


def _measured_optimizer(impl: str) -> Callable[[list], Any] | None:
    """The optimizer measured planning times: the implementation the plan lowers (``fused`` AdamW), or
    None for ``measure_costs``'s default (``AdamW`` as torch builds it)."""
    if impl != "fused":
        return None
    import functools

    import torch

    return functools.partial(torch.optim.AdamW, fused=True)  # a partial pickles (measurement in a subprocess)


def _host_notes(opts: PlannerOptions, cluster: ClusterSpec) -> list[str]:
    """``allow_checkpoint_offload=True`` (off by default, so asked for) on a cluster whose groups give no
    host memory cannot be planned: said in the plan's notes, not left out silently."""
    if opts.allow_checkpoint_offload and all(g.cpu_memory_bytes is None for g in cluster.groups):
        return ["allow_checkpoint_offload=True had no effect: no group of the cluster gives its host memory "
                "(add cpu_memory_gb: <GiB per node> to the groups in the cluster spec)"]
    return []


def _check_global_batch(global_batch: Any) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch must be a positive integer, got {global_batch!r}; pass the samples per "
                        "step, e.g. global_batch=256")


def _with_precision(opts: PlannerOptions, cluster: ClusterSpec) -> PlannerOptions:
    """``opts`` with its precision resolved for (and checked against) the cluster's device types."""
    from whalepy.hardware.cluster import resolve_precision

    precision = resolve_precision((g.device for g in cluster.groups), opts.precision)
    return replace(opts, precision=precision.value, optimizer_impl=resolve_optimizer_impl(cluster, opts.optimizer_impl),
                   compile=resolve_compile(cluster, opts.compile))


def _device_types(cluster: ClusterSpec) -> set[str]:
    """The torch device types the cluster's ranks run on (``runtime.mesh.resolve_device_type``'s rule)."""
    return {"cpu" if g.runs_on_cpu else "cuda" for g in cluster.groups}


def resolve_optimizer_impl(cluster: ClusterSpec, choice: str) -> str:
    """``"auto"`` resolved for ``cluster`` (:attr:`PlannerOptions.optimizer_impl`)."""
    if choice != "auto":
        return choice
    # CUDA only: the scope and where the fused kernel pays (one pass over the states instead of
    # foreach's several); on CPU ranks the user's implementation runs (the fused CPU kernel is still used
    # for states the plan offloads to the host, as before)
    return "fused" if _device_types(cluster) == {"cuda"} else "as_given"


def resolve_compile(cluster: ClusterSpec, choice: bool | str, *, dynamo_supported: bool | None = None) -> bool:
    """``"auto"`` resolved for ``cluster`` (:attr:`PlannerOptions.compile`). ``dynamo_supported``: what
    ``torch._dynamo.is_dynamo_supported()`` answered in this environment (the CLI's stored profiles keep
    it), so that a caller without torch's import need not import it; None: asked here."""
    if choice != "auto":
        return bool(choice)
    if _device_types(cluster) != {"cuda"}:
        return False
    if dynamo_supported is None:
        import torch._dynamo

        dynamo_supported = torch._dynamo.is_dynamo_supported()
    return dynamo_supported


def _fields() -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(PlannerOptions)]


def _check_option_names(options: dict[str, Any]) -> None:
    """An unknown option name is a PlanError with the closest ones and the list of names."""
    import difflib

    known = _fields()
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=2)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise PlanError(f"unknown planner option {name!r}; {hint}options are: {', '.join(known)}")


def make_options(options: dict[str, Any]) -> PlannerOptions:
    """:class:`PlannerOptions` from keyword options; an unknown name is a PlanError with the closest ones."""
    return PlannerOptions(**options)


_dataclass_init = PlannerOptions.__init__


def _init_options(self: PlannerOptions, *args: Any, **options: Any) -> None:
    if args:
        raise PlanError(f"PlannerOptions takes keyword options only, got {len(args)} positional value(s) "
                        f"{args!r:.60}; write e.g. PlannerOptions(solver='highs', time_limit_s=60)")
    _check_option_names(options)
    _dataclass_init(self, **options)


_init_options.__doc__ = _dataclass_init.__doc__
_init_options.__signature__ = inspect.signature(_dataclass_init)  # type: ignore[attr-defined]
PlannerOptions.__init__ = _init_options  # type: ignore[method-assign]


def _annotation_notes(result) -> list[str]:  # type: ignore[no-untyped-def]
    cons = result.constraints
    out = []
    for kind, src in (cons.sources.items() if cons else []):
        out.append(f"honoured {src} ({kind} annotation: a hard constraint)")
    pruned = sum(1 for r in result.rejections if r.kind is RejectionKind.PRUNED)
    if pruned:
        out.append(f"{pruned} of {result.num_candidates} candidates pruned by their lower bound")
    return out


def homogeneous_baseline(profile: ModelProfile, cluster: ClusterSpec, *, global_batch: int,
                         **options: Any) -> Plan:
    """The best plan that treats every GPU as the cluster's slowest type (uniform batch shares, block
    partition balanced for identical devices), costed on the REAL cluster: what a
    hardware-oblivious planner would run. Hardware-aware :func:`plan_from_profile` is never slower."""
    from whalepy.planner.costing import CostContext
    from whalepy.planner.search import evaluate_fixed

    from whalepy.frontend.checks import as_cluster

    cluster = as_cluster(cluster, "whalepy.homogeneous_baseline()")
    opts = _with_precision(make_options(options), cluster)
    _check_global_batch(global_batch)
    hw = Hardware(cluster)
    slow = min((g.device for g in hw.groups), key=lambda d: (d.peak_flops_16, d.memory_bytes))
    small = min(g.device.memory_bytes for g in hw.groups)
    slow = replace(slow, name=f"{slow.name}-baseline", memory_bytes=small)
    fake = ClusterSpec(groups=tuple(replace(g, device=slow, gpu=slow.name) for g in cluster.groups),
                       inter_group_bandwidth=cluster.inter_group_bandwidth,
                       inter_group_latency=cluster.inter_group_latency, rank_map=cluster.rank_map,
                       custom_devices=tuple(cluster.custom_devices) + (slow,))
    fake_hw = Hardware(fake)
    progress = _progress_fn(opts.progress)
    result = run_search(profile, fake_hw, global_batch, opts, progress=progress, force_uniform=True)
    if result.best is None:
        raise_infeasible(result, opts, global_batch)
    ev = result.best
    assert ev is not None
    cand = ev.coeffs.candidate
    ctx = CostContext(profile, hw, precision=opts.precision, sequence_parallel=opts.sequence_parallel,
                      clip_gradients=opts.clip_gradients, optimizer_impl=opts.optimizer_impl, compile=opts.compile,
                      memory_margin=opts.memory_margin)
    S = cand.num_stages
    ckpts = [list(ev.stages[j % S].chunk_checkpoints[j // S]) for j in range(cand.num_virtual)]
    offs = [list(ev.stages[j % S].chunk_offloads[j // S]) for j in range(cand.num_virtual)]
    ckoffs = [list(ev.stages[j % S].chunk_checkpoint_offloads[j // S]) if ev.stages[j % S].chunk_checkpoint_offloads
              else [0] * len(ev.coeffs.segments) for j in range(cand.num_virtual)]
    real = evaluate_fixed(ctx, cand, ev.boundaries, ckpts, [st.mix or st.option for st in ev.stages], offs, ckoffs)
    notes = [f"homogeneous baseline: planned as if all {hw.world_size} GPUs were {slow.name} with "
             f"{small / 2**30:.0f} GiB, costed on the real cluster"]
    return build_plan(real, ctx=ctx, global_batch=global_batch, result=result, solver_name=result.solver_used,
                      status=result.status if result.best_result else "given", mip_gap=0.0,
                      notes=notes)


__all__ = ["PlannerOptions", "plan", "plan_from_profile", "planning_profile", "homogeneous_baseline", "SOLVERS"]
