"""Predicted vs measured on one H200 (../shared/calibration/h200-2026-11-26/, copied into
benchmarks/data/h200_2026-11-26.json): the step time, peak memory and per-component time of the two
models of ``bench_gpu_step.py`` (GPT 1.42B, vocabulary 50257; HF Llama 1.2B), global batch 4 x 1024,
bf16 autocast, AdamW, from the analytic model with the H200 profile ``whalepy calibrate`` measured on
that GPU (shipped as ``cost_models/profiles/H200.json``). Models are built on the meta device; nothing
runs on a GPU. Used by ``validate_cost_model.py`` and ``tests/test_cost_h200.py``.

    python benchmarks/h200_check.py
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from whalepy.hardware.cluster import ClusterSpec, NodeGroup
from whalepy.cost_models.compute import (
    DOWNCAST_BANDWIDTH_FRACTION,
    UPCAST_BANDWIDTH_FRACTION,
    adamw_step_time,
    kernels_time,
    loss_time,
)
from whalepy.cost_models.device_profiles import resolve_compute_profile
from whalepy.cost_models.devices import CATALOG
from whalepy.planner.estimate import estimate_from_profile
from whalepy.frontend.profile import profile

DATA = Path(__file__).resolve().parent / "data" / "h200_2026-11-26.json"
H200 = CATALOG["H200"]
GIB = 2**30
BATCH, SEQ = 4, 1024


def measured() -> dict:
    return json.loads(DATA.read_text())


def build(name: str, vocab: int | None = None) -> torch.nn.Module:
    """The model of ``bench_gpu_step.py`` on the meta device (``vocab`` overrides the vocabulary)."""
    with torch.device("meta"):
        if name == "gpt":
            from whalepy.models import GPT, GPTConfig

            return GPT(GPTConfig(vocab_size=vocab or 50257, block_size=SEQ, num_layers=24, num_heads=16,
                                 hidden_size=2048))
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=8192, vocab_size=vocab or 128256, max_position_embeddings=SEQ,
                          tie_word_embeddings=True, use_cache=False, attention_dropout=0.0)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)


@functools.lru_cache(maxsize=None)
def model_profile(name: str, vocab: int | None = None):  # type: ignore[no-untyped-def]
    return profile(build(name, vocab), (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),))


def cluster() -> ClusterSpec:
    return ClusterSpec(groups=(NodeGroup.build(name="h200", gpu="H200", gpus_per_node=1,
                                               cpu_memory_bytes=128 * GIB),))


def predict(name: str, vocab: int | None = None) -> dict:
    """The plan the runtime ran (one H200: no parallelism, one micro-batch of 4) estimated, and its
    per-component attribution (ms): the same kernel model the planner's block times use."""
    prof = model_profile(name, vocab)
    # the measured run stepped torch's default AdamW (foreach), the factory's optimizer as given, and ran
    # its blocks eagerly (whalepy at 8c21ad1, before compiled blocks were the default)
    est = estimate_from_profile(prof, cluster(), dict(dp=1), global_batch=BATCH, precision="bf16",
                                optimizer_impl="as_given", compile=False)
    p = resolve_compute_profile(H200)
    ratio = BATCH / prof.batch_size
    comp = dict.fromkeys(("optimizer", "lm_head_gemms", "aligned_gemms", "attention", "casts", "loss",
                          "elementwise_norm"), 0.0)
    for b in prof.blocks:
        t = kernels_time(b.kernels, device=H200, precision="bf16", batch_ratio=ratio, byte_scale=0.5, profile=p,
                         autocast=True)
        gemms = sum(t.gemm) + sum(t.gemm_misaligned)
        comp["lm_head_gemms" if b.kind.value == "head" else "aligned_gemms"] += gemms
        comp["attention"] += sum(t.attention)
        comp["casts"] += sum(t.casts)
        comp["elementwise_norm"] += sum(t.memory)
    logits = prof.blocks[-1].output_bytes / 4 * ratio
    lf, lb = loss_time(logits, logits_bytes=2, profile=p)
    casts = logits * 6 / p.memory_bandwidth * (1 / UPCAST_BANDWIDTH_FRACTION + 1 / DOWNCAST_BANDWIDTH_FRACTION)
    comp["casts"] += casts
    comp["loss"] = lf + lb - casts
    comp["optimizer"] = adamw_step_time(prof.total_params, H200, profile=p)
    comp = {k: 1e3 * v for k, v in comp.items()}
    comp["gemms"] = comp["lm_head_gemms"] + comp["aligned_gemms"]
    return dict(step_ms=1e3 * est.step_time_s, peak_gib=est.stages[0].memory_bytes / GIB, components_ms=comp,
                notes=est.notes if hasattr(est, "notes") else ())


