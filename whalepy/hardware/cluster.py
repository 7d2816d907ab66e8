"""Cluster description: groups of identical nodes, possibly of different GPU generations.

A :class:`ClusterSpec` is a tuple of :class:`NodeGroup` (``num_nodes`` nodes of ``gpus_per_node`` GPUs
of one type, one intra-node link, one network bandwidth per node) plus the network between groups and
an optional rank order. It is read from YAML / JSON / a dict (schema and units in docs/cluster_spec.md),
resolves GPU names against the device catalog, and hands the cost models :class:`CommGroup` rows.

Units inside the dataclasses are base SI units: bytes, bytes/s (per direction), seconds.
"""

from __future__ import annotations

import collections
import difflib
import enum
import hashlib
import json
import math
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whalepy.errors import ClusterSpecError, PlanError
from whalepy.cost_models.communication import NCCL_LAUNCH_LATENCY_S, CommGroup, Fabric, Link, bus_efficiency
from whalepy.cost_models.devices import (
    ALIASES,
    CATALOG,
    DeviceType,
    match_device_name,
    resolve_device_type,
)
from whalepy.ir.types import Precision

NVLINK_LATENCY_S = 3.4e-6
"""Per-step latency over NVLink: NCCL's ring/Simple ``hwLat`` (src/graph/tuning.cc)."""
PCIE_LATENCY_S = 5.7e-6
"""Per-step latency over PCIe: NCCL's ring/Simple ``hwLat`` for PCI."""
DEFAULT_NETWORK_LATENCY_S = 9.6e-6
"""Per-step network latency when the spec gives none: NCCL's ring/Simple ``hwLat`` for NET."""
XGMI_LATENCY_S = NVLINK_LATENCY_S
"""AMD Infinity Fabric (xGMI) per-step latency, taken equal to NVLink's (RCCL forks NCCL's table)."""
SHM_BANDWIDTH = 10e9
"""NOMINAL bandwidth between CPU processes on one host (gloo over shared memory / loopback)."""
SHM_LATENCY_S = 20e-6
"""NOMINAL per-message latency between CPU processes on one host."""


class LinkKind(str, enum.Enum):
    """Intra-node interconnect. Numbers are per GPU per direction (table in docs/cluster_spec.md)."""

    NVLINK1 = "nvlink1"
    """P100: 4 links x 20 GB/s = 80 GB/s per direction (160 GB/s bidirectional, P100 datasheet)."""
    NVLINK2 = "nvlink2"
    """V100: 6 links x 25 GB/s = 150 GB/s per direction (300 GB/s bidirectional)."""
    NVLINK3 = "nvlink3"
    """A100: 12 links x 25 GB/s = 300 GB/s per direction (600 GB/s bidirectional)."""
    NVLINK4 = "nvlink4"
    """H100 / H200: 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s bidirectional)."""
    NVLINK5 = "nvlink5"
    """B200: 18 links x 50 GB/s = 900 GB/s per direction (1.8 TB/s bidirectional)."""
    NVSWITCH = "nvswitch"
    """All-to-all NVSwitch fabric: the NVLink generation of the group's GPU."""
    XGMI = "xgmi"
    """AMD Infinity Fabric, per GPU type: MI300X 7 x 64 = 448 GB/s; MI250X GCD 100 GB/s (see docs)."""
    PCIE3 = "pcie3"
    """PCIe 3.0 x16: 16 GB/s per direction (nominal)."""
    PCIE4 = "pcie4"
    """PCIe 4.0 x16: 32 GB/s per direction (nominal)."""
    PCIE5 = "pcie5"
    """PCIe 5.0 x16: 64 GB/s per direction (nominal)."""
    SHM = "shm"
    """CPU processes on one host (gloo): NOMINAL 10 GB/s, 20 us; for simulated and CPU groups."""

    def resolve(self, device: DeviceType, where: str = "") -> tuple[float, float]:
        """``(bandwidth bytes/s per direction, latency s)`` of this link for ``device``."""
        if self in _LINKS:
            return _LINKS[self]
        if self is LinkKind.NVSWITCH and device.name in _NVLINK_OF:
            return _LINKS[_NVLINK_OF[device.name]]
        if self is LinkKind.XGMI and device.name in _XGMI_BANDWIDTH:
            return _XGMI_BANDWIDTH[device.name], XGMI_LATENCY_S
        raise ClusterSpecError(
            f"{where}intra_node {self.value!r} has no known bandwidth for GPU type {device.name!r}; "
            "give a link kind (nvlink1..5, pcie3..5) or intra_node: {bandwidth_gbs: ..., latency_us: ...}")


