"""Device catalog: one frozen row per accelerator type, each citing its public datasheet.

Units and conventions (docs/cluster_spec.md has the full table):

- FLOP/s are vendor peak numbers for DENSE math: sparsity ("with 2:4 sparsity") figures are halved
  back. ``peak_flops_16`` is the fp16/bf16 tensor-core (matrix-core) peak; ``peak_flops_32`` the plain
  fp32 peak (CUDA cores / vector units, no TF32).
- ``memory_bytes`` reads the vendor's "80 GB" as 80 GiB (80 * 2**30 bytes): GPU memory is built from
  power-of-two devices and ``nvidia-smi`` reports an A100-80GB as 81920 MiB. Usable memory is smaller
  (ECC on GDDR parts, driver and CUDA context): the memory model keeps its own reserve.
- Bandwidths are decimal (1 GB/s = 1e9 bytes/s), as vendors quote them. ``host_link_bandwidth`` is the
  PCIe x16 link to the host per direction, nominal 16 / 32 / 64 GB/s for gen3 / gen4 / gen5; SXM and
  OAM parts talk to the host over PCIe too.
- One row is what one rank drives. An MI250X package holds two GCDs that PyTorch shows as two devices,
  so the "MI250X" row is ONE GCD: half the package's datasheet numbers.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from whalepy.errors import ClusterSpecError
from whalepy.ir.types import GIB


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceType:
    """Peak capabilities of one accelerator type (dense math, no sparsity)."""

    name: str
    """Canonical catalog name, e.g. ``"A100-80GB"``."""
    vendor: str
    """``"nvidia"``, ``"amd"`` or ``"cpu"``."""
    peak_flops_16: float
    """Dense fp16/bf16 tensor-core peak, FLOP/s."""
    peak_flops_32: float
    """Dense fp32 peak (non-tensor-core), FLOP/s."""
    memory_bytes: int
    """Device memory capacity, bytes."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    host_link_bandwidth: float
    """Host link (PCIe) bandwidth per direction, bytes/s."""
    source: str
    """URL of the datasheet the numbers come from."""
    supports_bf16: bool = True
    """Whether the device runs bf16 math (Ampere / CDNA2 and newer, CPUs); False for P100, V100, T4."""

    def __post_init__(self) -> None:
        for field in ("peak_flops_16", "peak_flops_32", "memory_bytes", "memory_bandwidth",
                      "host_link_bandwidth"):
            value = getattr(self, field)
            if not value > 0:
                raise ClusterSpecError(
                    f"device type {self.name!r}: {field} must be positive, got {value!r}; "
                    "give the datasheet value in base units (FLOP/s, bytes, bytes/s)")

    def replace(self, **changes: object) -> DeviceType:
        """A copy with some fields changed (e.g. a custom row derived from a catalog one)."""
        return dataclasses.replace(self, **changes)


_TERA = 1e12
_GBS = 1e9
PCIE3_X16 = 16 * _GBS
"""PCIe 3.0 x16 per direction, nominal (8 GT/s x 16 lanes, 128b/130b: 15.75 GB/s)."""
PCIE4_X16 = 32 * _GBS
"""PCIe 4.0 x16 per direction, nominal (31.5 GB/s)."""
PCIE5_X16 = 64 * _GBS
"""PCIe 5.0 x16 per direction, nominal (63 GB/s)."""


def _row(name: str, vendor: str, tf16: float, tf32: float, mem_gib: float, bw_gbs: float,
         host: float, source: str, bf16: bool = True) -> DeviceType:
    return DeviceType(name=name, vendor=vendor, peak_flops_16=tf16 * _TERA, peak_flops_32=tf32 * _TERA,
                      memory_bytes=int(mem_gib * GIB), memory_bandwidth=bw_gbs * _GBS,
                      host_link_bandwidth=host, source=source, supports_bf16=bf16)


_P100 = "https://images.nvidia.com/content/tesla/pdf/nvidia-tesla-p100-datasheet.pdf"
_V100 = ("https://images.nvidia.com/content/technologies/volta/pdf/"
         "volta-v100-datasheet-update-us-1165301-r5.pdf")
_T4 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
       "t4-tensor-core-datasheet-951643.pdf")
