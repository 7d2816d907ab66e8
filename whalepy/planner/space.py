"""The search space: segments of tied blocks, per-stage state options, outer candidates and rank layout.

What is enumerated outside the ILP lives here (``Candidate``: pipeline stages, TP and DP degrees,
micro-batches, schedule, virtual stages, which device group each ``(stage, replica)`` cell sits on, and
the batch share of every replica); what the ILP decides inside a candidate is described in
:mod:`whalepy.planner.ilp`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from dataclasses import dataclass, field

from whalepy.hardware.cluster import ClusterSpec
from whalepy.cost_models.communication import CommGroup
from whalepy.cost_models.devices import DeviceType
from whalepy.ir.plan import Schedule, Tier, ZeroStage
from whalepy.ir.profile import BlockAnnotations, BlockProfile, ModelProfile


# -- segments: runs of identical consecutive blocks -------------------------------------------------

@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive blocks the planner treats as interchangeable: a run of one ``repeat_group`` with
    equal annotations, equal parameter counts (split and whole under TP) and the same tied copies, or a
    single block. The ILP counts blocks per stage per segment. (Layers tied by ``whalepy.pseudo_to_real``
    share one repeat group, but the shared parameters are attributed to the first layer only, so that
    layer is a segment of its own.)"""

    index: int
    start: int
    """Position of the first block in the model's block order."""
    blocks: tuple[BlockProfile, ...]

    @property
    def length(self) -> int:
        return len(self.blocks)

    @property
    def block(self) -> BlockProfile:
        """The representative block (all blocks of a segment cost the same)."""
        return self.blocks[0]


def build_segments(profile: ModelProfile) -> tuple[Segment, ...]:
    segs: list[list[BlockProfile]] = []
    for b in profile.blocks:
        prev = segs[-1][-1] if segs else None
        if (prev is not None and b.repeat_group is not None and prev.repeat_group == b.repeat_group
                and _same_annotations(prev.annotations, b.annotations)
                and (prev.num_params, prev.param_bytes, prev.tp_whole_params, prev.tied_copies, prev.param_rows)
                == (b.num_params, b.param_bytes, b.tp_whole_params, b.tied_copies, b.param_rows)):
            segs[-1].append(b)
        else:
            segs.append([b])
    out, start = [], 0
    for i, blocks in enumerate(segs):
        out.append(Segment(index=i, start=start, blocks=tuple(blocks)))
        start += len(blocks)
    return tuple(out)


def _same_annotations(a: BlockAnnotations, b: BlockAnnotations) -> bool:
    return (a.split, a.replicate, a.stage, a.cluster_gpu, a.cluster_group) == (
        b.split, b.replicate, b.stage, b.cluster_gpu, b.cluster_group)


# -- per-stage state options (ZeRO stage x tiers) -----------------------------------------------------

@dataclass(frozen=True, slots=True, order=True)
class StateOption:
    """Where one stage keeps its model states: ZeRO stage, optimizer tier, parameter tier."""

    zero: ZeroStage
    optimizer_tier: Tier = Tier.GPU
    param_tier: Tier = Tier.GPU
    tiles: int = 1
    """Memory-centric tiling of the stage's linears and embeddings (``BlockPlan.tiles``; 1: none)."""
    reduce_each: bool = False
    """Gradients reduce-scattered every micro-batch (``StagePlan.reduce_every_microbatch``)."""
    beside_offload: bool = False
    """An on-device option costed as FSDP2 lowers it beside offloading blocks of the same stage (the
    runtime lowers a stage to FSDP2 when any block offloads, :func:`~whalepy.ir.rules.choose_lowering_kind`):
    only ever part of a mix (:data:`StateMix`) with an offloading option."""

    @property
    def off_device(self) -> bool:
        """Some of the stage's states (parameters or optimizer states) live off the device."""
        return self.param_tier is not Tier.GPU or self.optimizer_tier is not Tier.GPU

    def __str__(self) -> str:
        s = f"ZeRO-{int(self.zero)}"
        if self.optimizer_tier is not Tier.GPU:
            s += f" opt->{self.optimizer_tier.value}"
        if self.param_tier is not Tier.GPU:
            s += f" params->{self.param_tier.value}"
        if self.tiles > 1:
            s += f" tiles={self.tiles}"
        if self.reduce_each:
            s += " reduce every micro-batch"
        if self.beside_offload:
            s += " (FSDP2 beside offloaded blocks)"
        return s


StateMix = tuple[tuple[StateOption, tuple[int, ...]], ...]
"""Granular tiers inside one stage (M6-10T's per-layer offloading, issue 10): ``((option, blocks per
segment), ...)``, state options of one family (:attr:`~whalepy.planner.costing.StageCoeffs.families`),
each with the stage's blocks of every segment it keeps; the counts sum to the stage's. A stage with one
option is costed with the option itself, not a one-part mix."""

