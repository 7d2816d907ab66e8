"""What :func:`whalepy.parallelize` does before it lowers a plan: check its arguments, make the process
group (and destroy it at exit), plan once on rank 0 for every rank, and the one-line note that replaces
FSDP2's "returned a view tensor" warning under tensor parallelism."""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from whalepy.errors import ArgumentError, WhalepyError
from whalepy.log import info_once
from whalepy.ir.plan import Plan
from whalepy.runtime.mesh import resolve_device_type, set_local_device

if TYPE_CHECKING:
    from whalepy.hardware.cluster import ClusterSpec

log = logging.getLogger("whalepy.runtime")


def _explain_fsdp_view_warning() -> None:
    """FSDP2 warns, once per wrapped module class and rank, that a module "returned a view tensor"
    and an in-place op on it would drop FSDP2's pre-backward hook "and can produce wrong gradients".
    Under tensor parallelism the views are ``DTensor.to_local()`` results of the parallel layers'
    outputs; the hook is lost only if code outside the module modifies such an output in place. whalepy's
    lowering never does, and the multi-process tests compare these layouts' gradients with a single
    process. So the warning is replaced by one line that says this, once per job."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    info_once("fsdp-view", "whalepy: note: tensor-parallel outputs are views (DTensor.to_local); FSDP2's "
              "'returned a view tensor' warning is silenced: gradients are right unless your code "
              "modifies a block's output in place (whalepy's runtime does not)", log=log)


def _check_training_options(max_grad_norm: Any, log_every: Any) -> None:
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                      or not isinstance(max_grad_norm, (int, float))
                                      or not max_grad_norm > 0 or max_grad_norm == float("inf")):
        raise WhalepyError(f"max_grad_norm={max_grad_norm!r}: give a positive finite number (the global "
                           "gradient 2-norm to clip to, e.g. 1.0), or None for no clipping")
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise WhalepyError(f"log_every={log_every!r}: give a positive number of steps between reports, or "
                           "None for no step reports")


def _check_lowering_options(*, loss_parallel: Any, sync_initial_weights: Any, seed: Any, init_fn: Any,
                            profile: Any, checkpoint: Any) -> None:
    """``parallelize``'s remaining keyword arguments, by type (a truthy string is not ``True``)."""
    import os

    from whalepy.ir.profile import ModelProfile

    for name, value in (("loss_parallel", loss_parallel), ("sync_initial_weights", sync_initial_weights)):
        if not isinstance(value, bool):
            raise ArgumentError(f"parallelize({name}={value!r:.60}): give True or False")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ArgumentError(f"parallelize(seed={seed!r:.60}): the initialisation seed is an integer >= 0, e.g. seed=0")
    if init_fn is not None and not callable(init_fn):
        raise ArgumentError(f"parallelize(init_fn={init_fn!r:.60}) must be callable (module -> None, filling its "
                            "parameters in place), or None for each module's reset_parameters()")
    if init_fn is not None and not _takes(init_fn, 1):
        raise ArgumentError(f"parallelize(init_fn={getattr(init_fn, '__name__', init_fn)!r:.60}) must take one "
                            "argument, the module to initialise (e.g. def init(module): ...); it is called once per "
                            "module whose shards this rank holds")
    if profile is not None and not isinstance(profile, ModelProfile) and not hasattr(profile, "fingerprint"):
        raise ArgumentError(f"parallelize(profile=...) takes the model's whalepy.ModelProfile (from "
                            f"whalepy.profile(model, example_inputs)), got {type(profile).__name__}; or leave it out")
    if checkpoint is not None and (not isinstance(checkpoint, (str, os.PathLike)) or not str(checkpoint)):
        raise ArgumentError(f"parallelize(checkpoint={checkpoint!r:.60}) takes the path of a checkpoint directory "
                            "(ParallelModel.save) or of HF safetensors, or None")


def _takes(fn: Any, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True when its signature is unknown)."""
    import inspect

    try:
        inspect.signature(fn).bind(*([None] * n))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): let the call decide
        return True
    return True


def _check_arguments(model: nn.Module, loss_fn: Any, optimizer: Any) -> None:
    from whalepy.frontend.checks import check_model

    check_model(model, "whalepy.parallelize()")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentError(
            f"parallelize(optimizer=...) takes a factory, got a {type(optimizer).__name__} instance: its "
            "parameters are about to be replaced by shards. Pass e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
    if not callable(optimizer):
        raise ArgumentError(f"parallelize(optimizer=...) must be callable (params -> Optimizer), got "
                            f"{optimizer!r:.60}; pass e.g. optimizer=lambda params: torch.optim.AdamW(params)")
    if not callable(loss_fn):
        raise ArgumentError(f"parallelize(loss_fn=...) must be callable (output, targets) -> loss, got "
                            f"{loss_fn!r:.60}; pass e.g. loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), "
                            "y.flatten())")
    if not _takes(optimizer, 1):
        raise ArgumentError(f"parallelize(optimizer={getattr(optimizer, '__name__', optimizer)!r:.60}) cannot be "
                            "called with the parameters alone; pass a factory of one argument, e.g. "
                            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
    if not _takes(loss_fn, 2):
        raise ArgumentError(f"parallelize(loss_fn={getattr(loss_fn, '__name__', loss_fn)!r:.60}) cannot be called "
                            "as loss_fn(outputs, targets); pass a function of those two, e.g. "
                            "loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())")


GLOO_RELEASE_GRACE_S = 0.1
"""Seconds the exit handler leaves the interpreter alive, with the GIL free, after the process groups are
destroyed. A gloo worker thread releases a finished collective's tensors just after the caller's
``wait()`` has returned, and releasing a tensor Python can see takes the GIL; a worker that does so once
the interpreter has started finalizing is killed mid-unwind, and the process aborts at exit
("terminate called without an active exception"; seen in 1 of 30 two-rank runs of docs/runtime.md's
example, and under gdb caught in ``ProcessGroupGloo::AsyncWork::~AsyncWork`` -> ``decref_pyobject`` ->
``take_gil`` during ``Py_FinalizeEx``; pytorch/pytorch PR 179291 describes the same). The release
follows the completion by microseconds; a tenth of a second covers a descheduled worker on a loaded
machine, at that cost once per process."""

_exit_handler_installed = False
_made_group = False


def _init_process_group(cluster_spec: ClusterSpec) -> str:
    global _exit_handler_installed, _made_group
    device_type = resolve_device_type(cluster_spec)
    set_local_device(device_type)  # before any NCCL collective, the plan's broadcast included
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        _made_group = True
    if not _exit_handler_installed:
        # at exit: destroy the group whalepy made (left to the interpreter's teardown, the backend's
        # threads can outlive it) and let the backend's threads finish with Python's tensors
        atexit.register(_at_exit)
        _exit_handler_installed = True
    return device_type


def _at_exit() -> None:
    if _made_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(GLOO_RELEASE_GRACE_S)


def _plan_once(solve: Callable[[], Plan]) -> Plan:
    """Plan on rank 0 and send the plan to every rank: ranks must lower the same plan, and a search under
    a time limit need not end the same way on every machine. A failure on rank 0 is raised everywhere."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("plan", solve().to_json())
        except WhalepyError as e:
            box[0] = ("error", type(e).__name__, str(e))
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, *payload = box[0]  # type: ignore[misc]
    if kind == "error":
        import whalepy.errors as errors

        raise getattr(errors, payload[0], WhalepyError)(f"planning on rank 0 failed: {payload[1]}")
    return Plan.from_json(payload[0])
