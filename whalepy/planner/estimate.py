"""``whalepy.estimate``: the predicted step time and memory of a parallel configuration you choose.

Uses exactly the costing the planner optimises (:mod:`whalepy.planner.costing`), so an estimate of the
configuration a plan chose reproduces the plan's numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from whalepy.ir.rules import check_pipeline, sequence_parallel_error, tiling_error
from whalepy.errors import PlanError
from whalepy.hardware.cluster import ClusterSpec
from whalepy.ir.plan import Plan, Schedule, Tier, ZeroStage
from whalepy.ir.plan_text import step_choices
from whalepy.ir.profile import ModelProfile
from whalepy.planner.margin import DEFAULT_MEMORY_MARGIN, parse_memory_margin


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """A fully chosen parallel configuration (what the planner would otherwise search)."""

    dp: int
    """Data-parallel degree (replicas)."""
    tp: int = 1
    """Tensor-parallel degree (inside a node)."""
    pp: int = 1
    """Pipeline stages."""
    num_microbatches: int = 1
    schedule: Schedule | str = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    """Model chunks per rank (interleaved schedule only)."""
    zero_stage: int = 0
    checkpoint: bool | tuple[int, ...] = False
    """True: checkpoint every block; a tuple: how many blocks of each stage (first ones of each stage)."""
    boundaries: tuple[int, ...] | None = None
    """Blocks per (virtual) stage, in model order; default: balanced by compute."""
    batch_shares: tuple[int, ...] | None = None
    """Samples per replica (mixed clusters); default: the global batch split evenly."""
    offload: Tier | str | None = None
    """``"cpu"``: parameters, gradients and optimizer states on the host (FSDP2's ``CPUOffloadPolicy``);
    ``"nvme"``: optimizer states in files, parameters on the device."""
    offload_params: bool = False
    """With ``offload="nvme"``: parameters in files too (ZeRO-Infinity's parameter offload; their
    optimizer states in files with them)."""
    zero_offload: bool = False
    """With ``offload="cpu"``: parameters stay on the device (in the compute dtype), their fp32 master
    weights, gradients and optimizer states live on the host, where the optimizer steps (ZeRO-Offload,
    the tier pair ``(gpu, cpu)``); without it ``offload="cpu"`` puts the parameters on the host too."""
    tiles: int = 1
    """Memory-centric tiling (``BlockPlan.tiles``): each linear and embedding of every block (but a tied
    one's) split into this many FSDP2 units; ZeRO-3 and tp 1 only."""
    checkpoint_offload: bool = False
    """Every checkpointed block keeps its input in host memory (``BlockPlan.checkpoint_offload``); needs
    ``checkpoint``."""
    reduce_every_microbatch: bool = False
    """Reduce-scatter the gradients every micro-batch (``StagePlan.reduce_every_microbatch``): FSDP2
    lowering without pipeline stages only."""
    layout: str | None = None
    """Mixed clusters: ``"replicas"`` (each replica on one group) or ``"stages"`` (each stage on one
    group, in cluster order); default: replicas when every group holds whole pipelines."""
    host_blocks: tuple[int, ...] | None = None
    """Granular tiers (M6-10T's per-layer offloading; the planner's ``mixed_tiers``): per stage, how many
    of its repeated blocks keep their parameters and optimizer states in host memory (the tier pair
    ``(cpu, cpu)``) beside the others' on the device; 0 for none. One chunk per stage, no ``offload``."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "num_microbatches", "virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"ParallelConfig.{name} must be a positive integer, got {v!r}; e.g. {name}=2")
        try:
            object.__setattr__(self, "schedule", Schedule(self.schedule))
        except ValueError:
            raise PlanError(f"unknown schedule {self.schedule!r}; use "
                            f"{', '.join(s.value for s in Schedule)}") from None
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}; e.g. zero_stage=3")
        for name in ("offload_params", "zero_offload", "checkpoint_offload", "reduce_every_microbatch"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"ParallelConfig.{name}={getattr(self, name)!r}: give True or False")
        ck = self.checkpoint
        if not isinstance(ck, bool) and not (isinstance(ck, (tuple, list)) and all(
                isinstance(n, int) and not isinstance(n, bool) for n in ck)):
            raise PlanError(f"ParallelConfig.checkpoint={ck!r}: give True (every block), False, or a tuple of "
                            "checkpointed blocks per stage, e.g. checkpoint=(2, 2)")
        # what the runtime lowers (sequence parallelism is checked against the profile)
        check_pipeline(self.schedule, num_stages=self.pp, virtual_stages=self.virtual_stages,
                       num_microbatches=self.num_microbatches, sequence_parallel=False, where="ParallelConfig")
        if self.tp & (self.tp - 1):
            raise PlanError(f"tp={self.tp} must be a power of two")
        if isinstance(self.tiles, bool) or not isinstance(self.tiles, int) or self.tiles < 1:
            raise PlanError(f"ParallelConfig.tiles must be a positive integer, got {self.tiles!r}; e.g. tiles=4")
        reason = tiling_error(self.tiles, zero=self.zero_stage, tp=self.tp)
        if reason is not None:
            raise PlanError(f"ParallelConfig: {reason}")
        if self.offload is not None:
            try:
                object.__setattr__(self, "offload", Tier(self.offload))
            except ValueError:
                raise PlanError(f"offload={self.offload!r}: use 'cpu' or 'nvme', or leave it out (None) for no "
                                "offload") from None
            if self.offload is Tier.GPU:
                raise PlanError("offload='gpu' is no offload: leave offload out (None), or give 'cpu' or 'nvme'")
        if self.offload_params and self.offload is not Tier.NVME:
            raise PlanError("offload_params=True goes with offload='nvme' (with offload='cpu' the parameters "
                            "are on the host already); set offload='nvme' or drop offload_params")
        if self.zero_offload and self.offload is not Tier.CPU:
            raise PlanError("zero_offload=True keeps the optimizer on the host: it goes with offload='cpu'; set "
                            "offload='cpu' or drop zero_offload")
        if isinstance(self.checkpoint, list):
            object.__setattr__(self, "checkpoint", tuple(self.checkpoint))
        if isinstance(self.checkpoint, tuple) and len(self.checkpoint) != self.pp:
            raise PlanError(f"checkpoint gives {len(self.checkpoint)} counts for {self.pp} stages")
        if self.checkpoint_offload and self.checkpoint is False:
            raise PlanError("ParallelConfig: checkpoint_offload=True keeps checkpointed blocks' inputs in host "
                            "memory; set checkpoint too")
        if self.layout not in (None, "replicas", "stages"):
            raise PlanError(f"layout must be 'replicas' or 'stages', got {self.layout!r}")
        if self.host_blocks is not None:
            hb = tuple(self.host_blocks) if isinstance(self.host_blocks, (tuple, list)) else None
            if hb is None or len(hb) != self.pp or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in hb):
                raise PlanError(f"ParallelConfig.host_blocks={self.host_blocks!r}: give {self.pp} counts of blocks "
                                "(one per stage, 0 for none), e.g. host_blocks=(0, 2)")
            if self.virtual_stages != 1 or self.offload is not None:
                raise PlanError("ParallelConfig.host_blocks needs one chunk per stage (virtual_stages=1) and no "
                                "offload (the other blocks stay on the device)")
            object.__setattr__(self, "host_blocks", hb)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per device of one stage's tightest replica, by what holds them."""

    params: float
    grads: float
    optimizer: float
    """Optimizer states and fp32 master weights."""
    activations: float
    """Saved for backward by the micro-batches in flight, plus one recomputed block."""
    buffers: float
    """FSDP2's gathered blocks and gradient buffers, unsharded gradient accumulation, autocast's
    16-bit weight copies."""
    reserve: float
    """Kept back from the allocator: CUDA context, NCCL buffers, fragmentation."""
    margin: float
    """Left unplanned (``memory_margin``)."""
    cpu: float
    """Host memory per GPU (offloaded states)."""
    nvme: float

    @property
    def gpu(self) -> float:
        """The allocated peak: params + grads + optimizer + activations + buffers."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def __str__(self) -> str:
        g = 2**30
        host = (f"; host {self.cpu / g:.2f} GiB" if self.cpu else "") + (f", NVMe {self.nvme / g:.2f} GiB"
                                                                         if self.nvme else "")
        return (f"params {self.params / g:.2f} + grads {self.grads / g:.2f} + optimizer {self.optimizer / g:.2f}"
                f" + activations {self.activations / g:.2f} + buffers {self.buffers / g:.2f} GiB"
                f" (+ reserve {self.reserve / g:.2f}, margin {self.margin / g:.2f} GiB){host}")


@dataclass(frozen=True, kw_only=True)
class CommBreakdown:
    """Exposed (not hidden) communication of one stage's slowest replica."""

    tp_s: float
    """Tensor-parallel collectives per micro-batch (the runtime does not overlap them)."""
    p2p_s: float
    """Pipeline sends per micro-batch."""
    dp_s: float
    """Data-parallel collectives per micro-batch not hidden by the neighbouring block's compute
    (FSDP2 all-gathers), including the compute they slow down."""
    sync_s: float
    """Per step: the gradient reduction not hidden by the last backward, and post-step all-gathers."""

    def __str__(self) -> str:
        ms = 1e3
        return (f"exposed comm per micro-batch: TP {self.tp_s * ms:.3g} ms, p2p {self.p2p_s * ms:.3g} ms, "
                f"DP {self.dp_s * ms:.3g} ms; gradient sync per step {self.sync_s * ms:.3g} ms")


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    index: int
    blocks: int
    time_per_microbatch_s: float
    memory_bytes: float
    capacity_bytes: float
    device_type: str
    memory: MemoryBreakdown
    comm: CommBreakdown


@dataclass(frozen=True, kw_only=True)
class Estimate:
    config: ParallelConfig
    step_time_s: float
    compute_s: float
    """Busiest stage's compute per step (all micro-batches)."""
    comm_s: float
    """Busiest stage's TP + p2p communication per step."""
    bubble_s: float
    tail_s: float
    """Exposed gradient synchronisation plus optimizer step."""
    samples_per_s: float
    stages: tuple[StageEstimate, ...]
    feasible: bool
    reason: str
    plan: Plan

    def __str__(self) -> str:
        head = (f"Estimate dp={self.config.dp} tp={self.config.tp} pp={self.config.pp} "
                f"M={self.config.num_microbatches} {Schedule(self.config.schedule).value} "
                f"ZeRO-{self.config.zero_stage}: step {self.step_time_s:.4g} s "
                f"(compute {self.compute_s:.3g} s, comm {self.comm_s:.3g} s, bubble {self.bubble_s:.3g} s, "
                f"sync+optimizer {self.tail_s:.3g} s), {self.samples_per_s:.4g} samples/s")
        lines = [head, "  " + ("fits" if self.feasible else "DOES NOT FIT: " + self.reason),
                 "  " + step_choices(self.plan)]
        for s in self.stages:
            lines.append(f"  stage {s.index}: {s.blocks} blocks on {s.device_type}, "
                         f"{s.time_per_microbatch_s * 1e3:.3g} ms per micro-batch, memory "
                         f"{s.memory_bytes / 2**30:.1f} / {s.capacity_bytes / 2**30:.1f} GiB")
            lines.append(f"    memory: {s.memory}")
            lines.append(f"    {s.comm}")
        return "\n".join(lines)


def estimate(model: Any, cluster: ClusterSpec, config: ParallelConfig | dict[str, Any], *,
             example_inputs: Any, global_batch: int, precision: str | None = None,
             optimizer_impl: str = "auto", compile: bool | str = "auto",
             memory_margin: Any = DEFAULT_MEMORY_MARGIN) -> Estimate:
    """Predicted step time and memory of ``config``; ``precision``, ``optimizer_impl`` and ``compile``
    resolve from the cluster as the planner resolves them (``PlannerOptions``); ``memory_margin`` as
    ``PlannerOptions.memory_margin`` (device memory left unplanned: the configuration fits only below it)."""
    from whalepy.frontend.checks import as_cluster, check_example_inputs, check_model
    from whalepy.frontend.profile import profile

    check_model(model, "whalepy.estimate()")
    cluster = as_cluster(cluster, "whalepy.estimate()")
    check_config_on_cluster(_coerce(config), cluster, global_batch, precision)  # before the capture
    memory_margin = parse_memory_margin(memory_margin)
    check_example_inputs(model, example_inputs, "whalepy.estimate()")
    return estimate_from_profile(profile(model, example_inputs), cluster, config, global_batch=global_batch,
                                 precision=precision, optimizer_impl=optimizer_impl, compile=compile,
                                 memory_margin=memory_margin)


def check_config_on_cluster(cfg: ParallelConfig, cluster: ClusterSpec, global_batch: Any, precision: str | None
                            ) -> tuple[str, Any, tuple[int, ...]]:
    """What ``cfg`` asks of the cluster and the batch, checked without the model (so :func:`estimate`
    refuses it before the capture): the precision (resolved), the state option and the batch shares."""
    from whalepy.ir.rules import check_state_option
    from whalepy.hardware.cluster import resolve_precision
    from whalepy.frontend.checks import check_positive_int
    from whalepy.planner.space import StateOption

    check_positive_int(global_batch, "global_batch", "whalepy.estimate()")
    resolved = resolve_precision((g.device for g in cluster.groups), precision).value
    tier = Tier(cfg.offload) if cfg.offload is not None else Tier.GPU
    param_tier = (Tier.GPU if cfg.zero_offload else Tier.CPU) if tier is Tier.CPU else \
        Tier.NVME if cfg.offload_params else Tier.GPU
    option = StateOption(ZeroStage(cfg.zero_stage), tier, param_tier, cfg.tiles, cfg.reduce_every_microbatch)
    check_state_option(option.zero, option.param_tier, option.optimizer_tier, where=f"offload={tier.value}")
    W = cluster.world_size
    if cfg.dp * cfg.tp * cfg.pp != W:
        raise PlanError(f"dp({cfg.dp}) * tp({cfg.tp}) * pp({cfg.pp}) = {cfg.dp * cfg.tp * cfg.pp} != world size "
                        f"({W}); a configuration must use every device")
    for g in cluster.groups:
        if g.gpus_per_node % cfg.tp:
            raise PlanError(f"tp={cfg.tp} does not divide the {g.gpus_per_node} GPUs per node of group "
                            f"{g.name!r}; TP stays inside a node")
    shares = cfg.batch_shares or ((global_batch // cfg.dp,) * cfg.dp if global_batch % cfg.dp == 0 else None)
    if shares is None:
        raise PlanError(f"global batch {global_batch} does not split evenly over dp={cfg.dp}; give batch_shares")
    if len(shares) != cfg.dp or sum(shares) != global_batch or min(shares) < 1:
        raise PlanError(f"batch_shares {list(shares)} must be {cfg.dp} positive numbers summing to {global_batch}")
    if any(s % cfg.num_microbatches for s in shares):
        raise PlanError(f"batch shares {list(shares)} must divide into {cfg.num_microbatches} equal micro-batches")
    return resolved, option, tuple(shares)


def _check_tp_degree(profile: ModelProfile, tp: int) -> None:
    """``tp`` splits at least one block: a block whose heads, features or vocabulary do not divide by it
    runs replicated (``tp_splits``, costed so), and a degree that splits none would only waste devices."""
    from whalepy.planner._cost_context import tp_splits

    if tp == 1 or any(tp_splits(b, tp) for b in profile.blocks):
        return
    degrees = sorted({d for b in profile.blocks if b.tp_rules for d in b.tp_degrees})
    raise PlanError(f"tp={tp} splits no block of this model (its heads, features or vocabulary do not divide by "
                    f"{tp}; tensor-parallel degrees it takes: {', '.join(map(str, degrees)) or '1'}); use one of "
                    "those, or tp=1")


def _coerce(config: ParallelConfig | dict[str, Any]) -> ParallelConfig:
    if isinstance(config, ParallelConfig):
        return config
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)  # type: ignore[arg-type]
    if not isinstance(config, dict):
        raise PlanError(f"config must be a ParallelConfig or a dict, got {type(config).__name__}")
    names = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = set(config) - names
    if unknown:
        raise PlanError(f"unknown config key(s) {sorted(unknown)}; known: {', '.join(sorted(names))}")
    try:
        return ParallelConfig(**config)
    except TypeError as e:
        raise PlanError(f"bad config: {e}") from None


def _balanced_sizes(times: list[float], parts: int) -> list[int]:
    """Contiguous split of ``times`` into ``parts`` non-empty parts minimising the largest sum."""
    n = len(times)
    pre = [0.0]
    for t in times:
        pre.append(pre[-1] + t)
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def estimate_from_profile(profile: ModelProfile, cluster: ClusterSpec, config: ParallelConfig | dict[str, Any], *,
                          global_batch: int, precision: str | None = None, optimizer_impl: str = "auto",
                          compile: bool | str = "auto", memory_margin: Any = DEFAULT_MEMORY_MARGIN) -> Estimate:
    from whalepy.planner import make_options, resolve_compile, resolve_optimizer_impl
    from whalepy.planner.runtime_costs import check_device_reserve
    from whalepy.planner.build import build_plan
    from whalepy.planner.costing import CostContext, build_coefficients, evaluate, has_sequence_rules
    from whalepy.planner.space import Candidate, Hardware, StateOption, build_segments

    from whalepy.ir.rules import check_state_option
    from whalepy.hardware.cluster import resolve_precision

    from whalepy.frontend.checks import as_cluster, check_positive_int

    cluster = as_cluster(cluster, "whalepy.estimate()")
    cfg = _coerce(config)
    margin = parse_memory_margin(memory_margin)
    precision, option, shares = check_config_on_cluster(cfg, cluster, global_batch, precision)
    tier = option.optimizer_tier
    sp = sequence_parallel_error(sequence_parallel=has_sequence_rules(profile) and cfg.tp > 1, num_stages=cfg.pp)
    if sp is not None:
        raise PlanError(f"ParallelConfig: {sp}")
    hw = Hardware(cluster)
    check_device_reserve(hw.groups, hw.world_size)
    N = len(profile.blocks)
    J = cfg.pp * cfg.virtual_stages
    if J > N:
        raise PlanError(f"{J} (virtual) stages for {N} blocks: every stage needs at least one block")
    _check_tp_degree(profile, cfg.tp)
    layout = cfg.layout
    if len(hw.groups) == 1:
        cell_groups = tuple((0,) * cfg.dp for _ in range(cfg.pp))
        layout = "homogeneous"
    else:
        whole = all(g.size % (cfg.pp * cfg.tp) == 0 for g in hw.groups)
        layout = layout or ("replicas" if whole else "stages")
        if layout == "replicas":
            if not whole:
                raise PlanError(f"layout='replicas' needs every group to hold whole pipelines of "
                                f"pp*tp={cfg.pp * cfg.tp} devices")
            reps = tuple(g.index for g in hw.groups for _ in range(g.size // (cfg.pp * cfg.tp)))
            cell_groups = tuple(reps for _ in range(cfg.pp))
        else:
            if any(g.size % (cfg.dp * cfg.tp) for g in hw.groups):
                raise PlanError(f"layout='stages' needs every group to hold whole stages of dp*tp="
                                f"{cfg.dp * cfg.tp} devices")
            cell_groups = tuple((g.index,) * cfg.dp for g in hw.groups for _ in range(g.size // (cfg.dp * cfg.tp)))
    cand = Candidate(num_stages=cfg.pp, tp=cfg.tp, dp=cfg.dp, num_microbatches=cfg.num_microbatches,
                     schedule=Schedule(cfg.schedule), virtual_stages=cfg.virtual_stages, cell_groups=cell_groups,
                     batch_shares=tuple(shares), layout=layout)
    if option.reduce_each:
        from whalepy.ir.rules import reduce_every_microbatch_error
        from whalepy.planner.runtime_costs import lowering_kind

        reason = reduce_every_microbatch_error(lowering_kind(option, cand), pp=cfg.pp, param_tier=option.param_tier,
                                               optimizer_tier=option.optimizer_tier)
        if reason is not None:
            raise PlanError(f"ParallelConfig: {reason}")
    make_options({"optimizer_impl": optimizer_impl, "compile": compile})  # checked as planner options
    ctx = CostContext(profile, hw, precision=precision, optimizer_impl=resolve_optimizer_impl(cluster, optimizer_impl),
                      compile=resolve_compile(cluster, compile), memory_margin=margin)
    host = dataclasses.replace(option, optimizer_tier=Tier.CPU, param_tier=Tier.CPU) \
        if cfg.host_blocks is not None and any(cfg.host_blocks) else None
    cc = build_coefficients(ctx, cand, build_segments(profile), (option,) if host is None else (option, host),
                            mixed_tiers=host is not None)
    for sc in cc.stages:
        wanted = [option] + ([host] if host is not None and cfg.host_blocks[sc.index] else [])  # type: ignore[index]
        lacking = next((o.optimizer_tier for o in wanted if o not in sc.options), None)
        if lacking is not None:
            fix = ("cpu_memory_gb: <GiB per node>" if lacking is Tier.CPU
                   else "nvme: {capacity_tb: ..., read_gbs: ..., write_gbs: ...}")
            raise PlanError(f"offload to {lacking.value} is not possible on stage {sc.index}: its group has no "
                            f"{'host memory (cpu_memory_gb)' if lacking is Tier.CPU else 'NVMe'} in the cluster spec; "
                            f"add {fix} to the group, or estimate without offload")
    if cfg.boundaries is not None:
        sizes = list(cfg.boundaries)
        if len(sizes) != J or sum(sizes) != N or min(sizes) < 1:
            raise PlanError(f"boundaries {sizes} must be {J} positive block counts summing to {N}")
    else:
        mb = shares[0] / cfg.num_microbatches
        dev = hw.groups[cell_groups[0][0]].device.name
        sizes = _balanced_sizes([sum(ctx.block_time(b.index, dev, cfg.tp, mb)) for b in profile.blocks], J)
    from whalepy.planner.costing import counts_from_boundaries

    counts = counts_from_boundaries(cc, sizes)
    if cfg.checkpoint is True:
        ckpts = [list(c) for c in counts]
    elif cfg.checkpoint is False:
        ckpts = [[0] * len(c) for c in counts]
    else:
        ckpts = []
        for s, k in enumerate(cfg.checkpoint):  # type: ignore[union-attr]
            if not 0 <= k <= sum(counts[s]):
                raise PlanError(f"checkpoint count {k} for stage {s}, which has {sum(counts[s])} blocks")
            row, left = [], k
            for n in counts[s]:
                row.append(min(n, left))
                left -= row[-1]
            ckpts.append(row)
    ckoffs = None
    if cfg.checkpoint_offload:
        from whalepy.planner.costing import chunk_counts_from_sizes, split_stage_checkpoints

        chunks = chunk_counts_from_sizes(cc, sizes)
        ckoffs = [[] for _ in range(J)]
        for s in range(cfg.pp):
            rows = split_stage_checkpoints([chunks[s + k * cfg.pp] for k in range(cfg.virtual_stages)], ckpts[s])
            for k, row in enumerate(rows):
                ckoffs[s + k * cfg.pp] = row
        if any(c.seg_ckoff is None for sc in cc.stages for c in sc.cells):
            raise PlanError("checkpoint_offload=True needs host memory: give cpu_memory_gb in the cluster spec")
    ev = evaluate(cc, sizes, ckpts, _stage_options(cc, counts, option, host, cfg.host_blocks), None, ckoffs)
    reason = ""
    if not ev.fits:
        worst = max((c for st in ev.stages for c in st.cells), key=lambda c: c.memory_bytes / c.cell.capacity)
        st = next(st for st in ev.stages if worst in st.cells)
        g = worst.cell.group
        if worst.memory_bytes > worst.cell.capacity:
            reason = (f"stage {st.index} on group {g.name!r} ({g.device.name}) needs "
                      f"{worst.memory_bytes / 2**30:.1f} GiB per device, has {worst.cell.capacity / 2**30:.1f} GiB "
                      f"usable: {(worst.memory_bytes - worst.cell.capacity) / 2**30:.1f} GiB short")
        else:
            reason = f"offloaded states do not fit host memory / NVMe on group {g.name!r}"
    M = cfg.num_microbatches
    busiest = max((c for st in ev.stages for c in st.cells), key=lambda c: c.time_s)
    plan = build_plan(ev, ctx=ctx, global_batch=global_batch, result=None, solver_name="given", status="given",
                      mip_gap=0.0, notes=[] if ev.fits else ["does not fit: " + reason])
    source_notes = ctx.cost_source_notes(plan)  # which costs were measured (whalepy.frontend.measure)
    if source_notes:
        plan = dataclasses.replace(plan, notes=plan.notes + tuple(source_notes))
    stages = tuple(_stage_estimate(st) for st in ev.stages)
    return Estimate(config=cfg, step_time_s=ev.step_time_s, compute_s=M * busiest.compute_s,
                    comm_s=M * busiest.comm_s, bubble_s=ev.bubble_s, tail_s=ev.X,
                    samples_per_s=global_batch / ev.step_time_s, stages=stages, feasible=ev.fits, reason=reason,
                    plan=plan)


def _stage_options(cc: Any, counts: Any, option: Any, host: Any, host_blocks: tuple[int, ...] | None) -> list[Any]:
    """Each stage's state option, or its mix with ``host`` (``host_blocks``: that many of the stage's
    repeated blocks, those of its longest segment, on the host)."""
    out: list[Any] = []
    for sc, row in zip(cc.stages, counts):
        n = host_blocks[sc.index] if host is not None and host_blocks is not None else 0
        if not n:
            out.append(option)
            continue
        g = max(range(len(row)), key=lambda i: (row[i], i))
        if n >= sum(row) or n > row[g]:
            raise PlanError(f"ParallelConfig.host_blocks: stage {sc.index} has {sum(row)} blocks, {row[g]} of them "
                            f"repeated; {n} on the host leaves none on the device or takes blocks of another "
                            "kind: give fewer")
        on_host = tuple(n if i == g else 0 for i in range(len(row)))
        mix = ((option, tuple(c - h for c, h in zip(row, on_host))), (host, on_host))
        if not any(set(o for o, _ in mix) <= set(f) for f in sc.families):
            raise PlanError(f"ParallelConfig.host_blocks: stage {sc.index} cannot keep blocks on the device and on "
                            f"the host side by side under {option} (whalepy.ir.rules.mixed_tiers_error)")
        out.append(mix)
    return out


def _stage_estimate(st: Any) -> StageEstimate:
    tight = max(st.cells, key=lambda c: c.memory_bytes / c.cell.capacity)
    slow = max(st.cells, key=lambda c: c.time_s)
    mem = MemoryBreakdown(params=tight.params_bytes, grads=tight.grads_bytes, optimizer=tight.optimizer_bytes,
                          activations=tight.activation_bytes, buffers=tight.buffer_bytes,
                          reserve=tight.reserve_bytes, margin=tight.cell.margin, cpu=tight.cpu_bytes, nvme=tight.nvme_bytes)
    comm = CommBreakdown(tp_s=slow.tp_s, p2p_s=slow.p2p_s, dp_s=slow.dp_exposed_s, sync_s=slow.exposed_sync_s)
    return StageEstimate(index=st.index, blocks=sum(st.counts), time_per_microbatch_s=st.time_s,
                         memory_bytes=max(c.memory_bytes for c in st.cells),
                         capacity_bytes=min(c.cell.capacity for c in st.cells),
                         device_type="/".join(sorted({c.cell.group.device.name for c in st.cells})),
                         memory=mem, comm=comm)


__all__ = ["CommBreakdown", "Estimate", "MemoryBreakdown", "ParallelConfig", "StageEstimate", "estimate", "estimate_from_profile"]
