"""The offload cost model (whalepy.cost_models.offload): rates, the prefetch pipeline, ZeRO-Offload's
overlap, activation offload; and the planner's ILP against exhaustive search once the runtime opens the
offload modes of the issue-10 contract (monkeypatched here until it does)."""

from __future__ import annotations

import dataclasses

import pytest

from whalepy.hardware.cluster import NvmeSpec
from whalepy.cost_models.devices import CATALOG
from whalepy.cost_models.offload import (
    CPU_ADAM_PARAMS_PER_S_PER_NODE,
    FUSED_OVER_FOREACH_CPU_ADAMW,
    PINNED_LINK_EFFICIENCY,
    choose_prefetch_depth,
    estimate_activation_offload_time,
    estimate_prefetch_exposed,
    resolve_offload_rates,
    zero_offload_step,
)
from whalepy.ir.plan import Tier

GB = 1e9


def test_rates_measured_where_calibrated_and_datasheet_elsewhere() -> None:
    h100 = resolve_offload_rates(CATALOG["H100-SXM"], gpus_per_node=8)
    # the shipped H100 profile carries the measured pinned copies (53.7 / 54.0 GB/s) and CPU AdamW
    assert 50 * GB < h100.h2d < 58 * GB and 50 * GB < h100.d2h < 58 * GB
    # it measured foreach AdamW only: the fused kernel the runtime steps host states with is derived from it
    assert h100.cpu_adam == pytest.approx(1e8 / (0.11066034599991781 * FUSED_OVER_FOREACH_CPU_ADAMW) / 8, rel=1e-6)
    v100 = resolve_offload_rates(CATALOG["V100-32GB"], gpus_per_node=16, nvme_read=25 * GB, nvme_write=20 * GB)
    assert v100.h2d == pytest.approx(16 * GB * PINNED_LINK_EFFICIENCY)
    assert v100.cpu_adam == pytest.approx(CPU_ADAM_PARAMS_PER_S_PER_NODE / 16)
    assert v100.nvme_read == pytest.approx(25 * GB / 16) and v100.nvme_write == pytest.approx(20 * GB / 16)


def test_prefetch_pipeline_by_hand() -> None:
    comp, x = [1.0] * 4, [[0.5]] * 4
    # depth 0: every fetch waits for the previous block: 4 * 0.5 exposed
    assert estimate_prefetch_exposed(compute_s=comp, hops_s=x, prefetch_depth=0) == pytest.approx(2.0)
    # depth 1: only the first fetch is exposed (nothing to hide it)
    assert estimate_prefetch_exposed(compute_s=comp, hops_s=x, prefetch_depth=1) == pytest.approx(0.5)
    # link-bound: transfers of 2 s behind 1 s of compute: 2 (first) + 3 * (2 - 1) stalls
    assert estimate_prefetch_exposed(compute_s=comp, hops_s=[[2.0]] * 4, prefetch_depth=3) == pytest.approx(5.0)
    # two hops (NVMe -> host -> device) of 0.8 s each behind 1 s blocks: depth 1 serialises the hops
    # of one block (1.6 s > 1 s, stalls); depth 2 pipelines them (ZeRO-Infinity's i+1 / i+2)
    two = [[0.8, 0.8]] * 6
    d1 = estimate_prefetch_exposed(compute_s=[1.0] * 6, hops_s=two, prefetch_depth=1)
    d2 = estimate_prefetch_exposed(compute_s=[1.0] * 6, hops_s=two, prefetch_depth=2)
    assert d2 == pytest.approx(1.6) and d1 > d2 + 1.0
    assert choose_prefetch_depth(compute_s=[1.0] * 6, hops_s=two) == (2, pytest.approx(1.6))
    # uniform one-hop blocks: deeper buys nothing, depth 1 is kept
    assert choose_prefetch_depth(compute_s=comp, hops_s=x)[0] == 1


