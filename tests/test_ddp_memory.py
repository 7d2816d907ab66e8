"""The predicted peak of DDP and ZeRO-1 plans against the peak each rank holds (whalepy.trace_memory on
2 gloo ranks). DDP's gradients are views of the reducer's buckets (gradient_as_bucket_view=True), which
it keeps through ``zero_grad(set_to_none=True)``: the gradients are held at the activation peak of
every step, and under gradient accumulation the micro-batches run under ``no_sync`` accumulate into
gradients of their own beside the buckets. The prediction that freed them was one gradient copy under
the traced peak (benchmarks/bench_predict_cpu.py's ``gpt-wide`` DDP rows: -16% to -20%)."""
from __future__ import annotations

import pytest

import whalepy
from whalepy import ClusterSpec
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

from ddp_memory_cases import build, traced_peaks
from dist_harness import run_distributed

LAYOUTS = {"DDP": dict(dp=2), "ZeRO-1": dict(dp=2, zero_stage=1), "DDP M2": dict(dp=2, num_microbatches=2)}

TOLERANCE = 0.03
"""These plans' errors after the fix: +0.3%, +0.4%, +1.3% (2026-11-27); the gradient copy the prediction
left out is 21-27% of these peaks (asserted below), so the old rule fails by far."""


@pytest.fixture(scope="module")
def predicted_and_traced():
    model, x, _ = build()
    prof = whalepy.profile(model, (x[:1],))
    cluster = ClusterSpec.local(2, device_type="CPU")
    ests = {k: estimate_from_profile(prof, cluster, ParallelConfig(**cfg), global_batch=8) for k, cfg in LAYOUTS.items()}
    peaks = run_distributed(traced_peaks, 2, [e.plan for e in ests.values()], cluster, timeout=300)
    return ests, peaks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_predicted_peak_holds_the_gradients_ddp_keeps(predicted_and_traced, layout):
    ests, peaks = predicted_and_traced
    i = list(LAYOUTS).index(layout)
    est = ests[layout]
    stage = est.plan.stages[0]
    predicted = stage.cost.memory_bytes
    for rank_peaks in peaks:
        assert predicted == pytest.approx(rank_peaks[i], rel=TOLERANCE), (
            f"{layout}: predicted {predicted / 2**20:.2f} MiB, traced {rank_peaks[i] / 2**20:.2f} MiB")
    # the gradient copy the prediction used to leave out is far beyond the tolerance
    assert stage.cost.grads_bytes > 5 * TOLERANCE * predicted