_A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"
_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"

_ROWS = (
    # name, vendor, dense fp16/bf16 TFLOP/s, fp32 TFLOP/s, memory GiB, memory GB/s, host link, source
    # P100 SXM2 has no tensor cores: its fp16 peak is packed half2 math at 2x fp32.
    _row("P100", "nvidia", 21.2, 10.6, 16, 732, PCIE3_X16, _P100, bf16=False),
    # V100 SXM2 rows; the PCIe card runs lower clocks (112 / 14 TFLOP/s).
    _row("V100-16GB", "nvidia", 125, 15.7, 16, 900, PCIE3_X16, _V100, bf16=False),
    _row("V100-32GB", "nvidia", 125, 15.7, 32, 900, PCIE3_X16, _V100, bf16=False),
    # T4 has no bf16; 65 TFLOP/s is its fp16 mixed-precision peak.
    _row("T4", "nvidia", 65, 8.1, 16, 320, PCIE3_X16, _T4, bf16=False),
    _row("A10", "nvidia", 125, 31.2, 24, 600, PCIE4_X16, _A10),
    # A100 SXM rows; the 80GB PCIe card has 1,935 GB/s.
    _row("A100-40GB", "nvidia", 312, 19.5, 40, 1555, PCIE4_X16, _A100),
    _row("A100-80GB", "nvidia", 312, 19.5, 80, 2039, PCIE4_X16, _A100),
    _row("L4", "nvidia", 121, 30.3, 24, 300, PCIE4_X16, "https://www.nvidia.com/en-us/data-center/l4/"),
    _row("L40S", "nvidia", 362.05, 91.6, 48, 864, PCIE4_X16,
         "https://www.nvidia.com/en-us/data-center/l40s/"),
    _row("H100-SXM", "nvidia", 989.4, 67, 80, 3350, PCIE5_X16, _H100),
    _row("H100-PCIe", "nvidia", 756, 51, 80, 2000, PCIE5_X16, _H100),
    # H200 SXM; 141 GB read as GiB overstates nvidia-smi's 143,771 MiB by under 0.5%.
    _row("H200", "nvidia", 989.4, 67, 141, 4800, PCIE5_X16, "https://www.nvidia.com/en-us/data-center/h200/"),
    # One GPU of an HGX B200 board (1,000 W): 4.5 PFLOP/s sparse bf16, 75 TFLOP/s fp32, 180 GB,
    # 7.7 TB/s. The GB200 variant is faster (5 PFLOP/s sparse, 80 TFLOP/s fp32) and is not this row.
    _row("B200", "nvidia", 2250, 75, 180, 7700, PCIE5_X16, "https://www.nvidia.com/en-us/data-center/hgx/"),
    # One GCD of an MI250X (package: 383 TFLOP/s fp16, 47.9 TFLOP/s fp32 vector, 128 GB, 3.2 TB/s).
    _row("MI250X", "amd", 191.5, 23.95, 64, 1638.4, PCIE4_X16,
         "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html"),
    # MI300X: fp32 vector and matrix peaks are both 163.4 TFLOP/s.
    _row("MI300X", "amd", 1307.4, 163.4, 192, 5300, PCIE5_X16,
         "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
         "amd-instinct-mi300x-data-sheet.pdf"),
    # Pseudo-type for CPU-only runs (gloo). NOMINAL numbers, not a measurement of any CPU: about a
    # few cores of AVX2 fp32, dual-channel DDR4, and a memcpy-speed "host link". Plans made for it
    # are for testing the pipeline end to end, never for predicting real speed.
    _row("CPU", "cpu", 0.1, 0.1, 16, 20, 10 * _GBS, "https://pytorch.org/docs/stable/distributed.html"),
)

CATALOG: dict[str, DeviceType] = {row.name: row for row in _ROWS}
"""Every built-in device type by canonical name."""

ALIASES: dict[str, str] = {
    "h100": "H100-SXM",
    "h100-80gb": "H100-SXM",
    "h100-pcie-80gb": "H100-PCIe",
    "p100-16gb": "P100",
    "h200-141gb": "H200",
    "b200-180gb": "B200",
    "mi300x-192gb": "MI300X",
}
"""Lower-case extra names. "A100" and "V100" are deliberately NOT aliases: the two memory sizes plan
differently, so the user must say which."""

