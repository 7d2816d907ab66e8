"""What tensor parallelism keeps whole and the copies of tied weights a pipeline stage holds, in the plan.

The runtime's side (the bytes each rank really holds, lowered on the fake process group) is checked in
test_rank_check.py and test_runtime_infinity.py; here the planner: the memory of a stage is that of its
blocks' parameters per TP rank (split ones divided by the degree, the rest whole) plus one copy of each
tied weight whose owning block is on another stage, and the ILP, which decides where the stages begin,
finds what exhaustive enumeration finds once copies depend on it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner_fixtures import cluster, group, tiny_device
from precision_cases import cpu_cluster
from whalepy.cost_models.memory import estimate_device_bytes_for_usable
from whalepy.ir.profile import BlockAnnotations, TiedCopy
from whalepy.planner import plan_from_profile
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile
from whalepy.planner.synthetic import transformer_profile

H, V = 1024, 32000  # the vocabulary is a multiple of 128: the synthetic profile pads nothing


def _tied(middle: bool, name: str = "tied", tied_head: bool = True, **kw):  # type: ignore[no-untyped-def]
    """A 4-layer GPT with its head tied to the embedding (``tied_head``); ``middle``: the third layer
    (block 3) holds a copy of the table too (a tied weight away from the model's ends, as
    pseudo-to-real's layers)."""
    prof = transformer_profile(num_layers=4, hidden=H, seq_len=512, vocab=V, num_heads=8,
                               tied_embeddings=tied_head, name=name, **kw)
    if not middle:
        return prof
    blocks = list(prof.blocks)
    blocks[3] = dataclasses.replace(blocks[3], tied_copies=(
        TiedCopy(owner="embed", parameter="embed.weight", num_params=V * H, tp_split=True),))
    return dataclasses.replace(prof, blocks=tuple(blocks))


def _stage_states(prof, boundaries: tuple[int, ...], tp: int) -> list[int]:  # type: ignore[no-untyped-def]
    est = estimate_from_profile(prof, cpu_cluster(2 * tp), ParallelConfig(dp=1, pp=2, tp=tp, boundaries=boundaries, num_microbatches=2),
                                global_batch=2, precision="fp32")
    return [s.cost.model_state_bytes for s in est.plan.stages]


def test_a_stage_without_the_owner_holds_one_copy_of_each_tied_weight():
    """fp32 DDP-less stages hold 16 bytes per local parameter (weight, gradient, two Adam states)."""
    prof = _tied(middle=True)
    local = {b.name: b.num_params for b in prof.blocks}
    layer = local["h.0"]
    for tp in (1, 2):
        split_layer = (layer - 6 * H) / tp + 6 * H  # 6h whole: two norms, two row-parallel biases
        head = 2 * H
        # stage 1 = h.3, head: the head's copy, split by TP like the embedding
        assert _stage_states(prof, (4, 2), tp)[1] == 16 * (split_layer + head + V * H / tp)
        # stage 1 = h.2, h.3, head: the middle layer and the head hold the same weight, one copy
        assert _stage_states(prof, (3, 3), tp)[1] == 16 * (2 * split_layer + head + V * H / tp)
        # stage 0 = embed, h.0 .. h.2: the owner is there, no copy (positions whole: 512 x H)
        embed = V * H / tp + 512 * H
        assert _stage_states(prof, (4, 2), tp)[0] == 16 * (embed + 3 * split_layer)


def _instance(seed: int, tied_head: bool):  # type: ignore[no-untyped-def]
    """The middle copy, the head tied or not, the embedding and the head pinned to stages 0 and 1 (two
    or more stages), on 4 devices that hold 30-70% of the model's states: where the stages split decides
    whether the stage without the embedding holds the middle layer's copy."""
    rng = random.Random(seed)
    prof = _tied(True, name=f"tied{seed}", tied_head=tied_head,
                 annotations={"embed": BlockAnnotations(stage=0), "head": BlockAnnotations(stage=1)})
    dev = tiny_device(f"tied-dev{seed}{tied_head}", "A100-80GB",
                      estimate_device_bytes_for_usable(16 * prof.total_params * rng.uniform(0.3, 0.7)) / 2**30)
    return prof, cluster(group("a", dev.name, 4, 1, link="nvlink3", custom={dev.name: dev}, cpu_gb=None),
                         custom=[dev])


@pytest.mark.parametrize("seed, tied_head", [(1, False), (3, False), (2, True)])
def test_ilp_matches_exhaustive_with_tied_copies(seed: int, tied_head: bool) -> None:
    """The ILP's copy of a stage (a binary per copy and stage, ``_ilp_layout._tied_copy_vars``) and the
    gradient all-reduce it brings cost what :func:`evaluate` costs: both searches find the same step."""
    prof, c = _instance(seed, tied_head)
    plans = [plan_from_profile(prof, c, global_batch=8, solver=s, max_microbatches=4,
                               schedules=("1f1b", "interleaved_1f1b")) for s in ("highs", "exhaustive")]
    ilp, ex = (p.cost.step_time_s for p in plans)
    assert ex * (1 - 1e-9) <= ilp <= ex * (1 + 5e-3), (ilp, ex)
    assert plans[1].pp_degree == 2