@pytest.mark.parametrize("compute", [0.05, 0.2, 1.0])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_steady_state(compute: float, depth: int) -> None:
    """Many uniform blocks: past the first fetch the period per block is ``max(slowest hop, compute,
    (sum of hops + compute) / (depth + 1))`` -- each link moves one block at a time, and a block's buffer
    cycle (its hops, then its compute) is shared by ``depth + 1`` buffers -- so the exposure per block
    is that period less the compute (measured between 300 and 600 blocks, past the start-up)."""
    pcie, nvme = 1e9 / 25e9, 1e9 / 6e9

    def exposed(n: int) -> float:
        return estimate_prefetch_exposed(compute_s=[compute] * n, hops_s=[[nvme, pcie]] * n, prefetch_depth=depth)

    period = max(nvme, pcie, compute, (nvme + pcie + compute) / (depth + 1))
    assert (exposed(600) - exposed(300)) / 300 == pytest.approx(period - compute, abs=1e-9)


def test_prefetch_depth_helps_uneven_blocks() -> None:
    # a large block behind small ones: fetching it earlier hides it behind several blocks' compute
    comp = [1.0, 1.0, 1.0, 1.0]
    hops = [[0.1], [0.1], [0.1], [2.5]]
    d1 = estimate_prefetch_exposed(compute_s=comp, hops_s=hops, prefetch_depth=1)
    d3 = estimate_prefetch_exposed(compute_s=comp, hops_s=hops, prefetch_depth=3)
    assert d1 == pytest.approx(0.1 + 1.5) and d3 == pytest.approx(0.1)
    assert choose_prefetch_depth(compute_s=comp, hops_s=hops)[0] == 3


def test_zero_offload_step_hidden_by_backward() -> None:
    r = resolve_offload_rates(CATALOG["V100-32GB"], gpus_per_node=1)
    t = zero_offload_step(r, grad_bytes=2, param_bytes=2)
    P = 1e9
    # the CPU step (0.22 s per 1e9 on a DGX-2 host) is slower than 2 GB down at 13.5 GB/s
    assert t.overlap == pytest.approx(1 / r.cpu_adam)
    assert t.exposed(P, hide_s=10.0) == pytest.approx(2 * P / r.h2d)  # fully hidden: only params back
    assert t.exposed(P, hide_s=0.0) == pytest.approx(2 * P / r.h2d + P / r.cpu_adam)
    assert t.exposed(P, hide_s=0.1) == pytest.approx(2 * P / r.h2d + P / r.cpu_adam - 0.1)
    # fp16 / clipping: the CPU step waits for the whole backward; only the gradients' way down hides
    late = zero_offload_step(r, grad_bytes=2, param_bytes=2, after_backward=True)
    assert late.overlap == pytest.approx(2 / r.d2h)
    assert late.exposed(P, hide_s=10.0) == pytest.approx(2 * P / r.h2d + P / r.cpu_adam)
    assert late.exposed(P, hide_s=0.0) == pytest.approx(2 * P / r.h2d + P / r.cpu_adam + 2 * P / r.d2h)


