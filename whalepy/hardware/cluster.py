"""Cluster description: groups of identical nodes, possibly of different GPU generations.

A :class:`ClusterSpec` is a tuple of :class:`~whalepy.hardware.nodes.NodeGroup` (``num_nodes`` nodes of
``gpus_per_node`` GPUs of one type, one intra-node link, one network bandwidth per node) plus the network between groups and
an optional rank order. It is read from YAML / JSON / a dict (schema and units in docs/cluster_spec.md),
resolves GPU names against the device catalog, and hands the cost models :class:`CommGroup` rows.

Units inside the dataclasses are base SI units: bytes, bytes/s (per direction), seconds.
"""

from __future__ import annotations

import collections
import difflib
import hashlib
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whalepy.errors import ClusterSpecError, PlanError
from whalepy.cost_models.communication import NCCL_LAUNCH_LATENCY_S, CommGroup, Link
from whalepy.cost_models.devices import (
    ALIASES,
    CATALOG,
    DeviceType,
    match_device_name,
    resolve_device_type,
)
from whalepy.ir.types import Precision
from whalepy.hardware.nodes import (  # noqa: F401 - the public names re-exported: their documented path
    DEFAULT_NETWORK_LATENCY_S,
    NVLINK_LATENCY_S,
    PCIE_LATENCY_S,
    SHM_BANDWIDTH,
    SHM_LATENCY_S,
    XGMI_LATENCY_S,
    LinkKind,
    NodeGroup,
    NvmeSpec,
    _canonicalize,
    _grid_bandwidth,
    _grid_latency,
    _is_count,
    _is_positive,
    _require,
    parse_link_kind,
    suggest_link_kind,
)


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
        # a measured per-call cost where the spec gives one; else NCCL's fixed per-call cost, and CPU
        # groups (gloo) carry theirs in the nominal SHM latency
        given = [g.call_latency for g in groups if g.call_latency is not None]
        gloo = all(g.device.vendor == "cpu" for g in groups)  # CPU ranks communicate over gloo
        launch = max(given) if given else (0.0 if gloo else NCCL_LAUNCH_LATENCY_S)
        return CommGroup(ranks_per_node=max(per_node.values()), num_nodes=len(per_node), intra=intra,
                         inter=Link(bandwidth=bandwidth, latency=latency, efficiency=efficiency),
                         launch_latency=launch, reduce_scatter_as_all_reduce=gloo)

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


def _example_specs() -> str:
    """Where example specs are: the source tree's ``examples/clusters`` (not in an installed wheel)."""
    here = Path(__file__).resolve().parents[2] / "examples" / "clusters"
    return str(here) if here.is_dir() else "examples/clusters in the whalepy repository; format in docs/cluster_spec.md"


def _read_spec_file(path: str | os.PathLike[str]) -> str:
    examples = _example_specs()
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
