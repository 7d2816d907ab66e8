"""One self-contained HTML page of a plan: inline CSS, inline SVG, a little inline JavaScript (tooltips,
and a record of script errors in ``data-errors`` on ``<html>`` that the browser test reads). Nothing is
fetched from the network."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from whalepy.ir.plan_text import format_rate, block_tiers, compress_names, compress_ranks
from whalepy.tools.show.panels import (
    GROUPED_ABOVE,
    alternatives_table,
    batch_shares_bar,
    devices_grid,
    memory_bars,
    types_table,
)
from whalepy.tools.show.schedule import simulate
from whalepy.tools.show.svg import STAGE_COLOURS, colour, esc, fmt_time, stage_devices
from whalepy.tools.show.timeline import full_width, steady_cut, timeline_caption, timeline_svg

if TYPE_CHECKING:
    from whalepy.ir.plan import Plan

CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:0;background:#f5f6f8;color:#222}
main{max-width:1180px;margin:0 auto;padding:18px 20px 40px}
h1{font-size:22px;margin:6px 0 2px} h2{font-size:16px;margin:0 0 8px}
.sub{color:#555;font-size:13px;margin-bottom:14px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:14px 16px;margin:14px 0}
.cards{display:flex;gap:10px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:19px} .card span{font-size:11px;color:#666;text-transform:uppercase}
table{border-collapse:collapse;font-size:12.5px;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceff2;vertical-align:top}
th{background:#f0f2f5;font-weight:600;white-space:nowrap} td.wrap{overflow-wrap:anywhere} td.nowrap{white-space:nowrap}
tr.chosen td{font-weight:bold;background:#eef6ee}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;border:1px solid #777;margin-right:6px;
vertical-align:-1px}
.wp-bar{display:inline-block;width:180px;height:11px;background:#e9e9e9;margin-right:8px;vertical-align:-1px}
.wp-bar .busy{display:block;height:100%;background:#59a14f}
.wp-shares{display:flex;height:22px;border-radius:3px;overflow:hidden;margin:6px 0 4px}
.wp-share{font-size:11px;text-align:center;line-height:22px;box-shadow:inset 0 0 0 1px #888;min-width:1px}
.caption{font-size:12px;color:#555;margin-top:6px}
.notes li{font-size:12.5px;color:#444}
pre{font-size:11.5px;overflow-x:auto;background:#f7f7f7;padding:8px}
#wp-tip{position:fixed;pointer-events:none;background:#222;color:#fff;font-size:12px;padding:4px 7px;
border-radius:3px;display:none;z-index:9;white-space:pre}
svg{display:block;max-width:100%;height:auto}
"""

ERRORS_JS = """
(function(){var errs=[];var root=document.documentElement;
function rec(m){errs.push(String(m));root.setAttribute('data-errors',JSON.stringify(errs));}
root.setAttribute('data-errors','[]');
window.addEventListener('error',function(e){rec(e.message||'error');});
window.addEventListener('unhandledrejection',function(e){rec('unhandled rejection: '+e.reason);});
var ce=console.error;console.error=function(){rec(Array.prototype.join.call(arguments,' '));
return ce.apply(console,arguments);};})();
"""

TOOLTIP_JS = """
(function(){var tip=document.getElementById('wp-tip');
function ms(s){s=parseFloat(s);return s>=1?s.toPrecision(3)+' s':(s*1e3).toPrecision(3)+' ms';}
function describe(el){var d=el.dataset;
 if(d.kind){var t=d.kind.replace('_',' ');if(d.mb>=0)t+=' of micro-batch '+d.mb;
  if(d.stage>=0)t+=', virtual stage '+d.stage;return t+'\\n'+ms(d.start)+' to '+ms(d.end)+' ('+ms(d.end-d.start)+')';}
 if(d.rank&&d.deviceType)return 'rank '+d.rank+' ('+d.deviceType+')\\nstage '+d.stage+', replica '+d.replica+
  ', tp shard '+d.tp;
 if(d.part)return d.name+': '+(d.bytes/1073741824).toFixed(2)+' GiB';
 if(d.tier)return d.tier+': '+(d.bytes/1073741824).toFixed(2)+' GiB';return null;}
document.addEventListener('mousemove',function(e){var el=e.target.closest('[data-kind],[data-device-type],'+
 '[data-part],[data-tier]');var s=el&&describe(el);if(!s){tip.style.display='none';return;}
 tip.textContent=s;tip.style.display='block';tip.style.left=(e.clientX+12)+'px';tip.style.top=(e.clientY+12)+'px';});
var ops=document.querySelectorAll('svg.wp-timeline .wp-op').length;
document.documentElement.setAttribute('data-rendered',ops>0?'yes':'no timeline');})();
"""