_GBS = 1e9
_LINKS: dict[LinkKind, tuple[float, float]] = {
    LinkKind.NVLINK1: (80 * _GBS, NVLINK_LATENCY_S),
    LinkKind.NVLINK2: (150 * _GBS, NVLINK_LATENCY_S),
    LinkKind.NVLINK3: (300 * _GBS, NVLINK_LATENCY_S),
    LinkKind.NVLINK4: (450 * _GBS, NVLINK_LATENCY_S),
    LinkKind.NVLINK5: (900 * _GBS, NVLINK_LATENCY_S),
    LinkKind.PCIE3: (16 * _GBS, PCIE_LATENCY_S),
    LinkKind.PCIE4: (32 * _GBS, PCIE_LATENCY_S),
    LinkKind.PCIE5: (64 * _GBS, PCIE_LATENCY_S),
    LinkKind.SHM: (SHM_BANDWIDTH, SHM_LATENCY_S),
}
# What "nvswitch" and "xgmi" mean for each catalog type that has such a fabric.
_NVLINK_OF: dict[str, LinkKind] = {
    "P100": LinkKind.NVLINK1, "V100-16GB": LinkKind.NVLINK2, "V100-32GB": LinkKind.NVLINK2,
    "A100-40GB": LinkKind.NVLINK3, "A100-80GB": LinkKind.NVLINK3, "H100-SXM": LinkKind.NVLINK4,
    "H200": LinkKind.NVLINK4, "B200": LinkKind.NVLINK5,
}
_XGMI_BANDWIDTH: dict[str, float] = {
    "MI250X": 100 * _GBS,  # one GCD: 2 x 50 GB/s links to a ring neighbour in another package
    "MI300X": 448 * _GBS,  # 7 links x 64 GB/s per direction, fully connected 8-GPU platform
}
_FABRIC_OF: dict[LinkKind, Fabric] = {
    LinkKind.NVLINK3: Fabric.NVLINK3, LinkKind.NVLINK4: Fabric.NVLINK4,
    LinkKind.PCIE3: Fabric.PCIE, LinkKind.PCIE4: Fabric.PCIE, LinkKind.PCIE5: Fabric.PCIE,
}
_PCIE_BY_HOST_LINK = {16 * _GBS: LinkKind.PCIE3, 32 * _GBS: LinkKind.PCIE4, 64 * _GBS: LinkKind.PCIE5}


def _grid_bandwidth(x: float) -> float:
    return float(round(x))  # whole bytes/s: keeps dict round trips exact


def _grid_latency(x: float) -> float:
    return round(x * 1e9) / 1e9  # whole nanoseconds


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ClusterSpecError(message)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and math.isfinite(value))


