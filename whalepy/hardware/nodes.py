"""The nodes of a cluster: a :class:`NodeGroup` (``num_nodes`` nodes of ``gpus_per_node`` GPUs of one type,
one intra-node link, one network bandwidth per node), its optional :class:`NvmeSpec`, the intra-node
:class:`LinkKind` and its bandwidth and latency. :mod:`whalepy.hardware.schema` reads them from dicts and
:class:`~whalepy.hardware.cluster.ClusterSpec` is built from them.

Units inside the dataclasses are base SI units: bytes, bytes/s (per direction), seconds.
"""

from __future__ import annotations

import difflib
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from whalepy.cost_models.communication import Fabric, Link, bus_efficiency
from whalepy.cost_models.devices import DeviceType, resolve_device_type
from whalepy.errors import ClusterSpecError

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
    call_latency: float | None = None
    """Fixed cost of one collective call (a pipeline's send too) besides its per-step latency, seconds, as
    measured (a spec's ``intra_node: {call_latency_us: ...}``); ``None``: NCCL's ``baseLat`` on GPUs,
    nothing on CPU ranks (``ClusterSpec.comm_group``)."""

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
        _require(self.call_latency is None or isinstance(self.call_latency, (int, float)) and self.call_latency >= 0,
                 f"{where}call_latency must be >= 0 seconds, got {self.call_latency!r}")
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
              custom_devices: Mapping[str, DeviceType] | None = None,
              call_latency: float | None = None) -> NodeGroup:
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
                   cpu_memory_bytes=cpu_memory_bytes, nvme=nvme, simulated=simulated, call_latency=call_latency)

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
