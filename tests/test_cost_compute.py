"""Roofline compute model: checked against the roofline formula computed here and by order."""

from __future__ import annotations

import dataclasses

import pytest

from whalepy.cost_models.compute import (
    BACKWARD_TO_FORWARD_RATIO,
    MEMORY_BANDWIDTH_EFFICIENCY,
    BlockTime,
    Precision,
    estimate_block_time,
    estimate_compute_time,
)
from whalepy.cost_models.device_profiles import resolve_compute_profile
from whalepy.cost_models.devices import DeviceType

# Built by hand (A100 SXM 80GB and H100 SXM datasheet figures) so these tests do not depend on CATALOG.
A100 = DeviceType(
    name="A100-like", vendor="nvidia", peak_flops_16=312e12, peak_flops_32=19.5e12,
    memory_bytes=80 * 10**9, memory_bandwidth=2.039e12, host_link_bandwidth=32e9, source="test",
)
H100 = DeviceType(
    name="H100-like", vendor="nvidia", peak_flops_16=989e12, peak_flops_32=67e12,
    memory_bytes=80 * 10**9, memory_bandwidth=3.35e12, host_link_bandwidth=64e9, source="test",
)


def test_constants_are_fractions():
    assert 0.0 < resolve_compute_profile(A100).gemm_efficiency <= 1.0
    assert 0.0 < MEMORY_BANDWIDTH_EFFICIENCY <= 1.0
    assert BACKWARD_TO_FORWARD_RATIO == 2.0


def test_compute_bound_uses_tensor_core_peak_times_efficiency():
    flops = 1e15
    t = estimate_compute_time(flops=flops, bytes_moved=1e6, device=A100, efficiency=0.5)
    assert t == pytest.approx(flops / (312e12 * 0.5))


def test_memory_bound_uses_bandwidth_times_efficiency():
    nbytes = 1e10
    t = estimate_compute_time(flops=1e6, bytes_moved=nbytes, device=A100)
    assert t == pytest.approx(nbytes / (2.039e12 * MEMORY_BANDWIDTH_EFFICIENCY))


@pytest.mark.parametrize("flops,nbytes", [(1e12, 1e9), (1e14, 1e9), (1e9, 1e11), (0.0, 1e8), (1e12, 0.0)])
def test_roofline_takes_the_larger_bound(flops, nbytes):
    both = estimate_compute_time(flops=flops, bytes_moved=nbytes, device=A100)
    math_only = estimate_compute_time(flops=flops, bytes_moved=0.0, device=A100)
    memory_only = estimate_compute_time(flops=0.0, bytes_moved=nbytes, device=A100)
    assert both == max(math_only, memory_only)


def test_precision_selects_peak():
    kw = dict(flops=1e15, bytes_moved=0.0, device=A100)
    bf16 = estimate_compute_time(**kw, precision=Precision.BF16)
    assert estimate_compute_time(**kw, precision="fp16") == bf16
    fp32 = estimate_compute_time(**kw, precision=Precision.FP32)
    assert fp32 / bf16 == pytest.approx(312e12 / 19.5e12)


def test_unknown_precision_raises():
    with pytest.raises(ValueError):
        estimate_compute_time(flops=1.0, bytes_moved=1.0, device=A100, precision="int3")


def test_efficiency_override_and_validation():
    kw = dict(flops=1e15, bytes_moved=0.0, device=A100)
    assert estimate_compute_time(**kw, efficiency=0.9) < estimate_compute_time(**kw, efficiency=0.3)
    assert estimate_compute_time(**kw) == estimate_compute_time(**kw, efficiency=resolve_compute_profile(A100).gemm_efficiency)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            estimate_compute_time(**kw, efficiency=bad)
    with pytest.raises(ValueError):
        estimate_compute_time(flops=-1.0, bytes_moved=0.0, device=A100)


def test_faster_device_is_faster():
    for flops, nbytes in ((1e15, 1e6), (1e6, 1e10)):
        a = estimate_compute_time(flops=flops, bytes_moved=nbytes, device=A100)
        h = estimate_compute_time(flops=flops, bytes_moved=nbytes, device=H100)
        assert h < a


def test_block_time_forward_backward_recompute():
    fwd = estimate_compute_time(flops=1e13, bytes_moved=1e8, device=A100)
    plain = estimate_block_time(forward_flops=1e13, forward_bytes=1e8, device=A100)
    assert plain.forward_s == fwd
    assert plain.backward_s == pytest.approx(2 * fwd)  # backward does twice the forward's work
    assert plain.recompute_s == 0.0
    ckpt = estimate_block_time(forward_flops=1e13, forward_bytes=1e8, device=A100, recompute=True)
    assert ckpt.recompute_s == fwd
    assert ckpt.total_s == pytest.approx(4 * fwd)
    assert plain.total_s < ckpt.total_s


def test_block_time_explicit_backward():
    bt = estimate_block_time(
        forward_flops=1e13, forward_bytes=0.0, backward_flops=3e13, backward_bytes=0.0, device=A100,
        efficiency=0.5,
    )
    assert bt.backward_s == pytest.approx(3e13 / (312e12 * 0.5))


def test_block_time_is_frozen():
    bt = BlockTime(forward_s=1.0, backward_s=2.0)
    assert bt.total_s == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        bt.forward_s = 2.0  # type: ignore[misc]
