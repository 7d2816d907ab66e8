"""Device profiles: the measured (or datasheet-derived) rates the compute model uses, per device type.

A profile is a versioned JSON file keyed by catalog device type (``"H100-SXM"``), written by
``whalepy calibrate`` (:func:`whalepy.calibrate`) or shipped in ``whalepy/cost_models/profiles/`` from
published measurements, each figure with its source. :func:`resolve_compute_profile` picks, for a
:class:`~whalepy.cost_models.devices.DeviceType`:

1. a profile file for that type in a directory of ``$WHALEPY_DEVICE_PROFILES`` (``os.pathsep``
   separated), then in ``~/.cache/whalepy/device_profiles`` (where ``whalepy calibrate`` writes);
2. the profile shipped with whalepy;
3. otherwise the **datasheet transfer rule** (:func:`datasheet_profile`): the GEMM model's fitted
   fractions of peak (``gemm_efficiency``, ``gemm_k_overhead``) are taken from the reference profile
   (:data:`REFERENCE_DEVICE`, measured), applied to this device's datasheet peak, bandwidth and SM
   count; attention and memory-bound rates are the cited constants below; the host-side launch cost
   per kernel is :data:`EAGER_LAUNCH_S` / :data:`EAGER_LAUNCH_BACKWARD_S` (measured in a training step)
   on a GPU and :data:`CPU_OP_DISPATCH_S` on a CPU device (``vendor: cpu``).

``ComputeProfile.source`` says which it was; the plan's notes repeat it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from whalepy.errors import WhalepyError

from .devices import DeviceType

PROFILE_VERSION = 1
"""Version of the device-profile JSON format; files with another version are refused."""

REFERENCE_DEVICE = "H100-SXM"
"""Device type whose shipped, measured profile supplies the fractions the transfer rule applies."""

MEMORY_BANDWIDTH_EFFICIENCY = 0.8
"""Fraction of the datasheet memory bandwidth that streaming kernels reach when no measurement is
given: STREAM-style benchmarks on data-centre GPUs (Deakin et al., "Evaluating attainable memory
bandwidth of parallel programming models via BabelStream", 2018, and later BabelStream results for
A100/H100) reach about 80-90% of the datasheet figure; framework element-wise kernels sit at the low end."""

ATTENTION_EFFICIENCY_AMPERE = 0.6
"""Fraction of the 16-bit peak a FlashAttention-2 kernel (PyTorch's SDPA flash backend) reaches on
A100-class GPUs, forward and backward, causal FLOPs counted: Dao, "FlashAttention-2: Faster Attention
with Better Parallelism and Work Partitioning" (2023) reports 50-73% of the A100's peak; 0.6 is the
middle of that range (the top is forward at long sequences, the bottom backward)."""

ATTENTION_EFFICIENCY_HOPPER = 0.35
"""The same on Hopper (H100/H200): Shah et al., "FlashAttention-3" (2024) state that FlashAttention-2
reaches only about 35% of the H100's peak, because it uses none of Hopper's asynchronous features."""

EAGER_LAUNCH_S = 1.0252e-05
"""Host time per kernel of eager PyTorch inside a training step on a CUDA GPU (dispatch and
``cudaLaunchKernel``, the host's side of the queue): the forward's host time over its kernel count in
whalepy's own step trace on one H200 (../shared/calibration/h200-2026-11-26/, the H200 profile's
``launch_overhead_s``; 16-core host, torch 2.11). It is a property of the host and PyTorch, not of the
GPU, so it transfers to GPUs without a profile. The isolated-GEMM floor of a microbenchmark (43.6 us on
the H200, 50.2 us on the H100: ``gemm_floor_s``) times one synchronised call and is not a launch cost:
charged per kernel, it made small blocks several times too slow."""

EAGER_LAUNCH_BACKWARD_S = 1.7748e-05
"""The same per backward kernel (the autograd engine's work added), from the same trace."""

CPU_OP_DISPATCH_S = 2.5e-6
"""Host time of one eager PyTorch op on CPU tensors (no launch, no queue), for CPU devices without a
profile: measured by ``whalepy calibrate --quick`` (a chain of tiny in-place adds) on this project's
2-core development machine, torch 2.13. The reference GPU profile's launch cost (tens of microseconds,
a CUDA launch) does not transfer to a CPU."""

_HOPPER_AND_LATER = frozenset({"H100-SXM", "H100-PCIe", "H200", "B200"})

NUM_SMS: dict[str, int] = {
    # NVIDIA architecture whitepapers (Volta, Turing, Ampere GA100/GA102, Ada, Hopper) and AMD CDNA2/3
    # (compute units); used for wave quantisation of GEMM tiles.
    "P100": 56, "V100-16GB": 80, "V100-32GB": 80, "T4": 40, "A10": 72, "A100-40GB": 108,
    "A100-80GB": 108, "L4": 58, "L40S": 142, "H100-SXM": 132, "H100-PCIe": 114, "H200": 132,
    "B200": 148, "MI250X": 110, "MI300X": 304,
}
"""Streaming multiprocessors (compute units) per device type, from the vendors' whitepapers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeProfile:
    """What the compute model needs about one device type (see :mod:`whalepy.cost_models.compute`)."""

    device: str
    source: str
    """Where the figures come from: ``"calibrated: <file>"``, ``"shipped: <file> (<citation>)"`` or
    ``"datasheet transfer from <reference>"``."""
    gemm_efficiency: float
    """Fraction of the datasheet peak a GEMM tile runs at in steady state (``e`` in docs/cost_model.md)."""
    gemm_k_overhead: float
    """Fixed cost of a tile in units of its reduction length (``k0``): prologue, epilogue, pipeline fill."""
    gemm_tile: tuple[int, int] = (128, 256)
    num_sms: int | None = None
    """Streaming multiprocessors, for wave quantisation; None: no quantisation."""
    memory_bandwidth: float
    """Bytes/s that memory-bound kernels reach."""
    attention_efficiency: float
    """Fraction of peak of fused attention (causal FLOPs counted), forward and backward."""
    launch_overhead_s: float
    """Host-side time to launch one kernel from eager PyTorch (dispatch + launch)."""
    launch_backward_overhead_s: float | None = None
    """The same per backward kernel (autograd engine + launch); None: ``launch_overhead_s``."""
    fit_rms_log_error: float | None = None
    """RMS of ``log(predicted / measured)`` over the GEMM rows the fit used."""
    bandwidth_measured: bool = False
    """``memory_bandwidth`` is a measured streaming kernel (``whalepy calibrate``'s 1 GiB ``add``), not
    the datasheet times :data:`MEMORY_BANDWIDTH_EFFICIENCY` (which already stands for framework
    element-wise kernels): the compute model then applies the measured fractions eager kernels reach
    of it (:data:`~whalepy.cost_models.compute.ELEMENTWISE_BANDWIDTH_FRACTION`)."""
    extra: tuple[tuple[str, float], ...] = ()
    """Other measured rates (optimizer steps, host link, disk, collectives): name -> value."""
    measured: Any = dataclasses.field(default=None, compare=False, hash=False)
    """Measured block costs (``whalepy.ir.measured.MeasuredCosts``, the file's ``measured`` section:
    ``whalepy calibrate --model`` or ``--import``); the planner prefers them to the model above."""

    def value(self, name: str) -> float | None:
        return dict(self.extra).get(name)


def profile_dirs() -> tuple[Path, ...]:
    """Directories searched for calibrated profiles, in order."""
    env = os.environ.get("WHALEPY_DEVICE_PROFILES", "")
    dirs = [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(default_profile_dir())
    return tuple(dirs)


def default_profile_dir() -> Path:
    """Where ``whalepy calibrate`` writes by default: ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "whalepy" / "device_profiles"


def profile_filename(device_type: str) -> str:
    return f"{device_type}.json"


def load_profile_file(path: str | Path, *, origin: str = "calibrated", device: DeviceType | None = None
                      ) -> ComputeProfile:
    """Read a device-profile JSON (``version`` must be :data:`PROFILE_VERSION`); ``device``: the type it
    is for (a file without a ``fit`` section takes that type's datasheet transfer rule)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WhalepyError(f"cannot read device profile {path}: {e}; re-run `whalepy calibrate`") from None
    return profile_from_dict(data, source=f"{origin}: {path.name}" + (
        f" ({data['source']})" if data.get("source") else ""), device=device)


def profile_from_dict(data: dict[str, Any], *, source: str, device: DeviceType | None = None) -> ComputeProfile:
    if data.get("version") != PROFILE_VERSION:
        raise WhalepyError(f"device profile version {data.get('version')!r} is not supported (this whalepy "
                           f"reads version {PROFILE_VERSION}); re-run `whalepy calibrate`")
    extra = tuple(sorted((k, float(v)) for k, v in data.get("rates", {}).items() if v is not None))
    measured = None
    if data.get("measured"):
        from whalepy.ir.measured import MeasuredCosts

        measured = MeasuredCosts.from_dict(data["measured"], where=f"device profile {source}")
    if "fit" not in data:  # a measured-only profile (an imported per-layer table): modelled costs use the
        from .devices import CATALOG  # datasheet transfer rule

        device = device or CATALOG.get(data["device_type"])
        if device is None:
            raise WhalepyError(f"device profile {source}: device type {data['device_type']!r} is not in the "
                               "catalog and the file has no 'fit' section; define the type in the cluster "
                               "spec's devices: section and plan with that spec")
        return dataclasses.replace(datasheet_profile(device), source=source, extra=extra, measured=measured)
    fit = data["fit"]
    return ComputeProfile(measured=measured,
        device=data["device_type"], source=source, gemm_efficiency=float(fit["gemm_efficiency"]),
        gemm_k_overhead=float(fit["gemm_k_overhead"]), gemm_tile=tuple(fit.get("gemm_tile", (128, 256))),  # type: ignore[arg-type]
        num_sms=fit.get("num_sms"), memory_bandwidth=float(fit["memory_bandwidth"]),
        attention_efficiency=float(fit["attention_efficiency"]),
        launch_overhead_s=float(fit["launch_overhead_s"]), fit_rms_log_error=fit.get("rms_log_error"),
        launch_backward_overhead_s=fit.get("launch_backward_overhead_s"),
        bandwidth_measured=bool(data.get("measurements", {}).get("memory")), extra=extra)


@functools.lru_cache(maxsize=None)
def shipped_profile(device_type: str) -> ComputeProfile | None:
    """The profile shipped in the package for ``device_type``, or None."""
    res = resources.files("whalepy.cost_models").joinpath("profiles", profile_filename(device_type))
    if not res.is_file():
        return None
    data = json.loads(res.read_text())
    return profile_from_dict(data, source=f"shipped: {profile_filename(device_type)} ({data.get('source', '')})")


def datasheet_profile(device: DeviceType) -> ComputeProfile:
    """The transfer rule for a device type without a profile (module docstring)."""
    ref = shipped_profile(REFERENCE_DEVICE)
    assert ref is not None, "the reference device profile is missing from the package"
    attention = ATTENTION_EFFICIENCY_HOPPER if device.name in _HOPPER_AND_LATER else ATTENTION_EFFICIENCY_AMPERE
    return ComputeProfile(
        device=device.name, source=f"datasheet transfer from {REFERENCE_DEVICE}",
        gemm_efficiency=ref.gemm_efficiency, gemm_k_overhead=ref.gemm_k_overhead, gemm_tile=ref.gemm_tile,
        num_sms=NUM_SMS.get(device.name), memory_bandwidth=device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY,
        attention_efficiency=attention,
        launch_overhead_s=CPU_OP_DISPATCH_S if device.vendor == "cpu" else EAGER_LAUNCH_S,
        launch_backward_overhead_s=None if device.vendor == "cpu" else EAGER_LAUNCH_BACKWARD_S)


def resolve_compute_profile(device: DeviceType) -> ComputeProfile:
    """The profile the compute model uses for ``device`` (calibrated, shipped, or datasheet transfer).

    Cached per device and search path; :func:`forget_resolved_profiles` drops the cache (``whalepy
    calibrate`` calls it after writing a profile)."""
    key = (os.environ.get("WHALEPY_DEVICE_PROFILES", ""), os.environ.get("XDG_CACHE_HOME", ""),
           os.environ.get("HOME", ""))
    return _resolve(device, key)


def forget_resolved_profiles() -> None:
    _resolve.cache_clear()


@functools.lru_cache(maxsize=256)
def _resolve(device: DeviceType, _env: tuple[str, ...]) -> ComputeProfile:
    for d in profile_dirs():
        p = d / profile_filename(device.name)
        if p.is_file():
            return load_profile_file(p, device=device)
    return shipped_profile(device.name) or datasheet_profile(device)


def compute_profile_notes(devices: Iterable[DeviceType]) -> tuple[str, ...]:
    """One line per device type for the plan's notes: which profile its compute costs came from."""
    seen = dict.fromkeys(devices)
    return tuple(f"compute costs for {d.name}: {resolve_compute_profile(d).source}" for d in seen)


def with_source(profile: ComputeProfile, source: str) -> ComputeProfile:
    return dataclasses.replace(profile, source=source)
