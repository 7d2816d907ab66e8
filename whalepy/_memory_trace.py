"""Warm-up memory trace (PatrickStar's idea: place model data by what one real iteration uses).

:func:`trace_memory` runs one forward and backward and records, operator by operator, which module ran,
the bytes autograd keeps for backward so far (tensors packed by ``torch.autograd.graph.saved_tensors_hooks``,
counted once per storage, parameters excluded) and, on CUDA, the caching allocator's allocated bytes
(``torch.cuda.memory_allocated``; ``torch.cuda.memory._record_memory_history`` keeps the full allocator
history in :attr:`MemoryTrace.snapshot`). Operators are seen through a ``TorchDispatchMode``, modules
through forward hooks. PyTorch provides every piece; whalepy only attributes the bytes to its blocks.

:meth:`MemoryTrace.apply` replaces a :class:`~whalepy.profile.ModelProfile`'s estimated activation bytes
per block with the measured ones (scaled to the profile's batch), so the planner plans with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from whalepy._errors import WhalepyError

__all__ = ["MemoryEvent", "MemoryTrace", "trace_memory"]

OUTSIDE = "<outside modules>"
"""Module path of operators that ran outside every submodule (the loss, top-level functional code)."""


@dataclass(frozen=True, slots=True)
class MemoryEvent:
    """One operator of the traced iteration."""

    op: str
    """``aten`` overload name, e.g. ``"aten.mm.default"``."""
    module: str
    """Innermost module path running it (``OUTSIDE`` for none; backward ops keep the last forward's)."""
    phase: str
    """``"forward"`` or ``"backward"``."""
    saved_bytes: int
    """Bytes autograd keeps for backward after this operator (all modules)."""
    allocated_bytes: int | None
    """``torch.cuda.memory_allocated()`` after it (CUDA only)."""


@dataclass(slots=True)
class MemoryTrace:
    """What one iteration held, by operator and by module."""

    batch_size: int
    events: list[MemoryEvent] = field(default_factory=list)
    saved_by_module: dict[str, int] = field(default_factory=dict)
    """Bytes saved for backward by the operators of each innermost module (storages counted once)."""
    peak_saved_bytes: int = 0
    """The activation peak: bytes kept for backward at the end of the forward."""
    peak_allocated_bytes: int | None = None
    """CUDA: ``torch.cuda.max_memory_allocated()`` over the iteration."""
    snapshot: Any = None
    """CUDA: the allocator history (``torch.cuda.memory._snapshot()``), for ``torch.cuda._memory_viz``."""

    def saved_bytes_of(self, modules: tuple[str, ...] | list[str]) -> int:
        """Bytes saved by the operators of ``modules`` and everything under them."""
        return sum(b for path, b in self.saved_by_module.items()
                   if any(path == m or path.startswith(m + ".") for m in modules))

    def apply(self, profile):  # type: ignore[no-untyped-def]
        """``profile`` with each block's ``activation_bytes`` replaced by the measured bytes of its
        modules, scaled from the traced batch to the profile's (activations grow linearly with it)."""
        scale = profile.batch_size / self.batch_size
        blocks = tuple(dataclasses.replace(b, activation_bytes=int(round(self.saved_bytes_of(b.modules) * scale)))
                       for b in profile.blocks)
        return dataclasses.replace(profile, blocks=blocks)


class _OpRecorder(TorchDispatchMode):
    def __init__(self, on_op: Callable[[str], None]) -> None:
        super().__init__()
        self._on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self._on_op(str(func))
        return out


def trace_memory(model: Any, batch: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> MemoryTrace:
    """Run one forward and backward of ``model`` (an ``nn.Module`` with real weights, or a
    ``ParallelModel``: its local module is traced) on ``batch`` (a tensor, a tuple of positional inputs
    or a dict of keyword inputs) and record its memory timeline. ``loss_fn`` turns the output into a
    scalar (default: the mean of the output, or of its first element). Gradients it creates are
    cleared afterwards."""
    module = getattr(model, "module", model)
    if isinstance(module, list):
        raise WhalepyError("trace_memory traces one module; this ParallelModel runs several pipeline chunks "
                           "on this rank: trace the unparallelised model instead")
    if not isinstance(module, nn.Module):
        raise WhalepyError(f"trace_memory needs an nn.Module or a ParallelModel, got {type(model).__name__}")
    if any(p.is_meta for p in module.parameters()):
        raise WhalepyError("trace_memory runs the model, but its parameters are on the meta device; "
                           "materialise it first (whalepy.materialize) or trace a smaller real copy")
    args, kwargs = (batch if isinstance(batch, tuple) else (batch,), {}) if not isinstance(batch, dict) else ((), batch)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise WhalepyError("trace_memory needs a batch with a leading batch dimension (a tensor input)")
    cuda = first.is_cuda
    trace = MemoryTrace(batch_size=int(first.shape[0]))
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    param_ptrs |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    seen: set[int] = set()
    stack: list[str] = []
    state = {"phase": "forward", "last": OUTSIDE, "saved": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_ptrs and ptr not in seen and st.nbytes() > 0 and state["phase"] == "forward":
            seen.add(ptr)
            where = stack[-1] if stack else OUTSIDE
            trace.saved_by_module[where] = trace.saved_by_module.get(where, 0) + st.nbytes()
            state["saved"] += st.nbytes()
        return t

    def on_op(op: str) -> None:
        where = stack[-1] if stack else (state["last"] if state["phase"] == "backward" else OUTSIDE)
        trace.events.append(MemoryEvent(op=op, module=where, phase=state["phase"], saved_bytes=state["saved"],
                                        allocated_bytes=torch.cuda.memory_allocated() if cuda else None))

    names = {m: n for n, m in module.named_modules() if n}
    handles = []
    for m, n in names.items():
        handles.append(m.register_forward_pre_hook(lambda mod, a, n=n: stack.append(n)))
        handles.append(m.register_forward_hook(lambda mod, a, out, n=n: state.update(last=stack.pop())))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _OpRecorder(on_op):
            out = module(*args, **kwargs)
            loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
            trace.peak_saved_bytes = state["saved"]
            state["phase"] = "backward"
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        if cuda:
            trace.snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace.peak_allocated_bytes = torch.cuda.max_memory_allocated()
        module.zero_grad(set_to_none=True)
    return trace


def _default_loss(out: Any) -> torch.Tensor:
    t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise WhalepyError("trace_memory cannot make a loss from the model's output; pass loss_fn=")
    return t.float().mean()
