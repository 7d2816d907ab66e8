"""The plan's precision in the training step: ``torch.autocast`` and, for fp16, dynamic loss scaling.

Every lowering runs the forward and the loss under ``torch.autocast(dtype=<bf16|fp16>)``: matrix
products in the low precision, the ops autocast keeps in fp32 (softmax, norms, losses) in fp32. Under
FSDP2 the gathered parameters are already low precision (``MixedPrecisionPolicy``, see
:mod:`whalepy.runtime.data_parallel`), so autocast only decides the fp32 ops there; under DDP /
ZeRO-1 / no wrapper the parameters stay fp32 and autocast casts them per op.

fp16 has too little range for gradients, so the loss is scaled (``torch.amp.GradScaler``'s dynamic
scaling: halve on inf/nan and skip the step, double after 2000 clean steps). With sharded gradients
(FSDP2, ZeRO) or several pipeline / tensor-parallel ranks each rank sees only part of the gradients,
so every rank must agree on "found inf": FSDP's ``ShardedGradScaler`` all-reduces that flag over its
process group, here the whole world, and handles CPU tensors too.

The scaler's state (``GradScaler.state_dict()``: the scale, the count of clean steps since the last
change, the growth / backoff factors and interval) goes into checkpoints under :data:`STATE_KEY`, so a
resumed fp16 run scales as the uninterrupted one would. Every rank holds the same scaler state (the
"found inf" flag is agreed over the world before each update), so one copy is written and every rank
reads it back.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from whalepy.log import warn_once
from whalepy.ir.plan import Precision

__all__ = ["STATE_KEY", "AmpContext"]

log = logging.getLogger("whalepy.runtime")

STATE_KEY = "loss_scaler"
"""The top-level checkpoint / state-dict key of the fp16 loss scaler's state (absent in bf16 / fp32)."""


class AmpContext:
    """Autocast and (fp16) loss scaling for one rank's training step."""

    def __init__(self, precision: Precision | str, device: torch.device) -> None:
        self.precision = Precision(precision)
        self.device_type = device_type = device.type
        self.dtype: torch.dtype | None = {Precision.BF16: torch.bfloat16,
                                          Precision.FP16: torch.float16}.get(self.precision)
        self.scaler: Any = None
        if self.precision is Precision.FP16:
            import torch.distributed as dist
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device_type, process_group=dist.group.WORLD)
            # unscaling DTensor gradients multiplies by a 1-element tensor, which DTensor replicates
            # implicitly (and says so on every step)
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            # the scale is created by the first scale() call; pipeline ranks without the last stage
            # never scale a loss themselves but unscale their gradients all the same
            self.scaler.scale(torch.zeros((), device=device))

    def state_dict(self) -> dict[str, Any]:
        """``{STATE_KEY: the scaler's state}`` under fp16, ``{}`` otherwise: what a checkpoint adds."""
        return {} if self.scaler is None else {STATE_KEY: self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        """Restore the scaler from ``state[STATE_KEY]`` (a checkpoint or state dict named ``source``).
        Without it (a checkpoint written by a bf16 / fp32 run, or before checkpoints carried it) the
        scaler keeps its state (a fresh run's: the initial scale), said in one warning. bf16 / fp32:
        nothing to restore."""
        if self.scaler is None:
            return
        saved = state.get(STATE_KEY)
        if not saved:
            warn_once(f"no-loss-scaler-{source}",
                      "whalepy: %s holds no fp16 loss-scaler state (written by a bf16 / fp32 run or by an older "
                      "whalepy); the loss scale stays at %g (the initial scale, in a fresh run)", source,
                      float(self.scaler.get_scale()), log=log)
            return
        self.scaler.load_state_dict(saved)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current fp16 loss scale (unchanged in bf16 / fp32)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def scaled_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` followed by :meth:`scale` (for pipeline schedules, which call backward themselves)."""
        if self.scaler is None:
            return loss_fn
        return _ScaledLoss(loss_fn, self)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide the gradients by the loss scale now (before clipping); :meth:`step` then
        steps without unscaling again. No-op in bf16 / fp32."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; fp16: unscale, skip on inf/nan anywhere in the world, update the scale."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def clip_and_step(self, optimizer: torch.optim.Optimizer,
                      clip: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """The training step's update, in ``torch.amp.GradScaler``'s documented order: ``unscale_`` (the
        gradients divided by the scale, in place, and "found inf" recorded for this optimizer), then
        ``clip`` (it reads and scales the gradients ``optimizer.param_groups`` names, in place: the very
        tensors the optimizer will step with), then ``scaler.step`` (which does not unscale again after
        ``unscale_`` and skips the step on a found inf) and ``update``. Returns the norm ``clip`` gave
        (None without ``clip``). Without a scaler: clip, step."""
        norm = None
        if clip is not None:
            self.unscale(optimizer)
            norm = clip()
        self.step(optimizer)
        return norm


class _ScaledLoss:
    def __init__(self, loss_fn: Callable[..., torch.Tensor], amp: AmpContext) -> None:
        self.loss_fn = loss_fn
        self.amp = amp

    def __getattr__(self, name: str) -> Any:  # MicrobatchMeanLoss fields stay visible
        return getattr(self.loss_fn, name)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.amp.scale(self.loss_fn(output, target))
