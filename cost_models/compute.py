"""Compute time on one device type: GEMMs by their shape, fused attention, memory-bound kernels, and
the host-side launch cost of eager PyTorch.

The model (docs/cost_model.md, "Compute", has the derivation, the fit and its residuals):

- **GEMM** ``[batch x] (m x k) @ (k x n)``: a grid of output tiles ``Tm x Tn`` runs in waves over the
  device's ``S`` streaming multiprocessors; one tile costs ``2 Tm Tn (k + k0)`` FLOPs of time at
  ``e`` times the per-SM peak, so
  ``t_math = ceil(tiles / S) * S * 2 Tm Tn (k + k0) / (peak * e)`` (the better of the two tile
  orientations), where ``tiles = batch * ceil(m / Tm) * ceil(n / Tn)``. That captures wave and tile
  quantisation (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning Performance
  Documentation) and the fixed per-tile cost that makes short reductions slow. The memory side is the
  roofline's ``(mk + kn + mn) * bytes / bandwidth`` (Williams et al., CACM 2009): below the device's
  ridge point the GEMM is bandwidth-bound. ``e`` and ``k0`` are fitted to calibration measurements
  (:func:`fit_gemm`); ``Tm x Tn`` = 128 x 256 is the largest tile cuBLAS/CUTLASS use for 16-bit math.
- **Attention** (``scaled_dot_product_attention``, flash kernel): ``4 B L S d`` FLOPs forward, halved
  when causal (the kernel skips masked tiles), ``2.5x`` that backward (the kernel recomputes
  ``Q K^T``), at the profile's ``attention_efficiency`` of peak.
- **Memory-bound kernels** (norms, activations, element-wise, copies): bytes / measured bandwidth,
  :data:`MEMORY_BOUND_BACKWARD_RATIO` times the forward bytes in backward.
- **Launch cost**: eager PyTorch launches kernels from the host; when they are small the host, not the
  device, sets the pace. A block's forward (backward) takes ``max(device time, launches * launch_cost)``.

The device's figures come from a :class:`~whalepy.cost_models.device_profiles.ComputeProfile`
(calibrated, shipped, or the datasheet transfer rule).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .device_profiles import MEMORY_BANDWIDTH_EFFICIENCY, ComputeProfile, resolve_compute_profile
from .devices import DeviceType
from whalepy.ir.types import Precision  # noqa: F401  (re-exported: its users import it from here)

__all__ = ["MEMORY_BANDWIDTH_EFFICIENCY", "BACKWARD_TO_FORWARD_RATIO", "BlockTime", "Precision", "adamw_step_time",
           "estimate_block_time", "estimate_compute_time", "estimate_kernels_time", "fit_gemm", "gemm_aligned",
           "gemm_time", "loss_time", "peak_flops", "precision_bytes"]

BACKWARD_TO_FORWARD_RATIO = 2.0
"""Backward work relative to forward, for FLOPs and for bytes moved, when no measurement is given.

