"""The page's pictures besides the timeline: the devices grid, memory against capacity, GPU types
(batch shares, busy and idle time) and the alternatives. Each returns an HTML fragment; drawn elements
carry ``data-*`` attributes that tests/test_show_browser.py counts in the rendered page."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from whalepy.ir.plan_text import compress_names, compress_ranks
from whalepy.tools.show.svg import (
    MEMORY_COLOURS,
    STAGE_COLOURS,
    TYPE_COLOURS,
    colour,
    esc,
    fmt_bytes,
    fmt_time,
    ink,
    rect,
    stage_devices,
    svg_open,
    text,
)

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan, StagePlan

WIDTH = 1140


def type_index(plan: Plan) -> dict[str, int]:
    """Each GPU type's colour index, in the order the ranks first use them."""
    return {t: i for i, t in enumerate(dict.fromkeys(plan.rank_device_types))}


# -- devices ---------------------------------------------------------------------------------------

GROUPED_ABOVE = 128
"""Worlds above this many ranks are drawn grouped by stage (:func:`grouped_grid`): one cell per rank no
longer has room for its label."""


def devices_grid(plan: Plan) -> str:
    """Every rank as a cell: fill by stage, top bar and label colour by GPU type; above
    :data:`GROUPED_ABOVE` ranks, grouped by stage (:func:`grouped_grid`)."""
    n = plan.world_size
    if n > GROUPED_ABOVE:
        return grouped_grid(plan)
    cols = min(n, 16 if n <= 128 else 32 if n <= 512 else 64 if n <= 2048 else 128)
    gap = 4 if cols <= 32 else 2 if cols <= 64 else 1
    cell = min(60.0, (WIDTH - 20) / cols - gap)
    rows = math.ceil(n / cols)
    types = type_index(plan)
    out: list[str] = []
    where = {}
    for st in plan.stages:
        for d, row in enumerate(st.ranks):
            for t, r in enumerate(row):
                where[r] = (st.index, d, t)
    for r in range(n):
        s, d, t = where[r]
        x, y = 10 + (r % cols) * (cell + gap), (r // cols) * (cell + gap)
        dev = plan.rank_device_types[r]
        tc = colour(TYPE_COLOURS, types[dev])
        out.append(rect(x, y, cell, cell, colour(STAGE_COLOURS, s), cls="wp-device",
                        extra=(f'rx="3" data-rank="{r}" data-stage="{s}" '
                               f'data-replica="{d}" data-tp="{t}" data-device-type="{esc(dev)}"')))
        bar = max(2.0, cell / 4.5)
        if cell >= 6:
            out.append(rect(x + 1, y + 1, cell - 2, bar, tc, stroke="#555", extra='stroke-width="0.5"'))
        if cell >= 44:
            out.append(text(x + cell / 2, y + bar - 2, dev, size=9, anchor="middle", fill=ink(tc),
                            extra='pointer-events="none"', width=cell - 2))
        if cell >= 22:
            out.append(text(x + cell / 2, y + (cell + bar) / 2 + 4, r, size=12 if cell >= 30 else 9, anchor="middle",
                            fill=ink(colour(STAGE_COLOURS, s)), weight="bold", extra='pointer-events="none"'))
        if cell >= 44:
            out.append(text(x + cell / 2, y + cell - 5, f"d{d} t{t}", size=9, anchor="middle",
                            fill=ink(colour(STAGE_COLOURS, s)),
                            extra='pointer-events="none"'))
    y = rows * (cell + gap) + 8
    x = 10.0
    for st in plan.stages:
        x, y = _legend_item(out, x, y, colour(STAGE_COLOURS, st.index), f"stage {st.index}")
    for name, i in types.items():
        x, y = _legend_item(out, x, y, colour(TYPE_COLOURS, i), f"{name} ({plan.rank_device_types.count(name)})")
    head = svg_open(WIDTH, y + 20, cls="wp-devices", extra=f'data-devices="{n}" data-stages="{plan.pp_degree}"')
    return "\n".join([head, *out, "</svg>"])


GROUP_LABEL_W = 44
MIN_CELL = 7.0
LABEL_SPACING = 44.0


def grouped_grid(plan: Plan) -> str:
    """A large world, one panel per pipeline stage: a headline (stage, GPU types, ranks, dp x tp), then
    one column per data-parallel replica holding its tensor-parallel shards top to bottom (a TP group
    stays in one node), replicas wrapping onto more rows, every few replicas labelled. Each cell is a
    rank (fill: stage; top bar: GPU type) whose rank, replica and shard show on hover."""
    types = type_index(plan)
    avail = WIDTH - 20 - GROUP_LABEL_W
    out: list[str] = []
    y = 0.0
    for st in plan.stages:
        dp, tp = len(st.ranks), st.tp_degree
        gap = 2.0 if tp > 1 else 1.0
        per_row = max(1, min(dp, int(avail // (MIN_CELL + gap))))
        cw = min(22.0, avail / per_row - gap)
        ch = min(cw, max(MIN_CELL, 64.0 / tp))
        step = next(k for k in (1, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100, 128, 256, 512, 1024)
                    if k * (cw + gap) >= LABEL_SPACING or k >= dp)
        fill = colour(STAGE_COLOURS, st.index)
        out.append(rect(10, y + 3, 12, 12, fill, stroke="#777", extra='rx="2" stroke-width="0.5"'))
        out.append(text(28, y + 13, f"stage {st.index} · {stage_devices(st)} · ranks {compress_ranks(st.all_ranks)} · "
                                    f"dp {dp} x tp {tp}" + (" (column: one replica, its TP shards top to bottom)"
                                                            if tp > 1 else ""),
                        size=12, weight="bold", width=WIDTH - 40))
        y += 22
        out.append(f'<g class="wp-stage-group" data-stage="{st.index}" data-replicas="{dp}" data-tp="{tp}">')
        for row0 in range(0, dp, per_row):
            out.append(text(10 + GROUP_LABEL_W - 6, y + min(tp * ch, 24) / 2 + 4, f"d{row0}", size=10,
                            anchor="end", fill="#444"))
            for d in range(row0, min(dp, row0 + per_row)):
                x = 10 + GROUP_LABEL_W + (d - row0) * (cw + gap)
                dev = st.device_types[d]
                tc = colour(TYPE_COLOURS, types[dev])
                for t, r in enumerate(st.ranks[d]):
                    cy = y + t * ch
                    out.append(rect(x, cy, cw, ch - (0.5 if tp > 1 else 0), fill, cls="wp-device",
                                    extra=(f'data-rank="{r}" data-stage="{st.index}" data-replica="{d}" '
                                           f'data-tp="{t}" data-device-type="{esc(dev)}"')))
                out.append(rect(x, y, cw, min(2.5, ch / 4), tc, stroke="#555", extra='stroke-width="0.4" pointer-events="none"'))
                if (d - row0) % step == 0 and d != row0:
                    out.append(text(x, y + tp * ch + 11, f"d{d}", size=10, fill="#444"))
            y += tp * ch + 16
        out.append("</g>")
        y += 8
    x = 10.0
    for st in plan.stages:
        x, y = _legend_item(out, x, y, colour(STAGE_COLOURS, st.index), f"stage {st.index}")
    for name, i in types.items():
        x, y = _legend_item(out, x, y, colour(TYPE_COLOURS, i), f"{name} ({plan.rank_device_types.count(name)})")
    head = svg_open(WIDTH, y + 20, cls="wp-devices wp-grouped",
                    extra=f'data-devices="{plan.world_size}" data-stages="{plan.pp_degree}"')
    return "\n".join([head, *out, "</svg>"])


def _legend_item(out: list[str], x: float, y: float, fill: str, label: str) -> tuple[float, float]:
    out.append(rect(x, y, 12, 12, fill, stroke="#777", extra='rx="2" stroke-width="0.5"'))
    out.append(text(x + 16, y + 10, label, size=11))
    x += 30 + 6.5 * len(label)
    if x > WIDTH - 160:
        return 10.0, y + 18
    return x, y


# -- memory ----------------------------------------------------------------------------------------

MEMORY_PARTS = (("params", "params_bytes", "parameters"), ("grads", "grads_bytes", "gradients"),
                ("optimizer", "optimizer_bytes", "optimizer states"), ("activations", "activation_bytes",
                                                                       "activations"),
                ("buffers", "buffer_bytes", "buffers"))


def _tier_contents(st: StagePlan, tier: str) -> str:
    kinds = []
    if any(b.param_tier.value == tier for b in st.blocks):
        kinds.append("parameters")
    if any(b.optimizer_tier.value == tier for b in st.blocks):
        kinds.append("optimizer states")
    return " and ".join(kinds) or "-"


def memory_bars(plan: Plan) -> str:
    """Per stage (its tightest device): GPU memory by kind against usable capacity, then host and disk."""
    label_w, bar_w, row_h = 230, 640, 24
    full = max(max(s.cost.capacity_bytes + s.cost.margin_bytes + s.cost.reserve_bytes, s.cost.memory_bytes)
               for s in plan.stages) or 1
    host = max(max(s.cost.host_state_bytes, s.cost.cpu_bytes) for s in plan.stages)
    disk = max(max(s.cost.nvme_state_bytes, s.cost.nvme_bytes) for s in plan.stages)
    tiers = [("gpu", full)] + ([("host", host)] if host else []) + ([("disk", disk)] if disk else [])
    per_stage = len(tiers) * (row_h + 4) + 12
    out = [""]  # the <svg> head, once its height is known
    scale = bar_w / full
    for i, st in enumerate(plan.stages):
        c = st.cost
        y0 = i * per_stage
        out.append(rect(4, y0 + 4, 8, len(tiers) * (row_h + 4) - 4, colour(STAGE_COLOURS, st.index)))
        out.append(text(18, y0 + 16, f"stage {st.index} · {stage_devices(st)}", size=12, weight="bold",
                        width=label_w - 60))
        out.append(text(18, y0 + 30, f"ranks {compress_ranks(st.all_ranks)}, ZeRO-{int(st.zero_stage)}", size=10,
                        fill="#666", width=label_w - 60))
        for k, (tier, top) in enumerate(tiers):
            y = y0 + k * (row_h + 4) + 2
            x = label_w
            out.append(text(label_w - 8, y + 16, tier.upper() if tier == "gpu" else tier, size=11, anchor="end",
                            fill="#444"))
            if tier == "gpu":
                out.append(f'<g class="wp-mem" data-stage="{st.index}" data-tier="gpu" data-used="{c.memory_bytes}" '
                           f'data-capacity="{c.capacity_bytes}">')
                cap_x = label_w + c.capacity_bytes * scale
                out.append(rect(cap_x, y, c.margin_bytes * scale, row_h, MEMORY_COLOURS["margin"], stroke="#999",
                                cls="wp-mem-part", extra=f'data-part="margin" data-bytes="{c.margin_bytes}" '
                                                         'data-name="margin: left unplanned (memory_margin)"'))
                out.append(rect(cap_x + c.margin_bytes * scale, y, c.reserve_bytes * scale, row_h,
                                MEMORY_COLOURS["reserve"],
                                cls="wp-mem-part", extra=f'data-part="reserve" data-bytes="{c.reserve_bytes}" '
                                                         'data-name="reserved: CUDA context, NCCL, fragmentation"'))
                for key, field, name in MEMORY_PARTS:
                    w = getattr(c, field) * scale
                    out.append(rect(x, y, w, row_h, MEMORY_COLOURS[key], cls="wp-mem-part",
                                    extra=f'data-part="{key}" data-bytes="{getattr(c, field)}" data-name="{name}"'))
                    x += w
                out.append(f'<line x1="{cap_x:.2f}" y1="{y - 3}" x2="{cap_x:.2f}" y2="{y + row_h + 3}" '
                           'stroke="#222" stroke-width="2"/>')
                pct = 100 * c.memory_bytes / c.capacity_bytes if c.capacity_bytes else 0.0
                over = c.capacity_bytes and c.memory_bytes > c.capacity_bytes
                out.append(text(label_w + bar_w + 10, y + 16, f"{fmt_bytes(c.memory_bytes)} / "
                                f"{fmt_bytes(c.capacity_bytes)} usable ({pct:.0f}%)"
                                + (": DOES NOT FIT" if over else ""),
                                size=11, fill="#c0392b" if over else "#222", weight="bold" if over else "normal"))
                out.append("</g>")
            else:
                used = (max(c.host_state_bytes, c.cpu_bytes) if tier == "host"
                        else max(c.nvme_state_bytes, c.nvme_bytes))
                fill = "#8c6d31" if tier == "host" else "#636363"
                out.append(f'<line x1="{x}" y1="{y + 2}" x2="{x}" y2="{y + row_h - 2}" stroke="#222"/>')
                out.append(rect(x, y + 4, used / top * bar_w, row_h - 8, fill, cls="wp-mem-part",
                                extra=f'data-stage="{st.index}" data-tier="{tier}" data-bytes="{used}" '
                                      f'data-scale="{top}"'))
                what = _tier_contents(st, "cpu" if tier == "host" else "nvme")
                out.append(text(label_w + bar_w + 10, y + 16, f"{fmt_bytes(used)} per GPU: {what}", size=11))
    y = len(plan.stages) * per_stage + 8
    x = 10.0
    for key, _, name in MEMORY_PARTS:
        x, y = _legend_item(out, x, y, MEMORY_COLOURS[key], name)
    x, y = _legend_item(out, x, y, MEMORY_COLOURS["margin"], "margin (left unplanned)")
    x, y = _legend_item(out, x, y, MEMORY_COLOURS["reserve"], "reserved (CUDA context, NCCL, fragmentation)")
    out.append(text(x, y + 10, "| usable capacity", size=11, weight="bold"))
    others = [f"{tier}: {fmt_bytes(top)}" for tier, top in tiers[1:]]
    if others:  # each tier's bars share one scale: the full width is the largest stage's bytes there
        out.append(text(10, y + 28, "One scale per tier. GPU: full width = device memory; full width of "
                        + ", ".join(others) + " (the largest stage there).", size=11, fill="#444"))
        y += 18
    out[0] = svg_open(WIDTH, y + 22, cls="wp-memory", extra=f'data-stages="{plan.pp_degree}"')
    out.append("</svg>")
    return "\n".join(out)


# -- GPU types -------------------------------------------------------------------------------------

def type_rows(plan: Plan) -> list[dict[str, object]]:
    """Per GPU type: its ranks, the stages and blocks it runs, the samples per step its replicas carry
    in each of those stages, and busy / idle time per step (``PlanCost.busy_by_device_type``)."""
    busy = dict(plan.cost.busy_by_device_type)
    rows = []
    for name in type_index(plan):
        shares, blocks = {}, []
        for st in plan.stages:
            share = sum(b for b, t in zip(plan.batch_shares, st.device_types) if t == name)
            if share:
                shares[st.index] = share
                blocks += st.block_names
        b = busy.get(name)
        rows.append(dict(name=name, ranks=plan.rank_device_types.count(name), shares=shares,
                         blocks=compress_names(blocks), busy=b,
                         idle=None if b is None else max(0.0, plan.cost.step_time_s - b)))
    return rows


def _share_text(plan: Plan, shares: dict[int, int]) -> str:
    vals = set(shares.values())
    if len(vals) == 1:
        (v,) = vals
        where = ("every stage" if len(shares) == plan.pp_degree
                 else f"stage{'s' if len(shares) > 1 else ''} {', '.join(map(str, shares))}")
        return f"{v} / {plan.global_batch} samples ({100 * v / plan.global_batch:.0f}%) in {where}"
    return "; ".join(f"stage {s}: {v} / {plan.global_batch}" for s, v in shares.items())


def types_table(plan: Plan) -> str:
    step = plan.cost.step_time_s
    colours = type_index(plan)
    out = ['<table class="wp-types"><tr><th>GPU type</th><th>ranks</th><th>batch share</th><th>blocks</th>'
           '<th>busy / idle per step</th></tr>']
    for row in type_rows(plan):
        name = str(row["name"])
        if row["busy"] is not None and step > 0:
            b = float(row["busy"])  # type: ignore[arg-type]
            bar = (f'<div class="wp-bar" data-device-type="{esc(name)}" data-busy="{b:.6g}" data-step="{step:.6g}">'
                   f'<span class="busy" style="width:{min(100.0, 100 * b / step):.1f}%"></span></div>'
                   f'{fmt_time(b)} busy, {fmt_time(float(row["idle"]))} idle')  # type: ignore[arg-type]
        else:
            bar = "-"
        out.append(f'<tr class="wp-type" data-device-type="{esc(name)}"><td><span class="sw" style="background:'
                   f'{colour(TYPE_COLOURS, colours[name])}"></span>{esc(name)}</td><td>{row["ranks"]}</td>'
                   f'<td>{esc(_share_text(plan, row["shares"]))}</td>'  # type: ignore[arg-type]
                   f'<td class="wrap">{esc(row["blocks"])}</td><td class="nowrap">{bar}</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def batch_shares_bar(plan: Plan) -> str:
    """The global batch split across data-parallel replicas, each coloured by its GPU type in stage 0."""
    colours = type_index(plan)
    out = [f'<div class="wp-shares" data-replicas="{plan.dp_degree}">']
    for d, share in enumerate(plan.batch_shares):
        types = [st.device_types[d] for st in plan.stages]
        tip = f"replica {d}: {share} samples on " + " / ".join(dict.fromkeys(types))
        tc = colour(TYPE_COLOURS, colours[types[0]])
        out.append(f'<span class="wp-share" data-replica="{d}" data-share="{share}" title="{esc(tip)}" '
                   f'style="flex:{share};background:{tc};color:{ink(tc)}">'
                   f'{share if plan.dp_degree <= 32 else ""}</span>')
    out.append("</div>")
    return "\n".join(out)


# -- alternatives ----------------------------------------------------------------------------------

def squeeze_repeats(s: str) -> str:
    """``"a100:4,a100:4,a100:4,l40s:4"`` -> ``"a100:4 x3,l40s:4"``: long per-replica lists stay readable."""
    return re.sub(r"(?<![^\s,=])([^\s,=]+)(?:,\1(?=[,\s]|$))+",
                  lambda m: f"{m.group(1)} x{m.group(0).count(',') + 1}", s)


def alternatives_table(plan: Plan) -> str:
    if not plan.alternatives:
        return '<p class="wp-none">No alternatives recorded (a plan given by hand, or an older plan file).</p>'
    chosen = plan.cost.step_time_s
    out = ['<table class="wp-alternatives"><tr><th>configuration</th><th>predicted step</th><th>vs chosen</th>'
           '<th>why it lost</th></tr>',
           f'<tr class="chosen"><td>chosen: pp={plan.pp_degree} dp={plan.dp_degree} tp='
           f'{"/".join(map(str, sorted(set(plan.tp_degrees))))} M={plan.num_microbatches} {plan.schedule.value}'
           f'</td><td>{fmt_time(chosen)}</td><td></td><td></td></tr>']
    for a in plan.alternatives:
        fits = not math.isinf(a.step_time_s)
        pct = 100 * (a.step_time_s / chosen - 1) if fits and chosen > 0 else math.nan
        rel = "-" if math.isnan(pct) else f"{pct:+.1f}%" if abs(pct) < 10 else f"{pct:+.0f}%"
        out.append(f'<tr class="wp-alt"><td class="wrap">{esc(squeeze_repeats(a.description))}</td>'
                   f'<td>{fmt_time(a.step_time_s) if fits else "-"}'
                   f'</td><td>{rel}</td><td class="wrap">{esc(a.reason)}</td></tr>')
    out.append("</table>")
    return "\n".join(out)
