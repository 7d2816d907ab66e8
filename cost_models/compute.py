"""Compute time of a kernel or a block on one device type: a roofline with named efficiencies.

A piece of work that does ``flops`` floating-point operations and moves ``bytes_moved`` bytes through
device memory takes at least ``flops / achievable_flops`` and at least ``bytes / achievable_bandwidth``;
the roofline model (Williams, Waterman & Patterson, "Roofline: an insightful visual performance model
for multicore architectures", CACM 2009) takes the larger of the two. The achievable rates are the
datasheet peaks of a :class:`~whalepy.cost_models.devices.DeviceType` times the efficiency constants
below; a calibration run may pass a measured efficiency instead. Formulas and sources are collected in
docs/cost_model.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .devices import DeviceType

MATMUL_EFFICIENCY = 0.6
"""Fraction of the dense tensor-core peak that training reaches while it computes.

Evidence: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21) sustain 163 TFLOP/s per A100 (52% of the 312 TFLOP/s bf16 peak) end to end on a
1T-parameter GPT, and Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (MLSys'23) report 54.2% model FLOPs utilisation for a 530B GPT. Those end-to-end figures
include pipeline bubbles and exposed communication, which whalepy charges separately, so the rate
while computing is somewhat higher. It stays below what cuBLAS commonly reaches on isolated large
GEMMs (about 70-80% of peak) because a transformer block also runs smaller GEMMs, attention and
memory-bound element-wise kernels; 0.6 sits between the two. It covers everything a block does on
the device: GEMMs, attention, norms, activations and kernel launch gaps.
"""

MEMORY_BANDWIDTH_EFFICIENCY = 0.8
"""Fraction of the datasheet memory bandwidth that streaming kernels reach.

STREAM-style benchmarks on data-centre GPUs (Deakin et al., "Evaluating attainable memory bandwidth of
parallel programming models via BabelStream", 2018, and later BabelStream results for A100/H100) reach
about 80-90% of the datasheet figure; framework element-wise kernels sit at the lower end.
"""

BACKWARD_TO_FORWARD_RATIO = 2.0
"""Backward work relative to forward, for FLOPs and for bytes moved, when no measurement is given.

The backward of a matmul ``Y = X W`` computes two matmuls of the forward's size (``dX = dY W^T`` and
``dW = X^T dY``), so backward FLOPs are twice forward FLOPs (Narayanan et al., SC'21, Appendix; Kaplan
et al., "Scaling Laws for Neural Language Models", 2020). The same two products read and write about
twice the operands, which is why the default uses the same ratio for bytes.
"""


class Precision(str, enum.Enum):
    """Number format of the math; selects which peak of the device row applies."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"


def precision_bytes(precision: Precision | str) -> int:
    """Bytes per element of activations and communicated tensors trained in ``precision``."""
    return 4 if Precision(precision) is Precision.FP32 else 2


def peak_flops(device: DeviceType, precision: Precision | str) -> float:
    """Datasheet peak FLOP/s of ``device`` for ``precision`` (fp16/bf16 tensor cores, or fp32)."""
    precision = Precision(precision)
    if precision in (Precision.FP16, Precision.BF16):
        return device.peak_flops_16
    if precision is Precision.FP32:
        return device.peak_flops_32
    raise ValueError(f"no peak FLOP/s is known for precision {precision!r}")  # pragma: no cover


def estimate_compute_time(
    *,
    flops: float,
    bytes_moved: float,
    device: DeviceType,
    precision: Precision | str = Precision.BF16,
    efficiency: float | None = None,
) -> float:
    """Seconds for ``flops`` operations moving ``bytes_moved`` bytes on one ``device``.

    Roofline: ``max(flops / (peak * efficiency), bytes / (bandwidth * MEMORY_BANDWIDTH_EFFICIENCY))``.
    ``efficiency`` overrides :data:`MATMUL_EFFICIENCY`, e.g. with a value measured by calibration.
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops ({flops}) and bytes_moved ({bytes_moved}) must be non-negative")
    eff = MATMUL_EFFICIENCY if efficiency is None else efficiency
    if not 0.0 < eff <= 1.0:
        raise ValueError(f"efficiency must be in (0, 1], got {eff}")
    peak = peak_flops(device, precision)
    if peak <= 0 or device.memory_bandwidth <= 0:
        raise ValueError(
            f"device {device.name!r} has peak {peak} FLOP/s and bandwidth {device.memory_bandwidth} B/s; "
            "both must be positive"
        )
    math_s = flops / (peak * eff)
    memory_s = bytes_moved / (device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)
    return max(math_s, memory_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockTime:
    """Time of one block for one micro-batch, split by phase."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    """Second forward run in backward when the block is checkpointed; 0 otherwise."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s


def estimate_block_time(
    *,
    forward_flops: float,
    forward_bytes: float,
    device: DeviceType,
    backward_flops: float | None = None,
    backward_bytes: float | None = None,
    recompute: bool = False,
    precision: Precision | str = Precision.BF16,
    efficiency: float | None = None,
) -> BlockTime:
    """Forward, backward and recompute time of one block for one micro-batch.

    Backward figures default to :data:`BACKWARD_TO_FORWARD_RATIO` times the forward ones. A
    checkpointed block (``recompute=True``) runs its forward a second time inside backward (Chen et al.,
    "Training Deep Nets with Sublinear Memory Cost", 2016), so ``recompute_s`` equals ``forward_s``.
    """
    if backward_flops is None:
        backward_flops = BACKWARD_TO_FORWARD_RATIO * forward_flops
    if backward_bytes is None:
        backward_bytes = BACKWARD_TO_FORWARD_RATIO * forward_bytes
    common = dict(device=device, precision=precision, efficiency=efficiency)
    forward_s = estimate_compute_time(flops=forward_flops, bytes_moved=forward_bytes, **common)
    backward_s = estimate_compute_time(flops=backward_flops, bytes_moved=backward_bytes, **common)
    return BlockTime(forward_s=forward_s, backward_s=backward_s, recompute_s=forward_s if recompute else 0.0)