The backward of a matmul ``Y = X W`` computes two matmuls of the forward's size (``dX = dY W^T`` and
``dW = X^T dY``), so backward FLOPs are twice forward FLOPs (Narayanan et al., SC'21, Appendix; Kaplan
et al., "Scaling Laws for Neural Language Models", 2020). The same two products read and write about
twice the operands, which is why the default uses the same ratio for bytes.
"""


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

    Roofline: ``max(flops / (peak * efficiency), bytes / bandwidth)`` with the device profile's
    bandwidth; ``efficiency`` defaults to the profile's steady-state GEMM efficiency ``e``. For work
    whose kernels are unknown (optimizer steps, profiles without :class:`BlockKernels`).
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops ({flops}) and bytes_moved ({bytes_moved}) must be non-negative")
    if efficiency is not None and not 0.0 < efficiency <= 1.0:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    prof = resolve_compute_profile(device)
    eff = prof.gemm_efficiency if efficiency is None else efficiency
    peak = peak_flops(device, precision)
    if peak <= 0 or device.memory_bandwidth <= 0:
        raise ValueError(
            f"device {device.name!r} has peak {peak} FLOP/s and bandwidth {device.memory_bandwidth} B/s; "
            "both must be positive"
        )
    math_s = flops / (peak * eff)
    memory_s = bytes_moved / prof.memory_bandwidth
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


# -- the shape-dependent model -------------------------------------------------------------------------

ATTENTION_BACKWARD_FLOP_RATIO = 2.5
"""Backward FLOPs of a flash attention kernel per forward FLOP: ``dV = P^T dO``, ``dP = dO V^T``,
``dQ``, ``dK`` and the recomputed ``S = Q K^T``, five products against the forward's two (Dao,
"FlashAttention-2", 2023, counts its backward throughput the same way)."""


MEMORY_BOUND_BACKWARD_RATIO = 1.5
"""Backward bytes of a memory-bound kernel per forward byte: an element-wise or normalisation kernel reads
its input and writes its output (two tensors) forward; its backward reads the output gradient and the
saved input or output and writes the input gradient (three). Dropout's backward moves about what its
forward does, a residual add's backward nothing; 1.5 is the common case."""


GEMM_ALIGNMENT_BYTES = 16
"""Row stride (in bytes) cuBLAS needs on every operand of a 16-bit (or TF32) GEMM for its tensor-core
kernels with 16-byte vector loads: 8 elements of bf16 / fp16, 16 of fp8, 4 of fp32 (NVIDIA, "Matrix
Multiplication Background User's Guide", section "Tensor Core Requirements"; cuBLAS documentation,
"Tensor Core Usage"). For a row-major ``(m x k) @ (k x n)`` and both backward products the strides are
``k`` and ``n`` (never ``m``), so a GEMM is misaligned when ``k`` or ``n`` is not a multiple."""

MISALIGNED_GEMM_EFFICIENCY = 0.125
"""Fraction of the 16-bit peak a misaligned GEMM reaches. Measured: on one H200 (torch 2.11,
../shared/calibration/h200-2026-11-26/whalepy_step_kernels.txt, GPT 1.42B with vocabulary 50257) the LM
head's three GEMMs (``4096 x 2048 x 50257`` forward, ``dX``, ``dW``: 2.53 TFLOP per step) ran as cuBLAS's
fallback, sm75 CUTLASS ``s1688gemm ... align1`` kernels (Turing-style ``mma.sync``, 2-byte loads, no
Hopper ``wgmma``), in 8.65 + 6.04 + 5.78 = 20.48 ms per step: 123.5 TFLOP/s, 0.125 of the 989.4 TFLOP/s
peak (the aligned GEMMs of the same step ran at 0.65-0.72). Applied to every device: the fallback is
the same CUTLASS kernel family on Ampere and later (an A100 measurement would refine it)."""


def gemm_aligned(k: float, n: float, precision: Precision | str = Precision.BF16) -> bool:
    """Whether ``(m x k) @ (k x n)`` meets :data:`GEMM_ALIGNMENT_BYTES` (``k`` and ``n`` strides)."""
    b = precision_bytes(precision)
    return all(float(x).is_integer() and (int(x) * b) % GEMM_ALIGNMENT_BYTES == 0 for x in (k, n))


INDUCTOR_PAD_MULTIPLIER = 1.1
"""Inductor pads a misaligned 16-bit ``mm`` / ``addmm`` / ``bmm`` of a compiled graph (its
``pad_mm`` pass, ``torch._inductor.config.shape_padding``, on by default on CUDA with Triton): each of
``m``, ``k``, ``n`` that is not a multiple of 8 elements (4 for fp32) is padded with zeros up to the next
one, the product runs aligned and the result is sliced back; it keeps the padding where its benchmark
of both finds the original slower than the padded product times this factor (``shape_padding_multiplier``,
default 1.1, torch/_inductor/fx_passes/pad_mm.py in torch 2.13). On one H200 (2026-11-27) the GPT's
compiled head with its 50257-wide GEMMs ran forward + backward (with the loss) in 6.8 ms against 23.9
ms eager (benchmarks/data/h200_2026-11-27/gpt_measured.json)."""


