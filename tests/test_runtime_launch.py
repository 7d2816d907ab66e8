"""Launch checks, the not-launched fallback, ``make_plan`` and ``whalepy run``'s torchrun command."""

from __future__ import annotations

import argparse
import os
import types

import pytest
import torch

from dist_harness import run_distributed
from runtime_cases import Case, adamw, gpt_model, lm_loss, make_case_plan
from whalepy.errors import LaunchError, PlanError, WhalepyError
from whalepy.tools.launch import add_run_subparser, build_torchrun_command
from whalepy.runtime import UnlaunchedModel, make_plan, parallelize


def _attempt(kind: str) -> str:
    """Per rank: one wrong launch; return the error's class and message (or a failure marker)."""
    import dataclasses

    from whalepy import ClusterSpec

    x = torch.zeros(2, 16, dtype=torch.long)
    model = gpt_model()
    plan = make_case_plan(Case("dp2", dp=2))
    spec = None
    profile = None
    if kind == "world":
        plan = make_case_plan(Case("dp4", dp=4))
    elif kind == "model":
        plan = dataclasses.replace(plan, model_fingerprint="fp-of-another-model")
        from whalepy.passes import model_fingerprint

        # this model's fingerprint (parallelize refuses a profile of another model before the launch checks)
        profile = types.SimpleNamespace(fingerprint=model_fingerprint(model))
    elif kind == "device":
        spec = ClusterSpec.local(2)  # two CPU ranks
        plan = make_plan(["transformer.h.0"], dp=2, global_batch=8, device_type="A100")
    elif kind == "nvme":
        # make_plan refuses (nvme, gpu) at once; a hand-edited plan reaches the runtime, which refuses it too
        plan = make_plan(["transformer.h.0", "transformer.h.1"], dp=2, global_batch=8, zero_stage=3)
        st = plan.stages[0]
        st = dataclasses.replace(st, blocks=tuple(dataclasses.replace(b, param_tier="nvme") for b in st.blocks))
        plan = dataclasses.replace(plan, stages=(st,))
    elif kind == "per-rank batch":
        pm = parallelize(model, spec, example_inputs=(x,), loss_fn=lm_loss, optimizer=adamw,
                         global_batch=8, plan=plan)
        local = torch.zeros(3, 16, dtype=torch.long)  # neither the global batch nor this rank's share (4)
        try:
            pm.train_step(local, local)
        except WhalepyError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"
    try:
        parallelize(model, spec, example_inputs=(x,), loss_fn=lm_loss, optimizer=adamw,
                    global_batch=8, plan=plan, profile=profile)
    except LaunchError as e:
        return f"LaunchError: {e}"
    except WhalepyError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _attempts(kinds: list[str]) -> list[str]:
    return [_attempt(k) for k in kinds]


@pytest.mark.distributed
def test_wrong_launches_raise_launch_error():
    kinds = ["world", "model", "device", "nvme", "per-rank batch"]
    msgs = run_distributed(_attempts, 2, kinds, timeout=120)
    for per_rank in msgs:
        world, model, device, nvme, batch = per_rank
        assert world.startswith("LaunchError") and "2 processes" in world and "for 4" in world
        assert "--nproc-per-node 4" in world
        assert model.startswith("LaunchError") and "fingerprint" in model
        assert device.startswith("PlanError") and "puts a A100 on rank 0" in device  # a plan of another cluster
        assert "nvme" in nvme and "transformer.h.0" in nvme and "param_tier" in nvme
        assert "shape (3, 16)" in batch and "whole global batch (8 samples" in batch, batch
        assert "share (4 samples" in batch, batch


def test_outside_a_launch_returns_plan_holder(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WHALEPY_PLAN"):
        monkeypatch.delenv(var, raising=False)
    import whalepy.runtime.parallel_model as pmod

    monkeypatch.setattr(pmod, "_hint_printed", False)
    plan = make_case_plan(Case("dp2 x tp2", dp=2, tp=2))
    x = torch.zeros(2, 16, dtype=torch.long)
    kwargs = dict(example_inputs=(x,), loss_fn=lm_loss, optimizer=adamw, global_batch=8, plan=plan)
    pm = parallelize(gpt_model(), None, **kwargs)
    assert isinstance(pm, UnlaunchedModel) and pm.plan is plan
    with pytest.raises(LaunchError, match=r"torchrun --nproc-per-node 4 .*whalepy run -n 4"):
        pm.train_step(x, x)
    for name in ("measured_profile", "close", "wait_for_save", "device"):  # the rest of ParallelModel's API too
        with pytest.raises(LaunchError, match=rf"ParallelModel.{name} .*torchrun --nproc-per-node 4"):
            getattr(pm, name)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        pm.nonsense
    parallelize(gpt_model(), None, **kwargs)
    assert capsys.readouterr().err.count("torchrun --nproc-per-node 4") == 1


def test_make_plan_layout():
    plan = make_plan([f"b{i}" for i in range(5)], dp=2, tp=2, pp=2, global_batch=8,
                     batch_shares=(3, 5), num_microbatches=1, checkpoint=["b1"])
    assert plan.world_size == 8 and plan.pp_degree == 2
    assert plan.stages[0].ranks == ((0, 1), (2, 3)) and plan.stages[1].ranks == ((4, 5), (6, 7))
    assert [b.name for b in plan.stages[0].blocks] == ["b0", "b1", "b2"]
    assert plan.block_plan("b1").checkpoint and not plan.block_plan("b0").checkpoint
    with pytest.raises(PlanError):
        make_plan(["a"], pp=2, global_batch=8)


def test_make_plan_interleaved_chunks():
    # 8 blocks over pp=2 x v=2: pipeline stage g = s + j * pp takes blocks in model order
    plan = make_plan([f"b{i}" for i in range(8)], pp=2, virtual_stages=2, global_batch=8,
                     num_microbatches=2)
    assert plan.schedule.value == "interleaved_1f1b" and plan.virtual_stages == 2
    assert plan.stages[0].block_names == ("b0", "b1", "b4", "b5") and plan.stages[0].chunk_sizes == (2, 2)
    assert plan.stages[1].block_names == ("b2", "b3", "b6", "b7")
    plan = make_plan([f"b{i}" for i in range(5)], pp=2, virtual_stages=2, global_batch=8,
                     chunk_sizes=[(1, 1), (2, 1)])
    assert plan.stages[0].block_names == ("b0", "b3") and plan.stages[1].block_names == ("b1", "b2", "b4")
    with pytest.raises(PlanError):
        make_plan(["a", "b", "c"], pp=2, virtual_stages=2, global_batch=8)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="whalepy")
    add_run_subparser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_run_builds_torchrun_command():
    cmd = build_torchrun_command(_parse(["run", "-n", "4", "train.py", "--lr", "1e-3"]))
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                       "train.py", "--lr", "1e-3"]
    cmd = build_torchrun_command(_parse(["run", "-n", "8", "--nnodes", "2", "--rdzv-endpoint",
                                         "host:29400", "t.py"]))
    assert "--standalone" not in cmd and cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "host:29400"
    assert _parse(["run", "-n", "2", "t.py"]).func.__name__ == "main_run"
    assert os.path.basename(cmd[-1]) == "t.py"


def test_optimizer_instance_instead_of_factory_is_refused_with_the_fix():
    model = gpt_model()
    plan = make_case_plan(Case("dp2 x tp2", dp=2, tp=2))
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(TypeError, match=r"takes a factory.*lambda params"):
        parallelize(model, None, example_inputs=(x,), loss_fn=lm_loss, global_batch=8, plan=plan,
                    optimizer=torch.optim.AdamW(model.parameters()))
