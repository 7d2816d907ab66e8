"""The dict / YAML / JSON schema of a cluster spec (documented in docs/cluster_spec.md).

Kept apart from whalepy/hardware/cluster.py so the dataclasses read on their own; ClusterSpec.from_dict and
to_dict call into here. It reads dicts into node groups (whalepy/hardware/nodes.py) and never imports
ClusterSpec: from_dict passes its class in.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from whalepy.errors import ClusterSpecError
from whalepy.hardware.nodes import (
    PCIE_LATENCY_S,
    NodeGroup,
    NvmeSpec,
    _grid_bandwidth,
    _grid_latency,
    _require,
)
from whalepy.cost_models.devices import CATALOG, DeviceType

if TYPE_CHECKING:  # the class is passed in: ClusterSpec.from_dict calls _from_dict(cls, data)
    from whalepy.hardware.cluster import ClusterSpec

# ---- the dict / YAML schema (docs/cluster_spec.md) -------------------------------------------------

_TOP_KEYS = ("network", "devices", "groups", "rank_map")
_GROUP_KEYS = ("name", "gpu", "gpus_per_node", "nodes", "intra_node", "cpu_memory_gb", "nvme", "network",
               "simulated")
_NETWORK_KEYS = ("bandwidth_gbps", "latency_us")
_LINK_KEYS = ("kind", "bandwidth_gbs", "latency_us", "call_latency_us")
_NVME_KEYS = ("capacity_tb", "read_gbs", "write_gbs")
_DEVICE_KEYS = ("peak_tflops_16", "peak_tflops_32", "memory_gb", "memory_bandwidth_gbs", "host_link_gbs",
                "vendor", "source")
_DEVICE_FIELDS = {  # schema key -> (DeviceType field, scale to base units)
    "peak_tflops_16": ("peak_flops_16", 1e12), "peak_tflops_32": ("peak_flops_32", 1e12),
    "memory_gb": ("memory_bytes", 2**30), "memory_bandwidth_gbs": ("memory_bandwidth", 1e9),
    "host_link_gbs": ("host_link_bandwidth", 1e9),
}
_GBPS = 1e9 / 8  # network bandwidth is given in Gb/s (bits)
_US = 1e-6


def _mapping(value: object, allowed: Sequence[str], where: str) -> Mapping[str, Any]:
    _require(isinstance(value, Mapping),
             f"{where} must be a mapping, got {value!r}; see docs/cluster_spec.md")
    for key in value:  # type: ignore[union-attr]
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ClusterSpecError(
                f"unknown key {key!r} in {where}: {hint}allowed keys: {', '.join(allowed)}")
    return value  # type: ignore[return-value]


_UNITS = {  # schema key -> what its number counts (docs/cluster_spec.md, "Units")
    "cpu_memory_gb": "GiB of host memory per node", "capacity_tb": "decimal TB per node, e.g. 3.84",
    "read_gbs": "GB/s sequential read", "write_gbs": "GB/s sequential write",
    "bandwidth_gbps": "Gb/s per node", "bandwidth_gbs": "GB/s per GPU per direction", "latency_us": "microseconds",
    "memory_gb": "GiB", "memory_bandwidth_gbs": "GB/s", "host_link_gbs": "GB/s", "peak_tflops_16": "TFLOP/s",
    "peak_tflops_32": "TFLOP/s",
}


_MOST = {  # schema key -> (largest plausible value, what holds more, the unit a too-large number is likely in)
    "cpu_memory_gb": (2**16, "64 TiB; the largest single servers hold 24-32 TB", ("bytes", 2**30)),
    "capacity_tb": (2000, "24 drives of 61.44 TB make 1475 TB per node", ("GB", 1e3)),
    "read_gbs": (1000, "24 PCIe 5 drives read about 340 GB/s", ("MB/s", 1e3)),
    "write_gbs": (1000, "24 PCIe 5 drives write about 240 GB/s", ("MB/s", 1e3)),
    "bandwidth_gbps": (10**5, "8 NICs of 800 Gb/s make 6400 Gb/s per node", ("bit/s", 1e9)),
    "bandwidth_gbs": (10**4, "NVLink 5 moves 900 GB/s per GPU per direction", ("bytes/s", 1e9)),
    "memory_gb": (2**14, "the largest GPUs hold 288 GB", ("bytes", 2**30)),
    "memory_bandwidth_gbs": (10**5, "HBM3e reaches 8 TB/s", ("bytes/s", 1e9)),
    "host_link_gbs": (10**4, "NVLink-C2C moves 450 GB/s per direction", ("bytes/s", 1e9)),
    "peak_tflops_16": (10**5, "a B200 computes about 2250 dense 16-bit TFLOP/s", ("FLOP/s", 1e12)),
    "peak_tflops_32": (10**5, "a B200 computes about 80 fp32 TFLOP/s", ("FLOP/s", 1e12)),
}
"""A number above these is a unit mistake (bytes for GiB, GB for TB, bits for Gb), refused rather than
planned with: the bounds sit 1.5-50x above today's largest hardware (the reason beside each), far below
the value the usual wrong unit gives."""


def _num(d: Mapping[str, Any], key: str, where: str, scale: float, *, required: bool = False,
         zero_ok: bool = False) -> float | None:
    value = d.get(key)
    unit = _UNITS.get(key, "see docs/cluster_spec.md")
    if value is None:
        _require(not required, f"{where}: missing {key!r}; add {key}: <number> ({unit})")
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if zero_ok else value > 0)
    _require(ok, f"{where}: {key} must be a {'non-negative' if zero_ok else 'positive'} number, "
             f"got {value!r}; write a plain number ({unit}) without units or quotes")
    if key in _MOST and value > _MOST[key][0]:
        most, reason, (likely, factor) = _MOST[key]
        raise ClusterSpecError(
            f"{where}: {key}: {value!r} is more than any hardware has (above {most:g}; {reason}); {key} counts "
            f"{unit}: if {value!r} is in {likely}, write {key}: {value / factor:.4g}")
    return value * scale


def _emit(x: float, scale: float, parse: Any) -> float | int:
    """The shortest decimal of ``x / scale`` that parses back to exactly ``x``."""
    for digits in range(16):
        c = round(x / scale, digits)
        if parse(c) == x:
            return int(c) if float(c).is_integer() else c
    return x / scale


def _emit_bw(x: float, scale: float) -> float | int:
    return _emit(x, scale, lambda c: _grid_bandwidth(c * scale))


def _emit_lat(x: float) -> float | int:
    return _emit(x, _US, lambda c: _grid_latency(c * _US))


def _emit_bytes(x: int, scale: float) -> float | int:
    return _emit(x, scale, lambda c: int(round(c * scale)))


def _device_from_dict(name: str, raw: object) -> DeviceType:
    where = f"custom device {name!r}"
    d = _mapping(raw, _DEVICE_KEYS, where)
    values: dict[str, Any] = {}
    for key, (field, scale) in _DEVICE_FIELDS.items():
        value = _num(d, key, where, scale, required=True)
        values[field] = int(round(value)) if field == "memory_bytes" else value  # type: ignore[arg-type]
    vendor = d.get("vendor", "nvidia")
    _require(vendor in ("nvidia", "amd", "cpu"),
             f"{where}: vendor must be nvidia, amd or cpu, got {vendor!r}")
    source = str(d.get("source", "user-defined in the cluster spec"))
    return DeviceType(name=name, vendor=vendor, source=source, **values)


def _device_to_dict(dev: DeviceType) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (field, scale) in _DEVICE_FIELDS.items():
        x = getattr(dev, field)
        if field == "memory_bytes":
            out[key] = _emit_bytes(x, scale)
        else:
            out[key] = _emit(x, scale, lambda c, s=scale: c * s)
    return {**out, "vendor": dev.vendor, "source": dev.source}


def _group_from_dict(index: int, raw: object, custom: Mapping[str, DeviceType],
                     top_bw: float | None, top_lat: float | None) -> NodeGroup:
    g = _mapping(raw, _GROUP_KEYS, f"groups[{index}]")
    gpu = g.get("gpu")
    said = "missing 'gpu'" if gpu is None or gpu == "" else f"gpu must be a type name, got {gpu!r}"
    _require(isinstance(gpu, str) and bool(gpu), f"groups[{index}]: {said}; add gpu: <type>, one "
             f"of {', '.join(CATALOG)} or a name under 'devices:'")
    name = g.get("name", gpu)
    where = f"group {name!r}"
    _require("gpus_per_node" in g, f"{where}: missing 'gpus_per_node'; add gpus_per_node: <count>")
    kind, intra_bw, intra_lat, call_lat = g.get("intra_node"), None, None, None
    if isinstance(kind, Mapping):
        link = _mapping(kind, _LINK_KEYS, f"{where} intra_node")
        kind = link.get("kind")
        intra_bw = _num(link, "bandwidth_gbs", f"{where} intra_node", 1e9)
        intra_lat = _num(link, "latency_us", f"{where} intra_node", _US, zero_ok=True)
        call_lat = _num(link, "call_latency_us", f"{where} intra_node", _US, zero_ok=True)
        _require(kind is not None or intra_bw is not None,
                 f"{where}: intra_node has neither a kind nor bandwidth_gbs; add bandwidth_gbs: <GB/s per "
                 "GPU per direction> or a kind such as nvlink3 or pcie4")
    net_bw, net_lat = top_bw, top_lat
    if "network" in g and g["network"] is None:
        net_bw = None  # explicitly no network: a one-node group in a one-node cluster
    elif "network" in g:
        net = _mapping(g["network"], _NETWORK_KEYS, f"{where} network")
        net_bw = _num(net, "bandwidth_gbps", f"{where} network", _GBPS) or top_bw
        lat = _num(net, "latency_us", f"{where} network", _US, zero_ok=True)
        net_lat = top_lat if lat is None else lat
    nvme = None
    if g.get("nvme") is not None:
        n = _mapping(g["nvme"], _NVME_KEYS, f"{where} nvme")
        units = (("capacity_tb", 1e12), ("read_gbs", 1e9), ("write_gbs", 1e9))
        cap, read, write = (_num(n, key, f"{where} nvme", scale, required=True) for key, scale in units)
        nvme = NvmeSpec(capacity_bytes=cap, read_bandwidth=read,  # type: ignore[arg-type]
                        write_bandwidth=write)  # type: ignore[arg-type]
    return NodeGroup.build(
        name=name, gpu=gpu, gpus_per_node=g["gpus_per_node"], num_nodes=g.get("nodes", 1),
        intra_link=kind, intra_bandwidth=intra_bw, intra_latency=intra_lat, network_bandwidth=net_bw,
        network_latency=net_lat, cpu_memory_bytes=_num(g, "cpu_memory_gb", where, 2**30), nvme=nvme,
        simulated=g.get("simulated", False), custom_devices=custom, call_latency=call_lat)


def _group_to_dict(g: NodeGroup) -> dict[str, Any]:
    out: dict[str, Any] = {"name": g.name, "gpu": g.gpu, "gpus_per_node": g.gpus_per_node,
                           "nodes": g.num_nodes}
    explicit = {"bandwidth_gbs": _emit_bw(g.intra_bandwidth, 1e9),
                "latency_us": _emit_lat(g.intra_latency)}
    if g.call_latency is not None:
        explicit["call_latency_us"] = _emit_lat(g.call_latency)
    if g.intra_link is not None:
        bw, lat = g.intra_link.resolve(g.device)
        same = (_grid_bandwidth(bw), _grid_latency(lat)) == (g.intra_bandwidth, g.intra_latency) \
            and g.call_latency is None
        out["intra_node"] = g.intra_link.value if same else {"kind": g.intra_link.value, **explicit}
    elif g.call_latency is not None or not (g.gpus_per_node == 1 and (g.intra_bandwidth, g.intra_latency) == (
            _grid_bandwidth(g.device.host_link_bandwidth), _grid_latency(PCIE_LATENCY_S))):
        out["intra_node"] = explicit
    if g.cpu_memory_bytes is not None:
        out["cpu_memory_gb"] = _emit_bytes(g.cpu_memory_bytes, 2**30)
    if g.nvme is not None:
        out["nvme"] = {"capacity_tb": _emit_bytes(g.nvme.capacity_bytes, 1e12),
                       "read_gbs": _emit_bw(g.nvme.read_bandwidth, 1e9),
                       "write_gbs": _emit_bw(g.nvme.write_bandwidth, 1e9)}
    out["network"] = None if g.network_bandwidth is None else {
        "bandwidth_gbps": _emit_bw(g.network_bandwidth, _GBPS),
        "latency_us": _emit_lat(g.network_latency)}
    if g.simulated:
        out["simulated"] = True
    return out


def _from_dict(cls: type[ClusterSpec], data: Mapping[str, Any]) -> ClusterSpec:
    d = _mapping(data, _TOP_KEYS, "the cluster spec")
    devices = _mapping(d.get("devices") or {}, list(d.get("devices") or {}), "devices")
    custom = {str(name): _device_from_dict(str(name), row) for name, row in devices.items()}
    net = _mapping(d.get("network") or {}, _NETWORK_KEYS, "the top-level network")
    top_bw = _num(net, "bandwidth_gbps", "network", _GBPS)
    top_lat = _num(net, "latency_us", "network", _US, zero_ok=True)
    raw_groups = d.get("groups")
    _require(isinstance(raw_groups, Sequence) and not isinstance(raw_groups, str) and bool(raw_groups),
             f"the cluster spec needs a non-empty list under 'groups:', got {raw_groups!r}; see "
             "docs/cluster_spec.md for an example")
    groups = tuple(_group_from_dict(i, g, custom, top_bw, top_lat)
                   for i, g in enumerate(raw_groups))  # type: ignore[arg-type]
    rank_map = d.get("rank_map")
    _require(rank_map is None or (isinstance(rank_map, Sequence) and not isinstance(rank_map, str)),
             f"rank_map must be a list of group names (one per rank), got {rank_map!r}")
    return cls(groups=groups, custom_devices=tuple(custom.values()), inter_group_bandwidth=top_bw,
               inter_group_latency=top_lat,
               rank_map=None if rank_map is None else tuple(map(str, rank_map)))


def _to_dict(spec: ClusterSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    net: dict[str, Any] = {}
    if spec.inter_group_bandwidth is not None:
        net["bandwidth_gbps"] = _emit_bw(spec.inter_group_bandwidth, _GBPS)
    if spec.inter_group_latency is not None:
        net["latency_us"] = _emit_lat(spec.inter_group_latency)
    if net:
        out["network"] = net
    if spec.custom_devices:
        out["devices"] = {dev.name: _device_to_dict(dev) for dev in spec.custom_devices}
    out["groups"] = [_group_to_dict(g) for g in spec.groups]
    if spec.rank_map is not None:
        out["rank_map"] = list(spec.rank_map)
    return out
