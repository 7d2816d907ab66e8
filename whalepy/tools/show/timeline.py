"""The pipeline timeline as SVG: one lane per pipeline rank, forward / backward blocks per micro-batch,
sends on a thin lane under each rank, gradient sync and offload at the end, bubbles hatched."""

from __future__ import annotations

from collections import Counter
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


def timeline_svg(plan: Plan, timeline: Timeline | None = None) -> str:
    """The plan's pipeline schedule as one standalone SVG element."""
    tl = timeline or simulate(plan)
    S = tl.num_ranks
    span = tl.makespan_s or 1.0
    scale = PLOT_W / span
    lanes_h = S * (LANE_H + SEND_H + LANE_GAP)
    legend_rows = 1 + (plan.virtual_stages > 1)
    height = TOP + lanes_h + 10 + 18 * legend_rows
    width = LABEL_W + PLOT_W + 20
    out = [svg_open(width, height, cls="wp-timeline",
                    extra=(f'data-schedule="{plan.schedule.value}" data-ranks="{S}" '
                           f'data-microbatches="{tl.num_microbatches}" data-virtual-stages="{tl.virtual_stages}" '
                           f'data-makespan="{tl.makespan_s:.6g}"')),
           '<defs><pattern id="wp-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f2f2f2"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#c8c8c8" stroke-width="2"/></pattern></defs>',
           rect(0, 0, width, height, "#ffffff")]
    for t in nice_ticks(span):
        x = LABEL_W + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{TOP - 6}" x2="{x:.2f}" y2="{TOP + lanes_h - LANE_GAP}" '
                   f'stroke="#e3e3e3"/>')
        out.append(text(x, TOP - 10, fmt_time(t) if t else "0", size=10, anchor="middle", fill="#555"))
    for r in range(S):
        y = TOP + r * (LANE_H + SEND_H + LANE_GAP)
        st = plan.stages[r]
        ops = tl.of_rank(r)
        counts = Counter(o.kind for o in ops)
        out.append(f'<g class="wp-lane" data-rank="{r}" data-forward="{counts[OpKind.FORWARD]}" '
                   f'data-backward="{counts[OpKind.BACKWARD]}" data-busy="{tl.busy_s(r):.6g}" '
                   f'data-bubble="{tl.bubble_s(r):.6g}">')
        out.append(rect(8, y + 3, 10, LANE_H - 6, colour(STAGE_COLOURS, r)))
        out.append(text(24, y + 12, f"stage {r} · {stage_devices(st)}", size=11, weight="bold", width=LABEL_W - 30))
        out.append(text(24, y + 24, f"ranks {compress_ranks(st.all_ranks)}", size=10, fill="#666", width=LABEL_W - 30))
        out.append(rect(LABEL_W, y, PLOT_W, LANE_H, "#fafafa", stroke="#eee"))
        for o in ops:
            x, w = LABEL_W + o.start_s * scale, (o.end_s - o.start_s) * scale
            chunk = o.stage // S if o.stage >= 0 else 0
            common = (f'data-kind="{o.kind.value}" data-rank="{r}" data-stage="{o.stage}" '
                      f'data-mb="{o.microbatch}" data-start="{o.start_s:.6g}" data-end="{o.end_s:.6g}"')
            if o.kind is OpKind.SEND:
                out.append(rect(x, y + LANE_H + 1, w, SEND_H - 1, _op_fill(o.kind, 0), cls="wp-op", extra=common))
                continue
            fill = "url(#wp-hatch)" if o.kind is OpKind.BUBBLE else _op_fill(o.kind, chunk)
            out.append(rect(x, y, w, LANE_H, fill, cls="wp-op", extra=common,
                            stroke="#ffffff" if o.kind in (OpKind.FORWARD, OpKind.BACKWARD) else ""))
            if o.kind in (OpKind.FORWARD, OpKind.BACKWARD) and w >= 11 + 6 * len(str(o.microbatch)):
                out.append(text(x + w / 2, y + LANE_H / 2 + 4, o.microbatch, size=10, anchor="middle",
                                fill="#fff" if chunk % 2 == 0 else "#222", extra='pointer-events="none"'))
        out.append("</g>")
    out += _legend(plan, TOP + lanes_h + 6)
    out.append("</svg>")
    return "\n".join(out)


def timeline_caption(plan: Plan, tl: Timeline) -> str:
    """One sentence under the picture: what it shows and how it relates to the planner's step time."""
    bubble = max(tl.bubble_s(r) for r in range(tl.num_ranks))
    chunks = f" with {plan.virtual_stages} chunks per rank" if plan.virtual_stages > 1 else ""
    return (f"{plan.schedule.value}{chunks}"
            + f", {plan.num_microbatches} micro-batch{'es' if plan.num_microbatches > 1 else ''} per replica: the "
            f"schedule takes {fmt_time(tl.makespan_s)} "
            f"(largest bubble {fmt_time(bubble)}); the planner's step time, which adds the optimizer step, is "
            f"{fmt_time(plan.cost.step_time_s)}. Blocks are numbered by micro-batch; each lane is the slowest "
            f"replica of its stage.")


__all__ = ["timeline_caption", "timeline_svg"]