MAX_OPTIONS_PER_STAGE = 2
"""Most state options the blocks of one stage are split over: the device and one tier off it (M6-10T
keeps some layers' states on the GPU and offloads the rest; ZeRO-Infinity's tiers are per model). A
search-space restriction, not a cost: it keeps the ILP small and the exhaustive check enumerable."""


def build_state_options(zero_stages: tuple[int, ...], allow_offload: bool,
                        precision: str | None = None, clip_gradients: bool = False) -> tuple[StateOption, ...]:
    """Every combination the planner may pick per stage: those the runtime lowers
    (:func:`whalepy.ir.rules.state_option_error`, in ``precision`` when given, with gradient
    clipping when ``clip_gradients``), on the device only unless ``allow_offload``."""
    from whalepy.ir.rules import state_option_error

    out = []
    tiers = (Tier.GPU, Tier.CPU, Tier.NVME) if allow_offload else (Tier.GPU,)
    for z in sorted(set(zero_stages)):
        zs = ZeroStage(z)
        for ot in tiers:
            for pt in tiers:
                if state_option_error(zs, pt, ot, precision=precision, clip_gradients=clip_gradients) is None:
                    out.append(StateOption(zs, ot, pt))
    return tuple(out)


# -- hardware view ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GroupView:
    index: int
    name: str
    device: DeviceType
    gpus_per_node: int
    num_nodes: int
    ranks: tuple[int, ...]
    """The group's global ranks, node by node, local rank by local rank."""
    cpu_memory_bytes: int | None
    nvme_capacity_bytes: int | None
    nvme_read_bandwidth: float | None
    nvme_write_bandwidth: float | None

    @property
    def size(self) -> int:
        return len(self.ranks)


