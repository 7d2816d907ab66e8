"""``format_profile``: the text table ``print(profile)`` shows."""

from __future__ import annotations

from typing import Any

from whalepy.ir.plan import TPStyle

_SHORT = {TPStyle.COLWISE: "col", TPStyle.ROWWISE: "row", TPStyle.VOCAB: "vocab",
          TPStyle.SEQUENCE: "seq", TPStyle.REPLICATE: "rep"}


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}"


def _tp_summary(block: Any) -> str:
    if not block.tp_rules:
        return "-"
    counts: dict[str, int] = {}
    for rule in block.tp_rules:
        key = _SHORT.get(rule.style, str(rule.style))
        counts[key] = counts.get(key, 0) + 1
    styles = " ".join(f"{k}x{v}" if v > 1 else k for k, v in counts.items())
    degrees = block.tp_degrees
    sharded = any(r.style != TPStyle.REPLICATE for r in block.tp_rules)
    top = f" <={degrees[-1]}" if degrees and sharded else ""
    return styles + top


def _annotations(block: Any) -> str:
    a = block.annotations
    if a.is_empty:
        return ""
    parts = []
    if a.stage is not None:
        parts.append(f"stage {a.stage}")
    if a.split is not None:
        parts.append(f"split({a.split or ''})")
    if a.replicate is not None:
        parts.append(f"replicate({a.replicate or ''})")
    cluster = [f"{k}={v}" for k, v in (("gpu", a.cluster_gpu), ("group", a.cluster_group),
                                        ("count", a.cluster_count), ("nodes", a.cluster_nodes))
               if v is not None]
    if cluster:
        parts.append(f"cluster({', '.join(cluster)})")
    return ", ".join(parts)


def _rows(profile: Any) -> list[tuple[str, ...]]:
    """Table rows; runs of identical layer blocks (same repeat group, same figures) fold into one."""
    rows: list[tuple[str, ...]] = []
    blocks = list(profile.blocks)
    i = 0
    while i < len(blocks):
        b = blocks[i]
        j = i + 1
        key = (b.repeat_group, b.num_params, b.fwd_flops, b.activation_bytes, b.annotations)
        while (b.repeat_group is not None and j < len(blocks)
               and (blocks[j].repeat_group, blocks[j].num_params, blocks[j].fwd_flops,
                    blocks[j].activation_bytes, blocks[j].annotations) == key):
            j += 1
        name = b.name if j - i == 1 else f"{b.name} .. {blocks[j - 1].name} (x{j - i})"
        kind = b.kind.value if hasattr(b.kind, "value") else str(b.kind)
        rows.append((
            name, kind, _count(b.num_params), f"{b.fwd_flops / 1e9:,.1f}",
            f"{b.bwd_flops / 1e9:,.1f}", f"{b.activation_bytes / 2**20:,.1f}", _tp_summary(b),
            _annotations(b),
        ))
        i = j
    return rows


def format_profile(profile: Any) -> str:
    """A header with the totals and one row per block (repeated identical layers folded)."""
    header = (
        f"ModelProfile {profile.model_name} [{profile.fingerprint}]: "
        f"{_count(profile.total_params)} params ({profile.param_bytes / 2**30:.2f} GiB), "
        f"batch {profile.batch_size}"
        + (f" x seq {profile.seq_len}" if profile.seq_len is not None else "")
        + f", training {profile.train_flops / 1e12:,.2f} TFLOPs/step "
        f"(fwd {profile.fwd_flops / 1e12:,.2f} + bwd {profile.bwd_flops / 1e12:,.2f}), "
        f"{len(profile.blocks)} blocks, captured by {profile.capture_method} "
        f"in {profile.capture_time_s:.2f} s"
    )
    cols = ("block", "kind", "params", "fwd GFLOP", "bwd GFLOP", "act MiB", "TP", "annotations")
    rows = [cols, *_rows(profile)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
    right = {2, 3, 4, 5}

    def fmt(r: tuple[str, ...]) -> str:
        cells = [r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c])
                 for c in range(len(cols))]
        return "  ".join(cells).rstrip()

    lines = [header, fmt(cols), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows[1:]]
    return "\n".join(lines)


def format_tp_report(blocks: Any, tp: int | None = None) -> str:
    """One section per block: each ruled module with its style (fused pieces, copied output), then each
    module left whole with the reason. ``tp``: the stage's degree, to say which blocks run whole at it.
    A run of layers with the same report is printed once."""
    from whalepy.ir.rules import tp_splits

    sections: list[tuple[str, list[str]]] = []
    for b in blocks:
        off = tp is not None and tp > 1 and not tp_splits(b, tp)
        note = ""
        if off:
            note = (f" (runs whole at TP {tp}: its shapes divide only by {', '.join(map(str, b.tp_degrees))})"
                    if any(r.style is not TPStyle.REPLICATE for r in b.tp_rules) else " (runs whole)")
        body = []
        for r in b.tp_rules:
            if r.style is TPStyle.REPLICATE:
                continue
            extra = [f"{r.parts} fused pieces"] if r.parts > 1 else []
            extra += ["output modified in place: copied"] if r.copy_output else []
            extra += ["not applied"] if off else []
            body.append(f"  {r.module}: {r.style.value}" + (f" ({', '.join(extra)})" if extra else ""))
        body += [f"  {m}: whole ({why})" for m, why in getattr(b, "tp_whole", ())]
        generic = [line.replace(b.name + ".", "<block>.") for line in body]
        if sections and b.kind.value == "layer" and sections[-1][2] == (note, generic):
            sections[-1][1].append(b.name)
            continue
        sections.append((b.name, [b.name], (note, generic), body))  # type: ignore[arg-type]
    lines = []
    for _, names, (note, _g), body in sections:  # type: ignore[misc]
        head = names[0] if len(names) == 1 else f"{names[0]} (and {len(names) - 1} more layers alike: " \
            f"{names[1]}{' ... ' + names[-1] if len(names) > 2 else ''})"
        lines.append(head + note)
        lines += body
    return "\n".join(lines)


def format_plan_tp_report(plan: Any, profile: Any) -> str:
    """:func:`format_tp_report` for each stage of ``plan`` with TP above 1, at the stage's degree: which
    blocks split, and in each, which modules got which rule and which stayed whole and why."""
    out = []
    for st in plan.stages:
        if st.tp_degree > 1:
            blocks = [profile.block(n) for n in st.block_names]
            out.append(f"stage {st.index}, TP {st.tp_degree}:")
            out += ["  " + line for line in format_tp_report(blocks, st.tp_degree).splitlines()]
    return "\n".join(out) or "no stage runs tensor-parallel"
