"""A warm-up iteration's memory timeline, by operator (PatrickStar, Fang et al. 2021, Sec. 4: the
placement of model data follows the non-model memory a warm-up iteration measures).

:func:`trace_memory` runs one training iteration (forward, loss, backward, and the optimizer step when
given) of a model, or one :meth:`~whalepy.ParallelModel.train_step` on this rank, and records after
every ATen operator:

- ``live_bytes``: bytes of the storages created during the iteration and still alive (activations,
  temporaries, gradients, newly created optimizer states: PatrickStar's non-model data plus
  gradients). Storages are followed through the tensors that own them (a
  ``TorchDispatchMode`` sees every operator, forward and backward; a storage is freed when the last
  tensor viewing it is). On CUDA the allocator's own ``memory_allocated`` is recorded too.
- the phase (forward, backward, optimizer) and the block running (module hooks).

It also measures each block's activation bytes as autograd keeps them (``saved_tensors_hooks``:
distinct storages saved for backward, parameters excluded), which :func:`apply_memory_trace` puts in
place of the profile's estimate, so ``whalepy.plan(..., memory_trace=trace)`` plans with measured
activations.
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from whalepy.errors import WhalepyError

__all__ = ["MemoryTrace", "TraceEvent", "apply_memory_trace", "trace_memory"]


@dataclass(frozen=True, slots=True)
class TraceEvent:
    op: str
    phase: str
    """``forward``, ``backward`` or ``optimizer``."""
    block: str | None
    live_bytes: int
    """Bytes of storages created in the iteration and alive after this operator."""
    allocated_bytes: int | None = None
    """CUDA: ``torch.cuda.memory_allocated()`` after this operator; None on CPU."""


@dataclass
class MemoryTrace:
    """What :func:`trace_memory` recorded. ``peak_bytes`` = ``baseline_bytes`` (storages alive before
    the iteration: parameters, existing optimizer states, inputs) + the largest ``live_bytes``."""

    batch_size: int
    device: str
    baseline_bytes: int
    activation_bytes: dict[str, int]
    """Bytes each block's forward saves for backward (distinct storages, parameters excluded), per
    micro-batch: the largest over the iteration's forward passes."""
    activation_dtype: str
    """The dtype most saved floating-point bytes have (bf16 under autocast, else the model's)."""
    block_order: dict[str, list[str]] = field(default_factory=dict)
    """Blocks in the order they ran, per phase: when their parameters are used."""
    block_param_bytes: dict[str, int] = field(default_factory=dict)
    events: list[TraceEvent] = field(default_factory=list)
    model_fingerprint: str = ""
    """The traced model's fingerprint (its profile's and plan's); empty in traces saved before it was kept."""

    @property
    def peak_live_bytes(self) -> int:
        return max((e.live_bytes for e in self.events), default=0)

    @property
    def peak_bytes(self) -> int:
        return self.baseline_bytes + self.peak_live_bytes

    def by_block(self) -> dict[tuple[str, str | None], int]:
        """Peak ``live_bytes`` reached while each (phase, block) ran."""
        out: dict[tuple[str, str | None], int] = {}
        for e in self.events:
            k = (e.phase, e.block)
            out[k] = max(out.get(k, 0), e.live_bytes)
        return out

    def summary(self) -> str:
        mib = 1 << 20
        i = max(range(len(self.events)), key=lambda j: self.events[j].live_bytes) if self.events else None
        at = f" at {self.events[i].op} ({self.events[i].phase}, {self.events[i].block})" if i is not None else ""
        lines = [f"memory trace: batch {self.batch_size} on {self.device}, {len(self.events)} operators, "
                 f"peak {self.peak_bytes / mib:.1f} MiB = {self.baseline_bytes / mib:.1f} MiB before the "
                 f"iteration + {self.peak_live_bytes / mib:.1f} MiB created in it{at}"]
        for name, b in self.activation_bytes.items():
            lines.append(f"  {name}: {b / mib:.2f} MiB saved for backward ({self.activation_dtype})")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        d = asdict(self)
        d["events"] = [list(asdict(e).values()) for e in self.events]
        from whalepy.files import write_file

        write_file(path, json.dumps(d), what="MemoryTrace.save")

    @classmethod
    def load(cls, path: str | Path) -> MemoryTrace:
        try:
            d = json.loads(Path(path).read_text())
            d["events"] = [TraceEvent(*e) for e in d["events"]]
            return cls(**d)
        except FileNotFoundError:
            raise WhalepyError(f"memory trace {path}: no such file; make one with whalepy.trace_memory(...)"
                               ".save(path)") from None
        except (ValueError, TypeError, KeyError) as e:
            raise WhalepyError(f"memory trace {path} is not a whalepy memory trace ({e}); make one with "
                               "whalepy.trace_memory(...).save(path)") from None