def test_zero_offload_step_exposed_under_fp16_and_clipping() -> None:
    """The planner's predicted step time of a ZeRO-Offload (gpu, cpu) plan (the evaluation the ILP,
    the exhaustive solver and ``whalepy.estimate`` share) under fp16, and under bf16 with clipping, is
    the bf16 one plus the whole CPU step of the rank's share, ``P / d / cpu_adam``: here the backward
    (1.5 s of a 4-layer, 2048-wide model at 256 samples per replica on H100s, whose fp16 and bf16 matmul
    rates are the same) is long enough to hide all of that step in bf16, and none of it hides after the
    backward."""
    from planner_fixtures import cluster, group
    from whalepy.ir.plan import ZeroStage
    from whalepy.planner import PlannerOptions
    from whalepy.planner._offload_costs import group_rates
    from whalepy.planner.costing import CostContext, build_coefficients, counts_from_boundaries, evaluate
    from whalepy.planner.search import enumerate_candidates, read_annotations
    from whalepy.planner.space import Hardware, StateOption, build_segments
    from whalepy.planner.synthetic import transformer_profile

    prof = transformer_profile(num_layers=4, hidden=2048, seq_len=2048, vocab=32000, num_heads=16)
    hw = Hardware(cluster(group("h100s", "H100-SXM", 2, 1, link="nvswitch")))
    zero_offload = StateOption(ZeroStage.GRADIENTS, Tier.CPU, Tier.GPU)
    step_s, cpu_step = {}, sum(b.num_params for b in prof.blocks) / 2 / group_rates(hw.groups[0]).cpu_adam
    for precision, clip in (("bf16", False), ("fp16", False), ("bf16", True)):
        ctx = CostContext(prof, hw, precision=precision, clip_gradients=clip)
        opts = PlannerOptions(precision=precision, schedules=("1f1b",), max_microbatches=1)
        cand = next(c for c in enumerate_candidates(ctx, 512, opts, read_annotations(prof, hw), [])
                    if c.dp == 2 and c.num_stages == 1)
        cc = build_coefficients(ctx, cand, build_segments(prof), (zero_offload,))
        counts = counts_from_boundaries(cc, [len(prof.blocks)])
        ev = evaluate(cc, [len(prof.blocks)], [[0] * len(c) for c in counts], [zero_offload], None, None)
        step_s[precision, clip] = ev.step_time_s
        assert ev.stages[0].cells[0].compute_s > cpu_step  # the backward could hide the whole step
    assert step_s["fp16", False] == pytest.approx(step_s["bf16", False] + cpu_step, rel=1e-9)
    assert step_s["bf16", True] == pytest.approx(step_s["bf16", False] + cpu_step, rel=1e-9)


def test_activation_offload_charged_whole() -> None:
    """The runtime copies on the compute stream: nothing of the copies is hidden by the block's passes."""
    r = resolve_offload_rates(CATALOG["H100-SXM"], gpus_per_node=8)
    t = estimate_activation_offload_time(r, saved_bytes=1e9)
    assert t == pytest.approx(1e9 / r.d2h + 1e9 / r.h2d)
    assert estimate_activation_offload_time(r, saved_bytes=0.0) == 0.0
    with pytest.raises(ValueError, match="saved_bytes"):
        estimate_activation_offload_time(r, saved_bytes=-1.0)


# -- the planner with every tier pair of the contract open -----------------------------------------


def test_state_options_follow_the_capability() -> None:
    """The runtime lowers ZeRO-Offload (gpu, cpu) and NVMe parameters (issue 10), so the planner offers
    them, in every precision and with clipping (ZeRO-Offload then steps after the backward)."""
    from whalepy.planner.space import StateOption, build_state_options
    from whalepy.ir.plan import ZeroStage

    z3 = ZeroStage.PARAMETERS
    zero_offload = StateOption(z3, optimizer_tier=Tier.CPU, param_tier=Tier.GPU)
    new = {zero_offload, StateOption(z3, optimizer_tier=Tier.NVME, param_tier=Tier.NVME),
           StateOption(z3, optimizer_tier=Tier.CPU, param_tier=Tier.NVME)}
    assert new <= set(build_state_options((3,), True, precision="bf16"))
    assert new <= set(build_state_options((3,), True, precision="fp16"))
    assert new <= set(build_state_options((3,), True, precision="bf16", clip_gradients=True))


