"""Plans the picture tests draw: made by the planner's own costing on the example clusters."""

from __future__ import annotations

import functools
from pathlib import Path

from whalepy import ClusterSpec
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
from whalepy.ir.plan import BlockPlan, Plan, Schedule, StageCost, StagePlan
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import gpt_profile

CLUSTERS = Path(__file__).resolve().parents[1] / "examples" / "clusters"


@functools.lru_cache(maxsize=None)
def homogeneous_3d() -> Plan:
    """dp 4 x tp 4 x pp 4, 1F1B, on 64 H100s (examples/clusters/h100_8x8.yaml)."""
    cfg = ParallelConfig(dp=4, tp=4, pp=4, num_microbatches=8)
    return estimate_from_profile(gpt_profile("gpt3-1.3b"), ClusterSpec.load(CLUSTERS / "h100_8x8.yaml"), cfg,
                                 global_batch=256).plan


@functools.lru_cache(maxsize=None)
def interleaved() -> Plan:
    """Interleaved 1F1B, 2 chunks per rank, pp 4 x dp 8 x tp 2 on 64 H100s."""
    cfg = ParallelConfig(dp=8, tp=2, pp=4, num_microbatches=8, schedule="interleaved_1f1b", virtual_stages=2)
    return estimate_from_profile(gpt_profile("gpt3-1.3b"), ClusterSpec.load(CLUSTERS / "h100_8x8.yaml"), cfg,
                                 global_batch=256).plan


@functools.lru_cache(maxsize=None)
def at_scale() -> Plan:
    """1,024 A100s (examples/clusters/a100_128x8.yaml): pp 8 x dp 16 x tp 8, interleaved 1F1B with 2
    chunks per rank and 128 micro-batches: the picture at scale (issue 27)."""
    cfg = ParallelConfig(dp=16, tp=8, pp=8, num_microbatches=128, schedule="interleaved_1f1b", virtual_stages=2,
                         zero_stage=1)
    return estimate_from_profile(gpt_profile("gpt3-1.3b"), ClusterSpec.load(CLUSTERS / "a100_128x8.yaml"), cfg,
                                 global_batch=2048).plan


@functools.lru_cache(maxsize=None)
def mixed() -> Plan:
    """The planner's own choice for GPT-2 on 8 V100s + 8 T4s (examples/clusters/mixed_v100_t4.yaml)."""
    return plan_from_profile(gpt_profile("gpt2"), ClusterSpec.load(CLUSTERS / "mixed_v100_t4.yaml"), global_batch=64,
                             time_limit_s=30)


def uniform_plan(*, stages: int, microbatches: int, schedule: Schedule, virtual_stages: int = 1,
                 forward_s: float = 1.0, backward_s: float = 2.0, p2p_s: float = 0.0) -> Plan:
    """A hand-made plan whose every chunk takes ``forward_s`` / ``backward_s`` per micro-batch (one
    device per stage, two blocks per chunk): the closed forms of the schedules apply to it."""
    v = virtual_stages
    sts = []
    for s in range(stages):
        blocks = tuple(BlockPlan(name=f"h.{s}.{k}.{i}") for k in range(v) for i in range(2))
        cost = StageCost(compute_s=v * (forward_s + backward_s), p2p_s=p2p_s, chunk_forward_s=(forward_s,) * v,
                         chunk_backward_s=(backward_s,) * v)
        sts.append(StagePlan(index=s, blocks=blocks, ranks=((s,),), device_types=("H100-SXM",),
                             chunk_sizes=(2,) * v if v > 1 else (), cost=cost))
    return Plan(model_name="uniform", model_fingerprint="0", world_size=stages,
                rank_device_types=("H100-SXM",) * stages, global_batch=microbatches,
                num_microbatches=microbatches, schedule=schedule, virtual_stages=v,
                batch_shares=(microbatches,), stages=tuple(sts))