_AMBIGUOUS: dict[str, tuple[str, ...]] = {
    "a100": ("A100-40GB", "A100-80GB"),
    "v100": ("V100-16GB", "V100-32GB"),
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def closest_device_names(name: str, names: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` names from ``names`` that look like ``name`` (case-insensitive)."""
    key = _norm(name)
    by_norm = {_norm(candidate): candidate for candidate in names}
    hits = [by_norm[h] for h in difflib.get_close_matches(key, list(by_norm), n=n, cutoff=0.5)]
    prefixed = [c for norm, c in by_norm.items() if key and norm.startswith(key)]
    return list(dict.fromkeys(hits + prefixed))[:n]


def ambiguous_device_options(name: str) -> tuple[str, ...]:
    """The catalog names ``name`` could mean when it is ambiguous (``"V100"``), else ``()``."""
    return _AMBIGUOUS.get(_norm(name), ())


def resolve_device_type(name: str, custom: Mapping[str, DeviceType] | None = None) -> DeviceType:
    """The device type called ``name``: a custom type first, then the catalog, then an alias.

    Matching ignores case and treats ``_`` and spaces as ``-``. Raises :class:`ClusterSpecError` for
    an unknown or ambiguous name, suggesting the closest known names.
    """
    custom = custom or {}
    key = _norm(name)
    for table in (custom, CATALOG):
        for candidate, row in table.items():
            if _norm(candidate) == key:
                return row
    if key in ALIASES:
        return CATALOG[ALIASES[key]]
    if key in _AMBIGUOUS:
        options = " or ".join(repr(o) for o in _AMBIGUOUS[key])
        raise ClusterSpecError(
            f"GPU type {name!r} is ambiguous: it comes in several memory sizes; write {options}")
    close = closest_device_names(name, list(custom) + list(CATALOG))
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ClusterSpecError(
        f"unknown GPU type {name!r}: {hint}Known types: {', '.join(CATALOG)}. To use another GPU, "
        "define it under 'devices:' in the cluster spec (peak_tflops_16, peak_tflops_32, memory_gb, "
        "memory_bandwidth_gbs, host_link_gbs)")


def match_device_name(reported: str, total_memory_bytes: int | None = None) -> DeviceType | None:
    """The catalog row for a name as ``torch.cuda.get_device_name`` reports it, or ``None``.

    E.g. ``"NVIDIA A100-SXM4-80GB"``, ``"Tesla V100-SXM2-32GB"``, ``"NVIDIA H100 80GB HBM3"``,
    ``"AMD Instinct MI250X"``. Where a product comes in two memory sizes, ``total_memory_bytes``
    (``torch.cuda.get_device_properties(i).total_memory``) picks the size when the name does not.
    """
    tokens = "".join(c if c.isalnum() else " " for c in reported.upper()).split()
    mem_gib = (total_memory_bytes or 0) / GIB
    if "NVL" in tokens:  # H100 NVL: 94 GB and its own clocks, not in the catalog
        return None
    if "MI300X" in tokens:
        return CATALOG["MI300X"]
    if "MI250X" in tokens:  # ROCm may report "AMD Instinct MI250X/MI250"; a plain MI250 is slower
        return CATALOG["MI250X"]
    if "B200" in tokens:
        return CATALOG["B200"]
    if "H200" in tokens:
        return CATALOG["H200"]
    if "H100" in tokens:
        return CATALOG["H100-PCIe" if "PCIE" in tokens else "H100-SXM"]
    if "A100" in tokens:
        big = "80GB" in tokens or ("40GB" not in tokens and mem_gib > 48)
        return CATALOG["A100-80GB" if big else "A100-40GB"]
    if "V100" in tokens or "V100S" in tokens:
        big = "32GB" in tokens or ("16GB" not in tokens and mem_gib > 20)
        return CATALOG["V100-32GB" if big else "V100-16GB"]
    if "P100" in tokens:
        return CATALOG["P100"]
    for simple in ("L40S", "L4", "A10", "T4"):
        if simple in tokens:
            return CATALOG[simple]
    return None
