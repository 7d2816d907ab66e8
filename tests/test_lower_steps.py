"""Lowering steps (whalepy.runtime.lower) run on their own on two gloo ranks, without ParallelModel:
a GPT's embedding tied to its head over two pipeline stages (split_pipeline, tie_across_stages,
sync_tied_grads), and GPT over two replicas with ZeRO-Offload (parallelize_part, materialize_parts,
build_optimizers). The whole lowering is checked against one process by test_runtime_parallel.py."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

from dist_harness import run_distributed
from lower_step_cases import run_steps

PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.pipelining", "torch.distributed.fsdp",
           "whalepy.runtime.lower", "lower_step_cases")
"""Imported once by the fork server that forks the two ranks (about half of this test's time otherwise)."""


@pytest.mark.distributed
def test_steps_alone_on_two_ranks():
    results = run_distributed(run_steps, 2, timeout=180, preload=PRELOAD)
    for rank, (tied, offload) in enumerate(results):
        # one stage per rank, one tied weight with one copy each, unchanged by the split; the copies'
        # gradients (1 on rank 0, 2 on rank 1) summed over the pipeline group
        assert tied == {"kind": "none", "stages": [rank], "num_tied": 1, "copies": 1, "same_as_model": True,
                        "grads": [3.0]}, tied
        # FSDP2 shards every parameter and keeps its values; the host optimizer steps each of them once
        assert offload["kind"] == "fsdp2" and offload["ties"] == 0 and offload["stats"] is None, offload
        assert offload["sharded"] and offload["whole"] and offload["each_once"] and offload["host"] > 0, offload


def test_the_documented_order_is_lower_s():
    """docs/architecture.md's lowering steps are the calls of lower(), in the same order."""
    from whalepy.runtime import lower

    tree = ast.parse(inspect.getsource(lower.lower))
    calls = sorted((n.lineno, n.col_offset, n.func.id) for n in ast.walk(tree)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
    called = [name for _, _, name in calls]  # in source order
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    block = text[text.index("lower(model, plan, ctx) -> Lowered\n"):]
    block = block[:block.index("```")]
    documented = re.findall(r"= \[?(\w+)\(", block)
    assert documented == [c for c in called if c in documented], (documented, called)
    assert {"check_lowerable", "split_pipeline", "parallelize_part", "build_optimizers"} <= set(documented)
