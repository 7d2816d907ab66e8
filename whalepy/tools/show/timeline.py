"""The pipeline timeline as SVG: one lane per pipeline rank, forward / backward blocks per micro-batch,
sends on a thin lane under each rank, gradient sync and offload at the end, bubbles hatched."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from whalepy.ir.plan_text import compress_ranks
from whalepy.tools.show.schedule import OpKind, Timeline, simulate
from whalepy.tools.show.svg import (
    BACKWARD_SHADES,
    FORWARD_SHADES,
    KIND_COLOURS,
    STAGE_COLOURS,
    colour,
    fmt_time,
    ink,
    nice_ticks,
    rect,
    stage_devices,
    svg_open,
    text,
)

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan

LABEL_W = 190
PLOT_W = 940
LANE_H = 26
SEND_H = 5
LANE_GAP = 10
TOP = 34


def _op_fill(kind: OpKind, chunk: int) -> str:
    if kind is OpKind.FORWARD:
        return colour(FORWARD_SHADES, chunk)
    if kind is OpKind.BACKWARD:
        return colour(BACKWARD_SHADES, chunk)
    return KIND_COLOURS[kind.value]


def _legend(plan: Plan, y: float) -> list[str]:
    items = []
    v = plan.virtual_stages
    for k in range(v):
        suffix = f" (chunk {k})" if v > 1 else ""
        items += [(colour(FORWARD_SHADES, k), f"forward{suffix}"), (colour(BACKWARD_SHADES, k), f"backward{suffix}")]
    items += [(KIND_COLOURS["send"], "send (p2p)"), (KIND_COLOURS["grad_sync"], "gradient sync"),
              (KIND_COLOURS["offload"], "offload"), ("url(#wp-hatch)", "bubble (idle)")]
    out, x = [], LABEL_W
    for fill, label in items:
        out.append(rect(x, y, 12, 12, fill, stroke="#888"))
        out.append(text(x + 16, y + 10, label, size=11))
        x += 24 + 6.5 * len(label)
        if x > LABEL_W + PLOT_W - 80:
            x, y = LABEL_W, y + 18
    return out


BREAK_W = 48
"""Pixels of the gap that stands for the cut-out steady state of a compressed timeline."""
READABLE_OP_PX = 12.0
"""A timeline whose median forward / backward would be narrower than this is compressed (its steady
state cut out) on the page, the whole of it offered beside, wide enough to scroll through."""


@dataclass(frozen=True, slots=True)
class Cut:
    """The steady state cut out of a compressed timeline: ``[start_s, end_s]`` of the schedule."""

    start_s: float
    end_s: float

    def x(self, t: float, scale: float) -> float:
        """Plot x of time ``t`` (outside the cut)."""
        return t * scale if t <= self.start_s else (self.start_s * scale + BREAK_W + (t - self.end_s) * scale)


def _compute_ops(tl: Timeline, r: int) -> list:  # type: ignore[type-arg]
    return [o for o in tl.of_rank(r) if o.kind in (OpKind.FORWARD, OpKind.BACKWARD)]


def steady_cut(plan: Plan, tl: Timeline, plot_w: float = PLOT_W) -> Cut | None:
    """Where to cut a timeline too dense to read: keep the first rank's warm-up (the forwards before its
    first backward: it warms up longest, and every later rank has started its steady state by then) and
    two ops more, and as many ops at its end (the cool-down, which it finishes last); cut the time
    between. None when the ops are wide enough at ``plot_w`` pixels or the cut would remove less than
    a quarter of the schedule."""
    span = tl.makespan_s
    if span <= 0:
        return None
    widths = sorted(o.end_s - o.start_s for o in tl.ops if o.kind in (OpKind.FORWARD, OpKind.BACKWARD))
    if not widths or widths[len(widths) // 2] * plot_w / span >= READABLE_OP_PX:
        return None
    first = _compute_ops(tl, 0)
    warm = next((i for i, o in enumerate(first) if o.kind is OpKind.BACKWARD), len(first))
    keep = warm + 2
    if len(first) <= 2 * keep:
        return None
    cut = Cut(first[keep].start_s, first[-keep - 1].end_s)
    return cut if cut.end_s - cut.start_s >= 0.25 * span else None


def timeline_svg(plan: Plan, timeline: Timeline | None = None, *, compress: bool = False,
                 plot_w: float = PLOT_W) -> str:
    """The plan's pipeline schedule as one standalone SVG element, ``plot_w`` pixels of time wide. With
    ``compress``, a schedule too dense to read (:func:`steady_cut`) loses its steady state: warm-up and
    cool-down are drawn to scale either side of a gap labelled with the time cut out; its ops are
    ``wp-cop`` elements and its lanes ``wp-clane`` (the whole schedule's are ``wp-op`` and ``wp-lane``)."""
    tl = timeline or simulate(plan)
    S = tl.num_ranks
    span = tl.makespan_s or 1.0
    cut = steady_cut(plan, tl, plot_w) if compress else None
    scale = (plot_w - BREAK_W) / (span - (cut.end_s - cut.start_s)) if cut else plot_w / span
    xof = (lambda t: LABEL_W + cut.x(t, scale)) if cut else (lambda t: LABEL_W + t * scale)
    lanes_h = S * (LANE_H + SEND_H + LANE_GAP)
    legend_rows = 1 + (plan.virtual_stages > 1)
    height = TOP + lanes_h + 10 + 18 * legend_rows
    width = LABEL_W + plot_w + 20
    op_cls = "wp-cop" if cut else "wp-op"
    extra = (f'data-schedule="{plan.schedule.value}" data-ranks="{S}" '
             f'data-microbatches="{tl.num_microbatches}" data-virtual-stages="{tl.virtual_stages}" '
             f'data-makespan="{tl.makespan_s:.6g}"')
    if cut:
        extra += f' data-cut-start="{cut.start_s:.6g}" data-cut-end="{cut.end_s:.6g}"'
    if plot_w > PLOT_W:
        extra += ' style="max-width:none"'
    out = [svg_open(width, height, cls="wp-timeline" + (" wp-compressed" if cut else ""), extra=extra),
           '<defs><pattern id="wp-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f2f2f2"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#c8c8c8" stroke-width="2"/></pattern></defs>',
           rect(0, 0, width, height, "#ffffff")]
    last_x = -1e9
    gap_x = xof(cut.start_s) if cut else None
    for t in _ticks(span, cut, plot_w):
        x = xof(t)
        if x - last_x < 60 or (gap_x is not None and -30 < x - gap_x < BREAK_W + 30):
            continue
        last_x = x
        out.append(f'<line x1="{x:.2f}" y1="{TOP - 6}" x2="{x:.2f}" y2="{TOP + lanes_h - LANE_GAP}" '
                   f'stroke="#e3e3e3"/>')
        out.append(text(x, TOP - 10, fmt_time(t) if t else "0", size=10, anchor="middle", fill="#555"))
    for r in range(S):
        y = TOP + r * (LANE_H + SEND_H + LANE_GAP)
        st = plan.stages[r]
        ops = tl.of_rank(r)
        counts = Counter(o.kind for o in ops)
        out.append(f'<g class="{"wp-clane" if cut else "wp-lane"}" data-rank="{r}" data-forward="{counts[OpKind.FORWARD]}" '
                   f'data-backward="{counts[OpKind.BACKWARD]}" data-busy="{tl.busy_s(r):.6g}" '
                   f'data-bubble="{tl.bubble_s(r):.6g}">')
        out.append(rect(8, y + 3, 10, LANE_H - 6, colour(STAGE_COLOURS, r)))
        out.append(text(24, y + 12, f"stage {r} · {stage_devices(st)}", size=11, weight="bold", width=LABEL_W - 30))
        out.append(text(24, y + 24, f"ranks {compress_ranks(st.all_ranks)}", size=10, fill="#666", width=LABEL_W - 30))
        out.append(rect(LABEL_W, y, plot_w, LANE_H, "#fafafa", stroke="#eee"))
        for o in ops:
            pieces = [(o.start_s, o.end_s)]
            if cut:
                pieces = ([(o.start_s, min(o.end_s, cut.start_s))] if o.start_s < cut.start_s else []) + (
                    [(max(o.start_s, cut.end_s), o.end_s)] if o.end_s > cut.end_s else [])
            chunk = o.stage // S if o.stage >= 0 else 0
            common = (f'data-kind="{o.kind.value}" data-rank="{r}" data-stage="{o.stage}" '
                      f'data-mb="{o.microbatch}" data-start="{o.start_s:.6g}" data-end="{o.end_s:.6g}"')
            for a, b in pieces:
                x, w = xof(a), xof(b) - xof(a)
                if o.kind is OpKind.SEND:
                    out.append(rect(x, y + LANE_H + 1, w, SEND_H - 1, _op_fill(o.kind, 0), cls=op_cls, extra=common))
                    continue
                fill = "url(#wp-hatch)" if o.kind is OpKind.BUBBLE else _op_fill(o.kind, chunk)
                out.append(rect(x, y, w, LANE_H, fill, cls=op_cls, extra=common,
                                stroke="#ffffff" if o.kind in (OpKind.FORWARD, OpKind.BACKWARD) else ""))
                if o.kind in (OpKind.FORWARD, OpKind.BACKWARD) and w >= 11 + 6 * len(str(o.microbatch)):
                    out.append(text(x + w / 2, y + LANE_H / 2 + 4, o.microbatch, size=10, anchor="middle",
                                    fill=ink(fill), extra='pointer-events="none"'))
        if cut:  # what the gap stands for on this rank
            hidden = [o for o in ops if o.kind in (OpKind.FORWARD, OpKind.BACKWARD)
                      and o.start_s >= cut.start_s and o.end_s <= cut.end_s]
            out.append(f'<g class="wp-cut" data-rank="{r}" data-hidden="{len(hidden)}">')
            out.append(rect(xof(cut.start_s), y - 2, BREAK_W, LANE_H + SEND_H + 4, "#ffffff"))
            out.append(text(xof(cut.start_s) + BREAK_W / 2, y + LANE_H / 2 + 4, "\u2026", size=12, anchor="middle",
                            fill="#555"))
            out.append("</g>")
        out.append("</g>")
    if cut:
        gx = xof(cut.start_s)
        for dx in (2, BREAK_W - 2):
            out.append(f'<line x1="{gx + dx:.2f}" y1="{TOP - 4}" x2="{gx + dx - 4:.2f}" y2="{TOP + lanes_h - LANE_GAP}" '
                       'stroke="#888" stroke-dasharray="3 3"/>')
        out.append(text(gx + BREAK_W / 2, 12, f"{fmt_time(cut.end_s - cut.start_s)} cut", size=10,
                        anchor="middle", fill="#333", weight="bold"))
    out += _legend(plan, TOP + lanes_h + 6)
    out.append("</svg>")
    # one hatch pattern per picture: the page may hold a compressed and a whole timeline
    hatch = "wp-hatch-cut" if cut else "wp-hatch-wide" if plot_w > PLOT_W else "wp-hatch"
    return "\n".join(out).replace("wp-hatch", hatch)


def _ticks(span: float, cut: Cut | None, plot_w: float) -> list[float]:
    """Round times for the axis: over the whole span, or, either side of a cut, each part with ticks of
    its own (the parts are short next to the span)."""
    if cut is None:
        return nice_ticks(span, target=max(8, int(plot_w / 110)))
    out = []
    for lo, hi in ((0.0, cut.start_s), (cut.end_s, span)):
        step = (nice_ticks(hi - lo, target=4) + [hi - lo])[1] or 1.0
        k = math.ceil(lo / step - 1e-9)
        while k * step <= hi + 1e-12:
            out.append(k * step)
            k += 1
    return out


def full_width(plan: Plan, tl: Timeline) -> float:
    """Plot width at which the median forward / backward of ``tl`` is wide enough for its label (the
    whole schedule of a compressed one, to scroll through), at most 24,000 pixels."""
    widths = sorted(o.end_s - o.start_s for o in tl.ops if o.kind in (OpKind.FORWARD, OpKind.BACKWARD))
    if not widths or tl.makespan_s <= 0:
        return PLOT_W
    return float(min(24000.0, max(PLOT_W, 30.0 * tl.makespan_s / widths[len(widths) // 2])))


def timeline_caption(plan: Plan, tl: Timeline, cut: Cut | None = None) -> str:
    """One sentence under the picture: what it shows and how it relates to the planner's step time (and,
    for a compressed picture, what was cut out)."""
    bubble = max(tl.bubble_s(r) for r in range(tl.num_ranks))
    chunks = f" with {plan.virtual_stages} chunks per rank" if plan.virtual_stages > 1 else ""
    return (f"{plan.schedule.value}{chunks}"
            + f", {plan.num_microbatches} micro-batch{'es' if plan.num_microbatches > 1 else ''} per replica: the "
            f"schedule takes {fmt_time(tl.makespan_s)} "
            f"(largest bubble {fmt_time(bubble)}); the planner's step time, which adds the optimizer step, is "
            f"{fmt_time(plan.cost.step_time_s)}. Blocks are numbered by micro-batch; each lane is the slowest "
            f"replica of its stage."
            + (f" The steady state from {fmt_time(cut.start_s)} to {fmt_time(cut.end_s)} "
               f"({100 * (cut.end_s - cut.start_s) / tl.makespan_s:.0f}% of the schedule, every rank busy) is cut "
               "out at the dotted gap; warm-up and cool-down are drawn to scale. The whole schedule, every "
               "micro-batch, is below it." if cut else ""))


__all__ = ["Cut", "full_width", "steady_cut", "timeline_caption", "timeline_svg"]
