"""Device catalog: one frozen row per accelerator type, each citing its public datasheet.

Filled in by the catalog work (see CATALOG below); the dataclass is the contract every cost model uses.
"""

from __future__ import annotations

from dataclasses import dataclass


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
