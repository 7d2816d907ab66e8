"""Shape advice for a plan's notes: GEMM dimensions that cost speed on the planned devices (a dimension
that is not a multiple of :data:`~whalepy.cost_models.compute.GEMM_ALIGNMENT_BYTES`: a vocabulary of
50257, a hidden, FFN or head size, a micro-batch x sequence token count), with the predicted gain of
changing it (issue 21 item 2, issue 28 item 3).

The cost model's rule (``cost_models/compute.py``, ``gemm_aligned``): cuBLAS's tensor-core kernels need
the row strides of a ``(m x k) @ (k x n)`` product, ``k`` and ``n``, aligned. A token count is the ``m``
of a weight's forward and input-gradient products, and the ``k`` of its weight-gradient product
``X^T dY``: a misaligned one slows that third of the work. Each dimension is advised on alone: its gain
is the block GEMMs' predicted time now minus with that one dimension changed (the others as they are).
Where the plan compiles its blocks, inductor pads a misaligned product itself when that is faster
(``cost_models/compute.py``, ``INDUCTOR_PAD_MULTIPLIER``): what is left to gain is the padding copies,
and the advice is given only where that still reaches :data:`MIN_GAIN_FRACTION`.
"""

from __future__ import annotations

import math
from collections import Counter

from whalepy.cost_models.compute import GEMM_ALIGNMENT_BYTES, gemm_train_time, precision_bytes
from whalepy.cost_models.device_profiles import resolve_compute_profile
from whalepy.ir.rules import tp_splits
from whalepy.planner._cost_context import CostContext

PAD_MULTIPLE = 64
"""Elements the advice pads a misaligned model dimension up to a multiple of: aligned for every 16-bit
and 8-bit type, and a whole number of the 64-wide k-slices cuBLAS's Hopper kernels step through (the
nvjet kernel names of the H200 trace: ``..._64x4_...``); nanoGPT pads GPT-2's vocabulary of 50257 to
50304 for the same reason. Token counts and sequence lengths are padded to the alignment only (their
size is the user's data, not the model's)."""

MIN_GAIN_FRACTION = 0.01
"""Advice is given when a change is predicted to save at least this share of the step (1%)."""

VOCABULARY, HIDDEN, PROJECTION, HEAD_DIM, SEQUENCE, TOKENS = (
    "the vocabulary", "the hidden size", "an FFN / attention projection size", "the head dim",
    "the sequence length", "the tokens per micro-batch (micro-batch x sequence)")


def _hidden_size(ctx: CostContext) -> int | None:
    """The model's hidden size: the commonest input width of the weight products of its layer blocks."""
    widths = Counter(g.k for b in ctx.profile.blocks if b.kernels is not None and b.kind.value == "layer"
                     for g in b.kernels.gemms if g.batch <= 1)
    return widths.most_common(1)[0][0] if widths else None


def _label(block_kind: str, gemm, pos: str, size: int, hidden: int | None) -> str:  # type: ignore[no-untyped-def]
    """What the user calls dimension ``pos`` of ``gemm`` (a product of a block of ``block_kind``)."""
    if gemm.batch > 1:  # a product of two activations per head: (seq x d) @ (d x seq), (seq x seq) @ (seq x d)
        return SEQUENCE if pos == "m" or size == gemm.m else HEAD_DIM
    if pos == "m":
        return TOKENS
    if size == hidden:
        return HIDDEN
    return VOCABULARY if block_kind in ("head", "embedding") else PROJECTION


def _misaligned(x: float, precision: str) -> bool:
    return float(x).is_integer() and int(x) * precision_bytes(precision) % GEMM_ALIGNMENT_BYTES != 0


def shape_notes(ctx: CostContext, *, tp: int, micro_batch: float, microbatches: int, step_s: float) -> list[str]:
    """One line per misaligned dimension of the model's GEMMs whose change is predicted to save at least
    :data:`MIN_GAIN_FRACTION` of the step: what it is, the blocks that run it, the size to use and the
    seconds per step saved on the slowest device type."""
    if ctx.precision == "fp32" or step_s <= 0:
        return []
    devices = [g.device for g in ctx.hw.groups if g.device.vendor == "nvidia"]
    if not devices:
        return []
    align = GEMM_ALIGNMENT_BYTES // precision_bytes(ctx.precision)
    ratio = micro_batch / ctx.profile.batch_size
    hidden = _hidden_size(ctx)
    gains: dict[tuple[str, int], list] = {}  # (label, size) -> [seconds per step, block names, padded size, pos]
    for b in ctx.profile.blocks:
        if b.kernels is None:
            continue
        div = tp if tp_splits(b, tp) else 1
        for g in b.kernels.gemms:
            shape = dict(m=g.m * (ratio if g.batch <= 1 else 1), k=g.k / div if g.shard == "k" else g.k,
                         n=g.n / div if g.shard == "n" else g.n)
            batch = g.batch * (ratio if g.batch > 1 else 1)
            split = {"m": 1, "k": div if g.shard == "k" else 1, "n": div if g.shard == "n" else 1}
            keys: dict[tuple[str, int], list[str]] = {}  # a dimension -> its positions in this product
            for pos, x in shape.items():
                if _misaligned(x, ctx.precision):
                    full = int(x) * split[pos]
                    keys.setdefault((_label(b.kind.value, g, pos, full, hidden), full), []).append(pos)
            for key, positions in keys.items():
                model_dim = key[0] not in (TOKENS, SEQUENCE) and split[positions[0]] == 1
                mult = PAD_MULTIPLE if model_dim else align
                padded = {p: (math.ceil(x / mult) * mult if p in positions else x) for p, x in shape.items()}
                worst = 0.0
                for d in devices:
                    kw = dict(device=d, profile=resolve_compute_profile(d), precision=ctx.precision, batch=batch,
                              grad_input=g.grad_input, grad_weight=g.grad_weight, padded=bool(ctx.compile))
                    now = sum(gemm_train_time(shape["m"], shape["k"], shape["n"], **kw))  # type: ignore[arg-type]
                    new = sum(gemm_train_time(padded["m"], padded["k"], padded["n"], **kw))  # type: ignore[arg-type]
                    worst = max(worst, now - new)
                to = int(padded[positions[0]]) * split[positions[0]]
                entry = gains.setdefault(key, [0.0, [], to, positions[0]])
                entry[0] += worst * microbatches
                if b.name not in entry[1]:
                    entry[1].append(b.name)
    out = []
    for (label, size), (gain, blocks, to, pos) in gains.items():
        if gain < MIN_GAIN_FRACTION * step_s:
            continue
        where = ", ".join(blocks[:3]) + (f" and {len(blocks) - 3} more" if len(blocks) > 3 else "")
        change = {VOCABULARY: f"padding it to {to} (the embedding and head rows)",
                  TOKENS: f"a micro-batch x sequence of {to} tokens (a multiple of {align})",
                  SEQUENCE: f"a sequence length of {to}"}.get(label, f"making it {to}")
        out.append(f"shape: {label}, {size}, is not a multiple of {align} ({GEMM_ALIGNMENT_BYTES}-byte rows in "
                   f"{ctx.precision}; GEMM {pos} = {size} in {where}), so "
                   + ("the compiled blocks copy its operands padded (inductor's pad_mm) before each product; "
                      if ctx.compile else "cuBLAS runs slower fallback kernels; ") +
                   f"{change} is predicted to save {gain * 1e3:.3g} ms per step ({100 * gain / step_s:.0f}%)")
    return out
