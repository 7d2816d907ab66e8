"""Shared helpers for the planner tests: small clusters built in code."""

from __future__ import annotations

from whalepy.cluster import ClusterSpec, NodeGroup
from whalepy.cost_models.devices import CATALOG


def group(name: str, gpu: str, per_node: int, nodes: int, *, link: str | None = None, net_gbps: float = 200,
          cpu_gb: float | None = 512, custom=None) -> NodeGroup:  # type: ignore[no-untyped-def]
    return NodeGroup.build(name=name, gpu=gpu, gpus_per_node=per_node, num_nodes=nodes,
                           intra_link=link if per_node > 1 else None,
                           intra_bandwidth=None if (link or per_node == 1) else 100e9,
                           network_bandwidth=net_gbps * 1e9 / 8,
                           cpu_memory_bytes=None if cpu_gb is None else int(cpu_gb * 2**30),
                           custom_devices=custom)


def cluster(*groups: NodeGroup, custom=()) -> ClusterSpec:  # type: ignore[no-untyped-def]
    return ClusterSpec(groups=tuple(groups), custom_devices=tuple(custom))


def a100(nodes: int, per_node: int = 8) -> ClusterSpec:
    return cluster(group("a100s", "A100-80GB", per_node, nodes, link="nvswitch", net_gbps=1600, cpu_gb=2048))


def tiny_device(name: str, base: str, memory_gib: float):  # type: ignore[no-untyped-def]
    return CATALOG[base].replace(name=name, memory_bytes=int(memory_gib * 2**30))
