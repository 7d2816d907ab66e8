"""Meta-device models on 8 gloo processes: deferred initialisation, loading, export (one launch).

What is checked (phases in ``meta_cases``):

- a GPT built on the meta device, four or more times the size of a rank's share, trains under
  DP x TP x PP = 2 x 2 x 2 with the losses of a single-process run of the same model (same seed, same
  initialisation through ``whalepy.materialize``); materialisation never holds more parameter bytes
  than the share plus one block, and parameters of other pipeline stages stay on the meta device;
- the same layout with the weights of a checkpoint written under DP x TP = 4 x 2, and an HF Llama
  with the weights of its ``save_pretrained`` safetensors (sharded, with an index);
- ``whalepy export`` of a checkpoint written under 2 x 2 x 2 loads with ``from_pretrained`` and gives
  the logits of the parallel model (DP x TP = 4 x 2) that loaded the same checkpoint;
  ``full_state_dict`` gathers the trained weights on rank 0 on both the pipeline and the
  single-stage path.

Precision: ``PRECISION`` is the one switch for phases A-D (the plans' precision and the reference's
autocast follow it); phase E, the export check, runs an fp32 plan (logits against from_pretrained's).

- fp32: losses 1e-5 relative, weights and logits 1e-5 absolute; a parallel run differs from one
  process only by the order of floating-point sums (all-reduce, sharded matmuls), orders of magnitude
  below that for these sizes (measured: about 2e-7).
- bf16: losses within one unit roundoff of bf16 (2^-8) relative. The layouts round differently from
  the single process (FSDP2's MixedPrecisionPolicy runs every op on bf16 parameters where the
  reference's autocast keeps norms in fp32; other matmul shapes and reduction orders; bf16 activations
  at pipeline boundaries), so a logit may differ by about one rounding of bf16; the loss is computed in
  fp32 and so differs by about that relative amount. Trained weights (phase D): Adam normalises each
  update, so weights are compared by distance, against a bound measured in the same run: the bf16
  reference and the fp32 reference start from the same checkpoint, and both the layout and the bf16
  reference are bf16 runs, each that far from fp32 at most, so by the triangle inequality
  ``|p_layout - p_bf16| <= 2 |p_bf16 - p_fp32|`` (2-norm over all weights). A real error (a missing
  reduction, a wrong loss scale) lands far outside it, as test_precision.py's runs show.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from meta_cases import build_profiles, meta_gpt, meta_llama, references, run_meta_cases, sizes

pytestmark = pytest.mark.distributed

PRECISION = "bf16"
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2.0**-8}
ATOL = 1e-5
"""fp32 weights and logits (E is fp32 in every case; D too when PRECISION is fp32)."""


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b) ** 0.5)


def _close(got: list[float], want: list[float], rtol: float) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want))


def _check_memory(phase: dict, full: int, block: int) -> None:
    stats = phase["stats"]
    assert full >= 4 * stats.share_bytes, (full, stats)
    assert stats.peak_bytes <= stats.share_bytes + block, (block, stats)
    assert phase["others_meta"] and phase["num_others"] > 0, phase  # other stages never allocated


def test_meta_init_load_export_eight_ranks(tmp_path):
    from transformers import LlamaForCausalLM

    from whalepy.tools.cli import main

    rtol, atol = LOSS_RTOL[PRECISION], ATOL
    llama_dir = str(tmp_path / "llama_hf")
    ref = references(llama_dir, PRECISION)
    assert len(list((tmp_path / "llama_hf").glob("*.safetensors"))) > 1  # read through the index
    ranks = run_distributed(run_meta_cases, 8, str(tmp_path), llama_dir, build_profiles(), PRECISION,
                            timeout=400)

    gpt_full, gpt_block = sizes(meta_gpt(), "transformer.h.0")
    llama_full, llama_block = sizes(meta_llama(), "model.layers.0")
    for r, out in enumerate(ranks):
        for phase in "ABCD":
            assert _close(out[phase]["losses"], ref[phase], rtol), (r, phase, out[phase]["losses"], ref[phase])
        _check_memory(out["A"], gpt_full, gpt_block)
        _check_memory(out["C"], gpt_full, gpt_block)
        _check_memory(out["D"], llama_full, llama_block)
        assert (out["E"]["logits"] == ranks[0]["E"]["logits"]).all()  # every rank holds the same logits
        assert _close(out["F"]["losses"], ref["A"][:1], rtol), (r, out["F"]["losses"], ref["A"][:1])

    # full_state_dict on rank 0 only, nothing elsewhere. A (pipeline path), before training: exactly
    # the single-process initialisation (the same host values, sliced and gathered back). D (pipeline
    # path) after 2 steps: the single-process run's weights. E (get_model_state_dict's own path):
    # exactly D, whose checkpoint it loaded.
    d_full = {k: torch.from_numpy(v) for k, v in ranks[0]["D"]["full"].items()}
    if PRECISION != "fp32":
        assert set(d_full) == set(ref["llama_state"])
        noise = _distance(ref["llama_state"], ref["llama_state_fp32"])
        moved = _distance(ref["llama_state"], ref["llama_init"])
        assert 0 < noise < moved, (noise, moved)  # the bound is not vacuous: training moved further
        assert _distance(d_full, ref["llama_state"]) <= 2 * noise, (_distance(d_full, ref["llama_state"]), noise)
    checks = [("A", ref["gpt_init"], 0.0), ("E", d_full, 0.0)]
    if PRECISION == "fp32":
        checks.append(("D", ref["llama_state"], atol))
    for path, want, tol in checks:
        full = {k: torch.from_numpy(v) for k, v in ranks[0][path]["full"].items()}
        assert set(full) == set(want), (path, set(full) ^ set(want))
        errors = {k: (full[k] - want[k]).abs().max().item() for k in want}
        assert max(errors.values()) <= tol, (path, {k: e for k, e in errors.items() if e > tol})
        assert all(out[path]["full"] == {} for out in ranks[1:])

    out_dir = tmp_path / "export"
    assert main(["export", str(tmp_path / "llama_d"), "--to", str(out_dir), "--max-shard-size", "40KB",
                 "-q"]) == 0
    assert (out_dir / "model.safetensors.index.json").is_file()
    hf = LlamaForCausalLM.from_pretrained(out_dir).eval()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, d_full[k], rtol=0, atol=0, msg=k)
    with torch.no_grad():
        logits = hf(torch.as_tensor(_first_batch())).logits
    torch.testing.assert_close(logits, torch.from_numpy(ranks[0]["E"]["logits"]), rtol=0, atol=atol)


def _first_batch() -> torch.Tensor:
    from meta_cases import GLOBAL_BATCH, STEPS
    from runtime_cases import batches

    return batches(GLOBAL_BATCH, STEPS)[0][0][:4]
