"""Granular tiers (M6-10T's per-layer offloading, issue 10): the blocks of one stage may keep their
states in different tiers. Where neither the device alone nor the host alone holds a model, a mix does;
the ILP's mix is the exhaustive optimum; the plan's bytes are the sum of each block's tier; mixes are
only offered where the runtime lowers them (FSDP2, one chunk per stage)."""

from __future__ import annotations

import pytest

from whalepy.ir.rules import LoweringKind, mixed_tiers_error
from whalepy.errors import InfeasibleError
from whalepy.cost_models.memory import estimate_stage_model_state_bytes
from whalepy.cost_models.offload import host_capacity_per_gpu
from whalepy.ir.plan import Tier
from whalepy.planner import plan_from_profile
from whalepy.planner.synthetic import transformer_profile

from planner_fixtures import cluster, group, tiny_device

PROF = transformer_profile(num_layers=8, hidden=1024, seq_len=512, vocab=8000, num_heads=8, batch=1,
                           name="mixtiers")
"""118M parameters: about 1.9 GB of model states (16 bytes per parameter) in bf16 mixed precision."""
DEVICE_GIB, HOST_GIB = 2.5, 1.5
"""One A100 cut to 2.5 GiB (1.9 GiB usable) and 1.5 GiB of host memory (80% usable): the states of
every block fit neither the device (with the activations of even one sample) nor the host; a split of
the layers between them fits both. The devices here are sized against the usable memory the reserve
alone leaves: the plans use no memory margin (the tests are of tier mixes, not of headroom)."""


def _cluster(cpu_gb: float = HOST_GIB):  # type: ignore[no-untyped-def]
    dev = tiny_device("a100-mix", "A100-80GB", DEVICE_GIB)
    return cluster(group("a", dev.name, 1, 1, custom={dev.name: dev}, cpu_gb=cpu_gb), custom=[dev])


def _plan(**kw):  # type: ignore[no-untyped-def]
    # the sizes above were derived with the device step at foreach's rate (the user's AdamW as given);
    # with the fused step's lower rate the optimum keeps every layer on the device and offloads only the
    # embedding and head, which is not the mix this test looks at
    return plan_from_profile(PROF, _cluster(), global_batch=4, max_microbatches=2, schedules=("1f1b",),
                             memory_margin=0, optimizer_impl="as_given", **kw)


def _pairs(stage) -> list[tuple[Tier, Tier]]:  # type: ignore[no-untyped-def]
    return [(b.param_tier, b.optimizer_tier) for b in stage.blocks]


def test_a_mix_fits_where_no_single_tier_does_and_is_the_exhaustive_optimum() -> None:
    with pytest.raises(InfeasibleError):
        _plan(mixed_tiers=False)
    p = _plan()
    (st,) = p.stages
    pairs = _pairs(st)
    assert len(set(pairs)) == 2 and (Tier.GPU, Tier.GPU) in pairs, pairs
    ex = _plan(solver="exhaustive")
    # both cost the same configurations with the same functions: the ILP's is the optimum (0.5% MIP gap)
    assert ex.cost.step_time_s * (1 - 1e-9) <= p.cost.step_time_s <= ex.cost.step_time_s * (1 + 5e-3)
    assert st.cost.memory_bytes <= st.cost.capacity_bytes
    assert st.cost.host_state_bytes <= host_capacity_per_gpu(int(HOST_GIB * 2**30), 1)
    # within the repeated layers, the blocks that keep their states on the device come first
    layers = [pr for b, pr in zip(st.blocks, pairs) if b.name.startswith("h.")]
    first_off = next(i for i, pr in enumerate(layers) if pr != (Tier.GPU, Tier.GPU))
    assert all(pr != (Tier.GPU, Tier.GPU) for pr in layers[first_off:]), layers
    assert "tiers embed" in str(p) and "h.0-" in str(p), str(p)
    # one device type: the homogeneous baseline is the same plan, its mix costed again on the cluster
    from whalepy.planner import homogeneous_baseline

    base = homogeneous_baseline(PROF, _cluster(), global_batch=4, max_microbatches=2, schedules=("1f1b",),
                                memory_margin=0, optimizer_impl="as_given")
    assert base.cost.step_time_s == pytest.approx(p.cost.step_time_s, rel=1e-9)
    assert _pairs(base.stages[0]) == pairs


def test_plan_bytes_are_what_the_runtime_holds_for_its_blocks() -> None:
    """The stage's predicted device, host and disk bytes are the memory model's for its blocks' tiers
    (:func:`estimate_stage_model_state_bytes`, which tests/test_mixed_tiers.py checks against what the
    runtime holds, block by block, on gloo), and each tier holds part of the states."""
    p = _plan()
    (st,) = p.stages
    held = estimate_stage_model_state_bytes(
        blocks=[(pb.num_params, b.param_tier, b.optimizer_tier) for b, pb in zip(st.blocks, PROF.blocks)],
        zero_stage=st.zero_stage, dp_degree=1, precision=p.precision.value)
    assert st.cost.model_state_bytes == pytest.approx(held.resident, rel=1e-6)
    assert st.cost.host_state_bytes == pytest.approx(held.cpu, rel=1e-6)
    assert held.cpu > 0 and held.resident > 0


