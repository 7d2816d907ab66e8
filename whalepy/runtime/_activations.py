"""A block's activations between its forward and its backward: recomputed, or kept in host memory.

- **Activation checkpointing** (``BlockPlan.checkpoint``): the composable
  ``torch.distributed._composable.checkpoint`` (non-reentrant ``torch.utils.checkpoint`` under the
  hood). It wraps nothing, so parameter names do not change and FSDP2 can shard the same module
  afterwards.
- **Activation offload** (``BlockPlan.activation_offload``): what the block's forward saves for
  backward goes to host memory. ``torch.autograd.graph.saved_tensors_hooks`` around the block's forward
  (entered and left by forward hooks, so nothing is wrapped either) pack each saved tensor into a host
  copy (pinned, ``non_blocking`` on CUDA) and unpack it back onto the device in backward, as
  ``torch.autograd.graph.save_on_cpu`` does, except that parameters are left where they are (FSDP2's
  gathered parameters and plain ones: they stay alive on the device anyway, a host copy would only add
  traffic; views of parameters, such as the transposed weight a linear saves, stay too), saved tensors
  that view the same storage share one host copy of it (restored once in backward), and on a CPU
  device the copy is made all the same (same memory), so the path is exercised.
- **Checkpoint offload** (``BlockPlan.checkpoint_offload``; ZeRO-Infinity, Rajbhandari et al. SC'21,
  sec. 5.1.2): a checkpointed block keeps only its input (the activation checkpoint) for the
  recompute, on the device; here it is kept in host memory instead. The non-reentrant checkpoint
  stores the block's positional tensor inputs as autograd ``SavedVariable``\\ s (``save_inputs``, in
  its forward pre-hook, before it pushes its own saved-tensor hooks for the block's body), and a
  ``SavedVariable`` packs with whatever saved-tensor hooks are active. So the same host-copy hooks,
  active from just before the checkpoint's pre-hook to just after its forward hook, catch exactly the
  inputs: inside the body the checkpoint's own hooks are innermost (they keep no tensors). The device
  input is released when the forward returns (nothing else holds it, unless the caller does: a
  pipeline stage's first block gets the stage input, which ``torch.distributed.pipelining`` keeps for
  its input gradient), and the recompute in backward brings the host copy back (``frame.get_inputs``
  unpacks it). Keyword tensor arguments are held by the checkpoint's recompute closure, not as saved
  tensors: they stay on the device (a model's masks and rotary tables, shared by all its blocks).
  ``torch.autograd.graph.save_on_cpu`` is the same pair of hooks, but on a CPU device its copy is the
  tensor itself (``tensor.cpu()``) and it counts nothing, so the host-copy hooks below are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from whalepy.errors import WhalepyError

__all__ = ["HostCopies", "apply_activation_checkpointing", "apply_activation_offload", "apply_checkpoint_offload"]


def apply_activation_checkpointing(modules: Sequence[nn.Module]) -> None:
    from torch.distributed._composable import checkpoint

    for m in modules:
        checkpoint(m, use_reentrant=False)


class _PackedDTensor(NamedTuple):
    local: Any
    """The local shard, packed."""
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class HostCopies:
    """Saved-tensor hooks that keep host copies of what one forward saves (module docstring).

    With ``whole_storage`` (activation offload), one forward's copies by storage: views saved by several
    ops (the q, k, v projections all save the same norm output) share one copy of the storage they view,
    which is what keeps device memory alive without offload too (and what the profile's saved bytes
    count). Without it (checkpoint offload: a block's inputs, whose storage may be a larger batch the
    caller holds) each tensor is copied alone. An entry holds the tensor it copied until the forward
    ends (:meth:`clear`), so its storage cannot be freed and reused by another tensor in the meantime;
    an in-place change since (the version counter) makes a new copy."""

    def __init__(self, device: torch.device, *, whole_storage: bool = True, dtensors: bool = False) -> None:
        self.pin = device.type == "cuda"
        self.whole_storage = whole_storage
        """Copy the storage a saved view views (shared by its views); else each tensor alone."""
        self.dtensors = dtensors
        """Copy a DTensor's local shard too (and rebuild the DTensor around it in backward)."""
        self.copies: dict[tuple[Any, ...], tuple[torch.Tensor, int, list[Any]]] = {}

    def pack(self, t: torch.Tensor) -> Any:
        if self.dtensors and _is_dtensor(t):
            with torch.no_grad():
                local = t.to_local()
            return _PackedDTensor(self.pack(local), t.device_mesh, t.placements, t.shape, t.stride())
        if type(t) is not torch.Tensor or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
            return t  # parameters (plain or FSDP2's gathered ones), views of them (a linear's weight.t())
            # and tensor subclasses stay
        pin = self.pin
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.dtype)
        hit = self.copies.get(key)
        if hit is None or hit[1] != t._version:
            n, rest = divmod(storage.nbytes(), t.element_size())
            if rest or not self.whole_storage:  # (a storage not of this dtype's size) the tensor alone
                host = torch.empty(t.size(), dtype=t.dtype, pin_memory=pin)
                host.copy_(t, non_blocking=pin)
                box = [host, None]
                self.copies[("alone", id(host))] = (t, t._version, box)
                return (t.device, box, tuple(t.size()), host.stride(), 0)
            with torch.no_grad():
                whole = t.new_empty(0).set_(storage, 0, (n,), (1,))
            host = torch.empty(n, dtype=t.dtype, pin_memory=pin)
            host.copy_(whole, non_blocking=pin)
            hit = self.copies[key] = (t, t._version, [host, None])
        return (t.device, hit[2], tuple(t.size()), t.stride(), t.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _PackedDTensor):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(self.unpack(packed.local), packed.mesh, packed.placements, run_check=False,
                                      shape=packed.shape, stride=packed.stride)
        dev, box, size, stride, offset = packed
        if box[1] is None:  # the storage comes back once for all the views saved of it
            box[1] = box[0].to(dev, non_blocking=self.pin)
        return box[1].as_strided(size, stride, offset)

    def host_bytes(self) -> int:
        """Bytes of the host copies made in the current (or last) forward."""
        return sum(box[0].untyped_storage().nbytes() for _, _, box in self.copies.values())

    def clear(self) -> None:
        """Forget this forward's copies (the saved variables keep the ones backward needs)."""
        self.copies.clear()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _around_forward(m: nn.Module, copies: HostCopies, done: Callable[[int], None],
                    active: Callable[[nn.Module, tuple[Any, ...]], bool] = lambda _m, _a: True) -> None:
    """Push ``copies``' hooks when ``m``'s forward starts (where ``active``) and pop them when it ends,
    calling ``done`` with the host bytes of that forward. Registered before any later hook of ``m``."""
    contexts: list[Any] = []

    def enter(mod: nn.Module, args: tuple[Any, ...]) -> None:
        contexts.append(None)  # popped by leave, which runs even when active raises
        ctx = contexts[-1] = copies.hooks() if active(mod, args) else None
        if ctx is not None:
            copies.clear()
            ctx.__enter__()

    def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
        ctx = contexts.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
            done(copies.host_bytes())
            copies.clear()

    m.register_forward_pre_hook(enter)
    m.register_forward_hook(leave, always_call=True)


