"""Small SVG building blocks shared by the timeline and the page: escaping, colours, time ticks."""

from __future__ import annotations

import math
from collections import Counter
from html import escape
from typing import TYPE_CHECKING

from whalepy.ir.plan_text import format_seconds as fmt_time  # noqa: F401  (one time format for text and pictures)

if TYPE_CHECKING:
    from whalepy.ir.plan import StagePlan

STAGE_COLOURS = ("#66c2a5", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#1b9e77", "#e7298a", "#66a61e",
                 "#a6761d", "#c2a5cf")
"""Stages (ColorBrewer Set2 and Dark2 without their blues, oranges and greys, which the timeline uses
for forward, backward and sends): a stage never reads as a kind of work. Every palette here is disjoint
from the others (tests/test_show.py)."""

TYPE_COLOURS = ("#1a1a1a", "#ffffff", "#8c8c8c", "#0b5345", "#f5b7b1", "#154360")
"""GPU types (the bar on top of each device, swatches): black, white, grey, ... so that they never
read as one of the stage fills."""


def ink(fill: str) -> str:
    """Black or white text, whichever reads on ``fill`` (``#rrggbb``)."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


FORWARD_SHADES = ("#4e79a7", "#8cb3d9", "#2b4a6e", "#b8d3ee")
BACKWARD_SHADES = ("#f28e2b", "#ffbe7d", "#b3600f", "#ffd9b0")
KIND_COLOURS = {"send": "#969696", "grad_sync": "#3f007d", "offload": "#525252", "bubble": "#e9e9e9"}

MEMORY_COLOURS = {"params": "#253494", "grads": "#41ab5d", "optimizer": "#fec44f", "activations": "#ef3b2c",
                  "buffers": "#41b6c4", "margin": "#f7f7f7", "reserve": "#bdbdbd"}

PALETTES = {"stages": STAGE_COLOURS, "gpu types": TYPE_COLOURS, "forward": FORWARD_SHADES,
            "backward": BACKWARD_SHADES, "timeline kinds": tuple(KIND_COLOURS.values()),
            "memory": tuple(MEMORY_COLOURS.values())}
"""Every palette of the page by what it colours; no colour is in two of them."""


def esc(x: object) -> str:
    return escape(str(x), quote=True)


def colour(palette: tuple[str, ...], i: int) -> str:
    return palette[i % len(palette)]


def rect(x: float, y: float, w: float, h: float, fill: str, *, cls: str = "", extra: str = "",
         stroke: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    s = f' stroke="{stroke}"' if stroke else ""
    return (f'<rect{c} x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" fill="{fill}"{s}'
            f'{" " + extra if extra else ""}/>')


def text(x: float, y: float, s: object, *, size: int = 11, anchor: str = "start", fill: str = "#222",
         weight: str = "normal", extra: str = "", width: float | None = None) -> str:
    """An SVG text; with ``width`` (pixels) a longer string is cut with an ellipsis and the whole of it
    becomes the element's tooltip."""
    s = str(s)
    title = ""
    if width is not None:
        fit = int(width / (size * (0.62 if weight == "bold" else 0.56)))
        if len(s) > fit:
            title, s = f"<title>{esc(s)}</title>", s[:max(1, fit - 1)] + "\u2026"
    return (f'<text x="{x:.2f}" y="{y:.2f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}" '
            f'font-weight="{weight}"{" " + extra if extra else ""}>{title}{esc(s)}</text>')


def stage_devices(st: StagePlan) -> str:
    """``"A100-80GB x8, V100-32GB x8"``: a stage's GPUs by type."""
    return ", ".join(f"{n} x{k * st.tp_degree}" for n, k in Counter(st.device_types).items())


def nice_ticks(span: float, target: int = 8) -> list[float]:
    """Round tick positions from 0 to ``span`` (1, 2, 5 times a power of ten apart)."""
    if span <= 0:
        return [0.0]
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    n = int(span / step + 1e-9)
    return [i * step for i in range(n + 1)]


def fmt_bytes(b: float) -> str:
    gib = b / 2 ** 30
    if gib >= 1:
        return f"{gib:.1f} GiB"
    return f"{b / 2 ** 20:.0f} MiB"


def svg_open(width: float, height: float, *, cls: str, extra: str = "") -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif"'
            f'{" " + extra if extra else ""}>')
