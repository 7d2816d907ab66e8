"""Sequence parallelism (Korthikanti et al. 2022): the pattern pass's SEQUENCE rules and their lowering.

``build_profile(..., sequence_parallel=True)`` adds SEQUENCE rules for the pre-norms that feed
column-parallel layers and one on the first TP layer (where the residual stream is scattered along the
sequence); the runtime lowers them with DTensor's ``SequenceParallel`` and
``RowwiseParallel(output_layouts=Shard(1))``. Numerics: 3 AdamW steps on 2 gloo ranks (TP2) must
match one process within 1e-5, like tests/test_runtime_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime_cases import (
    SEQ,
    adamw,
    batches,
    build_model,
    full_params,
    lm_loss,
    reference_run,
)
from whalepy.errors import PlanError
from whalepy.ir.plan import TPStyle

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

_SP_PROFILES: dict[str, Any] = {}


def sp_profile(kind: str) -> Any:
    import whalepy

    if kind not in _SP_PROFILES:
        x = torch.zeros(2, SEQ, dtype=torch.long)
        _SP_PROFILES[kind] = whalepy.profile(build_model(kind), (x,), sequence_parallel=True)
    return _SP_PROFILES[kind]


def _sequence(block) -> set[str]:
    return {r.module for r in block.tp_rules if r.style is TPStyle.SEQUENCE}


@pytest.mark.parametrize("kind, layer, norms, final", [
    ("gpt", "transformer.h", ("ln_1", "ln_2"), "transformer.ln_f"),
    ("hf", "transformer.h", ("ln_1", "ln_2"), "transformer.ln_f"),
    ("llama", "model.layers", ("input_layernorm", "post_attention_layernorm"), "model.norm"),
])
def test_pass_emits_sequence_rules_when_asked(kind, layer, norms, final):
    prof = sp_profile(kind)
    b0, b1 = prof.block(f"{layer}.0"), prof.block(f"{layer}.1")
    # the first TP layer is the entry of the sequence-sharded region; each layer's norms are SEQUENCE
    assert _sequence(b0) == {f"{layer}.0", *(f"{layer}.0.{n}" for n in norms)}
    assert _sequence(b1) == {f"{layer}.1.{n}" for n in norms}
    assert _sequence(prof.blocks[-1]) == {final}
    assert not _sequence(prof.blocks[0])  # the embedding block stays whole (scattered at the entry)
    # the other rules are those of the default profile; without the option, no SEQUENCE rule
    from runtime_cases import case_profile
    plain = case_profile(kind)
    for a, b in zip(plain.blocks, prof.blocks):
        assert not _sequence(a)
        assert {r for r in b.tp_rules if r.style is not TPStyle.SEQUENCE} == set(a.tp_rules)


def test_post_norm_model_is_refused():
    """A post-norm block (the norm's output is also the residual) cannot run sequence parallel."""
    import whalepy
    from torch import nn

    class PostNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.ln = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

        def forward(self, x):
            return self.ln(x + self.fc2(torch.relu(self.fc1(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 16)
            self.layers = nn.ModuleList(PostNorm() for _ in range(2))
            self.head = nn.Linear(16, 64)

        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with pytest.raises(PlanError, match=r"layers\.0.*cannot run sequence parallel"):
        whalepy.profile(Net(), (torch.zeros(2, 8, dtype=torch.long),), sequence_parallel=True)


# -- numerics on 2 / 4 ranks ------------------------------------------------------------------------

def _light(prof: Any) -> Any:
    """The profile without its graph: picklable, so the ranks need not trace the model again."""
    import dataclasses

    return dataclasses.replace(prof, graph=None)


def run_sp_case(kind: str, dp: int, tp: int, name: str, prof: Any, global_batch: int = 8,
                steps: int = 3) -> dict:
    from whalepy.runtime import make_plan, parallelize

    rules = tuple(r for b in prof.blocks for r in b.tp_rules)
    plan = make_plan([b.name for b in prof.blocks], model_fingerprint=prof.fingerprint, dp=dp, tp=tp,
                     global_batch=global_batch, tensor_parallel=rules)
    data = batches(global_batch, steps)
    ref_losses, ref_params = reference_run(kind, data)
    pm = parallelize(build_model(kind), None, example_inputs=(data[0][0][:2],), loss_fn=lm_loss,
                     optimizer=adamw, global_batch=global_batch, plan=plan, profile=prof)
    seen: list[int] = []  # the residual stream between blocks is sequence-sharded
    entry = next(r.module for r in rules if r.style is TPStyle.SEQUENCE)
    pm.module.get_submodule(entry).register_forward_hook(lambda m, a, o: seen.append(o.shape[1]))
    losses = [pm.train_step(x, y).item() for x, y in data]
    params = full_params(pm)
    assert seen and set(seen) == {SEQ // tp}, (name, seen)
    return {"name": name, "losses": losses, "ref": ref_losses,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max((params[k] - ref_params[k]).abs().max().item() for k in params)}


def run_sp_cases(cases: list[tuple]) -> list[dict]:
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    return [run_sp_case(*c) for c in cases]


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for r in per_rank:
            assert r["loss_err"] <= LOSS_RTOL, (r["name"], r)
            assert r["param_err"] <= PARAM_ATOL, (r["name"], r)


@pytest.mark.distributed
def test_two_ranks_tp2_sequence_parallel_matches_one_process():
    from dist_harness import run_distributed

    # HF GPT-2 (Conv1D sharded by hand, reduce-scatter by hand) passes too; left out for test time
    cases = [("gpt", 1, 2, "gpt tp2 sp"), ("llama", 1, 2, "llama tp2 sp (gqa, rmsnorm)")]
    cases = [(*c, _light(sp_profile(c[0]))) for c in cases]
    _check(run_distributed(run_sp_cases, 2, cases, timeout=240))
