"""``whalepy diff a.json b.json``: what changed between two plans, and the predicted effect."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from whalepy.ir.plan_text import format_rate, compress_names
from whalepy.tools.show.svg import fmt_bytes, fmt_time, stage_devices

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan


def _degrees(p: Plan) -> str:
    return f"pp={p.pp_degree} dp={p.dp_degree} tp={'/'.join(map(str, p.tp_degrees))}"


def _schedule(p: Plan) -> str:
    return p.schedule.value + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")


def _change(name: str, a: object, b: object) -> list[str]:
    return [] if a == b else [f"  {name}: {a} -> {b}"]


def _by_block(p: Plan) -> dict[str, tuple[int, bool, str, str, bool, int, bool]]:
    return {b.name: (s.index, b.checkpoint, b.param_tier.value, b.optimizer_tier.value, b.activation_offload,
                     b.tiles, b.checkpoint_offload)
            for s in p.stages for b in s.blocks}


def _grouped(pairs: list[tuple[str, str]]) -> list[str]:
    """``[(block, change), ...]`` -> one line per distinct change, blocks compressed."""
    groups: dict[str, list[str]] = {}
    for block, change in pairs:
        groups.setdefault(change, []).append(block)
    return [f"    {compress_names(blocks)}: {change}" for change, blocks in groups.items()]


def _blocks(a: Plan, b: Plan) -> list[str]:
    ba, bb = _by_block(a), _by_block(b)
    out = []
    only_a, only_b = [n for n in ba if n not in bb], [n for n in bb if n not in ba]
    if only_a:
        out.append(f"  blocks only in the first plan: {compress_names(only_a)}")
    if only_b:
        out.append(f"  blocks only in the second plan: {compress_names(only_b)}")
    moved, ckpt, tiers, act, tiles = [], [], [], [], []
    for name, (sa, ca, pa, oa, aa, ta, ka) in ba.items():
        if name not in bb:
            continue
        sb, cb, pb, ob, ab, tb, kb = bb[name]
        if sa != sb:
            moved.append((name, f"stage {sa} -> {sb}"))
        if ca != cb:
            ckpt.append((name, "checkpointing " + ("added" if cb else "removed")))
        if aa != ab:
            act.append((name, "activations in host memory " + ("added" if ab else "removed")))
        if ka != kb:
            act.append((name, "checkpointed input in host memory " + ("added" if kb else "removed")))
        if ta != tb:
            tiles.append((name, f"tiles {ta} -> {tb}"))
        if (pa, oa) != (pb, ob):
            tiers.append((name, f"params {pa} -> {pb}, optimizer {oa} -> {ob}" if pa != pb
                          else f"optimizer {oa} -> {ob}"))
    for title, pairs in (("blocks moved", moved), ("activation checkpointing", ckpt), ("activation offload", act),
                         ("memory tiers", tiers), ("memory-centric tiling", tiles)):
        if pairs:
            out.append(f"  {title}:")
            out += _grouped(pairs)
    return out


def _stages(a: Plan, b: Plan) -> list[str]:
    out = []
    for i in range(max(a.pp_degree, b.pp_degree)):
        if i >= a.pp_degree or i >= b.pp_degree:
            st = (b if i >= a.pp_degree else a).stages[i]
            out.append(f"  stage {i}: only in the {'second' if i >= a.pp_degree else 'first'} plan "
                       f"({compress_names(st.block_names)})")
            continue
        x, y = a.stages[i], b.stages[i]
        parts = []
        if x.block_names != y.block_names:
            parts.append(f"blocks {compress_names(x.block_names)} -> {compress_names(y.block_names)}")
        dx, dy = stage_devices(x), stage_devices(y)
        if dx != dy:
            parts.append(f"devices {dx} -> {dy}")
        if (x.dp_degree, x.tp_degree) != (y.dp_degree, y.tp_degree):
            parts.append(f"dp x tp {x.dp_degree}x{x.tp_degree} -> {y.dp_degree}x{y.tp_degree}")
        if x.zero_stage != y.zero_stage:
            parts.append(f"ZeRO-{int(x.zero_stage)} -> ZeRO-{int(y.zero_stage)}")
        if x.chunk_sizes != y.chunk_sizes:
            parts.append(f"chunks {list(x.chunk_sizes)} -> {list(y.chunk_sizes)}")
        if x.reduce_every_microbatch != y.reduce_every_microbatch:
            parts.append("gradients reduced " + ("every micro-batch" if y.reduce_every_microbatch
                                                 else "once per step"))
        if parts:
            out.append(f"  stage {i}: " + "; ".join(parts))
    return out


def _pct(a: float, b: float) -> str:
    return f" ({100 * (b / a - 1):+.1f}%)" if a > 0 else ""


def _effect(a: Plan, b: Plan) -> list[str]:
    ca, cb = a.cost, b.cost
    out = ["predicted effect:",
           f"  step time {fmt_time(ca.step_time_s)} -> {fmt_time(cb.step_time_s)}"
           f"{_pct(ca.step_time_s, cb.step_time_s)}",
           f"  throughput {format_rate(ca.samples_per_s)} -> {format_rate(cb.samples_per_s)} samples/s"
           f"{_pct(ca.samples_per_s, cb.samples_per_s)}",
           f"  MFU {100 * ca.mfu:.1f}% -> {100 * cb.mfu:.1f}%"]

    def peak(p: Plan) -> tuple[float, int, int]:
        st = max(p.stages, key=lambda s: s.cost.memory_bytes / s.cost.capacity_bytes if s.cost.capacity_bytes else 0)
        k = st.cost
        return (k.memory_bytes / k.capacity_bytes if k.capacity_bytes else 0.0), k.memory_bytes, st.index

    (fa, ma, sa), (fb, mb, sb) = peak(a), peak(b)
    out.append(f"  tightest device memory {fmt_bytes(ma)} ({100 * fa:.0f}% of usable, stage {sa}) -> "
               f"{fmt_bytes(mb)} ({100 * fb:.0f}%, stage {sb})")
    bub_a = max(s.cost.bubble_s for s in a.stages)
    bub_b = max(s.cost.bubble_s for s in b.stages)
    if bub_a or bub_b:
        out.append(f"  largest pipeline bubble {fmt_time(bub_a)} -> {fmt_time(bub_b)} per step")
    host_a = max(s.cost.host_state_bytes for s in a.stages)
    host_b = max(s.cost.host_state_bytes for s in b.stages)
    if host_a or host_b:
        out.append(f"  host memory per GPU {fmt_bytes(host_a)} -> {fmt_bytes(host_b)}")
    return out


def plan_diff(a: Plan, b: Plan) -> str:
    """What differs between plan ``a`` and plan ``b`` (degrees, stages, blocks, tiers, micro-batches,
    schedule) and the predicted effect on step time and memory, as text."""
    head = [f"first:  {a.model_name}, {_degrees(a)}, {_schedule(a)}, {a.num_microbatches} micro-batches, "
            f"{fmt_time(a.cost.step_time_s)} per step",
            f"second: {b.model_name}, {_degrees(b)}, {_schedule(b)}, {b.num_microbatches} micro-batches, "
            f"{fmt_time(b.cost.step_time_s)} per step"]
    warn = []
    if a.model_fingerprint != b.model_fingerprint:
        warn.append("  note: the plans are for different models (fingerprints differ)")
    if a.rank_device_types != b.rank_device_types:
        warn.append(f"  note: the plans are for different clusters ({dict(Counter(a.rank_device_types))} vs "
                    f"{dict(Counter(b.rank_device_types))})")
    changes = (_change("degrees", _degrees(a), _degrees(b)) + _change("schedule", _schedule(a), _schedule(b))
               + _change("micro-batches", a.num_microbatches, b.num_microbatches)
               + _change("global batch", a.global_batch, b.global_batch)
               + _change("batch shares", list(a.batch_shares), list(b.batch_shares))
               + _change("precision", a.precision.value, b.precision.value)
               + _stages(a, b) + _blocks(a, b))
    if not changes and not warn:
        return "\n".join(head + ["no differences in the parallel layout", *_effect(a, b)])
    return "\n".join(head + warn + ["changes:"] + (changes or ["  none in the parallel layout"]) + _effect(a, b))