def apply_activation_offload(modules: Sequence[nn.Module], device: torch.device) -> list[int]:
    """Keep the saved activations of each module in ``modules`` in host memory (module docstring).
    Returns a list to which the host bytes of each forward of one of them are appended (for tests and
    benchmarks; clear it as you like)."""
    copies = HostCopies(device)
    sizes: list[int] = []
    for m in modules:
        _around_forward(m, copies, sizes.append)
    return sizes


def apply_checkpoint_offload(modules: Sequence[nn.Module], device: torch.device,
                             record: dict[nn.Module, int] | None = None) -> dict[nn.Module, int]:
    """Checkpoint each module in ``modules`` with its input kept in host memory between its forward and
    its backward (module docstring): the host-copy hooks are registered first, then the checkpoint, so
    they enclose exactly the checkpoint's pre-hook and forward. Returns ``record`` (a new dict if None),
    in which each module's forward writes the host bytes it kept (for tests and benchmarks)."""
    from torch.distributed._composable import checkpoint

    copies = HostCopies(device, whole_storage=False, dtensors=True)
    last: dict[nn.Module, int] = {} if record is None else record

    def active(mod: nn.Module, args: tuple[Any, ...]) -> bool:
        # not while the checkpoint recomputes in backward (it turns its own hooks off then) and not
        # without autograd (the checkpoint saves nothing)
        if not (torch.is_grad_enabled() and checkpoint.state(mod).enable_hook):
            return False
        odd = next((type(a).__name__ for a in args if isinstance(a, torch.Tensor)
                    and type(a) is not torch.Tensor and not _is_dtensor(a)), None)
        if odd is not None:
            raise WhalepyError(f"checkpoint_offload: an input of {type(mod).__name__} is a {odd}, not a tensor or "
                               "DTensor; it copies those only: unset checkpoint_offload for this block")
        return True

    for m in modules:
        _around_forward(m, copies, lambda n, m=m: last.__setitem__(m, n), active)
        checkpoint(m, use_reentrant=False)
    return last
