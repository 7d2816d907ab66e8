"""Bad plan files (malformed, hand-edited against the model, stale costs) and bad command lines: each one
whalepy error line naming the cause and the fix (issue 12, deliver 4). The CLI runs in-process
(``whalepy.tools.cli.main``) with a tiny model given as ``bad_input_cases:tiny_model_and_inputs``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import whalepy
from whalepy import ArgumentError, PlanError
from whalepy.tools.cli import main

from bad_input_cases import CPU4, TOKENS, assert_clear, edited_plan_json, tiny, write

# -- malformed plan files -----------------------------------------------------------------------------


def _stage(d: dict) -> dict:
    return d["stages"][0]


MALFORMED = [
    ("version 99", lambda d: d.update(version=99), ("version 99", "Re-create the plan")),
    ("missing stages", lambda d: d.pop("stages"), ("malformed", "stages")),
    ("unknown field", lambda d: d.update(speed=1), ("no field(s) ['speed']",)),
    ("world size 0", lambda d: d.update(world_size=0), ("world_size", "positive integer")),
    ("world size 8 for 4 ranks", lambda d: d.update(world_size=8), ("rank_device_types has 4 entries",)),
    ("batch shares do not sum", lambda d: d.update(batch_shares=[4, 3]), ("sum to the global batch 8",)),
    ("micro-batches do not divide", lambda d: d.update(num_microbatches=3), ("not divisible by 3 micro-batches",)),
    ("virtual stages without interleaving", lambda d: d.update(virtual_stages=2), ("interleaved schedule",)),
    ("unknown schedule", lambda d: d.update(schedule="zigzag"), ("zigzag",)),
    ("unknown tier", lambda d: _stage(d)["blocks"][0].update(param_tier="disk"), ("disk",)),
    ("zero stage 7", lambda d: _stage(d).update(zero_stage=7), ("7",)),
    ("duplicate block", lambda d: _stage(d)["blocks"].append(_stage(d)["blocks"][1]), ("more than one stage",)),
    ("stage without blocks", lambda d: _stage(d).update(blocks=[]), ("no blocks",)),
    ("rank used twice", lambda d: _stage(d).update(ranks=[[0, 1], [1, 3]]), ("exactly once",)),
    ("device types per replica", lambda d: _stage(d).update(device_types=["CPU"]), ("1 device types for 2",)),
    ("wrong device type", lambda d: _stage(d).update(device_types=["CPU", "T4"]), ("'T4'",)),
    ("tiles 0", lambda d: _stage(d)["blocks"][0].update(tiles=0), ("tiles must be an integer >= 1",)),
    ("tiles below ZeRO-3", lambda d: (_stage(d)["blocks"][0].update(tiles=2), _stage(d).update(zero_stage=2)),
     ("tiles=2 needs ZeRO-3", "set zero_stage=3 or tiles=1")),
    ("tiles with tensor parallelism", lambda d: (_stage(d)["blocks"][0].update(tiles=2), _stage(d).update(zero_stage=3)),
     ("tensor parallelism (tp=2)", "use tp=1 or tiles=1")),
    ("reduce every micro-batch not a bool", lambda d: _stage(d).update(reduce_every_microbatch="yes"),
     ("reduce_every_microbatch must be true or false",)),
    ("stages a string", lambda d: d.update(stages="x"), ("plan.stages must be a JSON list", "str 'x'")),
    ("a stage a list", lambda d: d.update(stages=[[1]]), ("plan.stages[0] must be a JSON object (a StagePlan)",)),
    ("ranks a string", lambda d: _stage(d).update(ranks="0,1"), ("plan.stages[0].ranks must be a JSON list",)),
    ("global batch a string", lambda d: d.update(global_batch="8"), ("plan.global_batch must be a number",)),
    ("block name a number", lambda d: _stage(d)["blocks"][0].update(name=5),
     ("plan.stages[0].blocks[0].name must be a string",)),
    ("checkpoint a string", lambda d: _stage(d)["blocks"][0].update(checkpoint="yes"),
     ("blocks[0].checkpoint must be true or false", "'yes'")),
    ("fingerprint a number", lambda d: d.update(model_fingerprint=5), ("plan.model_fingerprint must be a string",)),
    ("unknown TP style", lambda d: d["tensor_parallel"][0].update(style="diagonal"),
     ("'diagonal'", "re-create it with `whalepy plan`")),
]


@pytest.mark.parametrize("edit, needles", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_plan_files(tmp_path: Path, edit, needles) -> None:
    path = edited_plan_json(tmp_path, edit)
    assert_clear(lambda: whalepy.Plan.load(path), PlanError, *needles)


@pytest.mark.parametrize("text, needles", [
    (None, ("no plan file at", "whalepy plan --out")),
    ("", ("not valid JSON",)),
    ("{", ("not valid JSON",)),
    ("[]", ("JSON object with a 'version' field", "list")),
], ids=["missing", "empty", "truncated", "a list"])
def test_unreadable_plan_files(tmp_path: Path, text, needles) -> None:
    path = str(tmp_path / "p.json") if text is None else write(tmp_path, "p.json", text)
    assert_clear(lambda: whalepy.Plan.load(path), PlanError, *needles)


def test_plan_path_is_a_directory(tmp_path: Path) -> None:
    assert_clear(lambda: whalepy.Plan.load(tmp_path), PlanError, "is a directory", "JSON plan")
    assert_clear(lambda: whalepy.Plan.load(5), PlanError, "path of a JSON plan, got int 5")


# -- hand-edited plans checked against the model -------------------------------------------------------


def _tp_to_dp(d: dict) -> None:
    _stage(d).update(ranks=[[0], [1], [2], [3]], device_types=["CPU"] * 4)
    d["batch_shares"] = [2, 2, 2, 2]


def _rule(d: dict, module: str) -> None:
    d["tensor_parallel"][2]["module"] = module


EDITED = [
    ("TP 2 changed to DP, model says split(2)", _tp_to_dp, {"transformer.h.*.mlp": whalepy.split(2)},
     ("does not honour split(2) on transformer.h.0.mlp", "TP 1", "re-plan")),
    ("TP 2 kept, model says replicate()", lambda d: None, {"transformer.h.*": whalepy.replicate()},
     ("does not honour replicate()", "TP 2")),
    ("a block removed", lambda d: _stage(d)["blocks"].pop(2), {}, ("leaves out block(s) transformer.h.1",)),
    ("a block renamed", lambda d: _stage(d)["blocks"][1].update(name="transformer.h.9"), {},
     ("block 'transformer.h.9'", "does not have")),
    ("blocks reordered", lambda d: _stage(d)["blocks"].reverse(), {}, ("model order",)),
    ("TP rule on a missing module", lambda d: _rule(d, "transformer.h.0.attn.qq"), {}, ("no such module",)),
    ("TP rule on a LayerNorm", lambda d: _rule(d, "transformer.h.0.ln_1"), {},
     ("colwise on 'transformer.h.0.ln_1'", "not a pattern whalepy found")),
    ("TP rules deleted", lambda d: d.update(tensor_parallel=[]), {}, ("no tensor-parallel rule", "run unsplit")),
]


@pytest.mark.parametrize("edit, annotations, needles", [c[1:] for c in EDITED], ids=[c[0] for c in EDITED])
def test_hand_edited_plan_checked_against_the_model(tmp_path: Path, edit, annotations, needles) -> None:
    path = edited_plan_json(tmp_path, edit)
    model = tiny(**annotations)
    assert_clear(lambda: whalepy.Plan.load(path, model=model), PlanError, *needles)
    assert_clear(lambda: whalepy.Plan.load(path, model=model, example_inputs=(TOKENS,)), PlanError, *needles)


def test_plan_for_another_model(tmp_path: Path) -> None:
    path = edited_plan_json(tmp_path, lambda d: None)
    other = whalepy.models.GPT(whalepy.models.GPTConfig(vocab_size=32, block_size=16, num_layers=3, num_heads=2,
                                                        hidden_size=16))
    assert_clear(lambda: whalepy.Plan.load(path, model=other), PlanError, "fingerprint", "Re-plan")


def test_plan_check_needs_a_model_and_inputs(tmp_path: Path) -> None:
    import torch

    path = edited_plan_json(tmp_path, lambda d: None)
    assert_clear(lambda: whalepy.Plan.load(path, model="gpt"), ArgumentError, "nn.Module")
    assert_clear(lambda: whalepy.Plan.load(path, model=torch.nn.Linear(2, 2)), ArgumentError, "example_inputs=")


def test_unedited_plan_passes_and_costs_are_fresh(tmp_path: Path) -> None:
    path = edited_plan_json(tmp_path, lambda d: None)
    plan = whalepy.Plan.load(path, model=tiny())
    assert not plan.costs_stale and "STALE" not in str(plan)


def test_stale_costs_are_detected(tmp_path: Path) -> None:
    from whalepy.planner.check import check_costs

    plan = whalepy.Plan.load(edited_plan_json(tmp_path, _tp_to_dp))
    assert plan.costs_stale
    assert str(plan).startswith("STALE COSTS:") and "whalepy estimate" in str(plan).splitlines()[0]
    assert_clear(lambda: check_costs(plan), PlanError, "stale", "re-run `whalepy plan`", "whalepy estimate")
    plan.check_against(tiny())  # stale but lowerable: a TP->DP edit of an unannotated model is valid


# -- the command line ---------------------------------------------------------------------------------

MODEL = "bad_input_cases:tiny_model_and_inputs"
PLAN = ["plan", MODEL, "--cluster", CPU4, "-q"]
EST = ["estimate", MODEL, "--cluster", CPU4, "-q"]

CLI = [
    ("--zero-stages a,b", PLAN + ["--zero-stages", "a,b"], ("--zero-stages a,b", "'a', 'b'", "0,1")),
    ("--zero-stages 5", PLAN + ["--zero-stages", "0,5"], ("'5'",)),
    ("--seq-len 0", ["plan", "synthetic:gpt2", "--cluster", CPU4, "--seq-len", "0"], ("--seq-len 0", "positive")),
    ("--seq-len -1", ["plan", "synthetic:gpt2", "--cluster", CPU4, "--seq-len", "-1"], ("--seq-len -1",)),
    ("--seq-len with a function", PLAN + ["--seq-len", "8"], ("--seq-len applies to built-in",)),
    ("--global-batch 0", PLAN + ["--global-batch", "0"], ("--global-batch 0",)),
    ("--time-limit 0", PLAN + ["--time-limit", "0"], ("--time-limit 0", "seconds")),
    ("--max-tp 3", PLAN + ["--max-tp", "3"], ("--max-tp 3", "power of two")),
    ("--max-tp 0", PLAN + ["--max-tp", "0"], ("--max-tp 0",)),
    ("--schedules foo", PLAN + ["--schedules", "1f1b,foo"], ("'foo'", "gpipe")),
    ("--cluster missing", ["plan", MODEL, "--cluster", "nope.yaml"], ("nope.yaml", "YAML or JSON")),
    ("unknown built-in", ["plan", "gpt5", "--cluster", CPU4], ("unknown built-in model 'gpt5'",)),
    ("function not found", ["plan", "bad_input_cases:nope", "--cluster", CPU4], ("cannot load", "package.module")),
    ("function returns a model", ["plan", "bad_input_cases:not_a_pair", "--cluster", CPU4],
     ("must return (model, example_inputs)",)),
    ("synthetic unknown", ["plan", "synthetic:gpt9", "--cluster", CPU4], ("gpt9",)),
    ("names a constant, not a function", ["plan", "bad_input_cases:CPU4", "--cluster", CPU4],
     ("bad_input_cases:CPU4 is a str, not a function",)),
    ("function needs arguments", ["plan", "bad_input_cases:write", "--cluster", CPU4],
     ("needs arguments", "def build(): return my_fn(...)")),
    ("show --model without --check", ["show", "p.json", "--model", MODEL], ("--model is used by --check only",)),
    ("show a cluster spec", ["show", CPU4], ("cpu4.yaml: plan is not valid JSON", "whalepy plan --out")),
    ("estimate --dp 0", EST + ["--dp", "0"], ("--dp 0",)),
    ("estimate --zero 5", EST + ["--dp", "4", "--zero", "5"], ("--zero 5", "0, 1, 2 or 3")),
    ("estimate --schedule foo", EST + ["--dp", "4", "--schedule", "foo"], ("--schedule foo",)),
    ("estimate --microbatches 0", EST + ["--dp", "4", "--microbatches", "0"], ("--microbatches 0",)),
    ("estimate degrees", EST + ["--dp", "3"], ("dp(3) * tp(1) * pp(1) = 3 != world size (4)",)),
    ("show missing plan", ["show", "nope.json"], ("no plan file at nope.json",)),
    ("run -n 0", ["run", "-n", "0", "train.py"], ("-n 0", "positive integer", "-n 4")),
    ("run -n abc", ["run", "-n", "abc", "train.py"], ("-n abc",)),
    ("run --nnodes 3:2", ["run", "-n", "2", "--nnodes", "3:2", "train.py"], ("--nnodes 3:2", "MIN <= MAX")),
    ("run --master-port 70000", ["run", "-n", "2", "--master-port", "70000", "train.py"], ("1 to 65535",)),
    ("calibrate on a missing device", ["calibrate", "--device", "tpu", "--quick"], ("'tpu'", "'cpu'")),
]


@pytest.mark.parametrize("argv, needles", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_command_line_mistakes(capsys, argv, needles) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: "), err
    for needle in needles:
        assert needle in err[0], f"{needle!r} not in {err[0]!r}"


def test_show_check(tmp_path: Path, capsys) -> None:
    path = edited_plan_json(tmp_path, _tp_to_dp)
    assert main(["show", path, "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "costs are stale" in err[0], err
    path = edited_plan_json(tmp_path, lambda d: _rule(d, "transformer.h.0.ln_1"))
    data = json.loads(Path(path).read_text())
    data["costs_for"] = ""  # as if re-costed: only the model check can find the bad rule
    Path(path).write_text(json.dumps(data))
    assert main(["show", path, "--check", "--model", MODEL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a pattern whalepy found" in err[0], err
    good = edited_plan_json(tmp_path, lambda d: None)
    assert main(["show", good, "--check", "--model", MODEL]) == 0
    assert "checked" in capsys.readouterr().err


def test_run_mistakes(tmp_path: Path, capsys) -> None:
    assert main(["run", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert "no script at" in capsys.readouterr().err
    script = write(tmp_path, "s.py", "")
    assert main(["run", "-n", "2", "--plan", str(tmp_path / "p.json"), script]) == 2
    assert "no plan file at" in capsys.readouterr().err
    plan4 = edited_plan_json(tmp_path, lambda d: None)  # a plan for 4 processes, refused before any starts
    assert main(["run", "-n", "2", "--plan", plan4, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "-n 2 starts 2 processes but the plan" in err[0] and "use -n 4" in err[0], err
    assert main(["run", "-n", "4", "--plan", write(tmp_path, "bad.json", "{"), script]) == 2
    assert "plan is not valid JSON" in capsys.readouterr().err
    assert main(["run", "-n", "4", "--plan", plan4, "--dry-run", script]) == 0


USAGE = [
    ("unknown command", ["frobnicate"], ("invalid choice: 'frobnicate'", "`whalepy --help`")),
    ("missing model and cluster", ["plan"], ("required: model, --cluster", "`whalepy plan --help`")),
    ("non-integer --dp", EST + ["--dp", "x"], ("--dp: invalid int value: 'x'", "`whalepy estimate --help`")),
    ("unknown --offload", EST + ["--dp", "4", "--offload", "gpu"], ("invalid choice: 'gpu'",)),
    ("unknown --solver", PLAN + ["--solver", "gurobi"], ("invalid choice: 'gurobi'",)),
    ("unknown flag", PLAN + ["--dp", "4"], ("unrecognized arguments: --dp",)),
]


@pytest.mark.parametrize("argv, needles", [c[1:] for c in USAGE], ids=[c[0] for c in USAGE])
def test_usage_mistakes_are_one_line(capsys, argv, needles) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: whalepy"), err
    for needle in needles:
        assert needle in err[0], f"{needle!r} not in {err[0]!r}"
