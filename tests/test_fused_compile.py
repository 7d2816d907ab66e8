"""The plan's optimizer implementation and compiled blocks (issue 28).

Fused optimizers: torch's ``fused=True`` kernel of the user's optimizer class against the user's own
optimizer, within the tolerance torch's own test of the two uses (``test/test_optim.py``,
``test_fused_matches_forloop``: ``assertEqual``'s float32 defaults, those of ``torch.testing.assert_close``,
rtol 1.3e-6 and atol 1e-5); under FSDP2 on two gloo ranks against the single-process run with the user's
optimizer; checkpoints saved under one implementation load under the other.

Compiled blocks: under DP, ZeRO-3, TP, PP and activation checkpointing on two gloo ranks, against the
single-process eager run (fp32, 1e-5). The multi-process layouts compile with the ``aot_eager`` backend
(dynamo and AOTAutograd: the graphs, their composition with DTensor, FSDP2, checkpointing and pipeline
stages, without inductor's code generation, whose C++ build takes 25-75 s per graph on a 2-core CI
machine); inductor's CPU code is checked against eager by ``benchmarks/bench_runtime_overhead.py``
(docs/benchmarks.md). A block whose compile fails runs eagerly, said in one line.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from dist_harness import run_distributed
from runtime_cases import Case
from whalepy.ir.types import OptimizerImpl
from whalepy.runtime.compile_blocks import compile_blocks
from whalepy.runtime.optimizer_impl import describe, fused_supported, optimizer_factory_for

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("factory", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95)),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
], ids=["adamw", "adam-amsgrad", "sgd-nesterov"])
def test_fused_matches_the_users_optimizer(factory, caplog) -> None:
    given, fused = _mlp(), _mlp()
    opt_given = optimizer_factory_for(factory, "as_given")(given.parameters())
    with caplog.at_level(logging.INFO, logger="whalepy"):
        opt_fused = optimizer_factory_for(factory, OptimizerImpl.FUSED)(fused.parameters())
    assert describe(opt_given) == "for-loop" and describe(opt_fused) == "fused"
    assert type(opt_fused) is type(opt_given)
    flags = ("fused", "foreach", "params")  # the rest of every group (hyper-parameters) is the user's
    assert ([{k: v for k, v in g.items() if k not in flags} for g in opt_fused.param_groups]
            == [{k: v for k, v in g.items() if k not in flags} for g in opt_given.param_groups])
    assert {k: v for k, v in opt_fused.defaults.items() if k not in flags} == {
        k: v for k, v in opt_given.defaults.items() if k not in flags}  # ZeRO-1 rebuilds from these
    _train(given, opt_given)
    _train(fused, opt_fused)
    for a, b in zip(fused.parameters(), given.parameters()):
        torch.testing.assert_close(a, b)  # torch's fused-vs-for-loop tolerance (module docstring)
    # the same state layout: each loads the other's state and steps on identically
    assert opt_fused.state_dict()["state"].keys() == opt_given.state_dict()["state"].keys()
    for key in opt_given.state_dict()["state"][0]:
        assert key in opt_fused.state_dict()["state"][0]


def test_kept_where_torch_has_no_fused_kernel(caplog) -> None:
    model = _mlp()
    with caplog.at_level(logging.INFO, logger="whalepy"):
        opt = optimizer_factory_for(lambda ps: torch.optim.RMSprop(ps, lr=1e-3), "fused")(model.parameters())
    assert describe(opt) == "for-loop" and not opt.param_groups[0].get("fused")
    assert fused_supported(opt) == "torch has no fused RMSprop"
    # the user's own fused flag is the user's choice: kept as it is
    mine = torch.optim.AdamW(_mlp().parameters(), fused=True)
    assert optimizer_factory_for(lambda ps: mine, "fused")(None) is mine
    # Adagrad's fused kernel is CPU-only (torch/optim/adagrad.py: cuda_unsupported)
    meta = nn.Parameter(torch.zeros(2, device="meta"))
    assert "no fused Adagrad kernel on meta" in fused_supported(torch.optim.Adagrad([meta]))


def test_a_block_that_cannot_compile_falls_back_eagerly(caplog) -> None:
    def refuse(gm, example_inputs):  # a backend that fails, as inductor does on a C++ compile error
        raise RuntimeError("no kernel for this block")

    model = _mlp()
    want = model(torch.ones(3, 8))
    stats = compile_blocks([("mlp-block-0", [model])], backend=refuse)
    with caplog.at_level(logging.WARNING, logger="whalepy"):
        got = model(torch.ones(3, 8))
        again = model(torch.ones(3, 8))  # eager from now on: no second compile, no second line
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    lines = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(lines) == 1 and "'mlp-block-0'" in lines[0] and "no kernel for this block" in lines[0], lines
    assert stats.modules == 1 and stats.fell_back[0][0] == "mlp-block-0"
    assert list(model.state_dict()) == list(_mlp().state_dict())  # names unchanged by compiling


def test_a_models_own_error_is_not_taken_for_a_compile_failure() -> None:
    model = _mlp()
    compile_blocks([("mlp-block-1", [model])], backend="eager")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(torch.ones(3, 5))


def _fused(name: str, **kw) -> Case:
    return Case(name, extra={"optimizer_impl": "fused"}, **kw)


def _compiled(name: str, **kw) -> Case:
    return Case(name, extra={"compile": True}, **kw)


@pytest.mark.distributed
def test_fused_and_compiled_layouts_match_one_process(tmp_path) -> None:
    from fused_compile_cases import run_all

    both = {"optimizer_impl": "fused", "compile": True}
    cases = [
        Case("fused compiled dp2 (ddp)", dp=2, extra=both),
        Case("fused compiled dp2 zero3 checkpointing", dp=2, zero=3, checkpoint=True, extra=both),
        _compiled("compiled tp2", tp=2),
        _compiled("compiled pp2 1f1b", pp=2, microbatches=2),
        _fused("fused dp2 zero1 (zero-redundancy optimizer)", dp=2, zero=1),
        _fused("fused tp2 (DTensor shards and plain norms in one group)", tp=2),
        ("resume", _fused("fused dp2 zero3", dp=2, zero=3), Case("as given tp2", tp=2), str(tmp_path / "a")),
        ("resume", Case("as given dp2", dp=2), _fused("fused pp2", pp=2, microbatches=2), str(tmp_path / "b")),
    ]
    per_rank = run_distributed(run_all, 2, cases, "aot_eager", timeout=600)
    for out in per_rank:
        for r in out["results"]:
            assert r["loss_err"] <= LOSS_RTOL and r["param_err"] <= PARAM_ATOL, r
            if "load_err" in r:
                assert r["load_err"] <= PARAM_ATOL, r
            if r["name"].startswith("fused") and "fused" in r:
                assert all(r["fused"]) and r["lr"] == [1e-3] and r["weight_decay"] == [0.1], r
            if "compiled" in r["name"]:
                assert r["compiled"] > 0 and not r["fell_back"] and r["first_step_s"] > 0, r
    lines = per_rank[0]["lines"]
    said = [ln for ln in lines if "optimizer torch.optim.adamw.AdamW steps" in ln]
    assert len(said) == 1 and "steps fused on cpu" in said[0], said
    assert sum("first step" in ln and "compiling the blocks" in ln for ln in lines) == 1, lines


def test_plan_records_the_choices_and_old_plans_keep_theirs() -> None:
    import json

    from whalepy.ir.plan import Plan
    from whalepy.runtime import make_plan

    plan = make_plan(["a", "b"], global_batch=4, optimizer_impl="fused", compile=True)
    again = Plan.from_json(plan.to_json())
    assert again.optimizer_impl is OptimizerImpl.FUSED and again.compile is True and not again.costs_stale
    old = json.loads(make_plan(["a", "b"], global_batch=4).to_json())
    old["version"] = 5
    del old["optimizer_impl"], old["compile"]
    loaded = Plan.from_dict(old)
    assert loaded.optimizer_impl is OptimizerImpl.AS_GIVEN and loaded.compile is False
    assert not loaded.costs_stale  # a version-5 file's cost hash still matches
    assert dataclasses.replace(loaded, compile=True).decision_hash() != loaded.decision_hash()


def test_planner_resolves_auto_and_charges_the_implementation_it_plans() -> None:
    from planner_fixtures import a100
    from whalepy.errors import PlanError
    from whalepy.hardware.cluster import ClusterSpec
    from whalepy.planner import plan_from_profile
    from whalepy.planner.synthetic import gpt_profile

    prof = gpt_profile("gpt3-1.3b")
    kw = dict(global_batch=8, allow_offload=False, zero_stages=(0,), schedules=("1f1b",), top_k=0)
    auto = plan_from_profile(prof, a100(1, per_node=1), **kw)
    assert auto.optimizer_impl is OptimizerImpl.FUSED and auto.compile is True  # CUDA GPUs
    given = plan_from_profile(prof, a100(1, per_node=1), optimizer_impl="as_given", compile=False, **kw)
    assert given.optimizer_impl is OptimizerImpl.AS_GIVEN and given.compile is False
    # the same layout; the fused step (28 bytes a parameter, or the measured rate) is cheaper than foreach (80)
    assert auto.cost.step_time_s < given.cost.step_time_s
    cpu = plan_from_profile(gpt_profile("gpt2"), ClusterSpec.local(1, device_type="CPU"), **{**kw, "global_batch": 1})
    assert cpu.optimizer_impl is OptimizerImpl.AS_GIVEN and cpu.compile is False  # CPU: the user's optimizer, eager
    with pytest.raises(PlanError, match="use 'auto', 'fused' or 'as_given'"):
        plan_from_profile(prof, a100(1, per_node=1), optimizer_impl="foreach", **kw)
    with pytest.raises(PlanError, match="use True, False or 'auto'"):
        plan_from_profile(prof, a100(1, per_node=1), compile="yes", **kw)
