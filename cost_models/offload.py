"""Time of moving model states between the device, host memory and NVMe, and of stepping the optimizer
off the device: the pipelines of ZeRO-Offload, ZeRO-Infinity and activation offload, with the overlap
the compute around them allows. Bytes come from :mod:`whalepy.cost_models.memory` (what the runtime
holds); this module only prices moving them. Formulas and sources: docs/cost_model.md, "Offload".

Rates (:class:`OffloadRates`, :func:`resolve_offload_rates`), most specific first:

- host link: pinned host<->device copies measured by ``whalepy calibrate`` (profile rates
  ``h2d_pinned_GBps`` / ``d2h_pinned_GBps``), else the datasheet PCIe figure times
  :data:`PINNED_LINK_EFFICIENCY` (measured on one link, transferred);
- CPU optimizer: torch's fused CPU AdamW (``fused=True``: one vectorised pass per tensor), what the
  runtime steps host states with (ZeRO-Offload's host optimizer and FSDP2's host-offloaded shards alike
  switch the user's optimizer to it: ``runtime.host_optimizer.fused_variant``): the profile's measured
  ``adamw_cpu_fused_s_per_1e8``, else its ``adamw_cpu_s_per_1e8`` (``foreach``) times
  :data:`FUSED_OVER_FOREACH_CPU_ADAMW`, else :data:`CPU_ADAM_PARAMS_PER_S_PER_NODE` (cited, a vectorised
  CPU Adam);
- NVMe: the node's :class:`~whalepy.hardware.cluster.NvmeSpec` (datasheet read / write), shared by the node's
  GPUs, as the node's CPU optimizer is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .device_profiles import resolve_compute_profile
from .devices import DeviceType

PINNED_LINK_EFFICIENCY = 54.0 / 64.0
"""Fraction of the nominal PCIe x16 bandwidth a pinned 1 GiB copy reaches: 53.7 GB/s host-to-device
and 54.0 GB/s device-to-host on one H100 (PCIe Gen5 x16, nominal 64 GB/s;
../shared/calibration/h100-sxm_microbench.json). Applied to other PCIe generations without a
measurement (PCIe3 x16 -> 13.5 GB/s, in line with the 12-13 GB/s commonly measured on V100 hosts)."""

PAGEABLE_NOTE = ("pageable copies are 3-4x slower (12-16 GB/s on the same H100): the runtime stages "
                 "offloaded states in pinned buffers, so only the pinned rate is used")

CPU_ADAM_PARAMS_PER_S_PER_NODE = 1e9 / 0.22
"""Parameters per second one node's CPUs update with a vectorised, multi-threaded Adam, when the device
has no calibrated profile: ZeRO-Offload's CPU-Adam updates 1 B parameters in 0.22 s on a DGX-2 host
(Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC'21, Table 3;
PyTorch's CPU Adam took 1.39 s there). Shared by the node's GPUs. Used for torch's fused CPU AdamW, the
same kind of kernel (one vectorised, multi-threaded pass over each tensor)."""

FUSED_OVER_FOREACH_CPU_ADAMW = 0.18
"""Seconds of torch's fused CPU AdamW step over those of its ``foreach`` step, same parameters: applied
to a profile that measured only ``foreach`` (the shipped H100 profile: 0.11 s per 1e8 parameters, 16
threads) to get the fused kernel's rate. Measured with ``python benchmarks/bench_cpu_adamw.py`` on the
2-core development machine (torch 2.13.0, 2e7 parameters in 8 tensors, weight decay, the kinds' steps
alternating, median of 9), eight runs at 1 and 2 threads, load average 2 to 3.5 (2026-11-23): 0.118,
0.159, 0.161, 0.177, 0.180, 0.199, 0.211, 0.266, median 0.18; ATC'21, Table 3 gives 0.158 for a
vectorised CPU Adam against PyTorch's on a DGX-2 host (0.22 s and 1.39 s per 1e9). Both kernels are
bound by host memory traffic (the fused one reads and writes each state once, the foreach one once
per elementwise op), so the ratio carries across CPUs better than either rate; a calibration on the machine (``whalepy calibrate`` measures the fused kernel) replaces it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadRates:
    """The transfer and host-compute rates one GPU of a node sees."""

    h2d: float
    """Host-to-device bytes/s per GPU (pinned)."""
    d2h: float
    """Device-to-host bytes/s per GPU (pinned)."""
    cpu_adam: float
    """Adam parameter updates per second for one GPU's share of the node's CPUs (torch's fused CPU
    AdamW)."""
    nvme_read: float | None = None
    """NVMe read bytes/s for one GPU's share of the node's drives (None: no NVMe)."""
    nvme_write: float | None = None
    source: str = ""
    """Where the host-link and CPU-optimizer rates come from."""


def resolve_offload_rates(device: DeviceType, *, gpus_per_node: int, nvme_read: float | None = None,
                          nvme_write: float | None = None) -> OffloadRates:
    """Rates for one of ``gpus_per_node`` GPUs of type ``device`` (see the module docstring).
    ``nvme_read`` / ``nvme_write`` are the node's totals (its :class:`~whalepy.hardware.cluster.NvmeSpec`)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, got {gpus_per_node}")
    prof = resolve_compute_profile(device)
    h2d, d2h = prof.value("h2d_pinned_GBps"), prof.value("d2h_pinned_GBps")
    fused, foreach = prof.value("adamw_cpu_fused_s_per_1e8"), prof.value("adamw_cpu_s_per_1e8")
    link_src = f"measured ({prof.source})" if h2d and d2h else "datasheet PCIe x PINNED_LINK_EFFICIENCY"
    nominal = device.host_link_bandwidth * PINNED_LINK_EFFICIENCY
    if fused:
        node_adam, adam_src = 1e8 / fused, f"fused measured ({prof.source})"
    elif foreach:
        node_adam = 1e8 / (foreach * FUSED_OVER_FOREACH_CPU_ADAMW)
        adam_src = f"fused = measured foreach ({prof.source}) x FUSED_OVER_FOREACH_CPU_ADAMW"
    else:
        node_adam, adam_src = CPU_ADAM_PARAMS_PER_S_PER_NODE, "fused: ZeRO-Offload CPU-Adam (ATC'21, Table 3)"
    share = float(gpus_per_node)
    return OffloadRates(
        h2d=h2d * 1e9 if h2d else nominal, d2h=d2h * 1e9 if d2h else nominal, cpu_adam=node_adam / share,
        nvme_read=nvme_read / share if nvme_read else None, nvme_write=nvme_write / share if nvme_write else None,
        source=f"host link {link_src}; CPU Adam {adam_src}")


USABLE_HOST_MEMORY_FRACTION = 0.8
"""NAMED CONSTANT: fraction of a node's host memory available to offloaded states; the OS, the data
loader and the processes' own memory keep the rest (not measured: a node's free memory at launch should
replace it)."""


def host_capacity_per_gpu(cpu_memory_bytes: float | None, gpus_per_node: int) -> float | None:
    """Host bytes for one GPU's offloaded states: the node's usable host memory, shared by its GPUs
    (None: the spec gives no host memory, so nothing is planned there)."""
    if cpu_memory_bytes is None:
        return None
    return cpu_memory_bytes * USABLE_HOST_MEMORY_FRACTION / gpus_per_node


DISK_RESERVE_FRACTION = 0.01
"""NAMED CONSTANT (not measured): share of the disk tier's drive kept free beside the peak of its files,
for what else writes there during the run (logs, checkpoints or data caches on the same drive, the
tier's manifest and directory probes, file-system metadata and each file's rounding to whole blocks).
The planner plans a node's ranks within its NVMe less this share; the runtime checks the files of the
ranks sharing a file system against its free space less this share of its size
(:func:`disk_reserve_bytes`)."""


def disk_reserve_bytes(total_bytes: float) -> float:
    """Bytes of a file system (or drive) of ``total_bytes`` the disk tier leaves free:
    :data:`DISK_RESERVE_FRACTION` of it."""
    return total_bytes * DISK_RESERVE_FRACTION


def nvme_capacity_per_gpu(nvme_bytes: float | None, gpus_per_node: int) -> float | None:
    """NVMe bytes for one GPU's files: the node's drives less their reserve (:func:`disk_reserve_bytes`),
    shared by its GPUs. The planner's constraint is the node's (the sum over its ranks, whichever stages
    they run: ``planner.costing.NodeShare``), as the runtime's check is the file system's."""
    return None if nvme_bytes is None else (nvme_bytes - disk_reserve_bytes(nvme_bytes)) / gpus_per_node


# -- the optimizer step off the device -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTraffic:
    """Per local parameter, what one optimizer step off the device costs, in seconds: ``serial`` runs
    after the last backward whatever happens; ``overlap`` may run beside the last micro-batch's
    backward (ZeRO-Offload), so only ``max(0, overlap * P - backward)`` of it is exposed."""

    serial: float
    overlap: float = 0.0

    def exposed(self, num_params: float, hide_s: float = 0.0) -> float:
        """Exposed seconds for ``num_params`` local parameters with ``hide_s`` seconds of backward to
        hide the overlappable part behind."""
        return self.serial * num_params + max(0.0, self.overlap * num_params - hide_s)


def zero_offload_step(rates: OffloadRates, *, grad_bytes: float, param_bytes: float,
                      after_backward: bool = False) -> StepTraffic:
    """ZeRO-Offload (Ren et al., ATC'21, section 4.1): gradients stream to the host block by block
    during backward (``grad_bytes`` per parameter down), the CPU steps each block's parameters as its
    gradients arrive, and the updated compute-dtype parameters (``param_bytes``) stream back.

    The gradient copies and the CPU step are two stages of one pipeline beside the backward, so their
    throughput is set by the slower one: ``overlap = max(grad / d2h, 1 / cpu_adam)`` per parameter,
    hidden as far as the last micro-batch's backward lasts. The parameters' way back must finish before
    the next forward: ``serial = param / h2d`` (no one-step delayed update, which changes the
    numerics).

    ``after_backward`` (fp16 loss scaling or gradient clipping,
    :func:`whalepy.ir.rules.host_steps_after_backward`): the gradients still stream down during
    the backward (``overlap = grad / d2h``), but the CPU step waits for the whole backward and nothing
    of it is hidden: ``serial = 1 / cpu_adam + param / h2d``."""
    if grad_bytes < 0 or param_bytes < 0:
        raise ValueError(f"grad_bytes ({grad_bytes}) and param_bytes ({param_bytes}) must be >= 0")
    if after_backward:
        return StepTraffic(serial=1.0 / rates.cpu_adam + param_bytes / rates.h2d, overlap=grad_bytes / rates.d2h)
    return StepTraffic(serial=param_bytes / rates.h2d, overlap=max(grad_bytes / rates.d2h, 1.0 / rates.cpu_adam))


def host_step(rates: OffloadRates, *, grad_bytes: float, nvme_state_bytes: float = 0.0) -> StepTraffic:
    """Parameters, gradients and optimizer states on the host (FSDP2 ``CPUOffloadPolicy``): the last
    micro-batch's reduced gradient shards go down (``grad_bytes`` per parameter), then the CPU steps after
    backward, not overlapped. ``nvme_state_bytes`` per parameter of optimizer states are read from and
    written back to NVMe around the step."""
    return StepTraffic(serial=grad_bytes / rates.d2h + 1.0 / rates.cpu_adam + nvme_io(rates, nvme_state_bytes))


def nvme_io(rates: OffloadRates, nbytes: float) -> float:
    """Seconds to read ``nbytes`` from this GPU's share of the node's NVMe and write them back."""
    if not nbytes:
        return 0.0
    if rates.nvme_read is None or rates.nvme_write is None:
        raise ValueError("states on NVMe but the node has no nvme: {read_gbs, write_gbs} in its spec")
    return nbytes / rates.nvme_read + nbytes / rates.nvme_write


def device_step_nvme(rates: OffloadRates, *, state_bytes: float) -> StepTraffic:
    """Parameters on the device, optimizer states in files: per step the states are read, copied to the
    device, stepped there (the caller adds the device step), copied back and written; serial."""
    return StepTraffic(serial=nvme_io(rates, state_bytes) + state_bytes / rates.h2d + state_bytes / rates.d2h)


# -- parameters fetched ahead of use (ZeRO-Infinity) --------------------------------------------------


def estimate_prefetch_exposed(*, compute_s: Sequence[float], hops_s: Sequence[Sequence[float]],
                              prefetch_depth: int) -> float:
    """Exposed seconds of one pass over blocks whose parameters are fetched ahead of use.

    ``compute_s[i]`` is block i's compute; ``hops_s[i]`` its transfer time on each hop of the path, in
    order (``[nvme -> host, host -> device]`` or ``[host -> device]``). Each hop is one link that moves one
    block at a time. With depth ``d``, block ``i``'s fetch may start once block ``i - d - 1`` has finished
    computing (``d`` staging buffers ahead of the running block; ``d = 0`` fetches serially), so block
    ``i + 1`` comes from host and ``i + 2`` from disk while block ``i`` computes (ZeRO-Infinity,
    Rajbhandari et al., SC'21, section 6.2) when ``d >= 2``. Returns the pass's makespan less its compute:
    the first fetch (nothing hides it) plus every stall. For uniform blocks the steady-state period is
    ``max(slowest hop, compute, (sum of hops + compute) / (d + 1))``: each link moves one block at a time
    and a buffer's cycle (its block's hops, then its compute) is shared by ``d + 1`` buffers."""
    n = len(compute_s)
    if len(hops_s) != n or prefetch_depth < 0:
        raise ValueError(f"{n} blocks but {len(hops_s)} transfer rows, or prefetch_depth {prefetch_depth} < 0")
    if n == 0:
        return 0.0
    num_hops = max(len(h) for h in hops_s)
    link_free = [0.0] * num_hops
    done: list[float] = []
    t = 0.0
    for i in range(n):
        ready = done[i - prefetch_depth - 1] if i - prefetch_depth - 1 >= 0 else 0.0
        for h, x in enumerate(hops_s[i]):
            ready = max(ready, link_free[h]) + x
            link_free[h] = ready
        t = max(t, ready) + compute_s[i]
        done.append(t)
    return max(0.0, t - sum(compute_s))


def choose_prefetch_depth(*, compute_s: Sequence[float], hops_s: Sequence[Sequence[float]],
                          max_depth: int = 4) -> tuple[int, float]:
    """The smallest depth in ``1..max_depth`` whose exposed time no deeper one beats (each step deeper
    costs one more staging buffer on both sides), and that exposed time. Uniform blocks reach their
    floor at the number of hops; uneven ones (a large embedding behind small layers) may need more."""
    best = [(estimate_prefetch_exposed(compute_s=compute_s, hops_s=hops_s, prefetch_depth=d), d)
            for d in range(1, max_depth + 1)]
    floor = min(x for x, _ in best)
    for x, d in best:
        if x <= floor * (1 + 1e-9) + 1e-12:
            return d, x
    raise AssertionError("unreachable")  # pragma: no cover


def fetch_hops(rates: OffloadRates, nbytes: float, *, from_nvme: bool) -> tuple[float, ...]:
    """Per-hop seconds of bringing ``nbytes`` to the device: ``(host -> device,)`` or
    ``(nvme -> host, host -> device)``."""
    up = nbytes / rates.h2d
    if not from_nvme:
        return (up,)
    if rates.nvme_read is None:
        raise ValueError("parameters on NVMe but the node has no nvme: {read_gbs, write_gbs} in its spec")
    return (nbytes / rates.nvme_read, up)


def fetch_seconds_per_byte(rates: OffloadRates, *, from_nvme: bool) -> float:
    """Steady-state seconds per byte of a pipelined fetch (depth >= hops): the slowest hop's rate."""
    return max(fetch_hops(rates, 1.0, from_nvme=from_nvme))


# -- activations ----------------------------------------------------------------------------------------


def estimate_activation_offload_time(rates: OffloadRates, *, saved_bytes: float) -> float:
    """Seconds per micro-batch of keeping one block's saved activations in host memory
    (``BlockPlan.activation_offload``): copied down during its forward, up during its backward. Charged
    whole, not hidden: the runtime's saved-tensor hooks (:mod:`whalepy.runtime._activations`) issue both
    copies on the compute stream (``non_blocking`` frees the host thread, not the stream), so the
    block's kernels wait for them. Compare with recomputation, which costs a forward."""
    if saved_bytes < 0:
        raise ValueError(f"saved_bytes must be >= 0, got {saved_bytes}")
    return saved_bytes / rates.d2h + saved_bytes / rates.h2d


def estimate_checkpoint_offload_time(rates: OffloadRates, *, input_bytes: float) -> float:
    """Seconds per micro-batch of keeping one checkpointed block's input in host memory
    (``BlockPlan.checkpoint_offload``; ZeRO-Infinity's offloaded activation checkpoints): copied down at
    its forward, up when its recompute starts. Charged whole, not hidden: the runtime issues both
    copies on the compute stream (``non_blocking`` frees the host thread, not the stream), and the copy
    up is needed by the recompute that follows it. On top of the recompute's own time."""
    if input_bytes < 0:
        raise ValueError(f"input_bytes must be >= 0, got {input_bytes}")
    return input_bytes / rates.d2h + input_bytes / rates.h2d
