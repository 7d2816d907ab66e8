"""Every rank of a plan lowered without its hardware: ``whalepy check PLAN.json --model MODULE:FN``.

A plan for 1,024 GPUs can be wrong for one rank (a mesh, a stage boundary, a batch share) and be
found wrong only on that cluster, after the job is scheduled. This module lowers the plan in one
process, one rank at a time, as that rank would:

1. **Layout, every rank** (:func:`rank_layout`, no torch): from the plan file as written, before the
   :class:`~whalepy.Plan` is built, each rank's stage, data-parallel replica and tensor-parallel
   index, the ranks of its ``dp``, ``tp`` and ``pp`` groups, its blocks (per virtual stage) and its
   batch share. A rank on no stage or on two, a tensor-parallel group of another width than the
   others, a stage with another number of replicas, batch shares that are not one per replica or do
   not sum to the global batch, and a model block on no stage are each a :class:`RankCheckError`
   naming the rank(s).
2. **Lowering, one representative per role** (:func:`lower_rank`): ranks of the same stage, device
   type and batch share lower identically (their tensor-parallel shards have the same shapes: the
   plan check refuses a TP degree that does not divide), so the lowest rank of each role stands for
   it (``ranks="all"`` or a list lowers others). The representative is lowered by the runtime itself,
   :func:`whalepy.runtime.parallelize`, on PyTorch's fake process group (``backend="fake"``, world
   size the plan's, this process as that rank: every ``DeviceMesh`` and process group is made as on
   the cluster, no collective moves data) with the model on the meta device and its shards
   materialised as ``FakeTensor`` s (:func:`whalepy.runtime.materialize.dry_run`: shapes, dtypes and
   devices, no memory); the ranks of one check share the pipeline split's trace of the model
   (:func:`whalepy.runtime.pipeline.reuse_traces`: every rank splits the same model the same way, and
   the export of a 175B model is 10 s). Its optimizer then takes one step on zero gradients (fake too), so the
   optimizer states exist; the parameter, gradient and optimizer bytes it holds per place (device,
   host, files) are counted by :func:`whalepy.runtime.held.held_state_bytes`, the same function
   the multi-process tests compare with the memory model (elements, not FSDP2's padded storage,
   which the report gives beside them).
3. **Against the prediction**: the held bytes per place must equal the plan's
   ``StageCost.model_state_bytes`` (device), ``host_state_bytes`` and ``nvme_state_bytes`` exactly. Those
   are the first replica's; FSDP2 gives the other replicas fewer rows of a parameter whose first
   dimension the dp degree does not divide, and each rank is compared with its own replica's bytes
   (:func:`replica_state_bytes`).

4. **Collectives**: one training step runs on the fake tensors under
   :class:`whalepy.tools.comm_count.CollectiveCounter` (the counter of ``study zero --measure``; it
   sees DTensor's functional collectives too), pipelined steps included: the runtime builds every
   pipeline stage with its input and output shapes (``PipelineStage(input_args=, output_args=)``), so
   torch's schedule exchanges no metadata objects, which the fake process group could not carry, and
   the check answers torch's first-step vote on those shapes as the cluster would (:func:`_static_vote`).
   Its payload by kind is compared within :data:`COLLECTIVE_RTOL` with the cost model's
   (:func:`predicted_collectives`): data parallelism (``dp_step_payload_bytes``), tensor parallelism
   (``tp_step_payload_bytes``), the sends and receives between stages
   (``pipeline_step_payload_bytes``), a tied weight's gradient sum over stages
   (``tied_step_payload_bytes``) and the loss report. Sequence parallelism has no byte model yet: its
   bytes are reported, not compared.

The disk tier writes real files and is not dry-run (a rank with ``nvme`` blocks reports the
lowering error).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from whalepy.errors import WhalepyError

COLLECTIVE_RTOL = 0.01
"""Measured against predicted collective bytes: FSDP2 pads a parameter's first dimension to a multiple of
the dp degree, which the cost model leaves out (``dp_step_payload_bytes``); 1% holds that and nothing
more."""

__all__ = ["RankCheckError", "RankLayout", "RankReport", "check_ranks", "lower_rank", "rank_layout", "roles"]


class RankCheckError(WhalepyError):
    """A plan that is wrong for a rank, named in the message."""


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """What rank ``rank`` does, read from the plan as written."""

    rank: int
    stage: int
    replica: int
    tp_index: int
    device_type: str
    chunks: tuple[tuple[str, ...], ...]
    """Its blocks, per virtual stage it holds (one chunk without the interleaved schedule)."""
    batch_share: int
    dp_group: tuple[int, ...]
    tp_group: tuple[int, ...]
    pp_group: tuple[int, ...]

    @property
    def role(self) -> tuple[int, str, int]:
        return (self.stage, self.device_type, self.batch_share)


@dataclass(kw_only=True)
class RankReport:
    layout: RankLayout
    role_size: int = 1
    """Ranks this one stands for (its role)."""
    held: dict[str, dict[str, int]] = field(default_factory=dict)
    """``{kind: {place: bytes}}`` as lowered (kinds params / grads / optimizer; places device / host / files)."""
    predicted: dict[str, int] = field(default_factory=dict)
    """``{place: bytes}`` of model states, the plan's ``StageCost``."""
    meshes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The ``dp`` / ``tp`` / ``pp`` groups as the lowered ``DeviceMesh`` made them."""
    allocated: dict[str, dict[str, int]] = field(default_factory=dict)
    """As ``held``, storage bytes (FSDP2's padded shards): what the allocator would hand out."""
    collectives: dict[str, int] | None = None
    """Payload bytes of one training step's collectives by kind (``comm_count.CollectiveCounter``'s
    convention); None where no step ran (no optimizer)."""
    predicted_collectives: dict[str, float] | None = None
    """The cost model's payload of that step (:func:`predicted_collectives`); None under sequence
    parallelism."""
    error: str | None = None
    seconds: float = 0.0

    @property
    def held_by_place(self) -> dict[str, int]:
        return {p: sum(self.held[k][p] for k in self.held) for p in ("device", "host", "files")} if self.held else {}

    @property
    def mismatches(self) -> list[str]:
        out = []
        if self.error is not None:
            out.append(f"lowering failed: {self.error}")
            return out
        held = self.held_by_place
        for place, want in self.predicted.items():
            if held.get(place, 0) != want:
                out.append(f"{place}: holds {held.get(place, 0):,} bytes of model states, the plan predicts {want:,}")
        lowered = {"dp": self.layout.dp_group, "tp": self.layout.tp_group, "pp": self.layout.pp_group}
        if self.collectives is not None and self.predicted_collectives is not None:
            for kind in sorted(set(self.collectives) | set(self.predicted_collectives)):
                got, want = self.collectives.get(kind, 0), self.predicted_collectives.get(kind, 0.0)
                if abs(got - want) > COLLECTIVE_RTOL * max(want, 1.0):
                    out.append(f"{kind}: one step moves {got:,} bytes, the plan's cost model {want:,.0f}")
        for axis, ranks in self.meshes.items():
            if tuple(sorted(ranks)) != tuple(sorted(lowered[axis])):
                out.append(f"{axis} group: lowered {list(ranks)}, the plan's grid says {list(lowered[axis])}")
        return out

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def lines(self) -> list[str]:
        lay = self.layout
        blocks = " | ".join(_span(c) for c in lay.chunks)
        out = [f"rank {lay.rank} (stands for {self.role_size} rank{'s' if self.role_size != 1 else ''}): stage "
               f"{lay.stage}, replica {lay.replica} ({lay.device_type}), tp index {lay.tp_index}; blocks {blocks}; "
               f"batch share {lay.batch_share}",
               f"  meshes: dp {_ranks(lay.dp_group)}, tp {_ranks(lay.tp_group)}, pp {_ranks(lay.pp_group)}"]
        if self.held:
            for kind in ("params", "grads", "optimizer"):
                h = self.held[kind]
                out.append(f"  {kind:9s} device {h['device']:>15,}  host {h['host']:>15,}  files {h['files']:>13,}")
            held = self.held_by_place
            out.append("  model states: " + ", ".join(
                f"{p} {held[p]:,} (plan {self.predicted.get(p, 0):,})" for p in ("device", "host", "files")))
            alloc = {p: sum(self.allocated[k][p] for k in self.allocated) for p in ("device", "host", "files")}
            out.append("  allocated with FSDP2's shard padding: " + ", ".join(f"{p} {alloc[p]:,}" for p in alloc))
        if self.collectives is None:
            out.append("  collectives of one step: not run (no optimizer to step)")
        else:
            pred = self.predicted_collectives
            out.append("  collectives of one step: " + ", ".join(
                f"{k} {v:,}" + (f" (plan {pred.get(k, 0):,.0f})" if pred is not None else "")
                for k, v in sorted(self.collectives.items()))
                + ("" if pred is not None else " (no byte prediction under sequence parallelism)"))
        out += [f"  MISMATCH {m}" for m in self.mismatches]
        return out


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _ranks(rs: Sequence[int]) -> str:
    rs = list(rs)
    if len(rs) > 2 and all(b - a == rs[1] - rs[0] for a, b in zip(rs, rs[1:])):
        return f"{rs[0]}..{rs[-1]} step {rs[1] - rs[0]} ({len(rs)})"
    return str(rs)


# -- 1. layout, every rank ------------------------------------------------------------------------


def _odd_one(values: Sequence[int]) -> int:
    """Index of the value that differs from the most common one (the first index when all differ)."""
    common = Counter(values).most_common(1)[0][0]
    return next((i for i, v in enumerate(values) if v != common), 0)


def rank_layout(plan: dict[str, Any], model_blocks: Sequence[str] | None = None) -> list[RankLayout]:
    """Every rank's :class:`RankLayout` from a plan's JSON form (``Plan.to_json``'s dict), checked rank by
    rank (module docstring, step 1); ``model_blocks``: the model's blocks in order, each of which must
    be on a stage."""
    world = int(plan["world_size"])
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    where: dict[int, list[tuple[int, int, int]]] = {}
    widths = [(len(row), s["index"], d, row) for s in stages for d, row in enumerate(s["ranks"])]
    common = Counter(x[0] for x in widths).most_common(1)[0][0]
    for w, s, d, row in widths:
        if w != common:
            raise RankCheckError(f"rank {row[0]} (stage {s}, replica {d}): its tensor-parallel group {list(row)} has "
                                 f"{w} ranks, the other groups {common}; every group of the mesh has the same width "
                                 "(fix the plan's ranks, or re-plan)")
    for s in stages:
        for d, row in enumerate(s["ranks"]):
            for t, r in enumerate(row):
                where.setdefault(r, []).append((s["index"], d, t))
    twice = {r: w for r, w in where.items() if len(w) > 1}
    for r in range(world):
        if r not in where:
            also = f" (rank {min(twice)} is on {len(twice[min(twice)])} places)" if twice else ""
            raise RankCheckError(f"rank {r} is on no stage (world size {world}){also}; give it a place in a "
                                 "stage's ranks, or re-plan")
    for r in range(world):
        if len(where[r]) > 1:
            raise RankCheckError(f"rank {r} is on {len(where[r])} places (stage, replica, tp index) "
                                 f"{where[r]}; every rank runs one")
    extra = sorted(r for r in where if not 0 <= r < world)
    if extra:
        raise RankCheckError(f"rank {extra[0]} is in a stage's ranks but the world has ranks 0..{world - 1}")
    dps = [len(s["ranks"]) for s in stages]
    if len(set(dps)) > 1:
        s = stages[_odd_one(dps)]
        raise RankCheckError(f"rank {s['ranks'][0][0]} (stage {s['index']}): its stage has {len(s['ranks'])} "
                             f"data-parallel replicas, the others {Counter(dps).most_common(1)[0][0]}; "
                             "every stage has the same replicas")
    shares = list(plan["batch_shares"])
    first = stages[0]["ranks"]
    if len(shares) != dps[0]:
        d = min(len(shares), dps[0] - 1)
        raise RankCheckError(f"rank {first[d][0]} (replica {d}): {len(shares)} batch shares for {dps[0]} "
                             "data-parallel replicas; give one per replica")
    if sum(shares) != plan["global_batch"] or min(shares) < 1:
        d = _odd_one(shares) if min(shares) >= 1 else shares.index(min(shares))
        raise RankCheckError(f"rank {first[d][0]} (replica {d}, and its stages' ranks): batch share {shares[d]}; "
                             f"the shares {shares[:8]}{'...' if len(shares) > 8 else ''} sum to {sum(shares)}, "
                             f"not the global batch {plan['global_batch']}")
    chunks_of = {s["index"]: _chunks(s) for s in stages}
    if model_blocks is not None:
        placed = [b for s in stages for c in chunks_of[s["index"]] for b in c]
        missing = [b for b in model_blocks if b not in placed]
        if missing:
            i = list(model_blocks).index(missing[0])
            near = next((b for b in reversed(model_blocks[:i]) if b in placed), None) or \
                next(b for b in model_blocks[i:] if b in placed)
            s = next(s for s in stages for c in chunks_of[s["index"]] if near in c)
            raise RankCheckError(f"block {missing[0]!r} is on no stage: ranks {_ranks(sorted(r for row in s['ranks'] for r in row))} "
                                 f"(stage {s['index']}, which holds its neighbour {near!r}) would run without it; "
                                 "put it on a stage, or re-plan")
    types = plan.get("rank_device_types") or ["?"] * world
    out = []
    for r in range(world):
        s_idx, d, t = where[r][0]
        stage = next(s for s in stages if s["index"] == s_idx)
        out.append(RankLayout(
            rank=r, stage=s_idx, replica=d, tp_index=t, device_type=types[r], chunks=chunks_of[s_idx],
            batch_share=shares[d], dp_group=tuple(row[t] for row in stage["ranks"]),
            tp_group=tuple(stage["ranks"][d]), pp_group=tuple(s["ranks"][d][t] for s in stages)))
    return out


def _chunks(stage: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    names = [b["name"] for b in stage["blocks"]]
    sizes = stage.get("chunk_sizes") or [len(names)]
    out, start = [], 0
    for n in sizes:
        out.append(tuple(names[start:start + n]))
        start += n
    return tuple(out)


def roles(layouts: Sequence[RankLayout]) -> dict[tuple[int, str, int], list[int]]:
    """Ranks by role (stage, device type, batch share), lowest rank first."""
    out: dict[tuple[int, str, int], list[int]] = {}
    for lay in layouts:
        out.setdefault(lay.role, []).append(lay.rank)
    return out


# -- 2. lowering one rank ---------------------------------------------------------------------------


@contextlib.contextmanager
def _fake_world(rank: int, world: int) -> Iterator[None]:
    import torch.distributed as dist

    from whalepy.runtime.measure_lowered import fake_world

    if dist.is_initialized():
        raise WhalepyError("whalepy check lowers ranks on its own fake process group; run it outside a "
                           "torch.distributed job")
    try:
        with fake_world(world, rank):
            yield
    finally:
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's sharding-propagation and redistribution caches: they key on meshes, and the next
    rank's meshes compare equal to this one's (same layout) while their process groups are new, so a
    cached result would name a group of the destroyed world ("Could not resolve the process group")."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)
    if clear is not None:
        clear()


def _mean_of_output(output: Any, _target: Any) -> Any:
    """The check's loss: the mean of the model's first floating-point output (logits; an HF output
    object's too), whatever the targets (the values are fake)."""
    import torch
    import torch.utils._pytree as pytree

    if hasattr(output, "to_tuple"):  # HF ModelOutput
        output = output.to_tuple()
    first = next(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().mean()


def _group_ranks(mesh: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(mesh.get_group()))


def lower_rank(plan: Any, build: Callable[[], tuple[Any, tuple]], layout: RankLayout, *,
               profile: Any = None, cluster: Any = None) -> RankReport:
    """Lower ``plan`` as rank ``layout.rank`` (module docstring, step 2). ``build()`` returns ``(model on
    the meta device, example inputs)`` and is called once per rank (lowering changes the model)."""
    import time

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from whalepy.runtime import parallelize
    from whalepy.runtime.held import held_state_bytes
    from whalepy.runtime.materialize import dry_run, has_meta_tensors

    t0 = time.perf_counter()
    report = RankReport(layout=layout, predicted=replica_state_bytes(plan, profile, layout.stage, layout.replica))
    model, inputs = build()
    if not has_meta_tensors(model):
        raise WhalepyError("whalepy check lowers the model on the meta device: build it under "
                           "`with torch.device('meta'):` (a real model of the plan's size would not fit here)")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _fake_world(layout.rank, plan.world_size):
        try:
            with dry_run(mode):
                pm = parallelize(model, cluster, example_inputs=tuple(inputs), plan=plan, profile=profile,
                                 global_batch=plan.global_batch, loss_fn=_mean_of_output,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
            report.meshes = {"dp": _group_ranks(pm.meshes.dp_mesh), "tp": _group_ranks(pm.meshes.tp_mesh),
                             "pp": tuple(torch.distributed.get_process_group_ranks(pm.meshes.pp_group))}
            if pm.optimizer is not None:  # a whole step runs on fake tensors
                at_step: list[tuple[Any, Any]] = []
                step = pm.optimizer.step

                def measured(*a: Any, **k: Any) -> Any:  # what it holds at the step: gradients included
                    at_step.append((held_state_bytes(pm, unpadded=True), held_state_bytes(pm)))
                    return step(*a, **k)

                pm.optimizer.step = measured
                if pm.schedule is not None:
                    _static_vote(pm.schedule)
                report.collectives, report.predicted_collectives = _one_step(pm, plan, inputs, profile, mode)
                pm.optimizer.step = step
                # the states the step made (what every later step holds), the gradients it stepped with
                # (dropped after it)
                report.held, report.allocated = held_state_bytes(pm, unpadded=True), held_state_bytes(pm)
                if at_step:
                    report.held["grads"], report.allocated["grads"] = at_step[-1][0]["grads"], at_step[-1][1]["grads"]
            else:
                with mode, torch.no_grad():
                    _first_step_states(pm)
                report.held = held_state_bytes(pm, unpadded=True)
                report.allocated = held_state_bytes(pm)
        except Exception as e:  # noqa: BLE001 - a lowering error is this rank's result, reported with it
            report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report.seconds = time.perf_counter() - t0
    return report


def replica_state_bytes(plan: Any, profile: Any, stage: int, replica: int) -> dict[str, int]:
    """``{place: bytes}`` of model states a rank of ``stage`` and data-parallel ``replica`` holds, as the
    cost model predicts it. The plan's ``StageCost`` is the first replica's (FSDP2 splits each
    parameter's first dimension with ``torch.chunk``: the first replica holds the most, and must fit);
    replica ``r``'s differs by its rows (:func:`whalepy.ir.rules.fsdp_row_excess`), computed with the
    same function the plan's figures come from (``estimate_stage_model_state_bytes``) for both replicas.
    Without a profile (no rows known): the plan's figures."""
    cost = plan.stages[stage].cost
    out = {"device": int(cost.model_state_bytes), "host": int(cost.host_state_bytes),
           "files": int(cost.nvme_state_bytes)}
    if profile is None or replica == 0 or plan.dp_degree == 1:
        return out
    from whalepy.cost_models.memory import estimate_stage_model_state_bytes
    from whalepy.ir.rules import fsdp_row_excess, tied_copy_local_params, tied_copy_row_excess, tp_local_params

    st = plan.stages[stage]
    tp, dp = st.tp_degree, plan.dp_degree
    by_name = {b.name: b for b in profile.blocks}
    names = set(st.block_names)

    def held(r: int) -> Any:
        blocks = []
        copies: dict[str, tuple[float, Any, Any, float]] = {}
        for bp in st.blocks:
            b = by_name[bp.name]
            blocks.append((tp_local_params(b, tp), bp.param_tier, bp.optimizer_tier, fsdp_row_excess(b, tp, dp, r)))
            for c in getattr(b, "tied_copies", ()):
                if c.owner not in names:  # a copy of a tied weight (the memory model's rule, build.py)
                    copies.setdefault(c.parameter, (tied_copy_local_params(c, b, tp), bp.param_tier,
                                                    bp.optimizer_tier, tied_copy_row_excess(c, b, tp, dp, r)))
        return estimate_stage_model_state_bytes(
            blocks=blocks + list(copies.values()), zero_stage=st.zero_stage, dp_degree=dp, tp_degree=tp,
            pp_degree=plan.pp_degree, precision=plan.precision.value)

    first, this = held(0), held(replica)
    for place, attr in (("device", "resident"), ("host", "cpu"), ("files", "nvme")):
        out[place] += round(getattr(this, attr) - getattr(first, attr))
    return out


def _static_vote(schedule: Any) -> None:
    """Give this rank's pipeline stages the outcome of torch's first-step vote on metadata (torch 2.13:
    each stage votes static where its shapes were given, and the product travels to the last stage and
    back) without the exchange: on the fake process group a received tensor stays zeros, which reads as
    a vote for runtime shape inference, whose objects cannot travel there. Every stage the runtime
    builds has its shapes (``whalepy_io``), so on the cluster the vote is static; a stage of this rank
    without them is a lowering error here."""
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for st in stages:
        user = getattr(st, "_user_meta", None)
        if user is None:  # torch without the vote (2.11): no metadata vote to answer
            continue
        if not user.is_complete_for_forward():
            raise WhalepyError(f"pipeline stage {st.stage_index} was built without its input and output shapes, so "
                               "torch would infer them by exchanging objects, which the fake process group cannot "
                               "carry")
        st._warmup_forward_vote = lambda _has_backward, received_acc=None: _STATIC
        st._warmup_backward_result = lambda received_result=None: _STATIC


class _StaticVote:
    """The vote's result as the schedule reads it (``.item() == 1``: static), no tensor: the step runs in
    a ``FakeTensorMode``, where a tensor's value cannot be read."""

    @staticmethod
    def item() -> int:
        return 1


_STATIC = _StaticVote()


def _one_step(pm: Any, plan: Any, inputs: Sequence[Any], profile: Any, mode: Any) -> tuple[dict[str, int], dict[str, float] | None]:
    """One training step of the global batch (the example inputs repeated; the loss ignores targets)
    under ``CollectiveCounter`` (inside ``mode``: what the step allocates is fake), and the cost model's
    payload for it (:func:`predicted_collectives`)."""
    import torch

    from whalepy.tools.comm_count import CollectiveCounter

    B = plan.global_batch
    inputs = [torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) and x.is_meta else x
              for x in inputs]  # built under the meta device: zeros (token 0) of the same shape
    batch = tuple(x.repeat(-(-B // x.shape[0]), *([1] * (x.dim() - 1)))[:B] if isinstance(x, torch.Tensor) else x
                  for x in inputs)
    counter = CollectiveCounter()
    with mode, counter:  # buffers the step makes (pipeline receives) fake too: no memory
        pm.train_step(batch if len(batch) > 1 else batch[0], torch.zeros(B))
    got = {c.value: int(n) for c, n in counter.bytes.items()}
    if profile is None:
        return got, None
    return got, predicted_collectives(plan, profile, pm.meshes.stage.index, pm.meshes.replica, pm.dp_kind.value,
                                      loss_parallel=getattr(pm, "loss_parallel", False))


def predicted_collectives(plan: Any, profile: Any, stage: int, replica: int, dp_kind: str, *,
                          loss_parallel: bool = False) -> dict[str, float] | None:
    """The cost model's payload bytes, by kind, of one training step on a rank of ``stage`` and
    ``replica``: data parallelism (``dp_step_payload_bytes``), tensor parallelism
    (``tp_step_payload_bytes``), the pipeline's sends and receives (``pipeline_step_payload_bytes``)
    and the loss report. None where the model has no byte count (sequence parallelism)."""
    from whalepy.planner.runtime_costs import (
        LOSS_REPORT_BYTES,
        boundary_bytes,
        dp_step_payload_bytes,
        pipeline_step_payload_bytes,
        tied_step_payload_bytes,
        tp_step_payload_bytes,
    )
    import torch

    from whalepy.cost_models.compute import precision_bytes
    from whalepy.ir.rules import LoweringKind, tied_copy_local_params, tp_local_params

    st = plan.stages[stage]
    names = set(st.block_names)
    blocks = [b for b in profile.blocks if b.name in names]
    tp, M, precision = st.tp_degree, plan.num_microbatches, plan.precision.value
    micro_batch = plan.batch_shares[replica] / M
    byte_scale = precision_bytes(precision) / (torch.finfo(getattr(torch, profile.dtype)).bits // 8)
    out: dict[str, float] = {}

    def add(part: dict[Any, float]) -> None:
        for kind, n in part.items():
            out[kind.value] = out.get(kind.value, 0.0) + n

    tp_part = tp_step_payload_bytes(blocks, tp=tp, micro_batch=micro_batch, profile_batch=profile.batch_size,
                                    num_microbatches=M, byte_scale=byte_scale, loss_parallel=loss_parallel)
    if tp_part is None:
        return None
    add(tp_part)
    params = sum(tp_local_params(b, tp) for b in blocks)
    # a tied weight's copy a block of this stage holds without its owner (GPT-2's head holds wte): FSDP2
    # gathers and reduces it with the stage's own parameters (the memory model charges it the same way)
    held = {c.parameter: tied_copy_local_params(c, b, tp) for b in blocks for c in getattr(b, "tied_copies", ())
            if c.owner not in names}
    params += sum(held.values())
    if plan.dp_degree > 1 and params:
        add(dp_step_payload_bytes(dp_kind, zero3=st.zero_stage == 3, num_params=params, num_microbatches=M,
                                  precision=precision, pipelined=plan.pp_degree > 1))
    if plan.pp_degree > 1:
        message = boundary_bytes([b.output_bytes for b in profile.blocks], profile.dtype, precision) \
            * micro_batch / profile.batch_size
        add(pipeline_step_payload_bytes(message, stage=stage, num_stages=plan.pp_degree,
                                        virtual_stages=plan.virtual_stages, num_microbatches=M))
        add(tied_step_payload_bytes(blocks, profile.blocks, tp=tp, dp=plan.dp_degree,
                                    sharded=dp_kind == LoweringKind.FSDP))
    out["all_reduce"] = out.get("all_reduce", 0.0) + LOSS_REPORT_BYTES
    return out


def _first_step_states(pm: Any) -> None:
    """The optimizer states of one step: zero gradients (of the parameters' own layout, as FSDP2 and DDP
    give them) and a step of the device optimizer; the host optimizer's states (ZeRO-Offload) as its
    checkpoints create them."""
    import torch

    opt = pm.optimizer
    if opt is not None:
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
    if pm.host_optimizer is not None:
        pm.host_optimizer._init_states()


# -- 3. the check -----------------------------------------------------------------------------------


def select_ranks(layouts: Sequence[RankLayout], ranks: str | Sequence[int] = "roles") -> list[tuple[RankLayout, int]]:
    """``(layout, ranks it stands for)`` to lower: ``"roles"`` one per role, ``"all"`` every rank, or the
    given ranks."""
    by_role = roles(layouts)
    if ranks == "roles":
        return [(layouts[rs[0]], len(rs)) for rs in by_role.values()]
    if ranks == "all":
        return [(lay, 1) for lay in layouts]
    out = []
    for r in ranks:  # type: ignore[union-attr]
        if not 0 <= int(r) < len(layouts):
            raise RankCheckError(f"rank {r} is not in this plan's world of {len(layouts)} ranks")
        out.append((layouts[int(r)], 1))
    return out


def check_ranks(plan_json: dict[str, Any], build: Callable[[], tuple[Any, tuple]], *,
                ranks: str | Sequence[int] = "roles", profile: Any = None, cluster: Any = None,
                progress: Callable[[str], None] | None = None) -> list[RankReport]:
    """Steps 1-3 of the module docstring for a plan's JSON form and a model builder; returns the
    lowered ranks' reports (:attr:`RankReport.ok`). Raises :class:`RankCheckError` for a layout that is
    wrong for a rank."""
    from whalepy.ir.plan import Plan

    say = progress or (lambda _m: None)
    model_blocks = [b.name for b in profile.blocks] if profile is not None else None
    layouts = rank_layout(plan_json, model_blocks)
    plan = Plan.from_dict(plan_json) if hasattr(Plan, "from_dict") else _plan_of(plan_json)
    chosen = select_ranks(layouts, ranks)
    say(f"{len(layouts)} ranks in {len(roles(layouts))} roles; lowering {len(chosen)}")
    from whalepy.runtime.pipeline import reuse_traces

    out = []
    with reuse_traces():  # every rank splits the same model the same way: traced once (175B: 14 s a rank)
        for lay, n in chosen:
            rep = lower_rank(plan, build, lay, profile=profile, cluster=cluster)
            rep.role_size = n
            say(f"rank {lay.rank}: {'ok' if rep.ok else 'MISMATCH'} ({rep.seconds:.1f} s)")
            out.append(rep)
    return out


def _plan_of(data: dict[str, Any]) -> Any:
    from whalepy.ir.plan import Plan

    return Plan.from_dict(data)


def simulated(cluster: Any) -> Any:
    """``cluster`` with every group marked simulated: the check lowers each rank as a CPU rank of that
    device type (the memory model's bytes do not depend on where the bytes are)."""
    import dataclasses

    return dataclasses.replace(cluster, groups=tuple(dataclasses.replace(g, simulated=True) for g in cluster.groups))


# -- the command line -------------------------------------------------------------------------------


def add_check_subparser(sub: Any) -> None:
    from whalepy.tools.cli import COMMANDS

    sp = sub.add_parser("check", help=COMMANDS["check"].help)
    sp.add_argument("plan", help="the plan file (JSON, as `whalepy plan` writes it)")
    sp.add_argument("--model", required=True, help="package.module:function returning (model on the meta device, "
                    "example inputs), or a built-in name")
    sp.add_argument("--cluster", required=True, help="the cluster spec the plan was made for (YAML)")
    sp.add_argument("--ranks", default="roles", help="'roles' (one representative per role, default), 'all', "
                    "or ranks such as 0,517,1023")
    sp.add_argument("--seq-len", type=int, default=None, help="tokens per sample (built-in models)")
    sp.set_defaults(func=_cmd_check)


def _cmd_check(args: Any) -> int:
    import json
    import sys
    from pathlib import Path

    import torch

    from whalepy.errors import PlanError
    from whalepy.frontend.profile import profile
    from whalepy.hardware.cluster import ClusterSpec
    from whalepy.ir.plan import Plan
    from whalepy.planner.check import check_plan_cluster
    from whalepy.tools.model_arg import load_model

    try:
        data = json.loads(Path(args.plan).read_text())
    except (OSError, ValueError) as e:
        raise WhalepyError(f"cannot read the plan {args.plan}: {e}") from None
    try:  # the plan's own checks (fields, version, enums) before anything is built
        plan = Plan.from_dict(data)
    except PlanError as e:
        raise PlanError(f"the plan {args.plan}: {e}") from None
    ranks = _parse_ranks(args.ranks, plan.world_size)
    cluster = simulated(ClusterSpec.load(args.cluster))
    check_plan_cluster(plan, cluster)  # another cluster's plan: one line here, not a mismatch per rank

    def build() -> tuple[Any, tuple]:
        with torch.device("meta"):
            model, inputs = load_model(args.model, batch=1, seq_len=args.seq_len or data.get("seq_len"))
        return model, inputs if isinstance(inputs, tuple) else (inputs,)

    model, inputs = build()
    prof = profile(model, inputs, model_name=None if ":" in args.model else args.model.strip().lower())
    if plan.model_fingerprint != "unchecked":  # another model's plan: said as such, not as a missing block
        try:
            plan.check_model(prof.fingerprint)
        except PlanError as e:
            raise PlanError(f"--model {args.model}: {e}") from None
    reports = check_ranks(data, build, ranks=ranks, profile=prof, cluster=cluster,
                          progress=lambda m: print(f"[whalepy] {m}", file=sys.stderr, flush=True))
    for rep in reports:
        print("\n".join(rep.lines()))
    bad = [r for r in reports if not r.ok]
    print(f"{len(reports) - len(bad)} of {len(reports)} lowered ranks match the plan"
          + (f"; mismatches on ranks {[r.layout.rank for r in bad]}" if bad else ""))
    return 1 if bad else 0


def _parse_ranks(text: str, world: int) -> str | list[int]:
    """``--ranks``: ``roles``, ``all`` or comma-separated ranks of the plan's world."""
    if text in ("roles", "all"):
        return text
    fix = f"give 'roles', 'all' or ranks of the plan's world 0..{world - 1}, such as 0,{world - 1}"
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise RankCheckError(f"--ranks {text!r}: {fix}") from None
    if not ranks:
        raise RankCheckError(f"--ranks {text!r} names no rank; {fix}")
    out = [r for r in ranks if not 0 <= r < world]
    if out:
        raise RankCheckError(f"--ranks {text!r}: rank {out[0]} is not in the plan's world of {world} ranks; {fix}")
    return ranks
