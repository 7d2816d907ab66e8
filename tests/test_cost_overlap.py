"""Communication at achieved bandwidth, and overlap as the runtime does it: by formula and by order."""

from __future__ import annotations

import pytest

from whalepy.cost_models.communication import (
    BUS_EFFICIENCY,
    NCCL_LAUNCH_LATENCY_S,
    OVERLAP_COMPUTE_LOSS,
    Collective,
    CommGroup,
    Fabric,
    Link,
    estimate_collective_time,
    estimate_overlapped_time,
    estimate_p2p_time,
)
from whalepy.planner.estimate import estimate_from_profile
from whalepy.planner.synthetic import gpt_profile
from whalepy.planner.runtime_costs import dp_payload_bytes_per_param

from planner_fixtures import cluster, group

GB = 1 << 30


def test_overlap_formula() -> None:
    k = OVERLAP_COMPUTE_LOSS
    # compute outlasts the collective: it loses k of its speed while the collective runs
    assert estimate_overlapped_time(10.0, 4.0) == pytest.approx(10.0 + k * 4.0)
    # the collective outlasts the compute: it is the critical path
    assert estimate_overlapped_time(1.0, 4.0) == pytest.approx(4.0)
    assert estimate_overlapped_time(3.0, 0.0) == 3.0
    # never better than either alone, never worse than running them one after the other
    for c, x in ((1.0, 0.5), (0.5, 1.0), (2.0, 2.0)):
        t = estimate_overlapped_time(c, x)
        assert max(c, x) <= t <= c + x


def test_link_efficiency_is_bus_bandwidth() -> None:
    # an 8-GPU all-gather over NVLink 4 at the nccl-tests bus bandwidth: busbw = algbw (p-1)/p
    link = Link(bandwidth=450e9, latency=0.0, efficiency=BUS_EFFICIENCY[Fabric.NVLINK4])
    group8 = CommGroup(ranks_per_node=8, num_nodes=1, intra=link, inter=link)
    t = estimate_collective_time(Collective.ALL_GATHER, GB, group8)
    busbw = GB / t * 7 / 8
    assert busbw == pytest.approx(0.82 * 450e9)
    with pytest.raises(ValueError, match="efficiency"):
        Link(bandwidth=1e9, latency=0.0, efficiency=1.5)


def test_launch_latency_once_per_call_sends_included() -> None:
    link = Link(bandwidth=100e9, latency=1e-6)
    g0 = CommGroup(ranks_per_node=4, num_nodes=2, intra=link, inter=link)
    g1 = CommGroup(ranks_per_node=4, num_nodes=2, intra=link, inter=link, launch_latency=NCCL_LAUNCH_LATENCY_S)
    for c in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        assert estimate_collective_time(c, 1 << 20, g1) - estimate_collective_time(c, 1 << 20, g0) == \
            pytest.approx(NCCL_LAUNCH_LATENCY_S)
    # a send is a call too: it pays the launch latency once, as the planner's pipeline messages do
    assert estimate_collective_time(Collective.SEND_RECV, 1 << 20, g1) == \
        pytest.approx(estimate_p2p_time(1 << 20, link) + NCCL_LAUNCH_LATENCY_S)
    assert estimate_p2p_time(1 << 20, link, NCCL_LAUNCH_LATENCY_S) == \
        pytest.approx(estimate_p2p_time(1 << 20, link) + NCCL_LAUNCH_LATENCY_S)
    assert estimate_p2p_time(0, link, NCCL_LAUNCH_LATENCY_S) == 0.0
    assert estimate_collective_time(Collective.ALL_REDUCE, 0, g1) == 0.0


def test_cluster_links_carry_their_fabric() -> None:
    c = cluster(group("a", "A100-80GB", 8, 2, link="nvswitch", net_gbps=1600),
                group("p", "A100-80GB", 4, 1, link="pcie4"))
    nv = c.comm_group([0, 1])
    assert nv.intra.efficiency == BUS_EFFICIENCY[Fabric.NVLINK3]
    assert nv.launch_latency == NCCL_LAUNCH_LATENCY_S
    assert c.comm_group([0, 8]).inter.efficiency == BUS_EFFICIENCY[Fabric.NETWORK]
    pcie = c.comm_group([16, 17])
    assert pcie.intra.efficiency == BUS_EFFICIENCY[Fabric.PCIE]
    # achieved: PCIe 4 (32 GB/s) well below NVLink 3 (300 GB/s)
    assert pcie.intra.achieved_bandwidth < nv.intra.achieved_bandwidth / 10