class _Tracker(TorchDispatchMode):
    """Follows the storages operators create, and their lifetimes, through the tensors viewing them."""

    def __init__(self, known: set[int], cuda: bool) -> None:
        super().__init__()
        self.known = known  # storages alive before the iteration
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.cuda = cuda
        self.phase = "forward"
        self.block: str | None = None
        self.events: list[TraceEvent] = []
        self.freed: set[int] = set()
        # storages by identity (the StorageImpl, ``_cdata``), not address: FSDP2 frees and re-allocates
        # its unsharded parameters' storages in place (``untyped_storage().resize_``), which no operator
        # shows and which moves their address; a tensor viewing each one reads its size after every operator
        self.viewers: dict[int, weakref.ref] = {}
        self.addr: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)
            self.viewers.pop(key, None)
            self.freed.add(self.addr.pop(key))  # the allocator may hand the address out again

    def _follow(self, t: torch.Tensor) -> None:
        try:
            st = _plain(t).untyped_storage()  # a DTensor output: the shard this rank holds
            key, ptr, n = st._cdata, st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            return
        if n == 0 or ptr in self.known:
            return
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = n
            self.live += n
        elif self.sizes[key] != n:  # resized in place since it was last seen
            self.live += n - self.sizes[key]
            self.sizes[key] = n
        self.addr[key] = ptr
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)
        self.viewers[key] = weakref.ref(t)

    def _resized(self) -> None:
        """Count the storages resized in place (FSDP2's ``resize_(0)`` of the unsharded parameters after
        their use, and back) since the last operator: a tensor viewing one shows its size now."""
        for key, ref in list(self.viewers.items()):
            t = ref()
            if t is None:
                del self.viewers[key]  # the next tensor followed on it stands in
                continue
            st = _plain(t).untyped_storage()
            n = st.nbytes() if st._cdata == key else 0
            if n != self.sizes[key]:
                self.live += n - self.sizes[key]
                self.sizes[key] = n
                self.addr[key] = st.data_ptr()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._resized()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._follow(t)
        alloc = int(torch.cuda.memory_allocated()) if self.cuda else None
        self.events.append(TraceEvent(str(func.overloadpacket.__name__), self.phase, self.block, self.live, alloc))
        return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the storage this rank holds)."""
    return getattr(t, "_local_tensor", t)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = _plain(t).untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    if optimizer is None:
        return []
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _check_trace_args(target: Any, inputs: tuple, loss_fn: Any, optimizer: Any, blocks: Any, parallel: bool) -> None:
    """One line for an argument of :func:`trace_memory` it cannot use, before the model runs."""
    from whalepy.errors import ArgumentError
    from whalepy.frontend.checks import check_example_inputs

    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(f"trace_memory(loss_fn={loss_fn!r:.60}) must be callable (output, targets) -> scalar "
                            "loss, e.g. loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentError(f"trace_memory(optimizer=...) takes a torch.optim.Optimizer over the model's "
                            f"parameters (it is stepped once), got {type(optimizer).__name__}; build it first, "
                            "e.g. optimizer=torch.optim.AdamW(model.parameters())")
    if blocks is not None:
        if not isinstance(blocks, dict) or not all(
                isinstance(k, str) and not isinstance(v, str) and all(isinstance(p, str) for p in v)
                for k, v in blocks.items()):
            raise ArgumentError(f"trace_memory(blocks={blocks!r:.60}): give a dict of block name -> list of "
                                "module paths, e.g. blocks={'transformer.h.0': ['transformer.h.0']}")
        if not parallel:
            named = dict(target.named_modules())
            missing = sorted(p for paths in blocks.values() for p in paths if p not in named)
            if missing:
                raise ArgumentError(f"trace_memory(blocks=...) names module paths {missing[:3]} that "
                                    f"{type(target).__name__} does not have; use paths of model.named_modules()")
    if not parallel:
        check_example_inputs(target, inputs, "whalepy.trace_memory()")


def _blocks_of(model: nn.Module, inputs: tuple) -> dict[str, tuple[str, ...]]:
    # the capture itself (inputs were checked by _check_trace_args): whalepy.frontend.profile measures
    # with trace_memory, so importing it here would make a cycle
    from whalepy.passes.profile import build_profile

    return {b.name: tuple(b.modules) for b in build_profile(model, inputs).blocks}


def trace_memory(target: Any, inputs: Any, targets: Any = None, *,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 blocks: dict[str, Iterable[str]] | None = None) -> MemoryTrace:
    """Run one iteration of ``target`` and record its memory timeline (module docstring).

    ``target``: an ``nn.Module`` (forward on ``inputs``, ``loss_fn(output, targets)`` — or the output
    itself when it is a scalar — backward, then ``optimizer.step()`` when given) or a
    :class:`~whalepy.ParallelModel` (one ``train_step(inputs, targets)`` on this rank). ``blocks``: block
    name -> module paths; default the profile's blocks (a capture) for a module, the plan's for a
    parallel model."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    parallel = hasattr(target, "train_step") and hasattr(target, "plan")
    if not parallel and not isinstance(target, nn.Module):
        raise WhalepyError(f"trace_memory(target=...) takes an nn.Module or a whalepy ParallelModel, got "
                           f"{type(target).__name__}; pass the built model, or what whalepy.parallelize returned")
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() == 0:
        got = type(inputs[0]).__name__ if inputs else "nothing"
        got = "a 0-d tensor" if inputs and isinstance(inputs[0], torch.Tensor) else got
        raise WhalepyError(f"trace_memory needs a batch: a tensor (or tuple of tensors) with the batch along dim 0, "
                           f"got {got}; pass e.g. torch.zeros(4, 1024, dtype=torch.long) for 4 sequences of tokens")
    _check_trace_args(target, inputs, loss_fn, optimizer, blocks, parallel)
    _check_targets(target, inputs, targets, parallel)
    if parallel:
        if getattr(target.plan, "compile", False):
            from whalepy.log import warn_once

            warn_once("trace-compiled", "whalepy.trace_memory: the plan compiles its blocks, but torch.compile runs "
                      "them eagerly under the trace's TorchDispatchMode: this trace is of the eager blocks (what "
                      "the compiled ones save: whalepy.plan(..., measure=True), docs/profiling.md)")
        fingerprint = str(getattr(target.plan, "model_fingerprint", "") or "")
        roots = target.module if isinstance(target.module, list) else [target.module]
        mapping = blocks if blocks is not None else getattr(target, "block_modules", {})
        optimizer = target.optimizer
    else:
        roots = [target]
        if any(p.device.type == "meta" for p in target.parameters()):
            raise WhalepyError("trace_memory runs the model: materialise it first (whalepy.materialize or "
                               "to_empty + init), or trace a smaller configuration")
        mapping = blocks if blocks is not None else _blocks_of(target, inputs)
        from whalepy.passes.profile import model_fingerprint

        fingerprint = model_fingerprint(target)
    # a parallel model's compute device (its first parameter may be a host-tier shard)
    device = target.device if parallel else next((p.device for r in roots for p in r.parameters()), inputs[0].device)
    params = [p for r in roots for p in r.parameters()]
    known = set(_storages([*params, *inputs, *_state_tensors(optimizer),
                           *([targets] if isinstance(targets, torch.Tensor) else [])]))
    baseline = sum(_storages([*params, *_state_tensors(optimizer), *inputs]).values())
    tracker = _Tracker(known, device.type == "cuda")
    saved_ptrs: set[int] = set()
    saved_dtype: dict[str, int] = {}
    seen = set(_storages(params))
    order: dict[str, list[str]] = {"forward": [], "backward": []}
    handles = []

    passes: list[dict[str, int]] = [{}]  # saved bytes per block, one dict per forward pass

    def enter(name: str, phase: str) -> None:
        if phase == "forward" and tracker.phase != "forward" and passes[-1]:
            passes.append({})  # a new micro-batch's forward
        tracker.phase, tracker.block = phase, name
        if not order[phase] or order[phase][-1] != name:
            order[phase].append(name)

    for root in roots:
        named = dict(root.named_modules())
        for name, paths in mapping.items():
            for path in paths:
                mod = named.get(path) or named.get(f"module.{path}")  # DDP's wrapper prefix
                if mod is None:
                    continue
                handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: enter(n, "forward")))
                # ops between blocks (a loss after the head) belong to no block
                handles.append(mod.register_forward_hook(lambda m, a, o: setattr(tracker, "block", None)))
                handles.append(mod.register_full_backward_pre_hook(lambda m, g, n=name: enter(n, "backward")))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (tracker.phase == "forward" and tracker.block is not None and t.device.type != "meta"
                and not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter)):
            # parameters (and views of them) saved for backward are model data, not activations;
            # FSDP2's all-gathered parameters are Parameters too
            local = _plain(t)  # a DTensor (tensor parallelism) saves its local shard
            ptr = local.untyped_storage().data_ptr()
            if ptr in tracker.freed:  # a new storage at a freed one's address
                tracker.freed.discard(ptr)
                saved_ptrs.discard(ptr)
            if ptr not in seen and ptr not in saved_ptrs:
                saved_ptrs.add(ptr)
                n = local.untyped_storage().nbytes()
                passes[-1][tracker.block] = passes[-1].get(tracker.block, 0) + n
                if local.is_floating_point():
                    saved_dtype[str(local.dtype).removeprefix("torch.")] = saved_dtype.get(
                        str(local.dtype).removeprefix("torch."), 0) + n
        return t

    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
            # the backward pre-hooks mark blocks; torch notes when a block's inputs need no gradient
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            if parallel:
                _trace_parallel_step(target, tracker, inputs, targets)
            else:
                out = target(*inputs)
                tracker.block = None
                loss = loss_fn(out, targets) if loss_fn is not None else out
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise WhalepyError("trace_memory: give loss_fn(output, targets) returning a scalar "
                                       "(the model's output is not one)")
                del out  # as a training loop would: the graph keeps what backward needs
                tracker.phase = "backward"
                loss.backward()
                del loss
                if optimizer is not None:
                    tracker.phase, tracker.block = "optimizer", None
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    # per block, the largest forward pass (micro-batches of one iteration save alike)
    saved = {b: max(p.get(b, 0) for p in passes) for b in dict.fromkeys(k for p in passes for k in p)}
    named_params = {n: p for r in roots for n, p in r.named_parameters()}
    block_bytes = {name: sum(_plain(p).numel() * p.element_size() for n, p in named_params.items()
                             if any(n == path or n.startswith(path + ".") for path in paths))
                   for name, paths in mapping.items()}
    return MemoryTrace(batch_size=int(inputs[0].shape[0]), device=str(device), baseline_bytes=baseline,
                       activation_bytes=saved,
                       activation_dtype=max(saved_dtype, key=saved_dtype.get) if saved_dtype else "float32",
                       block_order=order, block_param_bytes=block_bytes, events=tracker.events,
                       model_fingerprint=fingerprint)


