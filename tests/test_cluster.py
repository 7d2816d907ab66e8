"""ClusterSpec: parsing, round trips, rank placement, communication groups and error messages."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from whalepy.errors import ClusterSpecError
from whalepy.hardware.cluster import (
    DEFAULT_NETWORK_LATENCY_S,
    ClusterSpec,
    LinkKind,
    NodeGroup,
)
from whalepy.cost_models.devices import CATALOG

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "clusters").glob("*.yaml"))
GIB = 2**30


def mixed() -> dict[str, Any]:
    """2 A100 nodes (NVSwitch, 800 Gb/s) + 2 V100 nodes (NVLink2, 400 Gb/s), 200 Gb/s between groups."""
    return {
        "network": {"bandwidth_gbps": 200, "latency_us": 12},
        "devices": {"MyGPU": {"peak_tflops_16": 100, "peak_tflops_32": 20, "memory_gb": 24,
                              "memory_bandwidth_gbs": 900, "host_link_gbs": 32}},
        "groups": [
            {"name": "a100s", "gpu": "A100-80GB", "gpus_per_node": 8, "nodes": 2, "intra_node": "nvswitch",
             "cpu_memory_gb": 1024, "nvme": {"capacity_tb": 3.8, "read_gbs": 6.8, "write_gbs": 4.0},
             "network": {"bandwidth_gbps": 800}},
            {"name": "v100s", "gpu": "v100-32gb", "gpus_per_node": 8, "nodes": 2, "intra_node": "nvlink2",
             "network": {"bandwidth_gbps": 400, "latency_us": 5}},
            {"name": "mine", "gpu": "MyGPU", "gpus_per_node": 2, "nodes": 1,
             "intra_node": {"bandwidth_gbs": 50, "latency_us": 3}},
        ],
    }


def raises(data: dict[str, Any], *fragments: str) -> str:
    with pytest.raises(ClusterSpecError) as err:
        ClusterSpec.from_dict(data)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ---- parsing and units -------------------------------------------------------------------------

def test_units_are_converted_to_bytes_and_seconds() -> None:
    spec = ClusterSpec.from_dict(mixed())
    a100, v100, mine = spec.groups
    assert a100.device is CATALOG["A100-80GB"] and a100.intra_link is LinkKind.NVSWITCH
    assert a100.intra_bandwidth == 300e9  # NVLink3 per GPU per direction
    assert a100.network_bandwidth == 800e9 / 8 and a100.network_latency == pytest.approx(12e-6)
    assert a100.cpu_memory_bytes == 1024 * GIB
    assert a100.nvme is not None and a100.nvme.capacity_bytes == 3.8e12
    assert a100.nvme.read_bandwidth == 6.8e9
    assert v100.gpu == "v100-32gb" and v100.device is CATALOG["V100-32GB"]
    assert v100.network_latency == pytest.approx(5e-6)
    assert mine.device.name == "MyGPU" and mine.device.peak_flops_16 == 100e12
    assert mine.intra_link is None and mine.intra_bandwidth == 50e9
    assert mine.network_bandwidth == 200e9 / 8  # the top-level default
    assert spec.inter_group_bandwidth == 25e9


def test_counts_and_types() -> None:
    spec = ClusterSpec.from_dict(mixed())
    assert spec.world_size == 34 and spec.num_nodes == 5
    assert spec.num_devices_by_type() == {"A100-80GB": 16, "V100-32GB": 16, "MyGPU": 2}
    assert [d.name for d in spec.device_types] == ["A100-80GB", "V100-32GB", "MyGPU"]
    assert spec.rank_device_type(0).name == "A100-80GB"
    assert spec.rank_device_type(16).name == "V100-32GB"
    assert spec.rank_device_type(33).name == "MyGPU"


def test_default_network_latency() -> None:
    data = mixed()
    del data["network"]["latency_us"]
    assert ClusterSpec.from_dict(data).groups[0].network_latency == DEFAULT_NETWORK_LATENCY_S


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_files_load_and_round_trip(path: Path) -> None:
    spec = ClusterSpec.from_yaml(path)
    assert spec.world_size >= 4
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_example_sizes() -> None:
    sizes = {p.stem: ClusterSpec.from_yaml(p).world_size for p in EXAMPLES}
    assert sizes["a100_512x8"] == 4096 and sizes["a100_128x8"] == 1024 and sizes["h100_8x8"] == 64
    assert sizes["mixed_a100_l40s_70b"] == 64 and sizes["mixed_h100_a10"] == 16
    assert sizes["cpu4"] == 4 and sizes["cpu_mixed_sim"] == 4


def test_simulated_groups_run_on_cpu() -> None:
    sim = ClusterSpec.load(next(p for p in EXAMPLES if p.stem == "cpu_mixed_sim"))
    assert all(g.simulated and g.runs_on_cpu for g in sim.groups)
    assert sim.num_devices_by_type() == {"V100-32GB": 2, "T4": 2}
    cpu = ClusterSpec.load(next(p for p in EXAMPLES if p.stem == "cpu4"))
    assert cpu.groups[0].runs_on_cpu and not cpu.groups[0].simulated


def test_round_trip_through_yaml_and_json(tmp_path: Path) -> None:
    import yaml

    spec = ClusterSpec.from_dict({**mixed(), "rank_map": ["mine"] * 2 + ["v100s"] * 16 + ["a100s"] * 16})
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    (tmp_path / "c.json").write_text(json.dumps(spec.to_dict()))
    assert ClusterSpec.from_yaml(tmp_path / "c.yaml") == spec
    assert ClusterSpec.from_json(tmp_path / "c.json") == spec
    assert ClusterSpec.load(tmp_path / "c.json") == spec


def test_round_trip_of_programmatic_spec() -> None:
    group = NodeGroup.build(name="g", gpu="H100", gpus_per_node=4, num_nodes=3, intra_link="nvlink4",
                            intra_bandwidth=123.456e9, network_bandwidth=1.23456789e10,
                            network_latency=7.77e-6)
    spec = ClusterSpec(groups=(group,), inter_group_latency=1e-5)
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


def test_fingerprint_is_stable_and_sensitive() -> None:
    a, b = ClusterSpec.from_dict(mixed()), ClusterSpec.from_dict(mixed())
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    other = mixed()
    other["groups"][0]["nodes"] = 3
    assert ClusterSpec.from_dict(other).fingerprint() != a.fingerprint()


def test_str_is_a_readable_table() -> None:
    text = str(ClusterSpec.from_dict(mixed()))
    for fragment in ("a100s", "A100-80GB", "2 x 8", "nvswitch", "800 Gb/s", "80 GiB", "MyGPU"):
        assert fragment in text


def test_local_on_this_machine() -> None:
    spec = ClusterSpec.local()
    assert spec.world_size >= 1 and spec.num_nodes == 1
    if spec.groups[0].device.vendor == "cpu":
        four = ClusterSpec.local(4)
        assert four.world_size == 4 and four.groups[0].runs_on_cpu
        assert four.groups[0].intra_link is LinkKind.SHM
        sim = ClusterSpec.local(2, device_type="T4")
        assert sim.groups[0].simulated and sim.rank_device_type(1) is CATALOG["T4"]
        custom = CATALOG["CPU"].replace(name="BigCPU", memory_bytes=64 * GIB)
        assert ClusterSpec.local(2, device_type=custom).rank_device_type(0) is custom
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


# ---- ranks and communication groups -------------------------------------------------------------

def test_rank_devices_default_order() -> None:
    ranks = ClusterSpec.from_dict(mixed()).rank_devices()
    assert [(r.group, r.node, r.local_rank) for r in ranks[7:10]] == [
        ("a100s", 0, 7), ("a100s", 1, 0), ("a100s", 1, 1)]
    assert ranks[16].group == "v100s" and ranks[16].node == 2 and ranks[33].node == 4


def test_rank_map_interleaves_groups() -> None:
    data = {"network": {"bandwidth_gbps": 100},
            "groups": [{"name": "v", "gpu": "V100-32GB", "gpus_per_node": 2, "intra_node": "nvlink2"},
                       {"name": "t", "gpu": "T4", "gpus_per_node": 2, "intra_node": "pcie3"}],
            "rank_map": ["v", "t", "v", "t"]}
    spec = ClusterSpec.from_dict(data)
    assert [(r.group, r.node, r.local_rank) for r in spec.rank_devices()] == [
        ("v", 0, 0), ("t", 1, 0), ("v", 0, 1), ("t", 1, 1)]
    assert spec.comm_group([0, 2]).num_nodes == 1 and spec.comm_group([0, 2]).ranks_per_node == 2
    assert spec.comm_group([0, 1]).num_nodes == 2


def test_comm_group_inside_one_node() -> None:
    spec = ClusterSpec.from_dict(mixed())
    group = spec.comm_group(range(8))
    assert (group.ranks_per_node, group.num_nodes, group.size) == (8, 1, 8)
    assert group.intra.bandwidth == 300e9


def test_comm_group_across_nodes_of_one_group() -> None:
    spec = ClusterSpec.from_dict(mixed())
    group = spec.comm_group([0, 1, 8, 9])
    assert (group.ranks_per_node, group.num_nodes) == (2, 2)
    assert group.inter.bandwidth == 100e9  # 800 Gb/s per node
    assert group.inter.bandwidth < group.intra.bandwidth


def test_comm_group_across_groups_takes_the_slower_links() -> None:
    spec = ClusterSpec.from_dict(mixed())
    group = spec.comm_group([0, 1, 16, 17, 24])
    assert (group.ranks_per_node, group.num_nodes) == (2, 3)
    assert group.intra.bandwidth == 150e9  # V100's NVLink2, not A100's NVLink3
    assert group.inter.bandwidth == 25e9  # capped by the 200 Gb/s between groups
    assert group.inter.latency == pytest.approx(12e-6)
    # Without a top-level network the slower group's network (400 Gb/s) is the path.
    data = mixed()
    del data["network"]
    data["groups"][2]["network"] = {"bandwidth_gbps": 400}
    assert ClusterSpec.from_dict(data).comm_group([0, 16]).inter.bandwidth == 50e9


def test_comm_group_rejects_bad_ranks() -> None:
    spec = ClusterSpec.from_dict(mixed())
    with pytest.raises(ClusterSpecError, match="34"):
        spec.comm_group([0, 34])
    with pytest.raises(ClusterSpecError, match="repeat"):
        spec.comm_group([1, 1])


# ---- errors: cause and fix in one line ----------------------------------------------------------

def test_unknown_gpu_suggests_closest_name() -> None:
    data = mixed()
    data["groups"][0]["gpu"] = "A100-80G"
    raises(data, "'a100s'", "'A100-80G'", "A100-80GB", "devices:")


@pytest.mark.parametrize("key, value", [("nodes", 0), ("gpus_per_node", -1), ("gpus_per_node", 2.5),
                                        ("nodes", True)])
def test_non_positive_counts(key: str, value: object) -> None:
    data = mixed()
    data["groups"][1][key] = value
    raises(data, "'v100s'", key, repr(value))


def test_multi_node_without_network() -> None:
    data = mixed()
    del data["network"]
    raises(data, "'mine'", "network", "bandwidth_gbps")
    single = {"groups": [{"name": "g", "gpu": "T4", "gpus_per_node": 1, "nodes": 2}]}
    raises(single, "'g'", "2 nodes", "bandwidth_gbps")


def test_intra_link_problems() -> None:
    data = mixed()
    data["groups"][2]["intra_node"] = {"latency_us": 3}
    raises(data, "'mine'", "intra_node", "bandwidth_gbs")
    data["groups"][2]["intra_node"] = "nvlnk3"
    raises(data, "'nvlnk3'", "nvlink3")
    data["groups"][2]["intra_node"] = "nvswitch"
    raises(data, "'nvswitch'", "MyGPU", "bandwidth_gbs")
    del data["groups"][2]["intra_node"]
    raises(data, "'mine'", "2 GPUs per node", "intra_node")


def test_custom_device_problems() -> None:
    data = mixed()
    del data["devices"]["MyGPU"]["memory_gb"]
    raises(data, "'MyGPU'", "memory_gb")
    data = mixed()
    data["devices"]["MyGPU"]["peak_tflops_16"] = 0
    raises(data, "'MyGPU'", "peak_tflops_16", "0")
    data = mixed()
    data["devices"]["T4"] = data["devices"]["MyGPU"]
    raises(data, "'T4'", "shadows", "rename")


@pytest.mark.parametrize("where, bad, suggestion", [
    ("top", "group", "groups"), ("group", "gpus_per_nod", "gpus_per_node"),
    ("network", "bandwith_gbps", "bandwidth_gbps"), ("device", "memory_gbs", "memory_gb"),
])
def test_unknown_keys_suggest_closest(where: str, bad: str, suggestion: str) -> None:
    data = mixed()
    target = {"top": data, "group": data["groups"][0], "network": data["groups"][0]["network"],
              "device": data["devices"]["MyGPU"]}[where]
    target[bad] = target.pop(suggestion) if suggestion in target else 1
    raises(data, repr(bad), repr(suggestion))


def test_duplicate_group_names() -> None:
    data = mixed()
    data["groups"][1]["name"] = "a100s"
    raises(data, "duplicate", "'a100s'", "unique")


def test_rank_map_problems() -> None:
    data = mixed()
    data["rank_map"] = ["a100s"] * 16 + ["v100z"] * 16 + ["mine"] * 2
    raises(data, "'v100z'", "'v100s'")
    data["rank_map"] = ["a100s"] * 16 + ["v100s"] * 16
    raises(data, "32", "34")
    data["rank_map"] = ["a100s"] * 17 + ["v100s"] * 15 + ["mine"] * 2
    raises(data, "'a100s'", "17", "16")


def test_missing_groups_and_gpu() -> None:
    raises({"network": {"bandwidth_gbps": 100}}, "groups")
    raises({"groups": [{"gpus_per_node": 1}]}, "groups[0]", "'gpu'")
    raises({"groups": [{"gpu": "T4"}]}, "'T4'", "gpus_per_node")


def test_yaml_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: [\n")
    with pytest.raises(ClusterSpecError, match="not valid YAML"):
        ClusterSpec.from_yaml(bad)
    bad.write_text("groups:\n  - {gpu: A100-80G, gpus_per_node: 8}\n")
    with pytest.raises(ClusterSpecError, match=r"bad\.yaml.*A100-80GB"):
        ClusterSpec.from_yaml(bad)
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ClusterSpecError, match="pip install pyyaml"):
        ClusterSpec.from_yaml(bad)


def test_spec_is_not_mutated_by_parsing() -> None:
    data = mixed()
    before = copy.deepcopy(data)
    ClusterSpec.from_dict(data)
    assert data == before


def test_missing_spec_file_is_a_cluster_spec_error(tmp_path):
    with pytest.raises(ClusterSpecError, match=r"cannot read cluster spec .*nope\.yaml"):
        ClusterSpec.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ClusterSpecError, match=r"cannot read cluster spec .*nope\.json") as e:
        ClusterSpec.load(tmp_path / "nope.json")
    # the examples it points to exist (the hint named whalepy/examples/clusters after the package re-layout)
    shown = Path(str(e.value).split("(examples: ")[1].rstrip(")"))
    assert shown.is_dir() and (shown / "cpu4.yaml").is_file()


def test_a_measured_call_latency_is_charged_once_per_call():
    """``intra_node: {call_latency_us: L}`` round-trips through the spec and is added once to each
    call that moves data, a send/recv included (a pipeline's message is a call like a collective), as
    NCCL's baseLat is on GPUs."""
    from whalepy.cost_models.communication import Collective, estimate_collective_time

    def spec(**link):
        return ClusterSpec.from_dict({"groups": [{"name": "cpu", "gpu": "CPU", "gpus_per_node": 2,
                                                  "intra_node": {"bandwidth_gbs": 1.5, "latency_us": 300, **link}}]})

    measured, plain = spec(call_latency_us=2000), spec()
    assert ClusterSpec.from_dict(measured.to_dict()) == measured
    assert measured.to_dict()["groups"][0]["intra_node"]["call_latency_us"] == 2000
    assert "call_latency_us" not in plain.to_dict()["groups"][0]["intra_node"]
    g, g0 = measured.comm_group([0, 1]), plain.comm_group([0, 1])
    assert g.launch_latency == pytest.approx(2e-3) and g0.launch_latency == 0.0
    for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        assert estimate_collective_time(kind, 1 << 20, g) - estimate_collective_time(kind, 1 << 20, g0) \
            == pytest.approx(2e-3)
    assert estimate_collective_time(Collective.SEND_RECV, 1 << 20, g) - estimate_collective_time(
        Collective.SEND_RECV, 1 << 20, g0) == pytest.approx(2e-3)
    with pytest.raises(ClusterSpecError, match="call_latency"):
        spec(call_latency_us=-1)
