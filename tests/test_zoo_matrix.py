"""The Hugging Face zoo as a test matrix (issue 22; the worker and the SGD argument: tests/zoo_cases.py).

Sixteen architectures, tiny configs built here from their ``Config`` classes (no downloads; the HF
configs' own ``use_cache`` default, True, as a user's model has it), each under
DP 2 x TP 2, PP 2 x DP 2, ZeRO-3 on 4 ranks, TP 2 x PP 2 and the planner's own plan for 4 CPU ranks,
plus whalepy's GPT with GPT-2's 50257-token vocabulary under a planner-made plan whose TP stage holds that
embedding (50257 does not divide by 2: the block runs whole, the plan check accepts it). Every case must
train to the single-process losses (fp32, relative 1e-5) and parameters (SGD, 1e-5), or be refused
before training with the one-line whalepy error listed in ``REFUSED``: no silent mismatch, no raw error.
All cases share ONE group of 4 gloo processes.
"""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from zoo_cases import ARCHS, LAYOUTS, run_matrix

pytest.importorskip("transformers")

TOL = 1e-5

REFUSED: dict[tuple[str, str], str] = {}
"""``(arch, layout) -> text the refusal must contain``; every other case must match one process."""


def test_zoo_matrix() -> None:
    per_rank = run_distributed(run_matrix, 4, ARCHS, LAYOUTS, timeout=900)
    cases = per_rank[0]
    assert len(cases) == len(ARCHS) * len(LAYOUTS) + 1
    problems = []
    for i, case in enumerate(cases):
        key = (case["arch"], case["layout"])
        ranks = [r[i] for r in per_rank]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            problems.append(f"{key}: raw error {errors[0][:600]}")
            continue
        refusals = {r.get("refused") for r in ranks}
        if key in REFUSED:
            msg = refusals.pop() if len(refusals) == 1 else None
            if msg is None or REFUSED[key] not in msg or "\n" in msg:
                problems.append(f"{key}: expected the refusal {REFUSED[key]!r}, got {refusals}")
            continue
        if refusals != {None}:
            problems.append(f"{key}: refused {refusals}")
            continue
        loss_err = max(r["loss_err"] for r in ranks)
        param_err = max(r["param_err"] for r in ranks)
        covered = set().union(*(r["params"] for r in ranks))
        if loss_err > TOL or param_err > TOL:
            problems.append(f"{key}: loss error {loss_err:.2e}, parameter error {param_err:.2e}")
        if not set(case["reference_params"]) <= covered:
            problems.append(f"{key}: parameters never compared: {sorted(set(case['reference_params']) - covered)[:4]}")
    assert not problems, "\n".join(problems)
    _check_patterns({c["arch"]: c["profile"] for c in cases if "profile" in c})
    vocab_case = cases[-1]
    assert vocab_case["arch"] == "gpt_v50257" and vocab_case["embed_tp"] == 2, vocab_case


def _check_patterns(profiles: dict) -> None:
    """What the pattern pass found in the graphs these cases were lowered from."""
    phi3 = profiles["phi3"]
    # Phi-3 has no split_size attribute: gate_up_proj's [gate | up] is seen as .chunk(2) in the graph
    assert phi3["rules"]["model.layers.0.mlp.gate_up_proj"] == {
        "style": "colwise", "parts": 2, "feeds_rowwise": True, "copy_output": False}
    # its qkv_proj is cut apart by slicing at unequal widths: left whole, and said so
    assert "model.layers.0.self_attn.qkv_proj" not in phi3["rules"]
    assert phi3["whole"]["model.layers.0.self_attn.qkv_proj"].startswith("fused layout unsupported")
    assert "model.layers.0.mlp.gate_up_proj: colwise (2 fused pieces)" in phi3["report"]
    gpt2 = profiles["gpt2"]["rules"]
    assert gpt2["transformer.h.0.attn.c_attn"]["parts"] == 3 and gpt2["transformer.h.0.mlp.c_fc"]["parts"] == 1
    # FalconDecoderLayer: mlp_output += attention_output, on the row-parallel output
    falcon = profiles["falcon"]["rules"]
    assert falcon["transformer.h.0.mlp.dense_4h_to_h"]["copy_output"]
    assert not any(r["copy_output"] for r in profiles["llama"]["rules"].values())
    # BERT: query lives in attention.self, its row-parallel partner in attention.output
    bert = profiles["bert"]["rules"]
    assert bert["bert.encoder.layer.0.attention.self.query"]["feeds_rowwise"]
    assert not bert["cls.predictions.decoder"]["feeds_rowwise"]  # the LM head gathers
    # T5's stacks call their dropout after the embedding and after the last layer: in no block
    owners: dict[str, list[str]] = {}
    for block, modules in profiles["t5"]["blocks"].items():
        for m in modules:
            owners.setdefault(m, []).append(block)
    assert all(len(v) == 1 for v in owners.values()), owners
    assert "encoder.dropout" not in owners and "decoder.dropout" not in owners
    # Mixtral's experts are 3-D parameters, not linears: replicated, and the profile says so
    assert profiles["mixtral"]["whole"]["model.layers.0.mlp.experts"].startswith("no pattern")