def _trace_parallel_step(pm: Any, tracker: _Tracker, inputs: tuple, targets: Any) -> None:
    """One ``train_step``; the phase switches to backward at the first backward hook and to optimizer
    when the step reaches the optimizer."""
    opt = pm.optimizer  # None when every block of the rank steps on the host (ZeRO-Offload)
    step = opt.step if opt is not None else None

    def traced_step(*a: Any, **k: Any) -> Any:
        tracker.phase, tracker.block = "optimizer", None
        return step(*a, **k)

    if opt is not None:
        opt.step = traced_step
    try:
        pm.train_step(inputs if len(inputs) > 1 else inputs[0], targets)
    finally:
        if opt is not None:
            opt.step = step


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def _check_targets(target: Any, inputs: tuple, targets: Any, parallel: bool) -> None:
    """Targets that are a tensor have the batch's size along dim 0 (else torch's loss raises deep inside)."""
    if not isinstance(targets, torch.Tensor) or targets.dim() == 0 or parallel:
        return  # a parallel model's train_step checks its own batch
    if targets.shape[0] != inputs[0].shape[0]:
        raise WhalepyError(f"trace_memory: targets have {targets.shape[0]} rows along dim 0, the inputs a batch of "
                           f"{inputs[0].shape[0]}; give targets of the same batch (e.g. the labels of these inputs)")


