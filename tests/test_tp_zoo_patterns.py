"""The one rule (``tp_splits``) the planner and the plan check share for which blocks split under TP
(issue 22), in one process. What the pattern pass finds in the zoo's graphs is checked by
tests/test_zoo_matrix.py, on the profiles its cases are lowered from."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import whalepy
from whalepy.ir.rules import tp_splits
from whalepy.errors import PlanError
from whalepy.ir.plan import TPStyle
from whalepy.runtime import make_plan


def test_plan_check_and_planner_share_the_split_rule() -> None:
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=129, block_size=16, num_layers=2, num_heads=4, hidden_size=32))
    prof = whalepy.profile(model, (torch.zeros(2, 16, dtype=torch.long),))
    embed = prof.block("embed")
    assert not tp_splits(embed, 2) and tp_splits(prof.blocks[1], 2)  # 129 does not divide by 2
    names = [b.name for b in prof.blocks]
    rules = tuple(r for b in prof.blocks if tp_splits(b, 2) for r in b.tp_rules)
    plan = make_plan(names, model_fingerprint=prof.fingerprint, dp=2, tp=2, global_batch=8,
                     tensor_parallel=rules)
    plan.check_against(profile=prof)  # the embedding runs whole: accepted
    with pytest.raises(PlanError, match="must run whole"):
        dataclasses.replace(plan, tensor_parallel=rules + embed.tp_rules).check_against(profile=prof)
    fused = next(r for r in rules if r.style is TPStyle.COLWISE)
    edited = tuple(dataclasses.replace(r, parts=r.parts + 1) if r is fused else r for r in rules)
    with pytest.raises(PlanError, match="fused piece"):
        dataclasses.replace(plan, tensor_parallel=edited).check_against(profile=prof)
