"""The memory margin: device memory the planner leaves unplanned (``PlannerOptions.memory_margin``),
beside what the cost model reserves (:func:`whalepy.planner.runtime_costs.usable_device_bytes`).
Light on imports: the CLI and the options parse it before any capture."""

from __future__ import annotations

from dataclasses import dataclass

from whalepy.errors import PlanError

__all__ = ["DEFAULT_MEMORY_MARGIN", "MemoryMargin", "parse_memory_margin"]

DEFAULT_MEMORY_MARGIN = 0.05
"""NAMED CONSTANT: the share of each device's memory the planner leaves unplanned by default
(``PlannerOptions.memory_margin``), beside the reserve: room for the memory model's own error. Argued in
docs/cost_model.md ("Margin"): the largest peak the model under-predicts on a GPU (HF Llama 1.2B on one
H200, 3.9 GiB, 11%) is 4.9% of an 80 GiB device."""


@dataclass(frozen=True, slots=True)
class MemoryMargin:
    """Device memory left unplanned (``PlannerOptions.memory_margin``): a share of each device's memory,
    or a fixed amount per device in GiB (exactly one of the two is non-zero, or neither)."""

    fraction: float = 0.0
    gib: float = 0.0

    def bytes_for(self, memory_bytes: float) -> float:
        """The margin of a device with ``memory_bytes`` of memory."""
        return self.fraction * memory_bytes + self.gib * 2**30

    def __str__(self) -> str:
        return f"{self.gib:g} GiB" if self.gib else f"{100 * self.fraction:g}%"


def parse_memory_margin(value: object, where: str = "memory_margin") -> MemoryMargin:
    """``value`` as a :class:`MemoryMargin`: a fraction in [0, 1) (``0.05``), a percentage (``"5%"``)
    or GiB per device (``"4GiB"``, ``"4 GiB"``); anything else is a :class:`~whalepy.PlanError`."""
    if isinstance(value, MemoryMargin):
        return value
    fix = (f"{where}: give a fraction of each device's memory in [0, 1) (e.g. 0.05), a percentage (e.g. '5%') "
           "or GiB per device (e.g. '4GiB'); 0 plans to the usable limit")
    text = value.strip().lower().replace(" ", "") if isinstance(value, str) else None
    try:
        if text is not None and text.endswith("%"):
            m = MemoryMargin(fraction=float(text[:-1]) / 100)
        elif text is not None and text.endswith("gib"):
            m = MemoryMargin(gib=float(text[:-3]))
        elif not isinstance(value, bool) and isinstance(value, (int, float)):
            m = MemoryMargin(fraction=float(value))
        else:
            raise ValueError
    except ValueError:
        raise PlanError(f"{where}={value!r} is not a memory margin; {fix}") from None
    if not (0 <= m.fraction < 1) or not (0 <= m.gib < float("inf")):
        raise PlanError(f"{where}={value!r} is out of range; {fix}")
    return m