LEGIBILITY_JS = """
(function(){var out={texts:0,min_px:null,smallest:null,overlaps:0,pairs:[]};
document.querySelectorAll('svg').forEach(function(svg){
 var vb=svg.viewBox&&svg.viewBox.baseVal,box=svg.getBoundingClientRect();
 var k=vb&&vb.width?box.width/vb.width:1,boxes=[];
 svg.querySelectorAll('text').forEach(function(t){var b=t.getBoundingClientRect();
  if(b.width<=0||b.height<=0||!t.textContent.trim())return;
  var px=parseFloat(getComputedStyle(t).fontSize)*k;out.texts++;
  if(out.min_px===null||px<out.min_px){out.min_px=px;out.smallest=t.textContent;}
  boxes.push({l:b.left,r:b.right,t:b.top,b:b.bottom,s:t.textContent});});
 boxes.sort(function(a,b){return a.l-b.l;});
 for(var i=0;i<boxes.length;i++)for(var j=i+1;j<boxes.length&&boxes[j].l<boxes[i].r;j++){
  var a=boxes[i],c=boxes[j],w=Math.min(a.r,c.r)-c.l,h=Math.min(a.b,c.b)-Math.max(a.t,c.t);
  if(w>1&&h>1){out.overlaps++;if(out.pairs.length<5)out.pairs.push([a.s,c.s]);}}});
document.documentElement.setAttribute('data-legibility',JSON.stringify(out));})();
"""
"""Measures, once the page is laid out, every visible SVG label: its rendered font size in pixels and
whether its box overlaps another label's, into ``data-legibility`` on ``<html>`` (what
tests/test_show_browser.py reads)."""


def _cards(plan: Plan) -> str:
    c = plan.cost
    tps = "/".join(map(str, sorted(set(plan.tp_degrees))))
    items = [(fmt_time(c.step_time_s), "step time"), (format_rate(c.samples_per_s), "samples/s")]
    if c.tokens_per_s:
        items.append((format_rate(c.tokens_per_s), "tokens/s"))
    items += [(f"{100 * c.mfu:.1f}%", "MFU"), (f"{c.model_tflops_per_gpu:.0f}", "TFLOP/s per GPU"),
              (f"{plan.pp_degree} x {plan.dp_degree} x {tps}", "pp x dp x tp"),
              (plan.schedule.value + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""), "schedule"),
              (f"{plan.num_microbatches}", "micro-batches"), (plan.precision.value, "precision")]
    return '<div class="cards">' + "".join(f'<div class="card"><b>{esc(v)}</b><span>{esc(k)}</span></div>'
                                           for v, k in items) + "</div>"


