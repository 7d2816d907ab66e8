"""Measured planning's block clock on a CUDA GPU (skipped without CUDA; benchmarks/gpu_session.sh's
``tiers`` part runs it on one). On a GPU the clock marks block boundaries with CUDA events and
synchronises once per step (whalepy.frontend.measure.BlockClock): a host synchronisation at every
boundary stalled the launch queue the runtime keeps full. The hooks still cost host time, which a step
bound by its kernel launches pays on the device too, so measured planning scales the clocked intervals
to the plain step it times in alternation (``_timed_steps``; on CPU: tests/test_measured_planning.py,
with a deliberately costly clock). Checked here, on a GPT whose step the GPU bounds: every block's
forward and backward gets a positive interval, and the measured blocks sum to the step as it runs
without the clock, timed apart (within 10%).

Why not a small model: on an H200 (2026-11-27) a GPT of 8 x 512 at batch 4 x 256, bound by its
launches, summed to 15.2-17.9 ms under the clock, and its plain step itself ran 14.6 ms, 10.8 ms and
8.9 ms at three moments of one process: no 10% comparison holds for it."""
from __future__ import annotations

import contextlib
import statistics
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA block clock: no CUDA device here (benchmarks/gpu_session.sh runs it on a GPU)")


def test_event_clock_times_the_step_as_it_runs_without_it():
    from whalepy.frontend.measure import BlockClock, _one_step, _timed_steps, default_loss
    from whalepy.models import GPT, GPTConfig

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, block_size=512, num_layers=8, num_heads=16, hidden_size=1024)).to(dev)
    x = torch.randint(0, 1024, (8, 512), device=dev)  # fp32 without TF32: about 2.5 TFLOP a step
    blocks = {0: ("transformer.wte", "transformer.wpe")} | {
        i + 1: (f"transformer.h.{i}",) for i in range(8)} | {9: ("transformer.ln_f", "lm_head")}
    sync = torch.cuda.synchronize

    def plain_step() -> float:
        sync()
        t0 = time.perf_counter()
        default_loss(model(x), (x,)).backward()
        sync()
        for p in model.parameters():
            p.grad = None
        return time.perf_counter() - t0

    for _ in range(5):
        plain_step()
    plain = statistics.median(plain_step() for _ in range(9))
    clock = BlockClock(model, blocks, sync, dev)
    try:
        for _ in range(3):
            _one_step(model, (x,), clock, default_loss, contextlib.nullcontext, 9)
        runs = [_one_step(model, (x,), clock, default_loss, contextlib.nullcontext, 9) for _ in range(9)]
        got = _timed_steps(model, (x,), clock, default_loss, contextlib.nullcontext, 9, repeats=9)
    finally:
        clock.remove()
    after = statistics.median(plain_step() for _ in range(9))
    for k in [(i, p) for i in blocks for p in "fb"]:
        assert all(r.get(k, 0.0) > 0 for r in runs), f"block {k} got no interval"
        assert got.get(k, 0.0) > 0, f"block {k} got no measured time"
    clocked = statistics.median(sum(r.values()) for r in runs)
    step = (plain + after) / 2
    print(f"clocked {clocked * 1e3:.2f} ms, measured blocks {sum(got.values()) * 1e3:.2f} ms, "
          f"step without the clock {plain * 1e3:.2f} / {after * 1e3:.2f} ms")
    assert sum(got.values()) == pytest.approx(step, rel=0.1), \
        f"measured blocks {sum(got.values()) * 1e3:.2f} ms, step {step * 1e3:.2f} ms"