def _canonicalize(obj: object, fields: Sequence[str], grid: Any) -> None:
    for name in fields:
        value = getattr(obj, name)
        if value is not None:
            object.__setattr__(obj, name, grid(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmeSpec:
    """Local NVMe storage of one node, for ZeRO-Infinity style offload."""

    capacity_bytes: int
    """Usable capacity, bytes (YAML ``capacity_tb`` is decimal: 1 TB = 1e12 bytes)."""
    read_bandwidth: float
    """Sequential read bandwidth, bytes/s."""
    write_bandwidth: float
    """Sequential write bandwidth, bytes/s."""

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "read_bandwidth", "write_bandwidth"):
            value = getattr(self, name)
            _require(_is_positive(value), f"nvme {name} must be positive, got {value!r}; "
                     "give nvme: {capacity_tb: ..., read_gbs: ..., write_gbs: ...} from its datasheet")
        object.__setattr__(self, "capacity_bytes", int(round(self.capacity_bytes)))
        _canonicalize(self, ("read_bandwidth", "write_bandwidth"), _grid_bandwidth)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGroup:
    """``num_nodes`` identical nodes, each with ``gpus_per_node`` GPUs of one type."""

    name: str
    """Unique group name, used in rank maps, plans and messages."""
    gpu: str
    """GPU type name as the user wrote it (catalog name, alias or custom type)."""
    device: DeviceType
    """The resolved device type of ``gpu``."""
    gpus_per_node: int
    """Ranks (GPUs, or simulated devices) per node."""
    num_nodes: int
    """Number of nodes in the group."""
    intra_link: LinkKind | None
    """Named intra-node link, or ``None`` for an explicit bandwidth (or a one-GPU node)."""
    intra_bandwidth: float
    """Intra-node bandwidth per GPU per direction, bytes/s."""
    intra_latency: float
    """Intra-node per-step latency, seconds."""
    network_bandwidth: float | None
    """Network bandwidth per NODE per direction, bytes/s (all its NICs); ``None`` only when the whole
    cluster is one node and nothing crosses a network."""
    network_latency: float = DEFAULT_NETWORK_LATENCY_S
    """Network per-step latency, seconds."""
    cpu_memory_bytes: int | None = None
    """Host memory per node, bytes; ``None`` when unknown (no CPU offload is planned then)."""
    nvme: NvmeSpec | None = None
    """Local NVMe per node, or ``None`` (no NVMe offload)."""
    simulated: bool = False
    """Ranks run on CPU (gloo) but take the role of ``device``: costs and memory limits are that
    GPU's. For testing plans for GPU clusters on a laptop or CI."""

    def __post_init__(self) -> None:
        where = f"group {self.name!r}: "
        _require(isinstance(self.name, str) and bool(self.name.strip()),
                 f"group name must be a non-empty string, got {self.name!r}; add name: <group name>")
        _require(isinstance(self.device, DeviceType),
                 f"{where}device must be a DeviceType, got {type(self.device).__name__}; "
                 "use NodeGroup.build(...) to resolve a GPU name")
        for field in ("gpus_per_node", "num_nodes"):
            value = getattr(self, field)
            key = "nodes" if field == "num_nodes" else field
            _require(_is_count(value), f"{where}{key} must be a positive integer, got {value!r}; "
                     f"set {key}: 1 or more")
        for field in ("intra_bandwidth", "network_bandwidth"):
            value = getattr(self, field)
            _require(value is None and field == "network_bandwidth" or _is_positive(value),
                     f"{where}{field} must be positive (bytes/s), got {value!r}; "
                     "give the link's bandwidth from its datasheet")
        for field in ("intra_latency", "network_latency"):
            value = getattr(self, field)
            _require(isinstance(value, (int, float)) and value >= 0,
                     f"{where}{field} must be >= 0 seconds, got {value!r}")
        _require(self.cpu_memory_bytes is None or _is_positive(self.cpu_memory_bytes),
                 f"{where}cpu_memory_bytes must be positive, got {self.cpu_memory_bytes!r}; "
                 "give cpu_memory_gb or leave it out")
        _require(isinstance(self.simulated, bool), f"{where}simulated must be true or false, "
                 f"got {self.simulated!r}")
        _require(self.nvme is None or isinstance(self.nvme, NvmeSpec), f"{where}nvme must be an NvmeSpec or "
                 f"None, got {type(self.nvme).__name__}; in a spec write nvme: {{capacity_tb: ..., read_gbs: ..., "
                 "write_gbs: ...}")
        # the disk tier stages every read and write through pinned host buffers, and the planner charges them
        # to host memory: an NVMe with unknown host memory would be silently never used
        _require(self.nvme is None or self.cpu_memory_bytes is not None,
                 f"{where}nvme is given without cpu_memory_gb; NVMe offload stages through host memory, so "
                 "whalepy plans it only where the host memory is known: add cpu_memory_gb: <GiB per node>")
        _require(self.num_nodes == 1 or self.network_bandwidth is not None,
                 f"{where}{self.num_nodes} nodes but no network bandwidth; add "
                 "network: {bandwidth_gbps: ...} to the group or at the top of the spec")
        _canonicalize(self, ("intra_bandwidth", "network_bandwidth"), _grid_bandwidth)
        _canonicalize(self, ("intra_latency", "network_latency"), _grid_latency)
        if self.cpu_memory_bytes is not None:
            object.__setattr__(self, "cpu_memory_bytes", int(round(self.cpu_memory_bytes)))

    @classmethod
    def build(cls, *, name: str, gpu: str, gpus_per_node: int, num_nodes: int = 1,
              intra_link: LinkKind | str | None = None, intra_bandwidth: float | None = None,
              intra_latency: float | None = None, network_bandwidth: float | None = None,
              network_latency: float | None = None, cpu_memory_bytes: int | None = None,
              nvme: NvmeSpec | None = None, simulated: bool = False,
              custom_devices: Mapping[str, DeviceType] | None = None) -> NodeGroup:
        """A group with the GPU name resolved and the link's bandwidth/latency filled from its kind.

        An explicit ``intra_bandwidth`` / ``intra_latency`` overrides the kind's numbers. A one-GPU
        node with no link gets its host PCIe link (never used: nothing crosses it).
        """
        where = f"group {name!r}: "
        try:
            device = resolve_device_type(gpu, custom_devices)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{where}{e}") from None
        kind = parse_link_kind(intra_link, where) if intra_link is not None else None
        if kind is not None:
            default_bw, default_lat = kind.resolve(device, where)
        elif intra_bandwidth is None and _is_count(gpus_per_node) and gpus_per_node > 1:
            raise ClusterSpecError(
                f"{where}{gpus_per_node} GPUs per node but no intra-node link; add intra_node: "
                f"{suggest_link_kind(device).value} (or another kind: "
                f"{', '.join(k.value for k in LinkKind)}) or intra_node: {{bandwidth_gbs: ...}}")
        else:
            default_bw, default_lat = device.host_link_bandwidth, PCIE_LATENCY_S
        return cls(name=name, gpu=gpu, device=device, gpus_per_node=gpus_per_node,
                   num_nodes=num_nodes, intra_link=kind,
                   intra_bandwidth=default_bw if intra_bandwidth is None else intra_bandwidth,
                   intra_latency=default_lat if intra_latency is None else intra_latency,
                   network_bandwidth=network_bandwidth,
                   network_latency=(DEFAULT_NETWORK_LATENCY_S if network_latency is None
                                    else network_latency),
                   cpu_memory_bytes=cpu_memory_bytes, nvme=nvme, simulated=simulated)

    @property
    def num_devices(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def runs_on_cpu(self) -> bool:
        """True when the ranks of this group run on CPU with gloo (simulated or a CPU type)."""
        return self.simulated or self.device.vendor == "cpu"

    @property
    def intra_fabric(self) -> Fabric:
        """What the intra-node link achieves is looked up by: its NVLink generation, PCIe, or
        ``given`` (an explicit bandwidth, also with a kind, or gloo between CPU processes: used as is)."""
        kind = self.intra_link
        if kind is None or kind is LinkKind.SHM or self.device.vendor == "cpu":
            return Fabric.GIVEN
        try:
            if kind.resolve(self.device)[0] != self.intra_bandwidth:
                return Fabric.GIVEN  # the kind with a measured bandwidth: taken as achieved
        except ClusterSpecError:
            return Fabric.GIVEN
        if kind is LinkKind.NVSWITCH:
            kind = _NVLINK_OF.get(self.device.name, kind)
        return _FABRIC_OF.get(kind, Fabric.NVLINK)

    @property
    def intra(self) -> Link:
        return Link(bandwidth=self.intra_bandwidth, latency=self.intra_latency,
                    efficiency=bus_efficiency(self.intra_fabric))

    @property
    def network(self) -> Link | None:
        """The node's network (RDMA: InfiniBand / RoCE) with its achieved share, or None."""
        if self.network_bandwidth is None:
            return None
        fabric = Fabric.GIVEN if self.device.vendor == "cpu" else Fabric.NETWORK
        return Link(bandwidth=self.network_bandwidth, latency=self.network_latency,
                    efficiency=bus_efficiency(fabric))


def parse_link_kind(value: LinkKind | str, where: str = "") -> LinkKind:
    """``value`` as a :class:`LinkKind` (case-insensitive); raises with the closest kind on a typo."""
    if isinstance(value, LinkKind):
        return value
    try:
        return LinkKind(str(value).strip().lower())
    except ValueError:
        names = [k.value for k in LinkKind]
        close = difflib.get_close_matches(str(value).lower(), names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ClusterSpecError(
            f"{where}unknown intra_node link {value!r}: {hint}known kinds: {', '.join(names)}; "
            "or give intra_node: {bandwidth_gbs: ..., latency_us: ...}") from None


def suggest_link_kind(device: DeviceType) -> LinkKind:
    """The usual intra-node link for ``device``: its fabric, else its host PCIe generation."""
    if device.vendor == "cpu":
        return LinkKind.SHM
    if device.name in _NVLINK_OF:
        return LinkKind.NVSWITCH
    if device.name in _XGMI_BANDWIDTH:
        return LinkKind.XGMI
    return _PCIE_BY_HOST_LINK.get(device.host_link_bandwidth, LinkKind.PCIE4)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankDevice:
    """Where one global rank sits."""

    rank: int
    """Global rank."""
    group: str
    """Name of its node group."""
    node: int
    """Global node index (groups in order, then nodes in order)."""
    local_rank: int
    """Index of the rank within its node."""
    device: DeviceType
    """Its device type."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The whole cluster: node groups, custom device types, inter-group network and rank order."""

    groups: tuple[NodeGroup, ...]
    """Node groups in rank order (unless ``rank_map`` says otherwise)."""
    custom_devices: tuple[DeviceType, ...] = ()
    """User-defined device types (the spec's ``devices:``); names may not shadow the catalog."""
    inter_group_bandwidth: float | None = None
    """Network bandwidth per node per direction between groups, bytes/s; ``None``: the slower of the
    groups' own networks. A path is never faster than either end's network."""
    inter_group_latency: float | None = None
    """Per-step latency between groups, seconds; ``None``: the larger of the groups' latencies."""
    rank_map: tuple[str, ...] | None = None
    """Group name of each global rank; ``None``: groups in order, nodes in order, local ranks in order.
    A group's ranks take its nodes' slots in order (node-major)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.groups, (tuple, list)), f"ClusterSpec(groups=...) takes a tuple of NodeGroup, "
                 f"got {type(self.groups).__name__}; build one with ClusterSpec.from_dict / ClusterSpec.load")
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "custom_devices", tuple(self.custom_devices))
        _require(len(self.groups) > 0, "cluster spec has no groups; add groups: [{name: ..., gpu: ..., "
                 "gpus_per_node: ..., nodes: ...}]")
        seen: set[str] = set()
        for group in self.groups:
            _require(isinstance(group, NodeGroup), f"groups must be NodeGroup, got {type(group).__name__}")
            _require(group.name not in seen, f"duplicate group name {group.name!r}; give each group "
                     "a unique name")
            seen.add(group.name)
        custom: dict[str, DeviceType] = {}
        for dev in self.custom_devices:
            _require(dev.name not in custom, f"custom device {dev.name!r} defined twice; keep one")
            _require(dev.name.lower() not in {n.lower() for n in (*CATALOG, *ALIASES)},
                     f"custom device {dev.name!r} shadows the catalog type of that name; rename it "
                     f"(e.g. {dev.name + '-custom'!r})")
            custom[dev.name] = dev
        for group in self.groups:
            _require(resolve_device_type(group.gpu, custom) == group.device,
                     f"group {group.name!r}: device {group.device.name!r} is not what gpu "
                     f"{group.gpu!r} names; list a custom type in custom_devices")
        if self.num_nodes > 1:
            for group in self.groups:
                _require(group.network_bandwidth is not None,
                         f"group {group.name!r}: the cluster has {self.num_nodes} nodes but this group "
                         "has no network bandwidth; add network: {bandwidth_gbps: ...} to the group "
                         "or at the top of the spec")
        _require(self.inter_group_bandwidth is None or _is_positive(self.inter_group_bandwidth),
                 f"inter-group network bandwidth must be positive, got {self.inter_group_bandwidth!r}")
        _require(self.inter_group_latency is None or self.inter_group_latency >= 0,
                 f"inter-group latency must be >= 0, got {self.inter_group_latency!r}")
        _canonicalize(self, ("inter_group_bandwidth",), _grid_bandwidth)
        _canonicalize(self, ("inter_group_latency",), _grid_latency)
        if self.rank_map is not None:
            object.__setattr__(self, "rank_map", tuple(self.rank_map))
            self._check_rank_map()

    def _check_rank_map(self) -> None:
        assert self.rank_map is not None
        counts = collections.Counter(self.rank_map)
        for name in counts:
            if name not in {g.name for g in self.groups}:
                close = difflib.get_close_matches(name, [g.name for g in self.groups], n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ClusterSpecError(f"rank_map names unknown group {name!r}: {hint}groups are "
                                       f"{', '.join(g.name for g in self.groups)}")
        _require(len(self.rank_map) == self.world_size,
                 f"rank_map has {len(self.rank_map)} entries but the cluster has {self.world_size} "
                 "ranks; list one group name per rank")
        for group in self.groups:
            _require(counts[group.name] == group.num_devices,
                     f"rank_map gives group {group.name!r} {counts[group.name]} ranks but it has "
                     f"{group.num_nodes} x {group.gpus_per_node} = {group.num_devices}; fix the counts")

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Parse the documented schema (docs/cluster_spec.md)."""
        from whalepy.hardware.schema import _from_dict

        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """The schema form; ``ClusterSpec.from_dict(spec.to_dict()) == spec``."""
        from whalepy.hardware.schema import _to_dict

        return _to_dict(self)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        try:
            import yaml
        except ImportError:
            raise ClusterSpecError(f"reading {str(path)!r} needs PyYAML, which is not installed; "
                                   "pip install pyyaml (or whalepy[yaml]), or use a JSON spec") from None
        try:
            data = yaml.load(_read_spec_file(path), Loader=_yaml_loader(path))  # noqa: S506 (a safe loader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(e, "problem", None) or " ".join(str(e).split())
            raise ClusterSpecError(f"{str(path)!r} is not valid YAML: {what}{where}; fix the syntax") from e
        return cls._from_file_data(data, path)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        try:
            data = json.loads(_read_spec_file(path),
                              object_pairs_hook=lambda pairs: _refuse_duplicate_keys(pairs, path))
        except json.JSONDecodeError as e:
            raise ClusterSpecError(f"{str(path)!r} is not valid JSON ({e}); fix the syntax") from e
        return cls._from_file_data(data, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """``from_json`` for ``*.json``, ``from_yaml`` otherwise."""
        if not isinstance(path, (str, os.PathLike)):
            raise ClusterSpecError(f"ClusterSpec.load() takes the path of a YAML / JSON spec, got "
                                   f"{type(path).__name__} {path!r:.60}; e.g. ClusterSpec.load('examples/clusters/cpu4.yaml')")
        return cls.from_json(path) if str(path).endswith(".json") else cls.from_yaml(path)

    @classmethod
    def _from_file_data(cls, data: object, path: str | os.PathLike[str]) -> ClusterSpec:
        _require(isinstance(data, Mapping), f"{str(path)!r} must hold a mapping with 'groups:', got "
                 f"{type(data).__name__}; see docs/cluster_spec.md")
        try:
            return cls.from_dict(data)  # type: ignore[arg-type]
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{path}: {e}") from None

    @classmethod
    def local(cls, num_devices: int | None = None, *,
              device_type: str | DeviceType | None = None) -> ClusterSpec:
        """This machine as a one-node cluster.

        With CUDA/ROCm: the visible GPUs (``num_devices`` of them, default all), typed from their
        reported name; the intra-node link is guessed (a warning says which). Without: ``num_devices``
        (default 1) CPU ranks of the nominal ``"CPU"`` type, or of ``device_type``, simulated on CPU.
        """
        import torch

        _require(device_type is None or isinstance(device_type, DeviceType)
                 or (isinstance(device_type, str) and bool(device_type.strip())),
                 f"ClusterSpec.local(device_type={device_type!r:.60}): give a device type name such as 'H100-SXM' "
                 "or 'CPU', or a DeviceType")
        custom: tuple[DeviceType, ...] = ()
        if isinstance(device_type, DeviceType) and CATALOG.get(device_type.name) != device_type:
            custom = (device_type,)  # a catalog name with other numbers is refused as shadowing
        named = device_type.name if isinstance(device_type, DeviceType) else device_type
        cpu_memory = _host_memory_bytes()
        if torch.cuda.is_available():
            available = torch.cuda.device_count()
            count = available if num_devices is None else num_devices
            _require(_is_count(count) and count <= available,
                     f"ClusterSpec.local(num_devices={count!r}) but {available} GPUs are visible; "
                     "ask for 1 to that many")
            if named is None:
                reported = sorted({torch.cuda.get_device_name(i) for i in range(count)})
                _require(len(reported) == 1, f"visible GPUs are of several types ({', '.join(reported)}); "
                         "restrict CUDA_VISIBLE_DEVICES to one type or write a cluster spec")
                found = match_device_name(reported[0], torch.cuda.get_device_properties(0).total_memory)
                _require(found is not None, f"GPU {reported[0]!r} is not in the device catalog; pass "
                         "ClusterSpec.local(device_type=DeviceType(...)) or write a cluster spec "
                         "with a 'devices:' entry")
                named = found.name  # type: ignore[union-attr]
            device = resolve_device_type(named, {d.name: d for d in custom})
            kind = suggest_link_kind(device) if count > 1 else None
            if kind is not None:
                from whalepy.log import warn_once  # once per job: every rank of a launch builds this spec

                warn_once(f"local-link-{count}-{device.name}", "whalepy: ClusterSpec.local(): assuming intra-node "
                          "link %r for %d x %s; write a cluster spec if that is wrong", kind.value, count, device.name)
            group = NodeGroup.build(name="local", gpu=named, gpus_per_node=count, intra_link=kind,
                                    cpu_memory_bytes=cpu_memory,
                                    custom_devices={d.name: d for d in custom})
        else:
            count = 1 if num_devices is None else num_devices
            _require(_is_count(count), f"ClusterSpec.local(num_devices={count!r}): need a positive "
                     "integer number of CPU ranks")
            gpu = named or "CPU"
            device = resolve_device_type(gpu, {d.name: d for d in custom})
            group = NodeGroup.build(name="local", gpu=gpu, gpus_per_node=count, intra_link=LinkKind.SHM,
                                    cpu_memory_bytes=cpu_memory, simulated=device.vendor != "cpu",
                                    custom_devices={d.name: d for d in custom})
        return cls(groups=(group,), custom_devices=custom)

    # ---- queries -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.groups)

    @property
    def device_types(self) -> tuple[DeviceType, ...]:
        """Distinct device types, in group order."""
        return tuple(dict.fromkeys(g.device for g in self.groups))

    def group(self, name: str) -> NodeGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise ClusterSpecError(f"no group named {name!r}; groups are "
                               f"{', '.join(g.name for g in self.groups)}")

    def num_devices_by_type(self) -> dict[str, int]:
        """Rank count per device type name."""
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.device.name] = counts.get(g.device.name, 0) + g.num_devices
        return counts

    def rank_devices(self) -> tuple[RankDevice, ...]:
        """Placement of every global rank, indexed by rank."""
        cached = self.__dict__.get("_rank_devices")
        if cached is None:
            cached = _place_ranks(self)
            object.__setattr__(self, "_rank_devices", cached)
        return cached

    def rank_device_type(self, rank: int) -> DeviceType:
        return self._rank(rank).device

    def _rank(self, rank: int) -> RankDevice:
        try:
            rank = operator.index(rank)
        except TypeError:
            raise ClusterSpecError(f"rank {rank!r} is not an integer; pass global rank numbers") from None
        placed = self.rank_devices()
        _require(0 <= rank < len(placed), f"rank {rank!r} is outside the cluster's {len(placed)} ranks "
                 f"(0..{len(placed) - 1}); use a rank in that range")
        return placed[rank]

    def comm_group(self, ranks: Sequence[int]) -> CommGroup:
        """The :class:`CommGroup` of a collective over ``ranks``.

        ``ranks_per_node`` is the most ranks on any one node (the cost of an uneven group is bounded
        by its fullest node); ``intra`` the slowest intra-node link of the groups involved; ``inter``
        the slowest network of the groups involved, further capped by the inter-group network when
        the ranks span groups. On one node ``inter`` is never crossed: it is the node's network, or
        a copy of ``intra`` when the spec has no network at all.
        """
        _require(len(ranks) > 0, "comm_group needs at least one rank")
        _require(len(set(ranks)) == len(ranks), f"comm_group ranks repeat: {list(ranks)}; list each once")
        placed = [self._rank(r) for r in ranks]
        per_node = collections.Counter(p.node for p in placed)
        groups = [self.group(name) for name in dict.fromkeys(p.group for p in placed)]
        slowest = min((g.intra for g in groups), key=lambda link: link.achieved_bandwidth)
        intra = Link(bandwidth=slowest.bandwidth, latency=max(g.intra_latency for g in groups),
                     efficiency=slowest.efficiency)
        networks = [g.network for g in groups if g.network is not None]
        net = min(networks, key=lambda link: link.achieved_bandwidth) if networks else intra
        bandwidth, efficiency = net.bandwidth, net.efficiency
        latency = max(g.network_latency for g in groups)
        if len(groups) > 1 and self.inter_group_bandwidth is not None:
            bandwidth = min(bandwidth, self.inter_group_bandwidth)
        if len(groups) > 1 and self.inter_group_latency is not None:
            latency = max(latency, self.inter_group_latency)
        # NCCL's fixed per-call cost; CPU groups (gloo) carry theirs in the nominal SHM latency
        launch = 0.0 if all(g.device.vendor == "cpu" for g in groups) else NCCL_LAUNCH_LATENCY_S
        return CommGroup(ranks_per_node=max(per_node.values()), num_nodes=len(per_node), intra=intra,
                         inter=Link(bandwidth=bandwidth, latency=latency, efficiency=efficiency),
                         launch_latency=launch)

    def fingerprint(self) -> str:
        """Stable 16-hex-digit hash of :meth:`to_dict` (what a plan records to match its cluster)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        by_type = ", ".join(f"{n} x{c}" for n, c in self.num_devices_by_type().items())
        lines = [f"ClusterSpec: {self.world_size} devices on {self.num_nodes} node(s) ({by_type})"]
        rows = [("group", "type", "nodes x gpus", "intra link", "network/node", "gpu mem", "cpu mem")]
        for g in self.groups:
            link = f"{g.intra_link.value} " if g.intra_link else ""
            net = f"{g.network_bandwidth * 8 / 1e9:g} Gb/s" if g.network_bandwidth else "-"
            cpu = f"{g.cpu_memory_bytes / 2**30:g} GiB" if g.cpu_memory_bytes else "-"
            rows.append((g.name, g.device.name + (" (sim)" if g.simulated else ""),
                         f"{g.num_nodes} x {g.gpus_per_node}",
                         f"{link}{g.intra_bandwidth / 1e9:g} GB/s", net,
                         f"{g.device.memory_bytes / 2**30:g} GiB", cpu))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if self.inter_group_bandwidth is not None and len(self.groups) > 1:
            lines.append(f"  between groups: {self.inter_group_bandwidth * 8 / 1e9:g} Gb/s per node")
        return "\n".join(lines)


def _place_ranks(spec: ClusterSpec) -> tuple[RankDevice, ...]:
    slots: dict[str, collections.deque[tuple[int, int]]] = {}
    node = 0
    for g in spec.groups:
        slots[g.name] = collections.deque(
            (node + n, local) for n in range(g.num_nodes) for local in range(g.gpus_per_node))
        node += g.num_nodes
    order = spec.rank_map or tuple(g.name for g in spec.groups for _ in range(g.num_devices))
    out = []
    for rank, name in enumerate(order):
        node_index, local = slots[name].popleft()
        out.append(RankDevice(rank=rank, group=name, node=node_index, local_rank=local,
                              device=spec.group(name).device))
    return tuple(out)


def _read_spec_file(path: str | os.PathLike[str]) -> str:
    examples = Path(__file__).resolve().parent.parent / "examples" / "clusters"
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ClusterSpecError(f"cannot read cluster spec {str(path)!r}: {e.strerror}; give the path of a "
                               f"YAML or JSON spec (examples: {examples})") from None
    except UnicodeDecodeError as e:
        raise ClusterSpecError(f"cluster spec {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); give "
                               f"the path of a YAML or JSON spec (examples: {examples})") from None


def _refuse_duplicate_keys(pairs: list[tuple[Any, Any]], path: str | os.PathLike[str], line: str = "") -> dict:
    """A mapping from ``pairs``; a key given twice is refused (YAML and JSON parsers keep the last one
    silently, so ``gpus_per_node: 2, gpus_per_node: 4`` would plan with 4)."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ClusterSpecError(f"{str(path)!r}: key {key!r} is given twice in one mapping{line}; keep one")
        out[key] = value
    return out


def _yaml_loader(path: str | os.PathLike[str]) -> Any:
    """PyYAML's safe loader, refusing duplicate keys (:func:`_refuse_duplicate_keys`)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            self.flatten_mapping(node)
            pairs = [(self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                     for k, v in node.value]
            return _refuse_duplicate_keys(pairs, path, f" (line {node.start_mark.line + 1})")

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, Loader.construct_mapping)
    return Loader


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _is_cpu(device: DeviceType) -> bool:
    return device.vendor == "cpu"


def resolve_precision(devices: Iterable[DeviceType], requested: Precision | str | None = None) -> Precision:
    """The training precision for a cluster of ``devices``.

    Default (``requested`` None): fp32 when any device type is a CPU (CPU runs keep exact fp32
    numerics unless they ask for bf16), bf16 where every device type supports it, otherwise fp16
    (tensor-core GPUs without bf16: V100, T4; trained with dynamic loss scaling). A requested bf16 on
    a device type without bf16 is a :class:`PlanError` naming the device and the alternatives."""
    devs = list({d.name: d for d in devices}.values())
    if requested is None:
        if any(_is_cpu(d) for d in devs):
            return Precision.FP32
        return Precision.BF16 if all(d.supports_bf16 for d in devs) else Precision.FP16
    try:
        p = Precision(requested)
    except ValueError:
        raise PlanError(f"precision={requested!r}: use bf16, fp16 or fp32") from None
    if p is Precision.BF16:
        lacking = [d.name for d in devs if not d.supports_bf16]
        if lacking:
            raise PlanError(f"precision='bf16' is not supported by {', '.join(lacking)}; use precision='fp16' "
                            "(dynamic loss scaling) or 'fp32'")
    return p