def gemm_time(m: float, k: float, n: float, *, device: DeviceType, profile: ComputeProfile,
              precision: Precision | str = Precision.BF16, batch: float = 1, padded: bool = False) -> float:
    """Device seconds of ``[batch x] (m x k) @ (k x n)`` (module docstring: tiles in waves, roofline).
    ``padded``: the product runs inside a compiled block, where a misaligned one is padded when that is
    faster (:data:`INDUCTOR_PAD_MULTIPLIER`)."""
    if min(m, k, n, batch) <= 0:
        return 0.0
    return _gemm_time(m, k, n, device, profile, Precision(precision), batch, padded)


@functools.lru_cache(maxsize=65536)
def _gemm_time(m: float, k: float, n: float, device: DeviceType, profile: ComputeProfile, precision: Precision,
               batch: float, padded: bool = False) -> float:
    nbytes = batch * (m * k + k * n + m * n) * precision_bytes(precision)
    if device.vendor == "nvidia" and precision is not Precision.FP32 and not gemm_aligned(k, n, precision):
        # cuBLAS's fallback kernels (MISALIGNED_GEMM_EFFICIENCY); fp32 without TF32 (torch's default,
        # ``allow_tf32 = False``) runs on CUDA cores and has no such path
        math_s = batch * 2.0 * m * k * n / (peak_flops(device, precision) * MISALIGNED_GEMM_EFFICIENCY)
        fallback = max(math_s, nbytes / profile.memory_bandwidth)
        if padded and all(float(x).is_integer() for x in (m, k, n)):
            pad_s = _padded_gemm_time(m, k, n, device, profile, precision, batch)
            if fallback > INDUCTOR_PAD_MULTIPLIER * pad_s:
                return pad_s
        return fallback
    peak = peak_flops(device, precision) * profile.gemm_efficiency
    work = 2.0 * (k + profile.gemm_k_overhead)
    sms = profile.num_sms
    if sms:
        best = math.inf
        for tm, tn in (profile.gemm_tile, profile.gemm_tile[::-1]):
            tiles = math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)
            best = min(best, math.ceil(tiles / sms) * sms * tm * tn * work / peak)
        math_s = best
    else:
        math_s = batch * m * n * work / peak
    return max(math_s, nbytes / profile.memory_bandwidth)


def _padded_gemm_time(m: float, k: float, n: float, device: DeviceType, profile: ComputeProfile,
                      precision: Precision, batch: float) -> float:
    """Inductor's padded product (:data:`INDUCTOR_PAD_MULTIPLIER`): the aligned GEMM of the padded
    shape, plus a copy of each operand with a padded dimension (read it, write it padded); the result
    is a sliced view."""
    step = GEMM_ALIGNMENT_BYTES // precision_bytes(precision)
    pm, pk, pn = (math.ceil(x / step) * step for x in (m, k, n))
    copy = 0.0
    if (pm, pk) != (m, k):
        copy += m * k + pm * pk
    if (pk, pn) != (k, n):
        copy += k * n + pk * pn
    return (_gemm_time(pm, pk, pn, device, profile, precision, batch)
            + memory_bound_time(batch * copy * precision_bytes(precision), profile))


def gemm_train_time(m: float, k: float, n: float, *, device: DeviceType, profile: ComputeProfile,
                    precision: Precision | str = Precision.BF16, batch: float = 1,
                    grad_input: bool = True, grad_weight: bool = True, padded: bool = False) -> tuple[float, float]:
    """``(forward, backward)`` seconds: backward runs ``dX = dY W^T`` as ``(m x n) @ (n x k)`` and
    ``dW = X^T dY`` as ``(k x m) @ (m x n)`` (batched GEMMs keep their batch). ``padded``: in a
    compiled block (:func:`gemm_time`)."""
    kw = dict(device=device, profile=profile, precision=precision, batch=batch, padded=padded)
    fwd = gemm_time(m, k, n, **kw)  # type: ignore[arg-type]
    bwd = (gemm_time(m, n, k, **kw) if grad_input else 0.0) + (gemm_time(k, m, n, **kw) if grad_weight else 0.0)  # type: ignore[arg-type]
    return fwd, bwd


