"""Issue 25's mistakes and faults, one case each: outputs that are inputs, checkpoints that are incomplete
or corrupted, safetensors that cannot be the model's, traces of another model or batch, calibrate's
files, init_fn and meta buffers, delink without an optimizer, a study that cannot fit in host memory,
targets that do not fit the outputs. Each is a one-line whalepy error before the expensive work (or a
warning where the brief asks one). The crash test itself is tests/test_checkpoint_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import whalepy
from whalepy import ArgumentError, WhalepyError
from whalepy.tools.cli import main
from whalepy.runtime.commit import PARTIAL, resolve, save_committed
from whalepy.runtime.materialize import materialize_modules, snapshot

from bad_input_cases import CPU4, assert_clear, edited_plan_json, tiny


def _cli_error(capsys, argv: list[str], *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[whalepy] error: "), err
    for needle in needles:
        assert needle in err[0], f"{needle!r} not in {err[0]!r}"


def _committed(path: Path, state: dict) -> Path:
    """A checkpoint as pm.save commits it (one process): DCP files, checksums, rename."""
    save_committed(path, lambda d: dcp.save(state, checkpoint_id=str(d), no_dist=True))
    return path


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64, 64)}}


# -- outputs equal to inputs ----------------------------------------------------------------------------


def test_show_html_over_its_own_plan_is_refused(tmp_path: Path, capsys) -> None:
    plan = edited_plan_json(tmp_path, lambda d: None)
    before = Path(plan).read_text()
    _cli_error(capsys, ["show", plan, "--html", plan], "--html", "input of the same command", "give another path")
    assert Path(plan).read_text() == before


def test_export_into_the_checkpoint_it_reads_is_refused(tmp_path: Path) -> None:
    from whalepy.tools.export import export_safetensors

    ckpt = _committed(tmp_path / "ckpt", _state())
    files = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt / "hf"):
        assert_clear(lambda out=out: export_safetensors(ckpt, out, config={}), ArgumentError, "export --to",
                     "the input", "give another path")
    assert sorted(p.name for p in ckpt.iterdir()) == files


def test_export_twice_into_one_directory_leaves_no_stale_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from whalepy.tools.export import export_safetensors

    ckpt = _committed(tmp_path / "ckpt", _state())
    out = tmp_path / "hf"
    assert len(export_safetensors(ckpt, out, config={}, max_shard_size="20KB")) == 2
    assert (out / "model.safetensors.index.json").is_file()
    export_safetensors(ckpt, out, config={})  # one file now: the shards and index must go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["a.weight"], _state()["model"]["a.weight"])


# -- checkpoints: incomplete, corrupted, replaced --------------------------------------------------------


def test_corrupted_checkpoint_is_refused_by_export(tmp_path: Path) -> None:
    from whalepy.tools.export import export_safetensors

    ckpt = _committed(tmp_path / "ckpt", _state())
    data = next(ckpt.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 4096] = bytes(4096)  # same size, other bytes
    data.write_bytes(bytes(raw))
    assert_clear(lambda: export_safetensors(ckpt, tmp_path / "hf", config={}), WhalepyError,
                 "is corrupted", data.name, "SHA-256", "use an earlier checkpoint")
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_incomplete_checkpoint_names_the_last_complete_one(tmp_path: Path) -> None:
    _committed(tmp_path / "step1", _state())
    (tmp_path / f".step2{PARTIAL}").mkdir()  # a save killed before its commit
    assert_clear(lambda: resolve(tmp_path / "step2"), WhalepyError, "step2 is not a complete checkpoint",
                 "interrupted", f"the last complete checkpoint there is {tmp_path / 'step1'}")
    assert_clear(lambda: resolve(tmp_path / f".step2{PARTIAL}"), WhalepyError, "not a complete checkpoint",
                 str(tmp_path / "step1"))


def test_saving_over_a_checkpoint_keeps_it_until_the_new_one_is_whole(tmp_path: Path) -> None:
    path = _committed(tmp_path / "ckpt", _state())

    def fail(d: Path) -> None:
        dcp.save({"model": {"a.weight": torch.zeros(2)}}, checkpoint_id=str(d), no_dist=True)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        save_committed(path, fail)
    assert resolve(path) == path
    state = {"model": {k: torch.empty_like(v) for k, v in _state()["model"].items()}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(state["model"]["a.weight"], _state()["model"]["a.weight"])
    _committed(path, {"model": {"a.weight": torch.ones(3)}})  # the next save clears the partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_into_a_directory_of_other_files_is_refused(tmp_path: Path) -> None:
    from whalepy.runtime.dcp_files import check_save_path

    (tmp_path / "notes.txt").write_text("mine")
    assert_clear(lambda: check_save_path(tmp_path), WhalepyError, "holds other files and no checkpoint",
                 "give a new directory")


# -- HF safetensors into a meta model -------------------------------------------------------------------


def _meta_linear() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4))


def test_int64_safetensors_into_a_float_model(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"0.weight": torch.ones(4, 4, dtype=torch.int64), "0.bias": torch.ones(4, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    model = _meta_linear()
    assert_clear(lambda: materialize_modules([model], snapshot(model), "cpu", checkpoint=tmp_path),
                 WhalepyError, "torch.int64", "torch.float32", "give the model's own checkpoint")


def test_safetensors_index_naming_a_missing_shard(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"0.weight": torch.ones(4, 4)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"0.weight": "model-00001-of-00002.safetensors",
                                            "0.bias": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = _meta_linear()
    assert_clear(lambda: materialize_modules([model], snapshot(model), "cpu", checkpoint=tmp_path),
                 WhalepyError, "model-00002-of-00002.safetensors", "1 shard(s) missing", "copy the whole checkpoint")


# -- memory traces ----------------------------------------------------------------------------------------


def test_memory_trace_of_another_model_is_refused(tmp_path: Path) -> None:
    from whalepy.models import GPT, GPTConfig

    x = torch.zeros(2, 8, dtype=torch.long)
    trace = whalepy.trace_memory(tiny(), x, loss_fn=lambda out, _t: out.float().mean())
    trace.save(tmp_path / "trace.json")
    other = GPT(GPTConfig(vocab_size=32, block_size=16, num_layers=2, num_heads=2, hidden_size=32))  # same blocks
    assert_clear(lambda: whalepy.plan(other, CPU4, example_inputs=(x,), global_batch=8,
                                      memory_trace=str(tmp_path / "trace.json")),
                 WhalepyError, "memory trace of another model", "trace this model")


def test_trace_memory_with_targets_of_another_batch() -> None:
    x = torch.zeros(2, 8, dtype=torch.long)
    assert_clear(lambda: whalepy.trace_memory(tiny(), x, torch.zeros(3, 8, dtype=torch.long),
                                              loss_fn=lambda o, t: o.float().mean()),
                 WhalepyError, "3 rows", "batch of 2", "same batch")


# -- calibrate's files -----------------------------------------------------------------------------------


def test_calibrate_out_on_a_read_only_place(capsys) -> None:
    _cli_error(capsys, ["calibrate", "--quick", "--device", "cpu", "--out", "/proc/whalepy/cpu.json"],
               "calibrate --out", "/proc/whalepy", "writable")


def test_calibrate_from_a_missing_microbench(tmp_path: Path, capsys) -> None:
    _cli_error(capsys, ["calibrate", "--from-microbench", str(tmp_path / "nope.json"), "--out", str(tmp_path)],
               "--from-microbench", "cannot read it", "microbench JSON")


def test_calibrate_from_a_plan_json(tmp_path: Path, capsys) -> None:
    plan = edited_plan_json(tmp_path, lambda d: None)
    _cli_error(capsys, ["calibrate", "--from-microbench", plan, "--out", str(tmp_path)],
               "not a microbench JSON (it is a whalepy plan)")


# -- initialisation ---------------------------------------------------------------------------------------


def test_init_fn_taking_no_argument() -> None:
    from whalepy.runtime._pm_setup import _check_lowering_options

    def init() -> None:
        pass

    assert_clear(lambda: _check_lowering_options(loss_parallel=False, sync_initial_weights=True, seed=0,
                                                 init_fn=init, profile=None, checkpoint=None),
                 ArgumentError, "init_fn='init'", "must take one argument")


def test_init_fn_that_raises_is_one_line() -> None:
    def init(module: nn.Module) -> None:
        raise KeyError("no scheme for this layer")

    assert_clear(lambda: whalepy.materialize(_meta_linear(), init_fn=init), WhalepyError,
                 "init_fn raised KeyError", "no scheme for this layer", "a Linear")


def test_meta_buffer_nothing_initialises() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.empty(4))

    with torch.device("meta"):
        model = Scaled()
    assert_clear(lambda: whalepy.materialize(model), WhalepyError, "the buffer 'scale'",
                 "nothing initialises it", "reset_parameters() or init_fn")


def test_delink_without_an_optimizer_warns() -> None:
    from runtime_cases import gpt_model

    model = whalepy.pseudo_to_real(gpt_model(2))
    with pytest.warns(UserWarning, match="without optimizer="):
        whalepy.delink(model)


# -- study and training ------------------------------------------------------------------------------------


def test_study_measure_of_a_model_too_big_for_host_memory(capsys) -> None:
    _cli_error(capsys, ["study", "zero", "gpt2-xl", "--cluster", CPU4, "--measure", "-q"],
               "--measure of gpt2-xl", "GiB available", "smaller model")


def test_targets_that_do_not_fit_the_outputs() -> None:
    from whalepy.runtime._pm_helpers import _checked_loss

    def lm(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    loss = _checked_loss(lm)
    assert_clear(lambda: loss(torch.zeros(2, 8, 32), torch.zeros(2, 7, dtype=torch.long)), ArgumentError,
                 "loss_fn(outputs, targets) raised ValueError", "outputs (2, 8, 32)", "targets (2, 7)",
                 "give targets that fit")