def _stages_table(plan: Plan) -> str:
    out = ['<table class="wp-stages"><tr><th>stage</th><th>blocks</th><th>devices</th><th>tp</th><th>dp</th>'
           '<th>ZeRO</th><th>checkpointed</th><th>tiers (params / optimizer)</th><th>compute + comm per micro-batch'
           '</th><th>gradient sync</th></tr>']
    for st in plan.stages:
        k = st.cost
        pairs = sorted({f"{b.param_tier.value} / {b.optimizer_tier.value}" for b in st.blocks})
        # blocks of one stage may have different tiers: then each run of blocks with its own pair
        tiers = [block_tiers(st)] if len(pairs) > 1 else pairs + sorted(
            {f"tiles {b.tiles}" for b in st.blocks if b.tiles > 1})
        tiers += ["activations in host memory"] if any(b.activation_offload for b in st.blocks) else []
        tiers += ["checkpoints in host memory"] if any(b.checkpoint_offload for b in st.blocks) else []
        tiers += ["gradients reduced every micro-batch"] if st.reduce_every_microbatch else []
        devs = stage_devices(st)
        chunks = f" (chunks {'+'.join(map(str, st.chunk_sizes))})" if st.chunk_sizes else ""
        out.append(f'<tr class="wp-stage" data-stage="{st.index}" data-blocks="{len(st.blocks)}">'
                   f'<td><span class="sw" style="background:{colour(STAGE_COLOURS, st.index)}"></span>{st.index}</td>'
                   f'<td class="wrap">{esc(compress_names(st.block_names))}{esc(chunks)}</td>'
                   f'<td>{esc(devs)} [{esc(compress_ranks(st.all_ranks))}]</td><td>{st.tp_degree}</td>'
                   f'<td>{st.dp_degree}</td><td>{int(st.zero_stage)}</td>'
                   f'<td>{sum(b.checkpoint for b in st.blocks)}/{len(st.blocks)}</td><td>{esc(", ".join(tiers))}</td>'
                   f'<td>{fmt_time(k.compute_s)} + {fmt_time(k.comm_s)}</td><td>{fmt_time(k.grad_sync_s)}</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def _devices_heading(plan: Plan) -> str:
    if plan.world_size > GROUPED_ABOVE:
        return ("Devices by stage: one cell per GPU (fill: stage, top bar: GPU type), one column per "
                "data-parallel replica (d = replica); hover a cell for its rank")
    return ("Devices: colour by stage, top bar by GPU type, number = global rank (d = data-parallel replica, "
            "t = tensor-parallel shard)")


def _whole_schedule(plan: Plan, tl) -> str:  # type: ignore[no-untyped-def]
    """The whole schedule of a compressed timeline, every micro-batch to scale, in a box that scrolls
    sideways (closed until asked for)."""
    return ('<details class="wp-whole"><summary>The whole schedule: every micro-batch, to scale (scrolls '
            'sideways)</summary><div style="overflow-x:auto">'
            + timeline_svg(plan, tl, plot_w=full_width(plan, tl)) + "</div></details>")


def plan_html(plan: Plan) -> str:
    """The whole page as a string."""
    tl = simulate(plan)
    cut = steady_cut(plan, tl)
    types = Counter(plan.rank_device_types)
    title = f"{plan.model_name} on {plan.world_size} devices"
    sv = plan.solver
    gap = "" if math.isnan(sv.mip_gap) else f", MIP gap {100 * sv.mip_gap:.2g}%"
    sub = (f"{', '.join(f'{n} x{k}' for n, k in types.items())}; global batch {plan.global_batch}"
           + (f", sequence length {plan.seq_len}" if plan.seq_len else "")
           + f"; solver {sv.solver} ({sv.status}), {sv.num_candidates} candidates in {sv.solve_time_s:.2f} s{gap}")
    notes = list(plan.notes) + list(tl.notes)
    notes_html = ("<ul class='notes'>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>") if notes else ""
    body = [
        f"<h1>whalepy plan: {esc(title)}</h1>", f'<div class="sub">{esc(sub)}</div>', _cards(plan),
        '<section id="devices"><h2>' + esc(_devices_heading(plan)) + '</h2>' + devices_grid(plan) + "</section>",
        '<section id="stages"><h2>Stages</h2>' + _stages_table(plan) + "</section>",
        '<section id="memory"><h2>Memory per device against capacity (the tightest replica of each stage)</h2>'
        + memory_bars(plan) + "</section>",
        '<section id="timeline"><h2>Pipeline schedule</h2>' + timeline_svg(plan, tl, compress=True)
        + f'<div class="caption">{esc(timeline_caption(plan, tl, cut))}</div>' + (_whole_schedule(plan, tl) if cut else "")
        + "</section>",
        '<section id="types"><h2>GPU types: batch shares, busy and idle time per step</h2>' + types_table(plan)
        + '<div class="caption">Global batch across the data-parallel replicas (colour: GPU type in stage 0)</div>'
        + batch_shares_bar(plan) + "</section>",
        '<section id="alternatives"><h2>Alternatives and why each lost</h2>' + alternatives_table(plan) + "</section>",
        f'<section id="notes"><h2>Notes</h2>{notes_html}<details><summary>text summary</summary><pre>'
        f"{esc(str(plan))}</pre></details></section>",
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>whalepy plan: {esc(title)}</title><style>{CSS}</style><script>{ERRORS_JS}</script></head>"
            f'<body><main data-world-size="{plan.world_size}" data-stages="{plan.pp_degree}" '
            f'data-microbatches="{plan.num_microbatches}" data-virtual-stages="{plan.virtual_stages}">'
            + "\n".join(body) + f'</main><div id="wp-tip"></div><script>{TOOLTIP_JS}{LEGIBILITY_JS}</script></body></html>\n')
