"""Alpha-beta collective costs: checked against the ring/tree formulas written out here and by order."""

from __future__ import annotations

import math

import pytest

from whalepy.cost_models.communication import (
    Algorithm,
    Collective,
    CommGroup,
    Link,
    estimate_collective_time,
    estimate_flat_collective_time,
    estimate_p2p_time,
)

NVLINK = Link(bandwidth=300e9, latency=3e-6)  # per GPU per direction, A100 NVLink3-like
NIC = Link(bandwidth=100e9, latency=10e-6)  # per node, e.g. 4 x 200 Gb/s InfiniBand
ALL = list(Collective)
N = 1 << 30


def flat(c, n, p, link, alg=Algorithm.RING):
    return estimate_flat_collective_time(c, n, p, link, alg)


def test_ring_formulas():
    a, bw = NVLINK.latency, NVLINK.bandwidth
    for p in (2, 3, 8, 64):
        step = a + N / (p * bw)
        assert flat(Collective.ALL_REDUCE, N, p, NVLINK) == pytest.approx(2 * (p - 1) * step)
        assert flat(Collective.ALL_GATHER, N, p, NVLINK) == pytest.approx((p - 1) * step)
        assert flat(Collective.REDUCE_SCATTER, N, p, NVLINK) == pytest.approx((p - 1) * step)
        assert flat(Collective.ALL_TO_ALL, N, p, NVLINK) == pytest.approx((p - 1) * step)
        assert flat(Collective.BROADCAST, N, p, NVLINK) == pytest.approx((p - 1) * a + N / bw)
        assert flat(Collective.SEND_RECV, N, p, NVLINK) == pytest.approx(a + N / bw)


def test_tree_formulas():
    a, bw = NIC.latency, NIC.bandwidth
    for p in (2, 5, 8, 100):
        depth = math.ceil(math.log2(p))
        tree_ar = flat(Collective.ALL_REDUCE, N, p, NIC, Algorithm.TREE)
        assert tree_ar == pytest.approx(2 * depth * (a + N / bw))
        assert flat(Collective.BROADCAST, N, p, NIC, "tree") == pytest.approx(depth * (a + N / bw))


def test_tree_wins_small_messages_ring_wins_large():
    p = 256
    small, large = 1024, 1 << 30
    assert flat(Collective.ALL_REDUCE, small, p, NIC, "tree") < flat(Collective.ALL_REDUCE, small, p, NIC)
    assert flat(Collective.ALL_REDUCE, large, p, NIC) < flat(Collective.ALL_REDUCE, large, p, NIC, "tree")


def test_tree_not_modelled_for_gather_scatter_alltoall():
    for c in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        with pytest.raises(ValueError, match="RING"):
            flat(c, N, 8, NVLINK, Algorithm.TREE)


@pytest.mark.parametrize("p", [2, 4, 7, 16, 128])
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(p):
    ar = flat(Collective.ALL_REDUCE, N, p, NIC)
    rs_ag = flat(Collective.REDUCE_SCATTER, N, p, NIC) + flat(Collective.ALL_GATHER, N, p, NIC)
    assert ar == pytest.approx(rs_ag, rel=1e-12)


@pytest.mark.parametrize("c", ALL)
def test_one_rank_or_zero_bytes_costs_nothing(c):
    # send/recv is point to point: the group size does not enter.
    one_message = NVLINK.latency + N / NVLINK.bandwidth
    assert flat(c, N, 1, NVLINK) == (one_message if c is Collective.SEND_RECV else 0.0)
    assert flat(c, 0, 8, NVLINK) == 0.0
    one_rank = CommGroup(ranks_per_node=1, num_nodes=1, intra=NVLINK, inter=NIC)
    if c is not Collective.SEND_RECV:
        assert estimate_collective_time(c, N, one_rank) == 0.0


def test_unknown_kinds_raise():
    with pytest.raises(ValueError):
        flat("allreduce_typo", N, 8, NVLINK)
    with pytest.raises(ValueError):
        flat(Collective.ALL_REDUCE, N, 8, NVLINK, "butterfly")
    group = CommGroup(ranks_per_node=8, num_nodes=2, intra=NVLINK, inter=NIC)
    with pytest.raises(ValueError):
        estimate_collective_time("gather", N, group)
    with pytest.raises(ValueError):
        flat(Collective.ALL_REDUCE, -1, 8, NVLINK)
    with pytest.raises(ValueError):
        flat(Collective.ALL_REDUCE, N, 0, NVLINK)


def test_string_kinds_accepted():
    assert flat("all_reduce", N, 8, NVLINK, "ring") == flat(Collective.ALL_REDUCE, N, 8, NVLINK)


@pytest.mark.parametrize("c", ALL)
def test_network_slower_than_nvlink(c):
    assert flat(c, N, 8, NIC) > flat(c, N, 8, NVLINK)


@pytest.mark.parametrize("c", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE,
                               Collective.ALL_TO_ALL, Collective.BROADCAST])
def test_more_ranks_never_faster_for_same_total_bytes(c):
    times = [flat(c, N, p, NIC) for p in range(1, 65)]
    assert all(t2 >= t1 for t1, t2 in zip(times, times[1:]))