class Hardware:
    """The cluster as the planner sees it: groups with their ranks, and cached communication groups."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        placed = cluster.rank_devices()
        views = []
        for i, g in enumerate(cluster.groups):
            ranks = sorted((p.node, p.local_rank, p.rank) for p in placed if p.group == g.name)
            nvme = g.nvme
            views.append(GroupView(
                index=i, name=g.name, device=g.device, gpus_per_node=g.gpus_per_node,
                num_nodes=g.num_nodes, ranks=tuple(r for _, _, r in ranks),
                cpu_memory_bytes=g.cpu_memory_bytes,
                nvme_capacity_bytes=nvme.capacity_bytes if nvme else None,
                nvme_read_bandwidth=nvme.read_bandwidth if nvme else None,
                nvme_write_bandwidth=nvme.write_bandwidth if nvme else None))
        self.groups: tuple[GroupView, ...] = tuple(views)
        self.world_size = cluster.world_size
        self._comm = functools.lru_cache(maxsize=65536)(self._comm_uncached)
        self.node_shares: dict = {}  # type: ignore[type-arg]
        """Per rank layout (by ``id``, with the layout kept alive beside it), how its nodes' ranks split
        over the stages (``costing._node_shares``)."""
        self.layouts: dict = {}  # type: ignore[type-arg]
        """:func:`build_layout`'s layouts, by ``(stages, replicas, TP, cell groups)``: candidates that
        differ only in micro-batches or schedule share one layout (built, and hashed, once)."""

    def _comm_uncached(self, ranks: tuple[int, ...]) -> CommGroup:
        return self.cluster.comm_group(list(ranks))

    def comm(self, ranks: tuple[int, ...]) -> CommGroup:
        return self._comm(tuple(ranks))

    @property
    def is_homogeneous(self) -> bool:
        return len({g.device.name for g in self.groups}) == 1

    def group_by_name(self, name: str) -> GroupView:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)


# -- outer candidates -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepForm:
    """The predicted step time as a linear form, built in this one place for every user (the costing,
    the ILP's objective and tie-break, the lower bound and its MIP): ``step = t T + tc Tc + x X`` with
    ``T`` the slowest stage's time per micro-batch (all its chunks), ``Tc`` the slowest chunk's (``T``
    itself without interleaving) and ``X`` the slowest stage's exposed gradient sync plus optimizer step.
    For ``M`` micro-batches on ``S`` stages ``step = M T + (S - 1) Tc + X``: the pipeline bubble is
    ``S - 1`` chunk times (Narayanan et al. SC'21), ``(M + S - 1) T + X`` for GPipe and 1F1B."""

    t: float
    tc: float
    x: float = 1.0

    def value(self, T: float, Tc: float, X: float) -> float:
        return self.t * T + self.tc * Tc + self.x * X

    def terms(self, T, Tc, X) -> dict:  # type: ignore[no-untyped-def,type-arg]
        """The form over solver variables ``{variable: coefficient}``; ``Tc`` may be ``T`` itself (one
        chunk per stage), whose coefficients then add up."""
        out = {T: self.t, X: self.x}
        out[Tc] = out.get(Tc, 0.0) + self.tc
        return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """One outer configuration; the ILP fills in the block partition, checkpointing and state options."""

    num_stages: int
    tp: int
    dp: int
    num_microbatches: int
    schedule: Schedule
    virtual_stages: int
    cell_groups: tuple[tuple[int, ...], ...]
    """``cell_groups[s][r]``: index of the device group that runs stage ``s`` of replica ``r``."""
    batch_shares: tuple[int, ...]
    """Samples per step of each replica (multiples of ``num_microbatches``)."""
    layout: str = "homogeneous"
    """``"homogeneous"`` (one group), ``"replicas"`` (each replica on one group) or ``"stages"``
    (each stage on one group)."""

    @property
    def num_virtual(self) -> int:
        return self.num_stages * self.virtual_stages

    @property
    def step_form(self) -> StepForm:
        """The step time as a linear form of ``T``, ``Tc`` and ``X`` (:class:`StepForm`)."""
        return StepForm(float(self.num_microbatches), float(self.num_stages - 1))

    @property
    def bubble_coefficient(self) -> float:
        """``M + S - 1`` (GPipe, 1F1B) or ``M + (S-1)/v`` (interleaved): the step's coefficient of ``T``
        when chunks are balanced. The step itself is ``M T + (S - 1) Tc + X`` (``costing.step_time``);
        since ``Tc >= T / v``-worth of compute, this coefficient times a bound on ``T`` bounds the step."""
        m, s, v = self.num_microbatches, self.num_stages, self.virtual_stages
        if self.schedule is Schedule.INTERLEAVED_1F1B:
            return m + (s - 1) / v
        return m + s - 1

    def describe(self, groups: tuple[GroupView, ...] | None = None) -> str:
        mb = "/".join(str(x // self.num_microbatches) for x in sorted(set(self.batch_shares)))
        s = (f"pp={self.num_stages} tp={self.tp} dp={self.dp} M={self.num_microbatches} mb={mb} "
             f"{self.schedule.value}")
        if self.virtual_stages > 1:
            s += f" v={self.virtual_stages}"
        if groups is not None and len(groups) > 1:
            if self.layout == "stages":
                s += " stages on " + ",".join(groups[row[0]].name for row in self.cell_groups)
            elif self.layout == "replicas":
                runs: list[list] = []  # "v100:20 x8,t4:12 x8", not sixteen entries
                for item in (f"{groups[g].name}:{b}" for g, b in zip(self.cell_groups[0], self.batch_shares)):
                    if runs and runs[-1][0] == item:
                        runs[-1][1] += 1
                    else:
                        runs.append([item, 1])
                s += " shares " + ",".join(f"{i} x{k}" if k > 1 else i for i, k in runs)
        return s


def build_layout(cand: Candidate, hw: Hardware) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``ranks[stage][replica][tp]``: Megatron order, TP innermost on consecutive local ranks of one
    node, then DP, then PP; each ``(stage, replica)`` cell takes the next ``tp`` ranks of its group.
    Cached on ``hw`` (:attr:`Hardware.layouts`): the same object for every candidate of that shape."""
    key = (cand.num_stages, cand.dp, cand.tp, cand.cell_groups)
    cached = hw.layouts.get(key)
    if cached is None:
        cached = hw.layouts[key] = _layout(cand, hw)
    return cached


def _layout(cand: Candidate, hw: Hardware) -> tuple[tuple[tuple[int, ...], ...], ...]:
    pools = {g.index: list(g.ranks) for g in hw.groups}
    cursor = {g.index: 0 for g in hw.groups}
    out = []
    for s in range(cand.num_stages):
        row = []
        for r in range(cand.dp):
            g = cand.cell_groups[s][r]
            i = cursor[g]
            row.append(tuple(pools[g][i:i + cand.tp]))
            cursor[g] = i + cand.tp
        out.append(tuple(row))
    return tuple(out)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(sqrt n) (a global batch may be large)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def distinct_orders(items: tuple[int, ...], key: dict[int, str]) -> list[tuple[int, ...]]:
    """Permutations of ``items`` up to swapping items with the same ``key`` (identical groups)."""
    seen, out = set(), []
    for perm in itertools.permutations(items):
        sig = tuple(key[i] for i in perm)
        if sig not in seen:
            seen.add(sig)
            out.append(perm)
    return out


class RejectionKind(enum.Enum):
    """Why an outer candidate is not the plan (``plan.explain()`` words each one)."""

    OUTER = "outer"
    """Not a candidate at all: a part of the outer space the runtime or the cluster rules out."""
    PRUNED = "pruned"
    """Not solved: its lower bound is no better than the incumbent."""
    TIME_LIMIT = "time limit"
    """Not solved: the search's time ran out first."""


@dataclass(slots=True)
class Rejection:
    """Why an outer candidate was not solved or lost."""

    candidate: Candidate | None
    reason: str
    step_time_s: float = float("inf")
    extra: dict = field(default_factory=dict)
    kind: RejectionKind = RejectionKind.OUTER