def _zero3(cl, per_gpu: int):  # type: ignore[no-untyped-def]
    prof = gpt_profile("gpt3-1.3b")
    W = cl.world_size
    return estimate_from_profile(prof, cl, dict(dp=W, zero_stage=3, checkpoint=True), global_batch=W * per_gpu)


def test_zero3_throughput_collapses_as_the_per_gpu_batch_shrinks() -> None:
    # 64 A100 on 100 Gb/s per node: the per-block gathers stop hiding behind compute as the batch shrinks.
    # The smallest batch is 2 samples per GPU, not 1: the shape-dependent compute model quantises GEMMs
    # into waves of 128 x 256 tiles over the A100's 108 SMs, and at one sample (2,048 tokens) each
    # h x h GEMM of this model is 128 tiles, two waves at 59 % occupancy, so compute per sample rises
    # by 31 % and "compute stays flat" would no longer be the premise. At 2 samples it rises by 13 %.
    slow = cluster(group("g", "A100-80GB", 8, 8, link="nvswitch", net_gbps=100))
    tflops, compute = [], []
    for b in (16, 4, 2):
        e = _zero3(slow, b)
        assert e.feasible
        tflops.append(e.plan.cost.model_tflops_per_gpu)
        compute.append(e.compute_s / b)
    assert tflops[0] > tflops[1] > tflops[2]
    assert tflops[2] < 0.5 * tflops[0]
    # ... not because compute per sample changed: it is flat (within the compute model's shape effects)
    assert max(compute) < 1.3 * min(compute)
    # with a fast network the same model keeps most of its throughput at two samples per GPU
    fast = cluster(group("g", "A100-80GB", 8, 8, link="nvswitch", net_gbps=1600))
    assert _zero3(fast, 2).plan.cost.model_tflops_per_gpu > 2 * tflops[2]


def test_ddp_hides_its_all_reduce_except_the_last_block() -> None:
    c = cluster(group("g", "A100-80GB", 8, 2, link="nvswitch", net_gbps=1600))
    prof = gpt_profile("gpt3-1.3b")
    ddp = estimate_from_profile(prof, c, dict(dp=16, zero_stage=0), global_batch=64)
    st = ddp.stages[0]
    assert st.comm.dp_s == 0.0  # nothing per micro-batch
    # DDP all-reduces the fp32 gradients of its fp32 parameters (autocast), 4 bytes per parameter
    per_param = dp_payload_bytes_per_param(Collective.ALL_REDUCE, "bf16")
    full = estimate_collective_time(Collective.ALL_REDUCE, per_param * prof.total_params, ddp_group(c))
    # the exposed reduction is far less than the whole all-reduce, but not nothing
    assert 0.0 < st.comm.sync_s < 0.5 * full


def ddp_group(c):  # type: ignore[no-untyped-def]
    return c.comm_group(list(range(16)))


def test_breakdown_in_estimate_and_plan_dump() -> None:
    c = cluster(group("g", "A100-80GB", 8, 2, link="nvswitch", net_gbps=1600))
    prof = gpt_profile("gpt3-1.3b")
    e = estimate_from_profile(prof, c, dict(dp=4, tp=2, pp=2, num_microbatches=4, zero_stage=3),
                              global_batch=64)
    for st in e.stages:
        m = st.memory
        assert m.gpu == pytest.approx(st.memory_bytes)
        assert min(m.params, m.optimizer, m.activations, m.buffers, m.reserve) > 0
        # ZeRO-3: two gathered 16-bit layers and one layer's gradient (TP 2 halves them), plus the
        # unsharded gradients accumulated over the 4 micro-batches
        assert m.buffers > 3 * 2 * prof.blocks[1].num_params / 2
        assert st.comm.tp_s > 0 and st.comm.p2p_s > 0 and st.comm.sync_s > 0
    text = str(e) + "\n" + str(e.plan)
    assert "memory: params" in text and "stage 0 memory GiB: params" in text
    assert "stage 1 exposed comm: TP" in text


def test_measured_bandwidth_is_taken_as_achieved() -> None:
    from whalepy.hardware.cluster import NodeGroup

    g = NodeGroup.build(name="m", gpu="A100-80GB", gpus_per_node=8, intra_link="nvswitch", intra_bandwidth=235e9)
    assert g.intra.efficiency == 1.0 and g.intra.achieved_bandwidth == 235e9
    named = NodeGroup.build(name="n", gpu="A100-80GB", gpus_per_node=8, intra_link="nvswitch")
    assert named.intra.achieved_bandwidth == pytest.approx(0.7 * 300e9)
