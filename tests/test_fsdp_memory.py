"""The predicted peak of FSDP2 and GPipe plans against the peak each rank holds (whalepy.trace_memory on
2 gloo ranks), one case per cause found in benchmarks/bench_predict_cpu.py's rows over 10%:

- FSDP2 (ZeRO-2): the running block's unsharded gradient buffer is not allocated yet at the loss's
  backward, the activation peak; the first block's backward holds it, once the loss's tensors are
  freed. The peak is the larger of the two (the model added the buffer to the loss's peak: +10%).
- ZeRO-3 with CPU offload (FSDP2 ``CPUOffloadPolicy``): the host's gradient shards are made in the
  backward, after the device's activation peak; a CPU rank, whose device is the host, peaks at
  ``memory_bytes + cpu_bytes - cpu_grads_bytes`` (the sum of the two peaks was +15%).
- GPipe: every micro-batch's forward runs before the first backward, so no gradient exists at the
  activation peak; the stage before the last peaks in its first block's backward (that block's
  gradients on top of every activation); the last stage keeps each micro-batch's output and
  log-probabilities until its backward (charging the gradients: +11% on ``gpt-wide``; the last stage
  without the other micro-batch's loss tensors: -7% to -10% here).

The trace counts the storages FSDP2 frees in place (``resize_(0)`` of the unsharded parameters) as
freed, and follows storages by identity rather than address (their address moves when FSDP2 gathers
into them again); before, ZeRO-3's traced peaks held every block's gathered parameters saved for
backward, and moved by up to 2 MiB between runs with where the allocator put them."""
from __future__ import annotations

import pytest

import whalepy
from whalepy import ClusterSpec
from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

from dist_harness import run_distributed
from ddp_memory_cases import GLOBAL_BATCH
from fsdp_memory_cases import build, traced_peaks

LAYOUTS = {
    # name: (sequence length, layout)
    "ZeRO-2": (64, dict(dp=2, zero_stage=2)),
    "ZeRO-3 CPU offload": (64, dict(dp=2, zero_stage=3, offload="cpu")),
    "GPipe M2": (64, dict(dp=1, pp=2, num_microbatches=2, schedule="gpipe")),
}

TOLERANCE = 0.06
"""These plans' errors after the fix (2026-11-27, the same in repeated runs): ZeRO-2 +3.6%, ZeRO-3 with
CPU offload +2.7%, GPipe +0.9% (stage 0) and -0.0% (last stage); what is left over the traced peaks is
the first block's backward transients the model does not charge. The old rules are 7% to 17% off
(asserted below)."""

MIB = 2**20


@pytest.fixture(scope="module")
def predicted_and_traced():
    cluster = ClusterSpec.local(2, device_type="CPU")
    ests = {}
    for name, (seq, cfg) in LAYOUTS.items():
        model, x, _ = build(seq)
        prof = whalepy.profile(model, (x[:1],))
        ests[name] = estimate_from_profile(prof, cluster, ParallelConfig(**cfg), global_batch=8)
    peaks = run_distributed(traced_peaks, 2, [(e.plan, LAYOUTS[k][0]) for k, e in ests.items()], cluster,
                            timeout=300)
    return ests, peaks


def _stage(est, rank):  # type: ignore[no-untyped-def]
    return next(st for st in est.plan.stages if rank in st.all_ranks)


def _check(ests, peaks, layout, old_rule):  # type: ignore[no-untyped-def]
    i = list(LAYOUTS).index(layout)
    for rank, rank_peaks in enumerate(peaks):
        c = _stage(ests[layout], rank).cost
        predicted = c.memory_bytes + c.cpu_bytes - c.cpu_grads_bytes  # a CPU rank: the host is its memory
        assert predicted == pytest.approx(rank_peaks[i], rel=TOLERANCE), (
            f"{layout} rank {rank}: predicted {predicted / MIB:.2f} MiB, traced {rank_peaks[i] / MIB:.2f} MiB")
        old = old_rule(c, rank)
        if old is not None:
            assert abs(old / rank_peaks[i] - 1) > TOLERANCE, (layout, rank, old / MIB, rank_peaks[i] / MIB)


def _logits_bytes(layout: str) -> int:
    """One micro-batch's fp32 logits on a rank (vocabulary 1024)."""
    seq, cfg = LAYOUTS[layout]
    return GLOBAL_BATCH // cfg.get("dp", 1) // cfg.get("num_microbatches", 1) * seq * 1024 * 4


def test_fsdp2_gradient_buffer_is_not_at_the_loss_peak(predicted_and_traced):
    ests, peaks = predicted_and_traced
    # the old rule: the loss's three fp32 logit-sized tensors and the block's gradient buffer at once
    _check(ests, peaks, "ZeRO-2", lambda c, rank: c.memory_bytes + 3 * _logits_bytes("ZeRO-2"))


def test_offloaded_host_gradients_come_after_the_device_peak(predicted_and_traced):
    ests, peaks = predicted_and_traced
    # the old rule: the host's peak (with every gradient shard) added to the device's
    _check(ests, peaks, "ZeRO-3 CPU offload", lambda c, rank: c.memory_bytes + c.cpu_bytes)


def test_gpipe_peaks_without_gradients_and_keeps_each_losss_tensors(predicted_and_traced):
    ests, peaks = predicted_and_traced
    assert _stage(ests["GPipe M2"], 0).cost.grads_bytes < _stage(ests["GPipe M2"], 0).cost.params_bytes
    # the old rule on the last stage: without the other micro-batch's output and log-probabilities
    _check(ests, peaks, "GPipe M2",
           lambda c, rank: c.memory_bytes - 2 * _logits_bytes("GPipe M2") if rank == 1 else None)