def test_mixes_only_where_lowered() -> None:
    """Several tier pairs in one stage need FSDP2 (per-block units and offload policies); the planner
    offers none with interleaving (several chunks per stage) and none when told not to."""
    from whalepy.planner.costing import CostContext, build_coefficients
    from whalepy.planner.space import Hardware, build_segments, build_state_options
    from whalepy.planner.search import enumerate_candidates, read_annotations
    from whalepy.planner import PlannerOptions

    assert mixed_tiers_error(LoweringKind.FSDP, [("gpu", "gpu"), ("cpu", "cpu")]) is None
    assert mixed_tiers_error(LoweringKind.DDP, [("gpu", "gpu")]) is None
    assert mixed_tiers_error(LoweringKind.DDP, [("gpu", "gpu"), ("gpu", "nvme")]) is None  # device params
    msg = mixed_tiers_error(LoweringKind.DDP, [("gpu", "gpu"), ("cpu", "cpu")])
    assert msg is not None and "FSDP2" in msg and "\n" not in msg

    hw = Hardware(_cluster())
    ctx = CostContext(PROF, hw, precision="bf16")
    opts = PlannerOptions(precision="bf16", schedules=("1f1b",), max_microbatches=2)
    cand = enumerate_candidates(ctx, 4, opts, read_annotations(PROF, hw), [])[0]
    segs = build_segments(PROF)
    options = build_state_options((0, 1, 2, 3), True, "bf16")
    on = build_coefficients(ctx, cand, segs, options, mixed_tiers=True)
    off = build_coefficients(ctx, cand, segs, options, mixed_tiers=False)
    assert any(st.families for st in on.stages) and not any(st.families for st in off.stages)
    # interleaving: two chunks per stage on two devices
    dev = tiny_device("a100-mix", "A100-80GB", DEVICE_GIB)
    hw2 = Hardware(cluster(group("a", dev.name, 2, 1, link="pcie4", custom={dev.name: dev}, cpu_gb=HOST_GIB),
                           custom=[dev]))
    ctx2 = CostContext(PROF, hw2, precision="bf16")
    opts2 = PlannerOptions(precision="bf16", schedules=("interleaved_1f1b",), max_microbatches=4)
    inter = [c for c in enumerate_candidates(ctx2, 8, opts2, read_annotations(PROF, hw2), [])
             if c.virtual_stages > 1]
    assert inter
    for c in inter:
        assert not any(st.families for st in build_coefficients(ctx2, c, segs, options, mixed_tiers=True).stages)
    for st in on.stages:
        for fam in st.families:
            assert any(not o.beside_offload for o in fam)
            assert len({(o.zero, o.tiles, o.reduce_each) for o in fam}) == 1


def test_blocks_sharing_parameters_take_one_tier() -> None:
    """Tied weights (embedding and head) sit in FSDP2's root unit, which has one offload policy: the
    planner gives all blocks that share parameters one tier pair (where, untied, it would split them),
    and the ILP's plan is still the exhaustive optimum."""
    import dataclasses

    from whalepy.ir.profile import BlockKind

    # the device of this module, where the states must be split between device and host (at 3.0 GiB all
    # fit on the device; the host tier was chosen for speed there before FSDP2's hook work was charged)
    dev = tiny_device("a100-mix", "A100-80GB", DEVICE_GIB)
    c = cluster(group("a", dev.name, 1, 1, custom={dev.name: dev}, cpu_gb=HOST_GIB), custom=[dev])
    kw = dict(global_batch=4, max_microbatches=2, schedules=("1f1b",), memory_margin=0)
    untied = plan_from_profile(PROF, c, **kw)
    ends = [i for i, b in enumerate(PROF.blocks) if b.kind is not BlockKind.LAYER]
    pair = [(b.param_tier, b.optimizer_tier) for b in untied.stages[0].blocks]
    assert len({pair[i] for i in ends}) == 2, pair  # untied, the embedding and the head differ
    tied_prof = dataclasses.replace(PROF, blocks=tuple(
        dataclasses.replace(b, shares_params=i in ends) for i, b in enumerate(PROF.blocks)))
    tied = plan_from_profile(tied_prof, c, **kw)
    pair = [(b.param_tier, b.optimizer_tier) for b in tied.stages[0].blocks]
    assert len({pair[i] for i in ends}) == 1, pair
    ex = plan_from_profile(tied_prof, c, solver="exhaustive", **kw)
    assert ex.cost.step_time_s * (1 - 1e-9) <= tied.cost.step_time_s <= ex.cost.step_time_s * (1 + 5e-3)
    assert tied.cost.step_time_s >= untied.cost.step_time_s * (1 - 1e-9)


def test_profile_marks_blocks_that_share_parameters() -> None:
    import torch
    from torch import nn

    from whalepy.frontend.profile import profile

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(64, 16)
            self.h = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.lm_head = nn.Linear(16, 64, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.wte(x)
            for layer in self.h:
                y = layer(y)
            return self.lm_head(y)

    prof = profile(Tied(), torch.zeros(2, 8, dtype=torch.long))
    marked = {b.name: b.shares_params for b in prof.blocks}
    assert sum(marked.values()) == 2 and not any(v for k, v in marked.items() if k.startswith("h.")), marked