@pytest.mark.parametrize("seed,clip", [(4, False), (12, False), (16, False), (4, True)])  # seeds whose plan
# offloads (checked below; 18 did until reducing every micro-batch on the device beat offloading it)
def test_ilp_matches_exhaustive_with_every_tier(monkeypatch: pytest.MonkeyPatch, seed: int, clip: bool) -> None:
    """The ILP's offload rows (fetches, ZeRO-Offload's overlap with backward, host and NVMe capacity)
    cost what the evaluation costs: on small generated instances with every tier open and host memory
    and NVMe given, the ILP's plan is the exhaustive optimum; also with clipping (ZeRO-Offload's CPU
    step then after the backward)."""
    from whalepy.errors import InfeasibleError
    from whalepy.planner import plan_from_profile
    import test_planner_optimality as opt

    prof, c, gb = opt._instance(seed)
    nvme = NvmeSpec(capacity_bytes=int(2e12), read_bandwidth=6 * GB, write_bandwidth=3 * GB)
    c = dataclasses.replace(c, groups=tuple(dataclasses.replace(g, cpu_memory_bytes=64 * 2**30, nvme=nvme)
                                            for g in c.groups))
    out, plans = {}, {}
    for solver in ("highs", "exhaustive"):
        try:
            plans[solver] = plan_from_profile(prof, c, global_batch=gb, solver=solver, max_microbatches=4,
                                              schedules=("1f1b",), clip_gradients=clip)
            out[solver] = plans[solver].cost.step_time_s
        except InfeasibleError:
            out[solver] = None
    ilp, ex = out["highs"], out["exhaustive"]
    assert ilp is not None and ex is not None, out
    # both costed with the same functions: the ILP's plan is the optimum, within the solver's 0.5% gap
    assert ex * (1 - 1e-9) <= ilp <= ex * (1 + 5e-3), out
    assert any(b.optimizer_tier is not Tier.GPU for s in plans["highs"].stages for b in s.blocks)


def test_host_memory_is_the_nodes() -> None:
    """A node's host memory is shared by its GPUs whichever stages they run: a stage may use the share
    of another stage that keeps its states on the device, but the node's total is a hard limit."""
    from types import SimpleNamespace

    from whalepy.planner.costing import NodeShare, node_fits

    node = NodeShare(ranks_per_stage=(4, 4), cpu_capacity=100.0, nvme_capacity=None)
    cc = SimpleNamespace(nodes=(node,))
    assert node_fits(cc, [0.0, 24.0], [0.0, 0.0])  # 96 of 100, though 24 > 100 / 8 per GPU
    assert not node_fits(cc, [2.0, 24.0], [0.0, 0.0])  # 8 + 96 > 100
    assert not node_fits(cc, [0.0, 0.0], [0.0, 1.0])  # no NVMe on the node


def test_nvme_is_the_nodes_drive_less_the_reserve() -> None:
    """``capacity_tb`` is the node's drive, shared by its GPUs: the planner's node capacity is it less the
    reserve the runtime keeps free on the file system (the same :func:`disk_reserve_bytes`), and the
    node's ranks' peak files are summed against it, whichever stages they run."""
    from types import SimpleNamespace

    from whalepy.cost_models.offload import DISK_RESERVE_FRACTION, disk_reserve_bytes, nvme_capacity_per_gpu
    from whalepy.planner.costing import NodeShare, node_fits

    drive = 1e12
    node_cap = nvme_capacity_per_gpu(drive, 8) * 8  # what costing's NodeShare gets for the node
    assert node_cap == pytest.approx(drive - disk_reserve_bytes(drive)) == pytest.approx(drive * (1 - DISK_RESERVE_FRACTION))
    cc = SimpleNamespace(nodes=(NodeShare(ranks_per_stage=(2, 6), cpu_capacity=None, nvme_capacity=node_cap),))
    assert node_fits(cc, [0.0, 0.0], [node_cap / 2 * 0.99, 0.0])  # two ranks of stage 0 fill it
    assert not node_fits(cc, [0.0, 0.0], [drive / 2, 0.0])  # the whole drive leaves no reserve
    assert not node_fits(cc, [0.0, 0.0], [node_cap / 8, node_cap / 8 * 1.01])  # 8 ranks, summed
