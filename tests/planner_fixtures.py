"""Shared helpers for the planner tests: small clusters built in code."""

from __future__ import annotations

from whalepy.hardware.cluster import ClusterSpec, NodeGroup
from whalepy.cost_models.devices import CATALOG
from whalepy.ir.profile import BlockKind


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


def as_fp32_capture(prof):  # type: ignore[no-untyped-def]
    """``prof`` as if captured from an fp32 model (what ``whalepy.profile`` records for a model built in
    its default dtype): every floating byte figure doubles, the dtype says float32. Token-id inputs
    (int64) do not change. Planning it for bf16 then exercises ``CostContext.byte_scale = 1/2``."""
    import dataclasses

    blocks = []
    for b in prof.blocks:
        token_ids = b.kind is BlockKind.EMBEDDING
        blocks.append(dataclasses.replace(
            b, param_bytes=2 * b.param_bytes, bytes_moved=2 * b.bytes_moved,
            activation_bytes=2 * b.activation_bytes, input_bytes=b.input_bytes if token_ids else 2 * b.input_bytes,
            output_bytes=2 * b.output_bytes, tp_comm_bytes=2 * b.tp_comm_bytes))
    return dataclasses.replace(prof, blocks=tuple(blocks), param_bytes=2 * prof.param_bytes, dtype="float32",
                               fingerprint=prof.fingerprint + "-fp32")