def attention_flops(batch_heads: float, q_len: int, kv_len: int, head_dim: int, v_dim: int, causal: bool) -> float:
    """Forward FLOPs a flash kernel executes: ``2 B L S (d + dv)``, halved when causal and square."""
    f = 2.0 * batch_heads * q_len * kv_len * (head_dim + v_dim)
    return f / 2 if causal and q_len == kv_len else f


def attention_train_time(batch_heads: float, q_len: int, kv_len: int, head_dim: int, v_dim: int, causal: bool, *,
                         device: DeviceType, profile: ComputeProfile, precision: Precision | str = Precision.BF16,
                         needs_grad: bool = True) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one fused attention call."""
    rate = peak_flops(device, precision) * profile.attention_efficiency
    f = attention_flops(batch_heads, q_len, kv_len, head_dim, v_dim, causal)
    return f / rate, (ATTENTION_BACKWARD_FLOP_RATIO * f / rate if needs_grad else 0.0)


ELEMENTWISE_BANDWIDTH_FRACTION = 0.62
"""Fraction of the profile's streaming bandwidth (``memory_bandwidth``, a 1 GiB ``add``) that PyTorch's
eager memory-bound kernels reach at a transformer layer's sizes. Measured on one H200
(../shared/calibration/h200-2026-11-26/gpt_whalepy_step_trace.json.gz, GPT 1.42B, batch 4 x 1024 under
autocast): one layer's forward norms, residual adds and GELU move 436 MB (two fp32 layer norms of
``(4096, 2048)``: 67 MB each; two fp32 + bf16 residual adds: 84 MB each; a bf16 GELU of ``(4096,
8192)``: 134 MB) in 28 + 28 + 32 + 32 + 46 = 166 us: 2.62 TB/s, 0.62 of the 4.25 TB/s ``whalepy
calibrate`` measured on that GPU (per-row reductions, mixed-dtype operands that defeat vectorised
loads). The layer-norm backward of the same trace runs at the same 2.6 TB/s. Derived from the GPT
trace alone; the Llama kernel table of the same day is the held-out check (docs/cost_model.md)."""

DOWNCAST_BANDWIDTH_FRACTION = 0.85
"""The same for autocast's fp32 -> 16-bit casts (``bfloat16_copy_kernel_cuda``, vectorised): on the H200
trace the forward casts of one step (1.31e9 weight and 0.81e9 activation elements, 6 bytes each: 12.75
GB) took 3.54 ms: 3.61 TB/s, 0.85 of the measured bandwidth."""

UPCAST_BANDWIDTH_FRACTION = 0.45
"""The same for 16-bit -> fp32 casts (the backward's ``ToCopyBackward``: gradients of autocast's weight
and activation casts; ``.float()`` of the logits): PyTorch runs a dtype-converting copy that has no
vectorised specialisation through its unrolled element-wise kernel. On the H200 trace the same 12.75 GB
took 6.74 ms per step: 1.89 TB/s, 0.45 of the measured bandwidth."""

SOFTMAX_PASS_BYTES = 16
"""Bytes per logit of cross-entropy's ``log_softmax`` forward, and again of its backward, on fp32
logits whose rows do not fit in shared memory (a vocabulary over ~12k): the forward reads the row for
its maximum, again for the sum of exponentials, and a third time to write the output (3 reads + 1
write of 4 bytes); the backward reads the gradient for its sum, then the gradient and the output, and
writes the input gradient (PyTorch's ``cunn_SoftMaxForward`` / ``cunn_SoftMaxBackward``). Checked on the
H200 trace: 0.76 + 0.89 ms for 206M logits (GPT), 4.0 + 4.3 ms for 525M (Llama): 3.7-4.3 TB/s against
the 4.25 measured, so charged at the full measured bandwidth."""

NLL_GRAD_FILL_BYTES = 4
"""``nll_loss``'s backward writes a zero fp32 gradient the size of the log-probabilities before
scattering into it: 4 bytes per logit."""

ADAMW_FOREACH_BYTES_PER_PARAM = 80.0
"""Device-memory traffic per fp32 parameter of ``torch.optim.AdamW``'s default ``foreach``
implementation (``torch/optim/adamw.py``, ``_multi_tensor_adamw``: one pass per ``_foreach_*`` call):
weight decay ``mul_`` (read + write the parameter, 8), ``lerp_`` of the first moment towards the
gradient (12), ``mul_`` and ``addcmul_`` of the second moment (8 + 12), ``sqrt``, ``div_``, ``add_`` of
its denominator (8 each), ``addcdiv_`` into the parameter (16). The H100 profile's measured rate (30.5 ms
per 1e9) is 80 bytes at 2.62 TB/s, its bandwidth 2.68 TB/s; used only when a profile has no measured
rate."""

ADAMW_FUSED_BYTES_PER_PARAM = 28.0
"""The same for ``fused=True`` (one kernel): read the fp32 parameter, gradient, both moments (16), write
the parameter and moments (12)."""


def bandwidth_fractions(profile: ComputeProfile) -> tuple[float, float, float]:
    """``(element-wise, downcast, upcast)`` fractions of ``profile.memory_bandwidth`` the kernels reach:
    the measured ones (:data:`ELEMENTWISE_BANDWIDTH_FRACTION`, :data:`DOWNCAST_BANDWIDTH_FRACTION`,
    :data:`UPCAST_BANDWIDTH_FRACTION`) against a measured streaming bandwidth; against a datasheet-derived
    one (already the element-wise figure, :data:`MEMORY_BANDWIDTH_EFFICIENCY`) the same ratios to the
    element-wise kernels: 1, 1 (a vectorised cast is no slower than them) and 0.45 / 0.62."""
    if profile.bandwidth_measured:
        return ELEMENTWISE_BANDWIDTH_FRACTION, DOWNCAST_BANDWIDTH_FRACTION, UPCAST_BANDWIDTH_FRACTION
    return 1.0, 1.0, UPCAST_BANDWIDTH_FRACTION / ELEMENTWISE_BANDWIDTH_FRACTION


def memory_bound_time(nbytes: float, profile: ComputeProfile) -> float:
    """Seconds of element-wise / normalisation kernels moving ``nbytes`` (:func:`bandwidth_fractions`)."""
    return nbytes / (profile.memory_bandwidth * bandwidth_fractions(profile)[0])


def adamw_step_time(num_params: float, device: DeviceType, *, implementation: str = "foreach",
                    profile: ComputeProfile | None = None) -> float:
    """Seconds of one AdamW step over ``num_params`` fp32 parameters on the device, for the
    implementation the runtime builds: ``"foreach"`` (torch's default on CUDA, what the runtime steps a
    user's ``AdamW(params)`` with) or ``"fused"``. The profile's measured rate
    (``adamw_device_s_per_1e9`` / ``adamw_device_fused_s_per_1e9``, ``whalepy calibrate``), else its bytes
    (:data:`ADAMW_FOREACH_BYTES_PER_PARAM`, :data:`ADAMW_FUSED_BYTES_PER_PARAM`) at the profile's bandwidth."""
    prof = profile or resolve_compute_profile(device)
    if implementation not in ("foreach", "fused"):
        raise ValueError(f"implementation must be 'foreach' or 'fused', got {implementation!r}")
    rate = prof.value("adamw_device_s_per_1e9" if implementation == "foreach" else "adamw_device_fused_s_per_1e9")
    if rate is not None and device.vendor != "cpu":
        return num_params * rate / 1e9
    per = ADAMW_FOREACH_BYTES_PER_PARAM if implementation == "foreach" else ADAMW_FUSED_BYTES_PER_PARAM
    return num_params * per / prof.memory_bandwidth


def loss_time(logits: float, *, logits_bytes: int, profile: ComputeProfile) -> tuple[float, float]:
    """``(forward, backward)`` seconds of cross-entropy over ``logits`` elements held in ``logits_bytes``
    bytes each: the upcast of 16-bit logits to fp32 (``.float()`` or autocast's fp32 loss) and its
    gradient's downcast, ``log_softmax`` (:data:`SOFTMAX_PASS_BYTES` each way), the zero gradient
    ``nll_loss`` writes (:data:`NLL_GRAD_FILL_BYTES`)."""
    bw = profile.memory_bandwidth
    _, fd, fu = bandwidth_fractions(profile)
    up = down = 0.0
    if logits_bytes < 4:
        up = logits * (logits_bytes + 4) / (bw * fu)
        down = logits * (logits_bytes + 4) / (bw * fd)
    return (up + logits * SOFTMAX_PASS_BYTES / bw,
            logits * (SOFTMAX_PASS_BYTES + NLL_GRAD_FILL_BYTES) / bw + down)


@dataclass(frozen=True, slots=True)
class KernelsTime:
    """A block's forward and backward seconds per kind of kernel (device time; launches not applied)."""

    gemm: tuple[float, float] = (0.0, 0.0)
    """GEMMs meeting :data:`GEMM_ALIGNMENT_BYTES`."""
    gemm_misaligned: tuple[float, float] = (0.0, 0.0)
    attention: tuple[float, float] = (0.0, 0.0)
    memory: tuple[float, float] = (0.0, 0.0)
    """Element-wise and normalisation kernels."""
    casts: tuple[float, float] = (0.0, 0.0)
    """Autocast's casts."""

    @property
    def forward(self) -> float:
        return sum(x[0] for x in (self.gemm, self.gemm_misaligned, self.attention, self.memory, self.casts))

    @property
    def backward(self) -> float:
        return sum(x[1] for x in (self.gemm, self.gemm_misaligned, self.attention, self.memory, self.casts))


def kernels_time(kernels: Any, *, device: DeviceType, precision: Precision | str = Precision.BF16,
                 batch_ratio: float = 1.0, tp: int = 1, byte_scale: float = 1.0,
                 profile: ComputeProfile | None = None, autocast: bool = False, compiled: bool = False) -> KernelsTime:
    """Device seconds of one block by kind of kernel (see :func:`estimate_kernels_time`)."""
    prof = profile or resolve_compute_profile(device)
    acc = {"gemm": [0.0, 0.0], "gemm_misaligned": [0.0, 0.0], "attention": [0.0, 0.0], "memory": [0.0, 0.0],
           "casts": [0.0, 0.0]}
    for g in kernels.gemms:
        m, k, n, batch = g.m, g.k, g.n, g.batch
        if batch > 1:
            batch = batch * batch_ratio
        else:
            m = m * batch_ratio
        if tp > 1 and g.shard == "n":
            n = n / tp
        elif tp > 1 and g.shard == "k":
            k = k / tp
        elif tp > 1 and g.shard == "batch":
            batch = batch / tp
        f, b = gemm_train_time(m, k, n, device=device, profile=prof, precision=precision, batch=batch,
                               grad_input=g.grad_input, grad_weight=g.grad_weight, padded=compiled)
        kind = acc["gemm"] if Precision(precision) is Precision.FP32 or gemm_aligned(k, n, precision) \
            else acc["gemm_misaligned"]
        kind[0] += f
        kind[1] += b
    for a in kernels.attention:
        f, b = attention_train_time(a.batch_heads * batch_ratio / tp, a.q_len, a.kv_len, a.head_dim, a.v_dim,
                                    a.causal, device=device, profile=prof, precision=precision,
                                    needs_grad=a.needs_grad)
        acc["attention"][0] += f
        acc["attention"][1] += b
    amp = getattr(kernels, "amp", None)
    if autocast and amp is not None:
        bw = prof.memory_bandwidth
        _, fd, fu = bandwidth_fractions(prof)
        down, up = bw * fd, bw * fu
        cast = 4 + precision_bytes(precision)  # bytes per element of one cast (read fp32, write 16-bit)
    if autocast and amp is not None and not compiled:
        acc["memory"] = [memory_bound_time(amp.amp_fwd * batch_ratio / tp, prof),
                         memory_bound_time(amp.amp_bwd * batch_ratio / tp, prof)]
        acc["casts"] = [cast * (amp.cast_param / down + (amp.cast_act * batch_ratio / down
                                                          + amp.upcast_act * batch_ratio / up) / tp),
                        cast * (amp.cast_param_grad / up + (amp.cast_act_grad * batch_ratio / up
                                                             + (amp.upcast_act + amp.mixed_grad_casts)
                                                             * batch_ratio / down) / tp)]
    else:
        fwd_bytes = kernels.memory_bytes * batch_ratio * byte_scale / tp
        bwd_bytes = (MEMORY_BOUND_BACKWARD_RATIO * kernels.memory_bytes if kernels.memory_bytes_bwd is None
                     else kernels.memory_bytes_bwd) * batch_ratio * byte_scale / tp
        acc["memory"] = [memory_bound_time(fwd_bytes, prof), memory_bound_time(bwd_bytes, prof)]
        if autocast and amp is not None:
            # compiled: inductor fuses autocast's activation casts and fp32 islands into the pointwise and
            # reduction kernels around them (a cast is one more pointwise op of the fused kernel; its tensor
            # stays in registers), so the memory-bound bytes are the 16-bit figure above, and what stays a
            # kernel of its own is a parameter's cast, which feeds a GEMM (an extern kernel inductor does
            # not fuse into). On one H200 the compiled step's bf16 copy kernels took 6.7 ms for either model
            # (GPT 1.42B, Llama 1.2B: 5.3 and 4.6 GB of fp32 parameters read, 16-bit written, forward and
            # backward; docs/benchmarks.md "One H200, session 16"), and its fused kernels 9.6 and 8.9 ms
            acc["casts"] = [cast * amp.cast_param / down, cast * amp.cast_param_grad / up]
    return KernelsTime(**{k: (v[0], v[1]) for k, v in acc.items()})


def estimate_kernels_time(kernels: Any, *, device: DeviceType, precision: Precision | str = Precision.BF16,
                          batch_ratio: float = 1.0, tp: int = 1, byte_scale: float = 1.0,
                          profile: ComputeProfile | None = None, autocast: bool = False,
                          compiled: bool = False) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one block from its :class:`~whalepy.ir.profile.BlockKernels`.

    ``batch_ratio`` scales the recorded batch (micro-batch / profiled batch); ``tp > 1`` divides the
    sharded GEMM dimension, the attention heads and the memory-bound bytes by ``tp`` (the block runs
    tensor-parallel); ``byte_scale`` converts memory-bound bytes from the profiled dtype to the
    training precision. ``autocast``: the block runs under ``torch.autocast`` over fp32 parameters (the
    runtime's DDP and single-device paths in 16-bit): memory-bound bytes in the dtypes autocast gives
    each tensor, plus its casts (``whalepy.passes.autocast``). ``compiled``: the block runs under
    ``torch.compile`` (``Plan.compile``): its misaligned GEMMs are padded where that is faster
    (:data:`INDUCTOR_PAD_MULTIPLIER`); the memory-bound kernels are still priced one by one, as eager
    runs them (inductor's fusion of them is not modelled). Each phase takes ``max(device time,
    launches * launch_overhead_s)``.
    """
    prof = profile or resolve_compute_profile(device)
    t = kernels_time(kernels, device=device, precision=precision, batch_ratio=batch_ratio, tp=tp,
                     byte_scale=byte_scale, profile=prof, autocast=autocast, compiled=compiled)
    amp = getattr(kernels, "amp", None)
    extra_f = amp.cast_launches_fwd if autocast and amp is not None else 0
    extra_b = amp.cast_launches_bwd if autocast and amp is not None else 0
    bwd_launch = prof.launch_overhead_s if prof.launch_backward_overhead_s is None else prof.launch_backward_overhead_s
    return (max(t.forward, (kernels.ops_fwd + extra_f) * prof.launch_overhead_s),
            max(t.backward, (kernels.ops_bwd + extra_b) * bwd_launch))


# -- fitting ----------------------------------------------------------------------------------------------

def fit_gemm(rows: Sequence[dict[str, float]], device: DeviceType, *, num_sms: int | None,
             memory_bandwidth: float, precision: Precision | str = Precision.BF16,
             tile: tuple[int, int] = (128, 256)) -> dict[str, float]:
    """Least-squares fit of ``e``, ``k0`` and the launch floor to measured GEMM times.

    ``rows`` carry ``m``, ``k``, ``n`` and ``s`` (seconds of one isolated ``a @ b``, launch included:
    measured ``= max(launch, device time)``). Minimises the sum of squared ``log(predicted /
    measured)`` by a coarse grid then a local refinement (no numpy needed). Returns the parameters and
    the RMS and largest absolute log error."""
    if len(rows) < 3:
        raise ValueError(f"fit_gemm needs at least 3 GEMM measurements, got {len(rows)}")

    def predict(r: dict[str, float], e: float, k0: float, floor: float) -> float:
        prof = ComputeProfile(device=device.name, source="fit", gemm_efficiency=e, gemm_k_overhead=k0,
                              gemm_tile=tile, num_sms=num_sms, memory_bandwidth=memory_bandwidth,
                              attention_efficiency=1.0, launch_overhead_s=floor)
        return max(floor, gemm_time(r["m"], r["k"], r["n"], device=device, profile=prof, precision=precision))

    def loss(e: float, k0: float, floor: float) -> float:
        return sum(math.log(predict(r, e, k0, floor) / r["s"]) ** 2 for r in rows)

    smallest = min(r["s"] for r in rows)
    # e on a log grid from 0.5% to 200% of the catalog peak (a CPU's catalog peak is nominal)
    grid = [(0.005 * 1.25**i, k0, smallest * f) for i in range(27) for k0 in (0, 64, 128, 256, 512, 1024)
            for f in (0.25, 0.5, 0.75, 1.0)]
    best = min(grid, key=lambda p: loss(*p))
    step = [0.1 * best[0], 64.0, 0.25 * smallest]
    for _ in range(60):  # coordinate descent with shrinking steps
        improved = False
        for i in range(3):
            for sign in (1, -1):
                trial = list(best)
                trial[i] = max(1e-9, trial[i] + sign * step[i])
                if loss(*trial) < loss(*best):
                    best, improved = tuple(trial), True  # type: ignore[assignment]
        if not improved:
            step = [s / 2 for s in step]
    e, k0, floor = best
    errs = [math.log(predict(r, e, k0, floor) / r["s"]) for r in rows]
    return {"gemm_efficiency": e, "gemm_k_overhead": k0, "launch_overhead_s": floor,
            "rms_log_error": math.sqrt(sum(x * x for x in errs) / len(errs)),
            "max_abs_log_error": max(abs(x) for x in errs)}


def predict_gemm_rows(rows: Iterable[dict[str, float]], device: DeviceType, profile: ComputeProfile,
                      precision: Precision | str = Precision.BF16) -> list[float]:
    """Predicted seconds of isolated GEMM calls (launch floor included), to compare with ``rows``."""
    return [max(profile.launch_overhead_s, gemm_time(r["m"], r["k"], r["n"], device=device, profile=profile,
                                                     precision=precision)) for r in rows]
