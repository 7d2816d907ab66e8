"""Measured block costs: the data measured planning produces (:mod:`whalepy.frontend.measure`) and the
planner reads (``CostContext._block_time``), and its JSON form, the ``measured`` section of a device
profile (docs/profiling.md, "Measured planning"). Plain Python: no torch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from whalepy.errors import WhalepyError

__all__ = ["ANY_PRECISION", "MEASURED_FORMAT", "MeasuredCosts", "block_signature"]

MEASURED_FORMAT = 1
"""Version of the ``measured`` section of a device profile (:meth:`MeasuredCosts.to_dict`)."""

ANY_PRECISION = "any"
"""The precision of times imported from a table that does not state one: used for every precision."""


def block_signature(profile: Any, block: Any) -> str:
    """A structural key of a block, the same for identical blocks of any model: its kind and its
    figures per sample (parameters, FLOPs, bytes moved and crossing its boundaries, the TP
    communication, styles and degrees) at the profile's sequence length and dtype. Two blocks with
    equal signatures run the same kernels on the same shapes. Saved activation bytes are left out: a
    memory trace replaces them (:func:`whalepy.frontend.trace.apply_memory_trace`) and the key must not move."""
    b = profile.batch_size
    key = [block.kind.value, profile.dtype, profile.seq_len, block.num_params, block.param_bytes,
           round(block.fwd_flops / b), round(block.bwd_flops / b), round(block.bytes_moved / b),
           round(block.input_bytes / b), round(block.output_bytes / b),
           round(block.tp_comm_bytes / b), list(block.tp_degrees), sorted(r.style.value for r in block.tp_rules)]
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]


def _merge_nested(a: dict, b: dict) -> dict:
    """``{sig: {key: value}}`` tables ``a`` and ``b`` merged per signature, ``b`` winning on a key."""
    out = {s: dict(v) for s, v in a.items()}
    for s, v in b.items():
        out.setdefault(s, {}).update(v)
    return out


def _interpolate(rows: list[tuple[float, tuple[float, float]]], micro_batch: float) -> tuple[float, float] | None:
    """``(forward, backward)`` at ``micro_batch`` from ``(micro_batch, times)`` rows sorted by size:
    piecewise linear between them, linear through the two nearest beyond them, proportional with one."""
    if not rows:
        return None
    if len(rows) == 1:
        mb, (f, b) = rows[0]
        return f * micro_batch / mb, b * micro_batch / mb
    for mb, t in rows:  # a measured size: its own times, not the segment's end point (t0 + (t1 - t0) can miss t1)
        if mb == micro_batch:
            return max(t[0], 0.0), max(t[1], 0.0)
    i = 1
    while i < len(rows) - 1 and rows[i][0] < micro_batch:
        i += 1
    (m0, t0), (m1, t1) = rows[i - 1], rows[i]
    w = (micro_batch - m0) / (m1 - m0)
    return max(t0[0] + w * (t1[0] - t0[0]), 0.0), max(t0[1] + w * (t1[1] - t0[1]), 0.0)


@dataclass(frozen=True, kw_only=True)
class MeasuredCosts:
    """Per device type, measured costs of distinct blocks (keyed by :func:`block_signature`).

    ``times[sig][(precision, tp, micro_batch)] = (forward_s, backward_s)``; ``updates[sig]`` the
    optimizer step over the block's parameters (tp 1, unsharded); ``activation_bytes[sig]`` the bytes
    its forward saves per sample (tp 1, in the precision measured); ``saved[sig]`` the bytes one
    micro-batch's forward saves, per micro-batch size, eager and compiled (:meth:`saved_fit` splits them
    into a part per sample and a part per micro-batch, the weights' casts)."""

    device_type: str
    """Catalog device type the times are for (``"CPU"``, ``"H100-SXM"``)."""
    device_name: str = ""
    threads: int | None = None
    """Intra-op threads the CPU measurement ran with (a rank of a gloo run has its own)."""
    source: str = ""
    optimizer: str = ""
    """The optimizer implementation the updates were measured with."""
    times: dict[str, dict[tuple[str, int, float], tuple[float, float]]] = field(default_factory=dict)
    updates: dict[str, float] = field(default_factory=dict)
    activation_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """``sig -> precision -> bytes per sample``."""
    names: dict[str, str] = field(default_factory=dict)
    """``sig -> a block name`` it was measured on (for people reading the file)."""
    wrapped: dict[str, dict[tuple[str, str, float], tuple[float, float]]] = field(default_factory=dict)
    """``sig -> (precision, wrapper, micro_batch) -> (forward_s, backward_s)``: the block as the runtime
    lowers it under a data-parallel wrapper (``"fsdp"``: FSDP2 keeping parameters gathered between
    forward and backward, ZeRO-1/2; ``"fsdp_reshard"``: FSDP2 resharding after forward, ZeRO-3), timed
    on a fake process group (collectives return at once): compute plus the wrapper's own host work."""
    compiled: dict[str, dict[tuple[str, int, float], tuple[float, float]]] = field(default_factory=dict)
    """``sig -> (precision, tp, micro_batch) -> (forward_s, backward_s)`` with the block's modules compiled
    as the runtime compiles them (``Plan.compile``: regional ``torch.compile``), lowered on a fake process
    group like :attr:`wrapped`; the wrappers' compiled rows are in :attr:`wrapped` under
    ``"<wrapper>/compiled"``."""
    tp_collectives: dict[str, dict[int, dict[str, dict[str, tuple[float, float]]]]] = field(default_factory=dict)
    """``sig -> tp -> phase ("f" / "b") -> kind -> (calls, bytes per sample)``: the collectives the block
    issues under tensor parallelism as the runtime lowers it (DTensor's redistributions), counted on the
    fake process group; the planner charges these calls instead of one modelled all-reduce per phase."""
    optimizer_step: tuple[float, int] | None = None
    """``(seconds, parameters)`` of one optimizer step over every measured block's parameters together
    (a parameter shared by two blocks, a tied embedding, once), as the runtime steps a stage: one
    optimizer over all of them. :attr:`updates` are each block's step alone, which also carries the
    per-step launch and host work once per block (on an H200, fused AdamW: 0.63 ms for one GPT-1.4B
    layer alone against 0.41 ms as its share of the whole step), so their sum over-charges the step;
    :meth:`optimizer_s_per_param` takes this instead where it was measured."""
    recompute_ratio: dict[str, dict[float, float]] = field(default_factory=dict)
    """``precision -> micro_batch -> ratio``: what recomputing a checkpointed block costs in backward per
    second of its forward, measured on the whole model (every block checkpointed as the runtime
    checkpoints them, against the plain step, timed in alternation): the checkpoint's own work (its
    saved-tensor hooks, the forward re-run with autograd recording) beyond a plain forward. On this
    machine's CPU a GPT's layers recomputed in 1.6x their forward. Where not measured the planner
    charges 1.0 (the forward again)."""
    fsdp_units: dict[str, int] = field(default_factory=dict)
    """``sig -> FSDP2 units``: the all-gathers the block's forward issues under FSDP2 (one per
    ``fully_shard`` unit: HF's embedding block is two, token and position tables), counted on the fake
    process group; the planner charges that many calls."""
    wrapped_updates: dict[str, dict[str, float]] = field(default_factory=dict)
    """``sig -> "fsdp/D" or "tp/D" -> seconds``: the optimizer step over the block's parameters as the
    runtime holds them (DTensor shards of degree ``D``), same fake process group."""
    saved: dict[str, dict[tuple[str, bool, float], float]] = field(default_factory=dict)
    """``sig -> (precision, compiled, micro_batch) -> bytes``: what one micro-batch's forward of the block
    saves for backward (``saved_tensors_hooks``: distinct storages, parameters excluded; tp 1), eager
    (``compiled`` False) and with the block compiled as the runtime compiles it (True: AOTAutograd's
    partitioner saves other tensors than eager autograd, recomputing cheap element-wise ops and casts).
    Tables written before it was measured have none: :attr:`activation_bytes` stands in."""

    def saved_fit(self, sig: str, precision: str, *, compiled: bool = False) -> tuple[float, float] | None:
        """``(bytes per micro-batch, bytes per sample)`` the block saves for backward (:attr:`saved`): the
        line through the two largest micro-batch sizes measured, its part per micro-batch (what does not
        grow with the batch: under autocast the 16-bit copies of the weights) at least 0; with one size
        measured, all of it per sample. None where the block was not measured so."""
        rows = sorted((mb, b) for (p, c, mb), b in self.saved.get(sig, {}).items() if p == precision and c == compiled)
        if not rows:
            return None
        m2, b2 = rows[-1]
        if len(rows) == 1:
            return 0.0, b2 / m2
        m1, b1 = rows[-2]
        fixed = max(b2 - m2 * (b2 - b1) / (m2 - m1), 0.0)
        return fixed, max(b2 - fixed, 0.0) / m2

    def wrapper_overhead(self, sig: str, precision: str, wrapper: str, micro_batch: float, *, compiled: bool = False
                         ) -> tuple[float, float] | None:
        """Forward and backward seconds the wrapper adds to the block at ``micro_batch`` (the wrapped
        time less the plain time measured beside it, interpolated as :meth:`block_time`; ``compiled``: both
        with the blocks compiled); None if not measured."""
        name = f"{wrapper}/compiled" if compiled else wrapper
        got = _interpolate(sorted((mb, t) for (p, w, mb), t in self.wrapped.get(sig, {}).items()
                                  if p == precision and w == name), micro_batch)
        base = self.block_time(sig, precision, 1, micro_batch, compiled=compiled)
        if got is None or base is None:
            return None
        return max(got[0] - base[0], 0.0), max(got[1] - base[1], 0.0)

    def update_overhead(self, sig: str, key: str) -> float | None:
        """Seconds the optimizer step of the block's parameters takes beyond the plain step's share
        (``updates[sig] / D``) when they are DTensor shards of degree ``D`` (``key`` ``"fsdp/D"`` or
        ``"tp/D"``); None if not measured."""
        t = self.wrapped_updates.get(sig, {}).get(key)
        if t is None or sig not in self.updates:
            return None
        return max(t - self.updates[sig] / int(key.rpartition("/")[2]), 0.0)

    def recompute_ratio_at(self, precision: str, micro_batch: float) -> float | None:
        """:attr:`recompute_ratio` at ``micro_batch``: piecewise linear between the measured sizes, the
        nearest one's beyond them; None if not measured in ``precision``."""
        rows = sorted(self.recompute_ratio.get(precision, {}).items())
        if not rows:
            return None
        if micro_batch <= rows[0][0]:
            return rows[0][1]
        for (m0, r0), (m1, r1) in zip(rows, rows[1:]):
            if micro_batch <= m1:
                return r0 + (micro_batch - m0) / (m1 - m0) * (r1 - r0)
        return rows[-1][1]

    def block_time(self, sig: str, precision: str, tp: int, micro_batch: float, *, compiled: bool = False
                   ) -> tuple[float, float] | None:
        """Forward and backward seconds at ``micro_batch``: piecewise linear between the measured sizes,
        linear through the two nearest beyond them (proportional with one size); None if not measured.
        ``compiled``: the compiled blocks' times (:attr:`compiled`), None where those were not measured."""
        entries = (self.compiled if compiled else self.times).get(sig, {})
        if not any(p == precision for p, _, _ in entries):
            precision = ANY_PRECISION  # an imported table that does not say its precision
        return _interpolate(sorted((mb, t) for (p, d, mb), t in entries.items() if p == precision and d == tp),
                            micro_batch)

    def optimizer_s_per_param(self, blocks: Iterable[tuple[str, int]]) -> float | None:
        """Seconds per parameter of the optimizer step over ``(sig, num_params)`` blocks: of the step over
        all measured parameters together (:attr:`optimizer_step`) where it was measured, else from the
        blocks' measured updates (None unless every block with parameters was measured)."""
        if self.optimizer_step is not None and self.optimizer_step[1] > 0:
            return self.optimizer_step[0] / self.optimizer_step[1]
        t = n = 0.0
        for sig, params in blocks:
            if params == 0:
                continue
            if sig not in self.updates:
                return None
            t, n = t + self.updates[sig], n + params
        return t / n if n else None

    def merged(self, other: MeasuredCosts) -> MeasuredCosts:
        """``self`` with ``other``'s entries added (``other`` wins where both measured)."""
        if other.device_type != self.device_type:
            raise WhalepyError(f"cannot merge measurements of {other.device_type} into {self.device_type}")
        times, acts, wrapped, compiled, tpc, wups, saved = (
            _merge_nested(getattr(self, f), getattr(other, f))
            for f in ("times", "activation_bytes", "wrapped", "compiled", "tp_collectives", "wrapped_updates",
                      "saved"))
        units = {**self.fsdp_units, **other.fsdp_units}
        ratios = {p: {**self.recompute_ratio.get(p, {}), **other.recompute_ratio.get(p, {})}
                  for p in set(self.recompute_ratio) | set(other.recompute_ratio)}
        return replace(self, device_name=other.device_name or self.device_name, threads=other.threads,
                       recompute_ratio=ratios,
                       source=other.source or self.source, optimizer=other.optimizer or self.optimizer,
                       times=times, updates={**self.updates, **other.updates}, activation_bytes=acts,
                       names={**self.names, **other.names}, wrapped=wrapped, wrapped_updates=wups,
                       compiled=compiled, tp_collectives=tpc, fsdp_units=units, saved=saved,
                       optimizer_step=other.optimizer_step if other.updates or other.optimizer_step
                       else self.optimizer_step)

    def to_dict(self) -> dict[str, Any]:
        return {"format": MEASURED_FORMAT, "device_type": self.device_type, "device_name": self.device_name,
                "threads": self.threads, "source": self.source, "optimizer": self.optimizer,
                **({"optimizer_step": {"seconds": self.optimizer_step[0], "params": self.optimizer_step[1]}}
                   if self.optimizer_step is not None else {}),
                **({"recompute_ratio": [{"precision": p, "micro_batch": mb, "ratio": r}
                                        for p, rows in sorted(self.recompute_ratio.items())
                                        for mb, r in sorted(rows.items())]} if self.recompute_ratio else {}),
                "blocks": {s: {"name": self.names.get(s, ""), "update_s": self.updates.get(s),
                               "activation_bytes_per_sample": self.activation_bytes.get(s, {}),
                               "times": [{"precision": p, "tp": d, "micro_batch": mb, "forward_s": f, "backward_s": b}
                                         for (p, d, mb), (f, b) in sorted(self.times.get(s, {}).items())],
                               "wrapped": [{"precision": p, "wrapper": w, "micro_batch": mb, "forward_s": f,
                                            "backward_s": b}
                                           for (p, w, mb), (f, b) in sorted(self.wrapped.get(s, {}).items())],
                               "wrapped_update_s": dict(sorted(self.wrapped_updates.get(s, {}).items())),
                               "compiled": [{"precision": p, "tp": d, "micro_batch": mb, "forward_s": f,
                                             "backward_s": b}
                                            for (p, d, mb), (f, b) in sorted(self.compiled.get(s, {}).items())],
                               "saved": [{"precision": p, "compiled": c, "micro_batch": mb, "bytes": n}
                                         for (p, c, mb), n in sorted(self.saved.get(s, {}).items())],
                               "fsdp_units": self.fsdp_units.get(s),
                               "tp_collectives": {str(tp): {ph: {k: list(v) for k, v in sorted(kinds.items())}
                                                            for ph, kinds in sorted(phases.items())}
                                                  for tp, phases in sorted(self.tp_collectives.get(s, {}).items())}}
                           for s in sorted(set(self.times) | set(self.updates) | set(self.activation_bytes)
                                           | set(self.wrapped) | set(self.wrapped_updates) | set(self.compiled)
                                           | set(self.tp_collectives) | set(self.fsdp_units) | set(self.saved))}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "measured costs") -> MeasuredCosts:
        if d.get("format") != MEASURED_FORMAT:
            raise WhalepyError(f"{where}: measured-costs format {d.get('format')!r} is not supported (this whalepy "
                               f"reads format {MEASURED_FORMAT}); measure again with whalepy calibrate --model")
        try:
            times, updates, acts, names, wrapped, wups, compiled, tpc, units, saved = ({} for _ in range(10))
            for sig, e in d.get("blocks", {}).items():
                if e.get("saved"):  # tables written before it was measured have none
                    saved[sig] = {(r["precision"], bool(r["compiled"]), float(r["micro_batch"])): float(r["bytes"])
                                  for r in e["saved"]}
                if e.get("fsdp_units") is not None:
                    units[sig] = int(e["fsdp_units"])
                if e.get("tp_collectives"):
                    tpc[sig] = {int(tp): {ph: {k: (float(v[0]), float(v[1])) for k, v in kinds.items()}
                                          for ph, kinds in phases.items()}
                                for tp, phases in e["tp_collectives"].items()}
                if e.get("compiled"):
                    compiled[sig] = {(r["precision"], int(r["tp"]), float(r["micro_batch"])):
                                     (float(r["forward_s"]), float(r["backward_s"])) for r in e["compiled"]}
                if e.get("wrapped"):
                    wrapped[sig] = {(r["precision"], str(r["wrapper"]), float(r["micro_batch"])):
                                    (float(r["forward_s"]), float(r["backward_s"])) for r in e["wrapped"]}
                if e.get("wrapped_update_s"):
                    wups[sig] = {str(k): float(v) for k, v in e["wrapped_update_s"].items()}
                times[sig] = {(r["precision"], int(r["tp"]), float(r["micro_batch"])):
                              (float(r["forward_s"]), float(r["backward_s"])) for r in e.get("times", [])}
                if e.get("update_s") is not None:
                    updates[sig] = float(e["update_s"])
                if e.get("activation_bytes_per_sample"):  # a run's times come without: none, not {} (round trip)
                    acts[sig] = {p: float(v) for p, v in e["activation_bytes_per_sample"].items()}
                names[sig] = e.get("name", "")
            step = d.get("optimizer_step")  # files written before it was measured have none
            step = (float(step["seconds"]), int(step["params"])) if step is not None else None
            ratios: dict[str, dict[float, float]] = {}
            for r in d.get("recompute_ratio", []):  # files written before it was measured have none
                ratios.setdefault(str(r["precision"]), {})[float(r["micro_batch"])] = float(r["ratio"])
            return cls(device_type=d["device_type"], device_name=d.get("device_name", ""), threads=d.get("threads"),
                       source=d.get("source", ""), optimizer=d.get("optimizer", ""), times=times, updates=updates,
                       activation_bytes=acts, names=names, wrapped=wrapped, wrapped_updates=wups,
                       compiled=compiled, tp_collectives=tpc, fsdp_units=units, optimizer_step=step,
                       saved=saved, recompute_ratio=ratios)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise WhalepyError(f"{where}: not a whalepy measured-costs table ({type(e).__name__}: {e}); measure "
                               "again with whalepy calibrate --model") from None


