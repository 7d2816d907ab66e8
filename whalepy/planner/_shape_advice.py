"""Shape advice for a plan's notes: GEMMs whose shape costs speed on the planned devices (a dimension
that is not a multiple of :data:`~whalepy.cost_models.compute.GEMM_ALIGNMENT_BYTES`, such as a
vocabulary of 50257), with the predicted gain of padding it (issue 21 item 2, issue 28 item 3)."""

from __future__ import annotations

import math

from whalepy.cost_models.compute import GEMM_ALIGNMENT_BYTES, gemm_aligned, gemm_train_time, precision_bytes
from whalepy.cost_models.device_profiles import resolve_compute_profile
from whalepy.ir.rules import tp_splits
from whalepy.planner._cost_context import CostContext

PAD_MULTIPLE = 64
"""Elements the advice pads a misaligned dimension up to a multiple of: aligned for every 16-bit and
8-bit type, and a whole number of the 64-wide k-slices cuBLAS's Hopper kernels step through (the
nvjet kernel names of the H200 trace: ``..._64x4_...``); nanoGPT pads GPT-2's vocabulary of 50257 to
50304 for the same reason."""

MIN_GAIN_FRACTION = 0.01
"""Advice is given when padding is predicted to save at least this share of the step (1%)."""


def shape_notes(ctx: CostContext, *, tp: int, micro_batch: float, microbatches: int, step_s: float) -> list[str]:
    """One line per misaligned GEMM dimension of the model: the blocks that run it, and the predicted
    seconds per step padding it to the next aligned size would save on the slowest device type."""
    if ctx.precision == "fp32" or step_s <= 0:
        return []
    devices = [g.device for g in ctx.hw.groups if g.device.vendor == "nvidia"]
    if not devices:
        return []
    align = GEMM_ALIGNMENT_BYTES // precision_bytes(ctx.precision)
    pad = max(align, PAD_MULTIPLE)
    ratio = micro_batch / ctx.profile.batch_size
    gains: dict[tuple[str, int], list] = {}  # (dimension name, size) -> [seconds per step, block names]
    for b in ctx.profile.blocks:
        if b.kernels is None:
            continue
        div = tp if tp_splits(b, tp) else 1
        for g in b.kernels.gemms:
            m = g.m * (ratio if g.batch <= 1 else 1)
            batch = g.batch * (ratio if g.batch > 1 else 1)
            k = g.k / div if g.shard == "k" else g.k
            n = g.n / div if g.shard == "n" else g.n
            if gemm_aligned(k, n, ctx.precision):
                continue
            pk, pn = (math.ceil(x / pad) * pad for x in (k, n)) if div == 1 else \
                (math.ceil(x / align) * align for x in (k, n))
            worst = 0.0
            for d in devices:
                prof = resolve_compute_profile(d)
                kw = dict(device=d, profile=prof, precision=ctx.precision, batch=batch, grad_input=g.grad_input,
                          grad_weight=g.grad_weight)
                now = sum(gemm_train_time(m, k, n, **kw))  # type: ignore[arg-type]
                padded = sum(gemm_train_time(m, pk, pn, **kw))  # type: ignore[arg-type]
                worst = max(worst, now - padded)
            for name, size, to in (("k", g.k, pk * (div if g.shard == "k" else 1)),
                                   ("n", g.n, pn * (div if g.shard == "n" else 1))):
                if int(size) * precision_bytes(ctx.precision) % GEMM_ALIGNMENT_BYTES:
                    entry = gains.setdefault((name, int(size)), [0.0, [], int(to)])
                    entry[0] += worst * microbatches
                    if b.name not in entry[1]:
                        entry[1].append(b.name)
                    break
    out = []
    for (name, size), (gain, blocks, to) in gains.items():
        if gain < MIN_GAIN_FRACTION * step_s:
            continue
        where = ", ".join(blocks[:3]) + (f" and {len(blocks) - 3} more" if len(blocks) > 3 else "")
        out.append(f"shape: the GEMMs of {where} have {name} = {size}, not a multiple of {align} "
                   f"({GEMM_ALIGNMENT_BYTES}-byte rows in {ctx.precision}), so cuBLAS runs slower fallback kernels; "
                   f"padding it to {to} (for a vocabulary: the embedding and head rows) is predicted to save "
                   f"{gain * 1e3:.3g} ms per step ({100 * gain / step_s:.0f}%)")
    return out
