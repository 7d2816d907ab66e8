"""Shared pieces of the bad-input tests (tests/test_bad_inputs*.py): a tiny model, clusters, and the check
that an error is a one-line whalepy error naming the cause and the fix."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import whalepy
from whalepy.errors import WhalepyError
from whalepy import ClusterSpec
from whalepy.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
CPU4 = str(ROOT / "examples" / "clusters" / "cpu4.yaml")
TOKENS = torch.zeros(1, 8, dtype=torch.long)


def tiny(**annotations: Any) -> GPT:
    """A 2-layer GPT with 16 positions; ``annotations`` are glob -> annotation (``whalepy.annotate``)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, num_layers=2, num_heads=2, hidden_size=16))
    return whalepy.annotate(model, annotations) if annotations else model


def cluster4() -> ClusterSpec:
    return ClusterSpec.load(CPU4)


def a100(nodes: int = 2) -> ClusterSpec:
    return ClusterSpec.from_dict({"network": {"bandwidth_gbps": 200}, "groups": [
        {"name": "a100", "gpu": "A100-80GB", "gpus_per_node": 8, "nodes": nodes, "intra_node": "nvswitch"}]})


def plan_kw(**kw: Any) -> dict[str, Any]:
    return {"example_inputs": (TOKENS,), "global_batch": 8, **kw}


def assert_clear(fn: Callable[[], Any], exc: type[BaseException], *needles: str) -> str:
    """``fn()`` raises ``exc`` (a whalepy error), as one line holding every needle (the cause's numbers
    and names, and the fix)."""
    assert issubclass(exc, WhalepyError)
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    assert len(message) < 600, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


@functools.cache
def _base_plan_json() -> str:
    return whalepy.estimate(tiny(), cluster4(), whalepy.ParallelConfig(dp=2, tp=2), example_inputs=(TOKENS,),
                            global_batch=8).plan.to_json()


def edited_plan_json(tmp: Path, edit: Callable[[dict], None]) -> str:
    """A real plan of ``tiny()`` (pp 1, dp 2, tp 2 on cpu4), saved, edited as JSON by ``edit``."""
    data = json.loads(_base_plan_json())
    edit(data)
    return write(tmp, "plan.json", json.dumps(data))


def tiny_model_and_inputs() -> tuple[Any, tuple]:
    """For the command line: ``bad_input_cases:tiny_model_and_inputs``."""
    return tiny(), (TOKENS,)


def not_a_pair() -> Any:
    return tiny()


@pytest.fixture()
def one_rank_launch(tmp_path: Path, monkeypatch):  # type: ignore[no-untyped-def]
    """This process as a 1-rank gloo launch (the train_step checks need a ParallelModel, not processes)."""
    import sys

    import torch.distributed as dist

    hook = sys.excepthook
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@pytest.fixture()
def no_capture(monkeypatch):  # type: ignore[no-untyped-def]
    """Fail the test if the call gets as far as capturing the model (the mistake must be refused first)."""
    import importlib

    def capture(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was captured before the bad input was refused")

    # the module that defines profile() (whalepy.profile, the attribute, is the function itself)
    monkeypatch.setattr(importlib.import_module("whalepy.frontend.profile"), "profile", capture)


def three_layer_model_and_inputs() -> tuple[Any, tuple]:
    """Another model than ``tiny()`` (a third layer): ``bad_input_cases:three_layer_model_and_inputs``."""
    from whalepy.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=32, block_size=16, num_layers=3, num_heads=2, hidden_size=16)), (TOKENS,)


def builder_that_raises() -> Any:
    raise RuntimeError("weights file not found")


def builder_of_three() -> Any:
    return tiny(), (TOKENS,), 3
