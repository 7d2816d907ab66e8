"""ZeRO-Offload: parameters on the device, their optimizer on the host, stepped during backward.

For the blocks a plan gives ``param_tier = gpu, optimizer_tier = cpu`` (Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", ATC'21). The stage is lowered to FSDP2
(:mod:`whalepy.runtime.data_parallel`), so every parameter here is this rank's shard (a DTensor's local
tensor) and what the host holds is partitioned over the replicas, as ZeRO-Offload partitions it:

- device: the parameter shard in the compute dtype (bf16 under a bf16 plan, fp32 under fp32), no
  gradient between steps. FSDP2 reduce-scatters the gradients in fp32 (``reduce_dtype``) and hands
  over the shard in the parameter's dtype, so under bf16 the gradient reaching the host is rounded to
  bf16 once, as ZeRO-Offload's fp16 gradients are;
- host (pinned when the device is CUDA): an fp32 master copy of the shard, an fp32 gradient buffer and
  the optimizer's states, one optimizer per block built by the user's factory (its class and
  hyper-parameters; Adam / AdamW and the others with a ``fused`` CPU kernel get ``fused=True``).

The pipeline per step: FSDP2 reduce-scatters a block's gradients at the end of its backward and calls
the parameters' post-accumulate-grad hooks (its post-reduce point, ``foreach_reduce``); the hook copies
the shard's gradient into the host buffer (``non_blocking`` on CUDA, in FSDP2's reduce stream) and drops
the device gradient. When every parameter of a block has its gradient, the block's step is queued on
one background thread: wait for the copies, ``optimizer.step()`` on the master weights, copy them back
into the device shards (on a side stream on CUDA). The steps of later blocks so run while the backward
of earlier blocks goes on; :meth:`HostOptimizer.finish` (the training step's optimizer step) waits for
the last ones and orders the device's next forward after the copies back.

Under fp16 or with gradient clipping (``step_in_backward=False``,
:func:`whalepy.ir.rules.host_steps_after_backward`) the gradients still reach the host block by
block during the backward, but no block steps then: :meth:`HostOptimizer.finish` waits for the copies
and leaves the host gradients as the masters' ``.grad``, where the loss scaler unscales and checks
them and the clipping reads and scales them with the device's (:mod:`whalepy.runtime._joint_step`);
:meth:`HostOptimizer.step` then steps every block and copies the parameters back, or
:meth:`HostOptimizer.zero_grad` drops the gradients of a skipped step.

torchao's ``CPUOffloadOptimizer`` does this for one process and plain parameters; it is not used
because it keeps the whole-model gradient copy on the host per parameter and knows nothing of FSDP2
shards. Here each block is its own optimizer so that a block steps as soon as it is complete.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from whalepy.errors import WhalepyError

__all__ = ["MASTER_KEY", "HostOptimizer", "HostStateView", "as_shard_of", "full_tensor", "local_tensor",
           "on_mesh_device"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


MASTER_KEY = "whalepy_fp32_master"
"""The key under which :meth:`HostOptimizer.state_view` carries a ZeRO-Offload parameter's fp32 master
when the device keeps the parameter in another dtype (checkpoints hold it as the parameter's weight)."""


def as_shard_of(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Host tensor ``v`` (a shard of ``p``, or a scalar) as a DTensor laid out like ``p``, sharing memory:
    its local tensor IS ``v`` (same storage, same device, ``v``'s dtype), so writes through it (a
    checkpoint load, clipping) land in ``v``.

    Not ``DTensor.from_local``: it moves a local tensor whose device differs from the mesh's device
    type to the mesh's device (a copy), so on a CUDA mesh a load or a clip through the wrapper would
    write into that copy and leave the host masters, states and gradients as they were (what the first
    GPU run found). The wrapper is built as FSDP2 builds its host shards (``DTensor(local, spec)``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if v.dim() == 0 or not isinstance(p, DTensor):
        return v
    spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=TensorMeta(p.shape, p.stride(), v.dtype))
    local = v.detach()  # same storage; the wrapper is a view of the state, not part of a graph
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def on_mesh_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a host local tensor on a device mesh (a ZeRO-Offload master or state, an FSDP2
    ``CPUOffloadPolicy`` shard or gradient) as a DTensor whose local tensor is on the mesh's device
    type (a copy); any other tensor as it is. Collectives over a CUDA mesh run on NCCL, which has no
    CPU backend (``ProcessGroup::getBackend`` raises "No backend type associated with device type
    cpu"), so a host shard goes to the device before it is gathered; on CPU / gloo this is a no-op."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor) or t._local_tensor.device.type == t.device_mesh.device_type:
        return t
    return DTensor.from_local(t._local_tensor.to(t.device_mesh.device_type), t.device_mesh, t.placements,
                              run_check=False, shape=t.shape, stride=t.stride())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor, gathered on its mesh's device (:func:`on_mesh_device`); a plain
    tensor as it is. A collective: every rank of the mesh calls it."""
    from torch.distributed.tensor import DTensor

    return on_mesh_device(t).full_tensor() if isinstance(t, DTensor) else t


class HostStateView(torch.optim.Optimizer):
    """See :meth:`HostOptimizer.state_view`; it never steps."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise WhalepyError("this is a view of the host optimizer's state for checkpoints; it does not step")


class _Block:
    """One block's device parameters, host buffers and optimizer."""

    def __init__(self, name: str, params: list[nn.Parameter], factory: OptimizerFactory, pin: bool) -> None:
        self.name = name
        self.params = params
        self.masters: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        for p in params:
            local = local_tensor(p.detach())
            master = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
            master.copy_(local)
            self.masters.append(nn.Parameter(master))
            self.grads.append(torch.zeros(local.shape, dtype=torch.float32, pin_memory=pin))
        self.optimizer = _cpu_optimizer(factory, self.masters, name)
        self.arrived: set[int] = set()
        self.events: list[Any] = []
        self.copied: Any = None  # CUDA: the event after the last copy back


KERNEL_FLAGS = ("fused", "foreach")
"""Param-group entries that choose an optimizer's implementation, not its mathematics (a checkpoint load
keeps the loading optimizer's: ``checkpointing.set_train_state``)."""


def _cpu_optimizer(factory: OptimizerFactory, masters: list[nn.Parameter], name: str) -> torch.optim.Optimizer:
    """The user's optimizer over ``masters``, with the fused CPU kernel where its class has one."""
    opt = factory(masters)
    if not isinstance(opt, torch.optim.Optimizer):
        raise WhalepyError(f"block {name!r}: the optimizer factory returned {type(opt).__name__}, not a "
                           "torch.optim.Optimizer")
    if {id(p) for g in opt.param_groups for p in g["params"]} != {id(p) for p in masters}:
        raise WhalepyError(f"block {name!r}: the optimizer factory must optimise exactly the parameters it "
                           "is given (optimizer_tier='cpu' builds one optimizer per block over its host copies)")
    return fused_variant(opt)


def fused_variant(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` rebuilt with ``fused=True`` (its class and hyper-parameters, no states yet) where its class
    has a fused kernel for these hyper-parameters and the user did not ask for ``fused`` or
    ``differentiable``, else ``opt`` itself. torch's fused CPU AdamW is one vectorised, multi-threaded
    pass per tensor, about 6x faster than its ``foreach`` or single-tensor steps over host memory
    (``benchmarks/bench_cpu_adamw.py``), the rate the cost model prices host steps at; the user's own
    flags are kept in ``whalepy_user_flags`` for checkpoints."""
    if "fused" in inspect.signature(type(opt).__init__).parameters and not any(
            g.get("fused") or g.get("differentiable") for g in opt.param_groups):
        groups = [{**g, "fused": True, "foreach": None} for g in opt.param_groups]
        try:
            fused = type(opt)(groups)
        except (RuntimeError, ValueError, TypeError):
            return opt  # this class or these hyper-parameters have no fused kernel on these devices
        # the user's hyper-parameters for groups added later and for ZeroRedundancyOptimizer, which
        # rebuilds the class from them (data_parallel.build_optimizer)
        fused.defaults = {**opt.defaults, "fused": True, "foreach": None}
        # what the user's factory chose, for checkpoints (a plan stepping on the device loads them)
        fused.whalepy_user_flags = [{k: g[k] for k in KERNEL_FLAGS if k in g}  # type: ignore[attr-defined]
                                    for g in opt.param_groups]
        return fused
    return opt


class HostOptimizer:
    """The host side of ZeRO-Offload for one rank: see the module docstring.

    ``blocks`` pairs each block name with its device parameters (FSDP2's sharded parameters, after
    materialisation). A parameter shared by several blocks belongs to the first."""

    def __init__(self, factory: OptimizerFactory, blocks: Sequence[tuple[str, Sequence[nn.Parameter]]],
                 device: torch.device,
                 cast: Callable[[list[nn.Parameter]], dict[int, nn.Parameter]] | None = None,
                 step_in_backward: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.step_in_backward = step_in_backward
        seen: set[int] = set()
        self.blocks: list[_Block] = []
        self._owner: dict[int, tuple[_Block, int]] = {}
        for name, params in blocks:
            mine = [p for p in params if p.requires_grad and id(p) not in seen]
            seen |= {id(p) for p in mine}
            if mine:
                self.blocks.append(_Block(name, mine, factory, pin=self.cuda))
        # the masters are fp32 copies of the shards as they are now; then the device may keep them in
        # the compute dtype (``cast``: old parameter id -> its replacement)
        swapped = cast([p for b in self.blocks for p in b.params]) if cast is not None else {}
        for b in self.blocks:
            b.params = [swapped.get(id(p), p) for p in b.params]
            for i, p in enumerate(b.params):
                self._owner[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad)
        # CUDA's current device is per host thread: the worker's is this rank's GPU, not GPU 0 (leaving
        # ``torch.cuda.stream`` restores the thread's previous stream through cudaSetDevice, which from
        # CUDA 12 on creates that device's primary context: every rank would hold one on GPU 0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whalepy-host-optimizer",
                                        initializer=torch.cuda.set_device if self.cuda else None,
                                        initargs=(device,) if self.cuda else ())
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.timeline: list[tuple[str, float, float]] = []
        """``(block, start, end)`` of each host step of the last training step (``time.perf_counter``;
        ``start``: once the block's gradients are on the host)."""
        self.queued_in_backward = 0
        """Blocks of the last training step whose host step was queued during the backward (as their
        gradients arrived) rather than by :meth:`finish`."""

    @property
    def params(self) -> list[nn.Parameter]:
        """The device parameters this optimizer steps."""
        return [p for b in self.blocks for p in b.params]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-block host optimizers (for learning-rate schedules: one scheduler per optimizer)."""
        return [b.optimizer for b in self.blocks]

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(kind, tensor)`` of what the host holds: ``params`` (masters), ``grads``, ``optimizer``
        states (tensors with at least one dimension)."""
        for b in self.blocks:
            yield from (("params", m) for m in b.masters)
            yield from (("grads", g) for g in b.grads)
            for m in b.masters:
                for v in b.optimizer.state.get(m, {}).values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield "optimizer", v

    # -- checkpoints -----------------------------------------------------------------------------------

    def state_view(self) -> torch.optim.Optimizer:
        """A ``torch.optim.Optimizer`` over the device parameters whose state IS the host state: each
        host tensor wrapped (not copied) as a DTensor laid out like its device shard, plus, where the
        device keeps another dtype (bf16), the fp32 master under :data:`MASTER_KEY` (which
        ``checkpointing.get_train_state`` moves to the model's state: the masters are the weights).
        DCP's ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` take it like any
        optimizer, so a checkpoint holds the host optimizer's states under the parameters' names and a
        load fills the host tensors in place. Call :meth:`after_load` once a load is done. States not
        created yet are created first, as DCP does (a step with zero gradients at learning rate 0)."""
        self._init_states()
        with_master = any(p.dtype != torch.float32 for p in self.params)
        # the blocks' groups with the same hyper-parameters become one group, in model order, as the
        # factory would have built them over all the parameters at once (so a checkpoint loads under a
        # plan that steps them on the device, and the other way round)
        groups: dict[str, dict[str, Any]] = {}
        state: dict[nn.Parameter, dict[str, Any]] = {}
        for b in self.blocks:
            device_of = {id(m): p for m, p in zip(b.masters, b.params)}
            flags = getattr(b.optimizer, "whalepy_user_flags", [{}] * len(b.optimizer.param_groups))
            for g, user in zip(b.optimizer.param_groups, flags):
                hyper = {**{k: v for k, v in g.items() if k != "params"}, **user}
                merged = groups.setdefault(repr(sorted(hyper.items())), {**hyper, "params": []})
                merged["params"] += [device_of[id(m)] for m in g["params"]]
            for m, p in zip(b.masters, b.params):
                state[p] = {k: as_shard_of(p, v) for k, v in b.optimizer.state[m].items()}
                if with_master:
                    state[p][MASTER_KEY] = as_shard_of(p, m)
        view = HostStateView(list(groups.values()))
        view.state.update(state)
        return view

    def after_load(self) -> None:
        """After a checkpoint load through :meth:`state_view`: fp32 device parameters are their own
        masters, so those masters are taken from the loaded device parameters. A low-precision device
        parameter's master is its weight in the checkpoint (``checkpointing.get_train_state`` moves
        :data:`MASTER_KEY` there), loaded into the host tensor itself, and is left alone."""
        with torch.no_grad():
            for b in self.blocks:
                for m, p in zip(b.masters, b.params):
                    if p.dtype == m.dtype:
                        m.copy_(local_tensor(p.detach()))

    def _init_states(self) -> None:
        for b in self.blocks:
            opt = b.optimizer
            if opt.state:
                continue
            for m in b.masters:
                m.grad = torch.zeros_like(m)
            lrs = [g.get("lr") for g in opt.param_groups]
            for g in opt.param_groups:
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
            opt.step()
            for g, lr in zip(opt.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            for m in b.masters:
                m.grad = None

    # -- backward ------------------------------------------------------------------------------------

    def _on_grad(self, p: nn.Parameter) -> None:
        """FSDP2's post-reduce point for ``p``: its shard's gradient leaves the device."""
        b, i = self._owner[id(p)]
        grad = local_tensor(p.grad)
        b.grads[i].copy_(grad, non_blocking=self.cuda)
        p.grad = None
        b.arrived.add(i)
        if self.cuda:
            b.events.append(torch.cuda.current_stream().record_event())
        if self.step_in_backward and len(b.arrived) == len(b.params):
            self._submit(b)

    def _submit(self, b: _Block) -> None:
        events, b.events = b.events, []
        arrived = set(b.arrived)
        b.arrived.clear()
        self._pending.append(self._pool.submit(self._step_block, b, events, arrived))

    def _step_block(self, b: _Block, events: list[Any], arrived: set[int]) -> None:
        import time

        for e in events:
            e.synchronize()
        if b.copied is not None:
            b.copied.synchronize()  # the last step's copy back has read the masters
        # from here: on CUDA the hook queued this step when the CPU issued the block's backward, far
        # ahead of the GPU; the wait above is the device's time, not the host step's
        start = time.perf_counter()
        for i, m in enumerate(b.masters):
            m.grad = b.grads[i] if i in arrived else None
        b.optimizer.step()
        for m in b.masters:
            m.grad = None
        with torch.no_grad():
            if self.cuda:
                with torch.cuda.stream(self._copy_stream):
                    for p, m in zip(b.params, b.masters):
                        local_tensor(p.data).copy_(m, non_blocking=True)
                    b.copied = self._copy_stream.record_event()
            else:
                for p, m in zip(b.params, b.masters):
                    local_tensor(p.data).copy_(m)
        with self._lock:
            self.timeline.append((b.name, start, time.perf_counter()))

    # -- the optimizer step ----------------------------------------------------------------------------

    def finish(self) -> None:
        """After the backward. Stepping during backward: :meth:`step` the blocks still waiting.
        Otherwise: wait for the gradient copies and give each master its host gradient as ``.grad``
        (None where the parameter got none), for :meth:`step` or :meth:`zero_grad`."""
        self.queued_in_backward = len(self._pending)
        if self.step_in_backward:
            self.step()
            return
        for b in self.blocks:
            for e in b.events:
                e.synchronize()
            b.events = []
            for i, m in enumerate(b.masters):
                m.grad = b.grads[i] if i in b.arrived else None

    def host_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(device parameter, host gradient)`` of every parameter with a gradient after :meth:`finish`
        (stepping after backward)."""
        return [(p, m.grad) for b in self.blocks for p, m in zip(b.params, b.masters) if m.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of a step that :meth:`step` did not take (fp16: a skipped step)."""
        for b in self.blocks:
            b.arrived.clear()
            b.events = []
            for m in b.masters:
                m.grad = None

    def step(self) -> None:
        """Step the blocks with gradients (parameters that got no gradient are skipped, as
        ``torch.optim`` skips a ``None`` gradient), wait for every host step of this training step and
        order the device after the copies back."""
        for b in self.blocks:
            if b.arrived:
                self._submit(b)
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # re-raises a failed step here, in the training step
        if self._copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self._copy_stream)

    def start_step(self) -> None:
        """Forget the last step's timeline (called at the start of each training step)."""
        with self._lock:
            self.timeline = []

    def close(self) -> None:
        self._pool.shutdown(wait=True)
