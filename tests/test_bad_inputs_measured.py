"""Mistakes in the newest features (issue 25): measured planning's options, loss and optimizer
(``whalepy.profile(..., measure=True)``, ``plan(measure=True)``, ``parallelize(profile=...)``), the
``whalepy calibrate --model`` and ``whalepy check`` command lines, the disk tier's directory and
``benchmarks/bench_gpu_step.py``'s flags. Each is one whalepy error line naming the cause and the fix,
raised before the model is captured or run wherever the arguments alone show it. Fast: tiny models, no
processes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import whalepy
from whalepy import ArgumentError, WhalepyError
from whalepy.tools.cli import main

from bad_input_cases import CPU4, ROOT, TOKENS, assert_clear, cluster4, edited_plan_json, tiny, write

sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731


@pytest.fixture()
def no_build(monkeypatch):  # type: ignore[no-untyped-def]
    """Fail the test if the call gets as far as capturing the model."""
    import whalepy.passes.profile as passes_profile

    def build(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was captured before the bad option was refused")

    monkeypatch.setattr(passes_profile, "build_profile", build)


def _measure(**kw):  # type: ignore[no-untyped-def]
    return lambda: whalepy.profile(tiny(), (TOKENS,), measure=True, **{"lowered": False, "repeats": 1, **kw})


MEASURE_OPTIONS = [
    ("micro_batches an int", dict(micro_batches=2), ("micro_batches=2 is a int", "micro_batches=(1, 2, 4)")),
    ("micro_batches a string", dict(micro_batches="4"), ("micro_batches='4' is a str",)),
    ("micro_batches empty", dict(micro_batches=()), ("micro_batches=() is empty",)),
    ("micro_batches 0", dict(micro_batches=(0,)), ("holds 0", "positive integers")),
    ("micro_batches 1.5", dict(micro_batches=(1.5,)), ("holds 1.5",)),
    ("micro_batches True", dict(micro_batches=(True,)), ("holds True",)),
    ("tp_degrees an int", dict(tp_degrees=2), ("tp_degrees=2 is a int", "tp_degrees=(1, 2)")),
    ("tp_degrees 0", dict(tp_degrees=(1, 0)), ("holds 0",)),
    ("tp_degrees a string", dict(tp_degrees=("2",)), ("holds '2'",)),
    ("tp_degrees empty", dict(tp_degrees=()), ("tp_degrees=() is empty",)),
    ("precision bf32", dict(precision="bf32"), ("precision='bf32'", "fp32, bf16 or fp16")),
    ("precision None", dict(precision=None), ("precision=None",)),
    ("repeats 0", dict(repeats=0), ("repeats=0", "positive integer")),
    ("lowered a string", dict(lowered="yes"), ("lowered='yes'", "True or False")),
    ("compile a string", dict(compile="yes"), ("compile='yes'", "True or False")),
    ("compile without lowered", dict(compile=True), ("compile=True with lowered=False", "give lowered=True")),
    ("device tpu", dict(device="tpu"), ("'tpu'", "not a torch device", "'cpu'")),
    ("device meta", dict(device="meta"), ("'meta'", "CUDA GPU or the CPU")),
    ("device cuda without one", dict(device="cuda:7"), ("CUDA is not available", "device='cpu'")),
    ("loss_fn not callable", dict(loss_fn=5), ("loss_fn=5 is not callable", "(output, inputs)")),
    ("optimizer built", dict(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)),
     ("optimizer is a built SGD", "lambda params: torch.optim.AdamW(params")),
    ("optimizer not callable", dict(optimizer="adamw"), ("optimizer='adamw' is not callable",)),
    ("optimizer factory raises", dict(optimizer=lambda ps: torch.optim.AdamW(ps, lr=-1)),
     ("optimizer factory raised ValueError: Invalid learning rate: -1", "give a factory")),
    ("optimizer factory returns no optimizer", dict(optimizer=lambda ps: ps),
     ("returned a list, not a torch.optim.Optimizer",)),
    ("truncate a string", dict(truncate="yes"), ("truncate='yes'", "True, False or leave it out")),
    ("cpu_peers negative", dict(cpu_peers=-1), ("cpu_peers=-1", "non-negative integer")),
    ("cpu_peers True", dict(cpu_peers=True), ("cpu_peers=True", "non-negative integer")),
    ("cpu_peers a string", dict(cpu_peers="1"), ("cpu_peers='1'",)),
    ("cpu_peers past the cores", dict(cpu_peers=4096), ("cpu_peers=4096 needs 4097 cores", "give at most")),
]


@pytest.mark.parametrize("kw, needles", [c[1:] for c in MEASURE_OPTIONS], ids=[c[0] for c in MEASURE_OPTIONS])
def test_measure_option_mistakes_refused_before_capture(no_build, kw, needles) -> None:
    assert_clear(_measure(**kw), ArgumentError, *needles)


def _meta_tiny():  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return tiny()


def test_meta_device_model_refused_before_capture(no_build) -> None:
    for call, where in ((lambda: whalepy.profile(_meta_tiny(), (TOKENS,), measure=True), "profile(measure=True)"),
                        (lambda: whalepy.plan(_meta_tiny(), cluster4(), example_inputs=(TOKENS,), global_batch=8,
                                              measure=True), "plan(measure=True)")):
        assert_clear(call, ArgumentError, where, "not on the meta device", "smaller model with the same layer shapes")


LOSSES = [
    ("raises", lambda out, x: out.missing, ("loss_fn raised AttributeError", "returns the scalar loss")),
    ("one argument", lambda out: out.mean(), ("loss_fn raised TypeError", "takes (output, inputs)")),
    ("not a scalar", lambda out, x: out.float(), ("shape (1, 8, 32), not a scalar", ".mean()")),
    ("a float", lambda out, x: 1.0, ("returned a float, not a tensor",)),
    ("no gradient", lambda out, x: torch.tensor(1.0), ("needs no gradient", "not computed from the model's output")),
]


@pytest.mark.parametrize("loss_fn, needles", [c[1:] for c in LOSSES], ids=[c[0] for c in LOSSES])
def test_a_loss_fn_that_fails_is_one_line(loss_fn, needles) -> None:
    assert_clear(_measure(loss_fn=loss_fn), ArgumentError, "measure: ", *needles)


def test_parallelize_refuses_the_profile_of_another_model(monkeypatch) -> None:
    """parallelize plans from the given profile when no plan is given (through whalepy.plan(profile=...)):
    another model's (a layer more; the same model in bf16) is refused by its fingerprint before any
    planning, by both."""
    from bad_input_cases import three_layer_model_and_inputs

    import whalepy.planner as planner

    others = [whalepy.profile(three_layer_model_and_inputs()[0], (TOKENS,)), whalepy.profile(tiny().bfloat16(), (TOKENS,))]
    monkeypatch.setattr(planner, "plan_from_profile", lambda *a, **k: pytest.fail("planned from another model's profile"))
    for prof in others:
        assert_clear(lambda: whalepy.parallelize(tiny(), cluster4(), example_inputs=(TOKENS,), optimizer=sgd,
                                                 loss_fn=lambda out, y: out.float().mean(), global_batch=8,
                                                 profile=prof),
                     ArgumentError, "parallelize(profile=...)", f"(fingerprint {prof.fingerprint})",
                     "pass whalepy.profile(model, example_inputs) of this model")
        assert_clear(lambda: whalepy.plan(tiny(), cluster4(), global_batch=8, profile=prof), ArgumentError,
                     "whalepy.plan(profile=...)", f"(fingerprint {prof.fingerprint})")


def test_a_precision_name_in_any_case_is_taken() -> None:
    assert _measure(precision=" BF16")().measured.times  # as PlannerOptions(precision=...) takes it


def test_a_tp_degree_no_block_divides_is_said(caplog) -> None:
    prof = _measure(tp_degrees=(1, 3))()
    assert prof.measured is not None and all(k[1] == 1 for rows in prof.measured.times.values() for k in rows)
    assert "tp_degrees holds 3, but no block's tensor-parallel layers divide by it" in caplog.text


MODEL = "bad_input_cases:tiny_model_and_inputs"


def _plan_file(tmp: Path, edit=lambda d: None) -> str:  # type: ignore[no-untyped-def]
    return edited_plan_json(tmp, edit)


def _retype(d: dict) -> None:
    d["rank_device_types"] = ["TPU-v9"] * d["world_size"]
    for s in d["stages"]:
        s["device_types"] = ["TPU-v9"] * len(s["device_types"])


CALIBRATE = [
    ("not MODULE:FN", "bad_input_cases", ("give MODULE:FN",)),
    ("no such function", "bad_input_cases:nope", ("cannot load", "no attribute 'nope'")),
    ("a constant", "bad_input_cases:CPU4", ("is a str, not a function",)),
    ("needs arguments", "bad_input_cases:write", ("needs arguments", "def build(): return my_fn(...)")),
    ("raises", "bad_input_cases:builder_that_raises", ("builder_that_raises() raised RuntimeError: weights file not "
                                                       "found", "fix the function")),
    ("returns a model", "bad_input_cases:not_a_pair", ("must return (model, example_inputs), got GPT",)),
    ("returns three", "bad_input_cases:builder_of_three", ("got tuple of 3",)),
]


CALIBRATE_FLAGS = [
    ("--out under a file", ["--model", MODEL, "--out", "FILE/cpu.json"], ("calibrate --out", "cannot create the "
                                                                           "directory", "(File exists)")),
    ("--device-type without --import", ["--device-type", "A=B", "--quick"], ("--device-type applies with --import",)),
    ("--table-model without --import", ["--model", MODEL, "--table-model", "gpt"], ("--table-model applies with",)),
    ("--precision without --model", ["--precision", "bf16", "--quick"], ("--precision applies with --model",)),
    ("--micro-batches 0", ["--model", MODEL, "--micro-batches", "0", "--out", "DIR"], ("--micro-batches '0'",
                                                                                    "positive integers")),
    ("--precision bf32", ["--model", MODEL, "--precision", "bf32", "--out", "DIR"], ("precision='bf32'",
                                                                                  "fp32, bf16 or fp16")),
]


@pytest.mark.parametrize("argv, needles", [c[1:] for c in CALIBRATE_FLAGS], ids=[c[0] for c in CALIBRATE_FLAGS])
def test_calibrate_flag_mistakes(capsys, tmp_path, monkeypatch, argv, needles) -> None:
    import whalepy.tools.measured_files as measured_files

    monkeypatch.setattr(measured_files, "write_measured", lambda *a, **k: pytest.fail("wrote a profile"))
    afile = write(tmp_path, "afile", "x")
    argv = [a.replace("FILE", afile).replace("DIR", str(tmp_path / "profiles")) for a in argv]
    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: "), err
    for needle in needles:
        assert needle in err[0], err[0]


@pytest.mark.parametrize("spec, needles", [c[1:] for c in CALIBRATE], ids=[c[0] for c in CALIBRATE])
def test_calibrate_model_mistakes(capsys, tmp_path, spec, needles) -> None:
    assert main(["calibrate", "--model", spec, "--out", str(tmp_path / "cpu.json"), "--micro-batches", "1",
                 "--tp-degrees", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: --model "), err
    for needle in needles:
        assert needle in err[0], err[0]
    assert not (tmp_path / "cpu.json").exists()


CHECK = [
    ("plan a list", lambda t: write(t, "p.json", "[1, 2]"), MODEL, [], ("p.json", "a JSON object with a 'version'")),
    ("plan without fields", lambda t: write(t, "p.json", '{"version": 6}'), MODEL, [],
     ("p.json", "missing", "'world_size'", "re-create it")),
    ("plan of another model", _plan_file, "bad_input_cases:three_layer_model_and_inputs", [],
     ("--model bad_input_cases:three_layer_model_and_inputs", "fingerprint", "Re-plan for this model")),
    ("plan for a device type the cluster lacks", lambda t: _plan_file(t, _retype), MODEL, [],
     ("puts a TPU-v9 on rank 0", "cluster spec has a CPU", "re-plan")),
    ("cluster of another size", _plan_file, MODEL, ["--cluster", str(ROOT / "examples/clusters/a100_128x8.yaml")],
     ("plan is for 4 devices", "has 1024")),
    ("--ranks out of range", _plan_file, MODEL, ["--ranks", "0,4"], ("rank 4 is not in the plan's world of 4", "0..3")),
    ("--ranks negative", _plan_file, MODEL, ["--ranks", "-1"], ("rank -1",)),
    ("--ranks malformed", _plan_file, MODEL, ["--ranks", "1-3"], ("--ranks '1-3'", "such as 0,3")),
    ("--ranks empty", _plan_file, MODEL, ["--ranks", ","], ("names no rank",)),
    ("--model raises", _plan_file, "bad_input_cases:builder_that_raises", [], ("raised RuntimeError",)),
]


@pytest.mark.parametrize("plan, model, extra, needles", [c[1:] for c in CHECK], ids=[c[0] for c in CHECK])
def test_check_command_mistakes(capsys, tmp_path, monkeypatch, plan, model, extra, needles) -> None:
    import whalepy.tools.rank_check as rank_check

    monkeypatch.setattr(rank_check, "lower_rank", lambda *a, **k: pytest.fail("lowered a rank of a bad check"))
    argv = ["check", plan(tmp_path), "--model", model, "--cluster", CPU4, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: "), err
    for needle in needles:
        assert needle in err[0], err[0]


def test_disk_tier_directory_that_is_a_file(tmp_path) -> None:
    """The rank's directory under nvme_dir (``whalepy-nvme-rank<r>``, kept for a restart) taken by a file:
    said as such, not as a permission fault."""
    from whalepy.runtime.nvme import default_nvme_dir, prepare_nvme_dir

    path = default_nvme_dir(tmp_path, 0, stable=True)
    path.write_text("x")
    assert_clear(lambda: prepare_nvme_dir(path, user_dir=tmp_path, keep=True), WhalepyError,
                 repr(str(path)), "is a file, not a directory", "remove the file or pass another nvme_dir")


def _bench_main():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_gpu_step", ROOT / "benchmarks" / "bench_gpu_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


BENCH = [
    ("no CUDA", [], "needs CUDA GPUs (none visible); --smoke runs tiny models on the CPU"),
    ("no CUDA, measured", ["--measure", "--model", "gpt"], "needs CUDA GPUs"),
    ("--steps 0", ["--smoke", "--steps", "0"], "--steps 0: give 1 or more"),
    ("--warmup -1", ["--smoke", "--warmup", "-1"], "--warmup -1: give 0 or more"),
    ("--batch 0", ["--batch", "0"], "--batch 0: give 1 or more"),
    ("--plan-time-limit 0", ["--smoke", "--plan-time-limit", "0"], "give the planner's budget in seconds"),
    ("--dump a file", ["--smoke", "--dump", "FILE"], "is a file; give a directory"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals without CUDA: this machine has one")
def test_bench_gpu_step_flags(capsys, tmp_path) -> None:
    main_ = _bench_main()
    afile = write(tmp_path, "afile", "x")
    for name, argv, needle in BENCH:
        assert main_([a.replace("FILE", afile) for a in argv]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (name, err)
