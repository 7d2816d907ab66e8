"""The options of measured planning (``whalepy.profile(..., measure=True)``, ``measure_costs``) checked
before anything is captured or run, and the user's loss function checked where it runs.

Each mistake is one :class:`~whalepy.errors.ArgumentError` line naming the option, the value given and
what to give instead (docs/errors.md, "Measured planning"). A loss or optimizer factory that fails is
reported as the user's function failing, not as a traceback from inside the timing loop.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from whalepy.errors import ArgumentError, WhalepyError

__all__ = ["check_measurable_model", "check_measure_options", "checked_loss", "parse_device"]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _positive_ints(name: str, value: Any, example: str) -> None:
    fix = f"give a sequence of positive integers, e.g. {name}={example}"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ArgumentError(f"measure: {name}={value!r:.60} is a {type(value).__name__}; {fix}")
    items = list(value)
    if not items:
        raise ArgumentError(f"measure: {name}={value!r:.60} is empty; {fix}")
    for v in items:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ArgumentError(f"measure: {name}={value!r:.60} holds {v!r:.30}; {fix}")


def check_measurable_model(model: nn.Module, where: str = "measure=True") -> None:
    """A model on the meta device cannot be run: refused before its capture."""
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ArgumentError(f"{where} runs the model's blocks: build it with weights (not on the meta "
                            "device), or measure a smaller model with the same layer shapes (blocks are "
                            "matched by structure) and plan the large one from that profile")


def check_measure_options(*, device: Any = None, precision: Any = "fp32", micro_batches: Any = None,
                          tp_degrees: Any = (1,), repeats: Any = 3, loss_fn: Any = None, optimizer: Any = None,
                          lowered: Any = True, compile: Any = False, device_type: Any = None,
                          cpu_peers: Any = 0, truncate: Any = None) -> torch.device:
    """Every option of :func:`whalepy.frontend.measure.measure_costs` by type and value; returns the device
    the blocks will run on. The optimizer factory is called once on a one-element parameter (cheap) so
    that a factory that fails, or builds no optimizer, is refused before the model is captured."""
    dev = parse_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if precision not in ("fp32", "bf16", "fp16"):
        raise ArgumentError(f"measure: precision={precision!r:.60}: use fp32, bf16 or fp16")
    if micro_batches is not None:
        _positive_ints("micro_batches", micro_batches, "(1, 2, 4)")
    _positive_ints("tp_degrees", tp_degrees, "(1, 2)")
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ArgumentError(f"measure: repeats={repeats!r:.60}: give a positive integer, e.g. 3")
    if not isinstance(lowered, bool):
        raise ArgumentError(f"measure: lowered={lowered!r:.60}: give True or False")
    if not isinstance(compile, bool):
        raise ArgumentError(f"measure: compile={compile!r:.60}: give True or False")
    if compile and not lowered:
        raise ArgumentError("measure: compile=True with lowered=False: compiled blocks are timed as the runtime "
                            "lowers them; give lowered=True, or drop compile=True")
    if device_type is not None and (not isinstance(device_type, str) or not device_type.strip()):
        raise ArgumentError(f"measure: device_type={device_type!r:.60}: give a device type name of the catalog, "
                            "e.g. 'H100-SXM', or leave it out for the local device's")
    if truncate is not None and not isinstance(truncate, bool):
        raise ArgumentError(f"measure: truncate={truncate!r:.60}: give True, False or leave it out (the default: "
                            "truncated on a GPU, whole on the CPU)")
    if isinstance(cpu_peers, bool) or not isinstance(cpu_peers, numbers.Integral) or cpu_peers < 0:
        raise ArgumentError(f"measure: cpu_peers={cpu_peers!r:.60}: give the number of other ranks per node "
                            "(a non-negative integer, e.g. 1 for two CPU ranks per node)")
    if cpu_peers and dev.type != "cpu":
        raise ArgumentError(f"measure: cpu_peers={cpu_peers} applies to measuring on the CPU (device={dev}); "
                            "leave it out on a GPU, whose ranks do not share its compute")
    if cpu_peers and cpu_peers + 1 > (os.cpu_count() or 1):
        raise ArgumentError(f"measure: cpu_peers={cpu_peers} needs {cpu_peers + 1} cores and this machine has "
                            f"{os.cpu_count()}; give at most cpu_peers={(os.cpu_count() or 1) - 1}")
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(f"measure: loss_fn={loss_fn!r:.60} is not callable; give a function (output, inputs) "
                            "-> scalar loss, e.g. loss_fn=lambda out, inputs: out.float().pow(2).mean()")
    if optimizer is not None:
        _check_optimizer_factory(optimizer, dev)
    return dev


def _check_optimizer_factory(optimizer: Any, dev: torch.device) -> None:
    fix = "give a factory params -> optimizer, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)"
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentError(f"measure: optimizer is a built {type(optimizer).__name__}; each block's parameters "
                            f"get an optimizer of their own, so {fix}")
    if not callable(optimizer):
        raise ArgumentError(f"measure: optimizer={optimizer!r:.60} is not callable; {fix}")
    try:
        probe = optimizer([nn.Parameter(torch.zeros(1, device=dev))])
    except WhalepyError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory: its failure said in one line
        raise ArgumentError(f"measure: the optimizer factory raised {_first_line(e)} when given a list of "
                            f"parameters; {fix}") from None
    if not isinstance(probe, torch.optim.Optimizer):
        raise ArgumentError(f"measure: the optimizer factory returned a {type(probe).__name__}, not a "
                            f"torch.optim.Optimizer; {fix}")


def checked_loss(loss_fn: Callable[[Any, Any], Any], out: Any, inputs: Any) -> torch.Tensor:
    """``loss_fn(out, inputs)``, refused in one line when it fails or returns no scalar loss with a
    gradient (what ``backward()`` needs)."""
    fix = "it takes (output, inputs) and returns the scalar loss, e.g. lambda out, inputs: out.float().pow(2).mean()"
    try:
        loss = loss_fn(out, inputs)
    except WhalepyError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's loss: its failure said in one line
        raise ArgumentError(f"measure: loss_fn raised {_first_line(e)}; fix it: {fix}") from None
    if not isinstance(loss, torch.Tensor):
        raise ArgumentError(f"measure: loss_fn returned a {type(loss).__name__}, not a tensor; {fix}")
    if loss.numel() != 1:
        raise ArgumentError(f"measure: loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar "
                            f"(reduce it, e.g. .mean()); {fix}")
    if not loss.requires_grad:
        raise ArgumentError("measure: loss_fn returned a tensor that needs no gradient (it is not computed from "
                            f"the model's output); {fix}")
    return loss


def parse_device(device: Any) -> torch.device:
    """``device`` as a torch device this machine has; ArgumentError otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError(f"calibrate(device={device!r}): not a torch device; use 'cuda', 'cuda:1' or "
                            "'cpu'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ArgumentError(f"calibrate(device={device!r}): measurements run on a CUDA GPU or the CPU; use "
                            "'cuda', 'cuda:1' or 'cpu'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"calibrate(device={device!r}): CUDA is not available on this machine; use "
                            "device='cpu' or run on a GPU machine")
    return dev
