"""The device catalog: every row complete and cited, names resolve, typos get a useful message."""

from __future__ import annotations

import pytest

from whalepy.errors import ClusterSpecError
from whalepy.cost_models.devices import (
    ALIASES,
    CATALOG,
    DeviceType,
    match_device_name,
    resolve_device_type,
)

REQUIRED = ("P100", "V100-16GB", "V100-32GB", "T4", "A10", "A100-40GB", "A100-80GB", "L4", "L40S",
            "H100-SXM", "H100-PCIe", "H200", "B200", "MI250X", "MI300X", "CPU")
GIB = 2**30


def test_catalog_has_every_required_type() -> None:
    assert set(REQUIRED) <= set(CATALOG)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_row_is_complete_and_cited(name: str) -> None:
    row = CATALOG[name]
    assert row.name == name
    assert row.vendor in ("nvidia", "amd", "cpu")
    for field in ("peak_flops_16", "peak_flops_32", "memory_bytes", "memory_bandwidth",
                  "host_link_bandwidth"):
        assert getattr(row, field) > 0, field
    assert row.peak_flops_16 >= row.peak_flops_32
    assert isinstance(row.memory_bytes, int)
    assert row.source.startswith("https://")


def test_datasheet_spot_checks() -> None:
    # Dense (no sparsity) numbers from the vendor datasheets cited in the rows.
    assert CATALOG["A100-80GB"].peak_flops_16 == pytest.approx(312e12)
    assert CATALOG["A100-80GB"].peak_flops_32 == pytest.approx(19.5e12)
    assert CATALOG["A100-80GB"].memory_bytes == 80 * GIB
    assert CATALOG["H100-SXM"].peak_flops_16 == pytest.approx(989.4e12)
    assert CATALOG["V100-32GB"].peak_flops_16 == pytest.approx(125e12)
    assert CATALOG["B200"].peak_flops_16 == pytest.approx(2.25e15)
    assert CATALOG["MI300X"].memory_bytes == 192 * GIB


def test_generations_are_ordered() -> None:
    flops = [CATALOG[n].peak_flops_16 for n in ("P100", "V100-32GB", "A100-80GB", "H100-SXM", "B200")]
    assert flops == sorted(flops)
    assert CATALOG["A100-80GB"].memory_bytes > CATALOG["A100-40GB"].memory_bytes
    assert CATALOG["H100-SXM"].memory_bandwidth > CATALOG["H100-PCIe"].memory_bandwidth
    # SXM parts still reach the host over PCIe: gen3 for Volta, gen5 for Hopper.
    assert CATALOG["V100-32GB"].host_link_bandwidth < CATALOG["A100-80GB"].host_link_bandwidth
    assert CATALOG["A100-80GB"].host_link_bandwidth < CATALOG["H100-SXM"].host_link_bandwidth


def test_resolve_is_case_insensitive_and_knows_aliases() -> None:
    assert resolve_device_type("a100-80gb") is CATALOG["A100-80GB"]
    assert resolve_device_type("h100_pcie") is CATALOG["H100-PCIe"]
    assert resolve_device_type("H100") is CATALOG["H100-SXM"]
    for alias, target in ALIASES.items():
        assert resolve_device_type(alias) is CATALOG[target]


def test_custom_type_resolves_first() -> None:
    mine = CATALOG["T4"].replace(name="MyGPU", source="https://example.com/mygpu")
    assert resolve_device_type("mygpu", {"MyGPU": mine}) is mine


def test_unknown_name_suggests_closest_and_how_to_define_one() -> None:
    with pytest.raises(ClusterSpecError) as err:
        resolve_device_type("A100-80G")
    message = str(err.value)
    assert "'A100-80G'" in message and "A100-80GB" in message and "devices:" in message


@pytest.mark.parametrize("name, options", [("A100", ("A100-40GB", "A100-80GB")),
                                           ("v100", ("V100-16GB", "V100-32GB"))])
def test_ambiguous_name_lists_the_sizes(name: str, options: tuple[str, ...]) -> None:
    with pytest.raises(ClusterSpecError, match="ambiguous") as err:
        resolve_device_type(name)
    assert all(o in str(err.value) for o in options)


@pytest.mark.parametrize("reported, memory_gib, expected", [
    ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", 80, "A100-80GB"),
    ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
    ("Tesla V100-SXM2-16GB", 16, "V100-16GB"),
    ("Tesla P100-SXM2-16GB", 16, "P100"),
    ("Tesla T4", 15, "T4"),
    ("NVIDIA A10", 22, "A10"),
    ("NVIDIA L4", 22, "L4"),
    ("NVIDIA L40S", 45, "L40S"),
    ("NVIDIA H100 80GB HBM3", 79, "H100-SXM"),
    ("NVIDIA H100 PCIe", 79, "H100-PCIe"),
    ("NVIDIA H200", 140, "H200"),
    ("NVIDIA B200", 179, "B200"),
    ("AMD Instinct MI250X", 64, "MI250X"),
    ("AMD Instinct MI300X", 192, "MI300X"),
])
def test_match_reported_device_names(reported: str, memory_gib: int, expected: str) -> None:
    assert match_device_name(reported, memory_gib * GIB) is CATALOG[expected]


def test_unmatched_reported_name_is_none() -> None:
    assert match_device_name("NVIDIA GeForce RTX 4090") is None
    assert match_device_name("NVIDIA H100 NVL") is None  # 94 GB part, not the SXM row


def test_device_type_rejects_non_positive_numbers() -> None:
    with pytest.raises(ClusterSpecError, match="memory_bandwidth.*-1"):
        CATALOG["T4"].replace(name="Broken", memory_bandwidth=-1.0)
    with pytest.raises(ClusterSpecError, match="peak_flops_16"):
        DeviceType(name="Zero", vendor="nvidia", peak_flops_16=0.0, peak_flops_32=1.0, memory_bytes=1,
                   memory_bandwidth=1.0, host_link_bandwidth=1.0, source="https://example.com")
