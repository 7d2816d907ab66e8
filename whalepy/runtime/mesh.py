"""Device meshes from a plan's rank grids, and a helper that writes a plan by hand.

The plan lays ranks out as ``[stage][replica][tp]``. When every stage has the same TP degree (the
runtime's requirement, checked here) that grid is a 3-D ``DeviceMesh`` with axes ``("pp", "dp",
"tp")`` built from the plan's own rank array, so a planner that interleaves ranks (a replica on
another node group) is honoured exactly. Each rank then keeps its stage's 2-D ``("dp", "tp")``
sub-mesh for FSDP2 and DTensor, and its ``pp`` column (same replica and TP index across stages) as
the pipeline's process group.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from whalepy.errors import LaunchError, PlanError
from whalepy.ir.plan import BlockPlan, Plan, Precision, Schedule, StagePlan, Tier, TPRule, ZeroStage
from whalepy.ir.types import OptimizerImpl

__all__ = ["RankMeshes", "build_meshes", "make_plan", "resolve_device_type"]


@dataclass(frozen=True, kw_only=True)
class RankMeshes:
    """What one rank needs from the global layout."""

    device_type: str
    """``"cpu"`` (gloo) or ``"cuda"`` (nccl)."""
    rank: int
    stage: StagePlan
    replica: int
    """Index of this rank's data-parallel replica."""
    tp_index: int
    world: DeviceMesh
    """The ``("pp", "dp", "tp")`` mesh of the whole job."""
    stage_mesh: DeviceMesh
    """This stage's ``("dp", "tp")`` sub-mesh."""

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.stage_mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.stage_mesh["tp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.world["pp"].get_group()

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def resolve_device_type(cluster_spec: Any = None) -> str:
    """``"cpu"`` when CUDA is absent or the cluster runs (some of) its ranks simulated on CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    groups = getattr(cluster_spec, "groups", ())
    if any(getattr(g, "runs_on_cpu", False) for g in groups):
        return "cpu"
    return "cuda"


def set_local_device(device_type: str) -> None:
    """CUDA: make ``LOCAL_RANK``'s GPU this process's current device. Before the first NCCL
    collective: object collectives (``broadcast_object_list`` in ``_pm_setup._plan_once``) stage their
    bytes on ``torch.cuda.current_device()``, and torch leaves it to the caller to give each rank its own
    GPU (``torch.distributed.broadcast_object_list`` docs); with GPU 0 current everywhere, ranks of one
    node would all join NCCL on the same GPU."""
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def build_meshes(plan: Plan, device_type: str) -> RankMeshes:
    """Build the job's meshes (a collective call: every rank must call it) and return this rank's."""
    widths = {s.tp_degree for s in plan.stages}
    if len(widths) != 1:
        raise PlanError(
            f"stages have tensor-parallel degrees {plan.tp_degrees}; the runtime needs one TP degree "
            "for all stages (pipeline stages exchange activations between matching TP ranks)"
        )
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    rank = dist.get_rank()
    set_local_device(device_type)
    with unset_fake_temporarily():  # rank numbers are real even in a dry run (whalepy check)
        grid = torch.tensor([[list(row) for row in s.ranks] for s in plan.stages], dtype=torch.int)
        world = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp", "tp"))
    stage, replica, tp_index = plan.stage_of_rank(rank)
    return RankMeshes(
        device_type=device_type, rank=rank, stage=stage, replica=replica, tp_index=tp_index,
        world=world, stage_mesh=world["dp", "tp"],
    )


def make_plan(
    block_names: Sequence[str],
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    global_batch: int,
    zero_stage: ZeroStage | int = ZeroStage.NONE,
    checkpoint: bool | Sequence[str] = False,
    batch_shares: Sequence[int] | None = None,
    num_microbatches: int = 1,
    schedule: Schedule | str = Schedule.ONE_F_ONE_B,
    stage_sizes: Sequence[int] | None = None,
    virtual_stages: int = 1,
    chunk_sizes: Sequence[Sequence[int]] | None = None,
    tensor_parallel: Sequence[TPRule] = (),
    param_tier: Tier | str = Tier.GPU,
    optimizer_tier: Tier | str = Tier.GPU,
    tiers: Mapping[str, tuple[Tier | str, Tier | str]] | None = None,
    activation_offload: bool | Sequence[str] = False,
    checkpoint_offload: bool | Sequence[str] = False,
    prefetch_depth: int = 1,
    device_type: str = "CPU",
    model_name: str = "model",
    model_fingerprint: str = "unchecked",
    precision: Precision | str = Precision.FP32,
    reduce_every_microbatch: bool = False,
    optimizer_impl: str = "as_given",
    compile: bool = False,
) -> Plan:
    """A valid :class:`Plan` for a fixed layout, without the planner (tests, benchmarks, users who
    know what they want). Ranks are laid out ``pp``-major, then ``dp``, then ``tp`` (TP innermost, as
    torchrun numbers ranks node by node). ``checkpoint`` is ``True`` for every block or a list of
    block names, and so are ``activation_offload`` (saved activations in host memory) and
    ``checkpoint_offload`` (a checkpointed block's input in host memory). Blocks are split
    over stages evenly unless ``stage_sizes`` gives the counts.

    ``virtual_stages = v > 1`` makes an interleaved plan (schedule ``interleaved_1f1b`` unless another
    is given): the blocks are cut into ``pp * v`` pipeline stages in model order, evenly unless
    ``chunk_sizes[s][j]`` gives the blocks of chunk ``j`` of physical stage ``s`` (pipeline stage
    ``s + j * pp``); each physical stage holds its ``v`` chunks (``StagePlan.chunk_sizes``).
    ``precision`` is what the runtime trains in (fp32 unless given); ``reduce_every_microbatch`` sets
    :attr:`StagePlan.reduce_every_microbatch` on every stage. ``optimizer_impl`` and ``compile`` are
    :attr:`Plan.optimizer_impl` and :attr:`Plan.compile` (the optimizer as given, eager blocks, unless
    given).

    ``param_tier`` / ``optimizer_tier`` are every block's memory tiers; ``tiers`` overrides them per
    block (granular offloading, as M6-10T's): ``{block name: (param_tier, optimizer_tier)}``, e.g.
    ``tiers={"transformer.h.0": ("cpu", "cpu")}``. An unknown block name in ``tiers``, or a pair there
    the runtime does not lower (:func:`whalepy.ir.rules.state_option_error`), is a
    :class:`PlanError` here; the stage-wide pair is checked when the plan is lowered."""
    blocks = [] if isinstance(block_names, (str, bytes)) else list(block_names)
    if not blocks or not all(isinstance(n, str) for n in blocks):
        raise PlanError(f"make_plan(block_names={block_names!r:.80}): give a list of block names in model order, "
                        "e.g. ['embed', 'transformer.h.0', 'transformer.h.1', 'head'] (the profile's block names)")
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"make_plan({name}={value!r}): {name} must be a positive integer; e.g. "
                            f"{name}={8 if name == 'global_batch' else 2}")
    v = virtual_stages
    if v > 1:
        if schedule == Schedule.ONE_F_ONE_B or schedule == Schedule.ONE_F_ONE_B.value:
            schedule = Schedule.INTERLEAVED_1F1B
        if stage_sizes is not None:
            raise PlanError("give chunk_sizes (blocks per virtual chunk), not stage_sizes, with "
                            "virtual_stages > 1")
        if chunk_sizes is None:  # even split of the blocks over the pp * v pipeline stages
            base, extra = divmod(len(blocks), pp * v)
            flat = [base + (1 if g < extra else 0) for g in range(pp * v)]
            chunk_sizes = [[flat[s + j * pp] for j in range(v)] for s in range(pp)]
        chunk_sizes = [tuple(c) for c in chunk_sizes]
        if len(chunk_sizes) != pp or any(len(c) != v for c in chunk_sizes):
            raise PlanError(f"chunk_sizes {chunk_sizes} must give {v} chunks for each of {pp} stages")
        if sum(map(sum, chunk_sizes)) != len(blocks) or min(map(min, chunk_sizes)) < 1:
            raise PlanError(f"chunk sizes {chunk_sizes} do not split {len(blocks)} blocks into "
                            f"{pp * v} non-empty chunks")
        # pipeline stage g = s + j * pp takes the next chunk_sizes[s][j] blocks in model order
        by_stage: list[list[str]] = [[] for _ in range(pp)]
        start = 0
        for g in range(pp * v):
            s, j = g % pp, g // pp
            by_stage[s] += blocks[start:start + chunk_sizes[s][j]]
            start += chunk_sizes[s][j]
        stage_sizes = [len(b) for b in by_stage]
        blocks = [n for b in by_stage for n in b]
    elif chunk_sizes is not None:
        raise PlanError("chunk_sizes needs virtual_stages > 1")
    if stage_sizes is None:
        base, extra = divmod(len(blocks), pp)
        stage_sizes = [base + (1 if i < extra else 0) for i in range(pp)]
    if len(stage_sizes) != pp or sum(stage_sizes) != len(blocks):
        raise PlanError(f"stage sizes {list(stage_sizes)} do not split {len(blocks)} blocks into {pp} "
                        "stages")
    pairs = _block_tiers(blocks, param_tier, optimizer_tier, tiers, zero_stage=zero_stage, precision=precision)
    ckpt = _block_set("checkpoint", checkpoint, blocks)
    act_off = _block_set("activation_offload", activation_offload, blocks)
    ck_off = _block_set("checkpoint_offload", checkpoint_offload, blocks)
    if batch_shares is None and global_batch % dp:
        raise PlanError(f"global batch {global_batch} does not split evenly over {dp} data-parallel replicas; "
                        "give batch_shares (samples per replica) or a batch divisible by dp")
    shares = tuple(batch_shares) if batch_shares is not None else (global_batch // dp,) * dp
    stages = []
    start = 0
    for s, size in enumerate(stage_sizes):
        names = blocks[start:start + size]
        start += size
        stages.append(StagePlan(
            index=s,
            blocks=tuple(BlockPlan(name=n, checkpoint=n in ckpt, param_tier=pairs[n][0],
                                   optimizer_tier=pairs[n][1], activation_offload=n in act_off,
                                   checkpoint_offload=n in ck_off, prefetch_depth=prefetch_depth)
                   for n in names),
            ranks=tuple(tuple(s * dp * tp + d * tp + t for t in range(tp)) for d in range(dp)),
            device_types=(device_type,) * dp,
            zero_stage=ZeroStage(zero_stage),
            chunk_sizes=tuple(chunk_sizes[s]) if v > 1 else (),
            reduce_every_microbatch=reduce_every_microbatch,
        ))
    world = pp * dp * tp
    return Plan(
        model_name=model_name, model_fingerprint=model_fingerprint, world_size=world,
        rank_device_types=(device_type,) * world, global_batch=global_batch,
        num_microbatches=num_microbatches, schedule=Schedule(schedule), virtual_stages=v,
        batch_shares=shares,
        stages=tuple(stages), tensor_parallel=tuple(tensor_parallel) if tp > 1 else (),
        precision=Precision(precision),
        optimizer_impl=OptimizerImpl(optimizer_impl),
        compile=compile,
    )


def _block_tiers(blocks: Sequence[str], param_tier: Tier | str, optimizer_tier: Tier | str,
                 tiers: Mapping[str, tuple[Tier | str, Tier | str]] | None, *, zero_stage: ZeroStage | int,
                 precision: Precision | str) -> dict[str, tuple[Tier, Tier]]:
    """Each block's ``(param_tier, optimizer_tier)``: the stage-wide pair, overridden by ``tiers``."""
    from whalepy.ir.rules import state_option_error

    if tiers is not None and not isinstance(tiers, Mapping):
        raise PlanError(f"tiers={tiers!r:.80} is a {type(tiers).__name__}; give a dict of block name -> "
                        "(param_tier, optimizer_tier), e.g. tiers={'transformer.h.0': ('cpu', 'cpu')}")
    tiers = dict(tiers or {})
    _check_block_names("tiers", tiers, blocks)
    try:
        stage_pair = (Tier(param_tier), Tier(optimizer_tier))
    except PlanError as e:
        shown = ", ".join(f"{k}={getattr(t, 'value', t)!r}" for k, t in (("param_tier", param_tier),
                                                                             ("optimizer_tier", optimizer_tier)))
        raise PlanError(f"make_plan({shown}): {e}") from None
    out: dict[str, tuple[Tier, Tier]] = {}
    for n in blocks:
        pair = tiers.get(n, stage_pair)
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise PlanError(f"tiers[{n!r}] = {pair!r}: give a (param_tier, optimizer_tier) pair of "
                            f"{', '.join(repr(t.value) for t in Tier)}, e.g. ('cpu', 'cpu')")
        try:
            p, o = (Tier(t) for t in pair)
        except PlanError as e:
            raise PlanError(f"tiers[{n!r}] = {tuple(pair)!r}: {e}") from None
        reason = state_option_error(zero_stage, p, o, precision=precision)
        if reason is not None:
            raise PlanError(f"tiers[{n!r}]: {reason}" if n in tiers else f"make_plan(): {reason}")
        out[n] = (p, o)
    return out


def _check_block_names(arg: str, names: Iterable[Any], blocks: Sequence[str]) -> None:
    """PlanError for a name in ``names`` that is not one of ``blocks``, with the closest ones."""
    import difflib

    unknown = sorted({str(n) for n in names} - set(blocks))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(blocks), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PlanError(f"{arg} names blocks {unknown} that the model does not have; {hint}its blocks are "
                        f"{list(blocks)}")


def _block_set(arg: str, value: bool | Sequence[str] | None, blocks: Sequence[str]) -> set[str]:
    """The blocks a ``True`` / ``False`` / list-of-names argument of :func:`make_plan` selects."""
    if value is True:
        return set(blocks)
    if value is None or value is False:
        return set()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        example = blocks[0] if blocks else "transformer.h.0"
        raise PlanError(f"make_plan({arg}={value!r:.80}): give True (every block), False, or a list of block "
                        f"names, e.g. {arg}=[{example!r}]")
    names = set(value)
    _check_block_names(arg, names, blocks)
    return names


def check_world(plan: Plan) -> None:
    world = dist.get_world_size()
    if world != plan.world_size:
        raise LaunchError(
            f"this job has {world} processes but the plan is for {plan.world_size}; launch with "
            f"`torchrun --nproc-per-node {plan.world_size} ...` (or `whalepy run -n {plan.world_size} "
            "...`), or re-plan for this cluster"
        )