def rows() -> list[dict]:
    """One row per (model, quantity): measured, predicted, error, bound."""
    m = measured()
    out = []
    for name in ("gpt", "llama"):
        p = predict(name)
        out.append(dict(model=name, what="step ms", measured=m["step_ms"][name], predicted=p["step_ms"],
                        bound=m["bounds"]["step"]))
        # the step's own peak: the logged one less what an earlier run of the process still held
        peak = m["peak_gib"][name] - m["peak_gib"]["held_before"][name]
        out.append(dict(model=name, what="peak GiB", measured=peak, predicted=p["peak_gib"], bound=m["bounds"]["peak"]))
        for k, v in m["components_ms"][name].items():
            out.append(dict(model=name, what=f"{k} ms", measured=v, predicted=p["components_ms"][k],
                            bound=m["bounds"]["component"]))
    for r in out:
        r["err"] = r["predicted"] / r["measured"] - 1
    return out


def render() -> str:
    lines = ["| model | quantity | measured | predicted | error | bound |", "|---|---|---|---|---|---|"]
    for r in sorted(rows(), key=lambda r: -abs(r["err"])):
        lines.append(f"| {r['model']} | {r['what']} | {r['measured']:.2f} | {r['predicted']:.2f} | "
                     f"{100 * r['err']:+.1f}% | {100 * r['bound']:.0f}% |"
                     + ("" if abs(r["err"]) <= r["bound"] else " **out**"))
    return "\n".join(lines)


MEASURED_RUN = Path(__file__).resolve().parent / "data" / "h200_2026-11-27"
"""``bench_gpu_step.py --model both --measure --dump`` on one H200 (2026-11-27, session 15, call 2 of
docs/benchmarks.md's "One H200, session 15"): the tables measured planning timed there
(``<model>_measured.json``), the plan it made (``<model>_plan.json``), the run's log
(``call2_gpu_step.log``: the measured steps) and the other parts of that session's ``gpu_check.sh``."""


def measured_run(name: str, log: str = "call2_gpu_step.log") -> dict:
    """The run's median step (ms) and peak (GiB) for ``name``, read from its log's summary line."""
    import re

    text = (MEASURED_RUN / log).read_text()
    at = text.index(f"{name}: plan pp=")
    m = re.search(r"median ([0-9.]+) ms \(whalepy\).*?peak ([0-9.]+) vs", text[at:])
    assert m is not None, f"no summary line for {name} in {log}"
    return dict(step_ms=float(m.group(1)), peak_gib=float(m.group(2)))


def replan_measured(name: str) -> dict:
    """The plan of that run made again here, on the meta model, from the tables the H200 measured (no
    GPU): predicted step and peak against the run's, and how many blocks the tables cover (a block's
    signature is its graph: a different ``transformers`` traces Llama's layers differently)."""
    from dataclasses import replace

    from whalepy.frontend.measure import apply_measured_activations
    from whalepy.ir.measured import MeasuredCosts, block_signature
    from whalepy.planner import plan_from_profile

    prof = model_profile(name)
    table = MeasuredCosts.from_dict(json.loads((MEASURED_RUN / f"{name}_measured.json").read_text()))
    covered = sum(block_signature(prof, b) in table.times for b in prof.blocks)
    prof = replace(apply_measured_activations(prof, table, "bf16", compiled=True), measured=table)
    plan = plan_from_profile(prof, cluster(), global_batch=BATCH, precision="bf16", compile=True,
                             optimizer_impl="fused", time_limit_s=10)
    run = measured_run(name)
    return dict(model=name, covered=covered, blocks=len(prof.blocks), predicted_ms=1e3 * plan.cost.step_time_s,
                predicted_gib=plan.stages[0].cost.memory_bytes / GIB, measured_ms=run["step_ms"],
                measured_gib=run["peak_gib"], layout=(plan.pp_degree, plan.tp_degrees[0], plan.dp_degree))


if __name__ == "__main__":
    print(render())
    print()
    print("Measured planning on the H200 (session 15), re-planned here from the tables measured there:")
    print("| model | blocks measured | predicted ms | measured ms | error | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("gpt", "llama"):
        r = replan_measured(name)
        print(f"| {name} | {r['covered']} of {r['blocks']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
              f"{100 * (r['predicted_ms'] / r['measured_ms'] - 1):+.1f}% | {r['predicted_gib']:.2f} | "
              f"{r['measured_gib']:.2f} | {100 * (r['predicted_gib'] / r['measured_gib'] - 1):+.1f}% |")
