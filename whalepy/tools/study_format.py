"""The ZeRO-stage study's output: a text table, a CSV file and a plot (matplotlib, the optional extra
``whalepy[plot]``, imported only here and only when a plot is asked for)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from whalepy.errors import WhalepyError
from whalepy.tools.study import ZeroStudyRow

__all__ = ["format_zero_study", "plot_zero_study", "write_zero_study_csv"]

_GIB, _GB = 2**30, 1e9


def _err(measured: float | None, predicted: float) -> str:
    if measured is None:
        return ""
    if predicted == 0:
        return "exact" if measured == 0 else "n/a"
    return f"{100 * (measured - predicted) / predicted:+.2f}%"


def format_zero_study(rows: Sequence[ZeroStudyRow]) -> str:
    """A fixed-width table: memory in GiB per GPU, communication in GB (10^9 bytes) per GPU per step."""
    measured = any(r.measured_state_bytes is not None for r in rows)
    head = ["model", "params", "config", "lowering", "states", "host", "activ.", "peak/usable", "fits",
            "comm", "intra", "inter", "step s", "samples/s", "TFLOP/s"]
    if measured:
        head += ["meas. states", "err", "meas. comm", "err"]
    body = []
    for r in rows:
        size = f"{r.num_params / 1e9:.2f}B" if r.num_params >= 1e8 else f"{r.num_params / 1e6:.3g}M"
        cells = [r.model, size, r.label, r.lowering.replace("+zero_redundancy_optimizer", "+zro"),
                 f"{r.model_state_bytes / _GIB:.3g}", f"{r.host_state_bytes / _GIB:.3g}",
                 f"{r.activation_bytes / _GIB:.3g}", f"{r.peak_bytes / _GIB:.1f}/{r.capacity_bytes / _GIB:.1f}",
                 "yes" if r.fits else "NO", f"{r.comm_bytes / _GB:.3g}", f"{r.intra_node_bytes / _GB:.3g}",
                 f"{r.inter_node_bytes / _GB:.3g}", f"{r.step_time_s:.3g}", f"{r.samples_per_s:.4g}",
                 f"{r.tflops_per_gpu:.3g}"]
        if measured:
            held = r.host_state_bytes if r.offload else r.model_state_bytes
            mc = r.measured_comm_bytes
            cells += [f"{r.measured_state_bytes / _GIB:.4g}" if r.measured_state_bytes is not None else "",
                      _err(r.measured_state_bytes, held), f"{mc / _GB:.4g}" if mc is not None else "",
                      _err(mc, r.comm_bytes)]
        body.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).rjust(w) if i > 3 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    notes = ["states / host / activ. / peak: GiB per GPU (states = parameters, gradients, optimizer states "
             "held on the GPU; host = offloaded); comm: collective payload per GPU per step, GB; intra / "
             "inter: GB each GPU sends over intra-node links / the network per step"]
    if measured:
        notes.append("meas.: held by a rank at the optimizer step (GiB; host bytes for offloaded rows) and "
                     "counted at its process group in one step (GB), on CPU gloo processes")
    not_fit = [f"{r.model} {r.label}: {r.reason}" for r in rows if not r.fits]
    return "\n".join(lines + notes + not_fit)


def write_zero_study_csv(rows: Sequence[ZeroStudyRow], path: str | Path) -> None:
    """One line per row, bytes as integers, the payload by collective in its own columns."""
    kinds = sorted({k for r in rows for k in (*r.payload_bytes, *(r.measured_payload_bytes or {}))})
    fields = ["model", "num_params", "zero_stage", "offload", "lowering", "dp", "global_batch",
              "model_state_bytes", "host_state_bytes", "activation_bytes", "buffer_bytes", "peak_bytes",
              "capacity_bytes", "fits", "comm_bytes", *(f"{k}_bytes" for k in kinds), "intra_node_bytes",
              "inter_node_bytes", "step_time_s", "samples_per_s", "tflops_per_gpu", "measured_state_bytes",
              "measured_comm_bytes", *(f"measured_{k}_bytes" for k in kinds)]
    from whalepy.files import atomic_path

    with atomic_path(path, what="the study's CSV") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            line = {k: getattr(r, k) for k in fields if hasattr(r, k)}
            line["offload"] = r.offload or ""
            for k in kinds:
                line[f"{k}_bytes"] = round(r.payload_bytes.get(k, 0.0))
                if r.measured_payload_bytes is not None:
                    line[f"measured_{k}_bytes"] = round(r.measured_payload_bytes.get(k, 0.0))
            for k in ("measured_state_bytes", "measured_comm_bytes"):
                line[k] = "" if getattr(r, k) is None else round(getattr(r, k))
            w.writerow(line)


def plot_zero_study(rows: Sequence[ZeroStudyRow], path: str | Path) -> None:
    """Three panels over the models, one bar per configuration: peak memory per GPU against the usable
    memory, communication volume per GPU per step, throughput (hatched where it does not fit)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise WhalepyError("--plot needs matplotlib: pip install 'whalepy[plot]' (or leave out --plot)") from None
    models = list(dict.fromkeys(r.model for r in rows))
    labels = list(dict.fromkeys(r.label for r in rows))
    by = {(r.model, r.label): r for r in rows}
    width = 0.8 / len(labels)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("peak memory per GPU (GiB)", lambda r: r.peak_bytes / _GIB),
              ("communication per GPU per step (GB)", lambda r: r.comm_bytes / _GB),
              ("throughput (samples/s)", lambda r: r.samples_per_s)]
    for ax, (title, value) in zip(axes, panels):
        for j, lab in enumerate(labels):
            xs = [i + (j - (len(labels) - 1) / 2) * width for i, m in enumerate(models) if (m, lab) in by]
            rs = [by[(m, lab)] for m in models if (m, lab) in by]
            bars = ax.bar(xs, [value(r) for r in rs], width, label=lab)
            for b, r in zip(bars, rs):
                if not r.fits:
                    b.set_hatch("//")
                    b.set_alpha(0.5)
        ax.set_xticks(range(len(models)), models, rotation=20)
        ax.set_title(title)
    usable = min(r.capacity_bytes for r in rows) / _GIB
    axes[0].axhline(usable, color="k", linestyle="--", linewidth=1, label="usable")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"ZeRO stages on {rows[0].dp} GPUs, global batch {rows[0].global_batch} "
                 "(hatched: does not fit)", fontsize=10)
    fig.tight_layout()
    from whalepy.files import atomic_path

    with atomic_path(path, what="the study's plot") as tmp:
        fig.savefig(tmp, dpi=90, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