def apply_memory_trace(profile: Any, trace: MemoryTrace | str | Path) -> Any:
    """``profile`` with each traced block's ``activation_bytes`` replaced by the measured bytes, scaled
    from the trace's batch to the profile's and from the trace's activation dtype to the profile's
    (the planner rescales the profile's dtype to its training precision). Blocks the trace did not see
    keep their estimate."""
    if not isinstance(trace, MemoryTrace):
        trace = MemoryTrace.load(trace)
    theirs, ours = trace.model_fingerprint, getattr(profile, "fingerprint", "")
    if theirs and ours and theirs != ours:
        raise WhalepyError(f"memory trace of another model (fingerprint {theirs}, this model's is {ours}: other "
                           "parameter names, shapes or dtypes); trace this model with whalepy.trace_memory, or "
                           "leave memory_trace out")
    unknown = sorted(set(trace.activation_bytes) - {b.name for b in profile.blocks})
    if unknown:
        raise WhalepyError(f"memory trace has blocks {unknown[:3]} that the profile does not: the trace is of "
                           "another model or block split; trace this model with whalepy.trace_memory")
    scale = (profile.batch_size / trace.batch_size) * (
        _DTYPE_BYTES.get(profile.dtype, 4) / _DTYPE_BYTES.get(trace.activation_dtype, 4))
    blocks = tuple(replace(b, activation_bytes=int(round(trace.activation_bytes[b.name] * scale)))
                   if b.name in trace.activation_bytes else b for b in profile.blocks)
    return replace(profile, blocks=blocks)