def test_p2p():
    assert estimate_p2p_time(N, NIC) == pytest.approx(NIC.latency + N / NIC.bandwidth)
    assert estimate_p2p_time(0, NIC) == 0.0
    assert estimate_p2p_time(N, NIC) > estimate_p2p_time(N, NVLINK)


# -- hierarchy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", ALL)
def test_single_node_is_flat_over_intra(c):
    group = CommGroup(ranks_per_node=8, num_nodes=1, intra=NVLINK, inter=NIC)
    assert estimate_collective_time(c, N, group) == flat(c, N, 8, NVLINK)


@pytest.mark.parametrize("c", ALL)
def test_one_rank_per_node_is_flat_over_inter(c):
    group = CommGroup(ranks_per_node=1, num_nodes=4, intra=NVLINK, inter=NIC)
    assert estimate_collective_time(c, N, group) == flat(c, N, 4, NIC)


def test_hierarchical_all_reduce_formula():
    r, m = 8, 4
    group = CommGroup(ranks_per_node=r, num_nodes=m, intra=NVLINK, inter=NIC)
    ai, bi, ae, be = NVLINK.latency, NVLINK.bandwidth, NIC.latency, NIC.bandwidth
    intra_rs = (r - 1) * (ai + N / (r * bi))
    # r concurrent rings of n/r bytes each share the node NIC: per-rank bandwidth be / r.
    inter_ar = 2 * (m - 1) * (ae + (N / r) / (m * be / r))
    intra_ag = (r - 1) * (ai + N / (r * bi))
    expected = intra_rs + inter_ar + intra_ag
    assert estimate_collective_time(Collective.ALL_REDUCE, N, group) == pytest.approx(expected)


def test_hierarchical_all_reduce_is_reduce_scatter_plus_all_gather():
    group = CommGroup(ranks_per_node=8, num_nodes=16, intra=NVLINK, inter=NIC)
    ar = estimate_collective_time(Collective.ALL_REDUCE, N, group)
    rs = estimate_collective_time(Collective.REDUCE_SCATTER, N, group)
    ag = estimate_collective_time(Collective.ALL_GATHER, N, group)
    assert ar == pytest.approx(rs + ag, rel=1e-12)


def test_hierarchy_orders():
    two_nodes = CommGroup(ranks_per_node=8, num_nodes=2, intra=NVLINK, inter=NIC)
    one_big_node = CommGroup(ranks_per_node=16, num_nodes=1, intra=NVLINK, inter=NIC)
    for c in ALL:
        assert estimate_collective_time(c, N, two_nodes) > estimate_collective_time(c, N, one_big_node)
    # Adding nodes never speeds up an all-gather of the same total bytes.
    groups = [CommGroup(ranks_per_node=8, num_nodes=m, intra=NVLINK, inter=NIC) for m in (1, 2, 4, 8, 32)]
    times = [estimate_collective_time(Collective.ALL_GATHER, N, g) for g in groups]
    assert times == sorted(times)


def test_hierarchical_all_to_all_is_network_bound():
    r, m = 8, 4
    p = r * m
    group = CommGroup(ranks_per_node=r, num_nodes=m, intra=NVLINK, inter=NIC)
    # Each rank sends N/p to each of its r*(m-1) off-node peers, and the node's r ranks do so at once
    # through one NIC.
    off_node_bytes_per_rank = r * (m - 1) * (N / p)
    network = r * (m - 1) * NIC.latency + r * off_node_bytes_per_rank / NIC.bandwidth
    nvlink = (r - 1) * (NVLINK.latency + N / (p * NVLINK.bandwidth))
    assert network > nvlink
    assert estimate_collective_time(Collective.ALL_TO_ALL, N, group) == pytest.approx(network)
    all_nvlink = flat(Collective.ALL_TO_ALL, N, p, NVLINK)
    assert estimate_collective_time(Collective.ALL_TO_ALL, N, group) > all_nvlink


def test_hierarchical_broadcast_and_send_recv():
    group = CommGroup(ranks_per_node=4, num_nodes=3, intra=NVLINK, inter=NIC)
    expected = (2 * NIC.latency + N / NIC.bandwidth) + (3 * NVLINK.latency + N / NVLINK.bandwidth)
    assert estimate_collective_time(Collective.BROADCAST, N, group) == pytest.approx(expected)
    assert estimate_collective_time(Collective.SEND_RECV, N, group) == estimate_p2p_time(N, NIC)


def test_hierarchical_tree_applies_to_inter_phase():
    r, m = 8, 8
    group = CommGroup(ranks_per_node=r, num_nodes=m, intra=NVLINK, inter=NIC)
    shared = Link(bandwidth=NIC.bandwidth / r, latency=NIC.latency)
    expected = (
        flat(Collective.REDUCE_SCATTER, N, r, NVLINK)
        + 2 * math.ceil(math.log2(m)) * (shared.latency + (N / r) / shared.bandwidth)
        + flat(Collective.ALL_GATHER, N, r, NVLINK)
    )
    tree = estimate_collective_time(Collective.ALL_REDUCE, N, group, Algorithm.TREE)
    assert tree == pytest.approx(expected)
    with pytest.raises(ValueError):
        estimate_collective_time(Collective.ALL_TO_ALL, N, group, Algorithm.TREE)
