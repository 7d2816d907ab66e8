"""Measured planning: time what the runtime will run on the local device, per distinct block.

``whalepy.profile(model, example_inputs, measure=True)`` (and ``whalepy.plan(..., measure=True)``,
``whalepy calibrate --model MODULE:FN``) runs the model on this machine's device (a CUDA GPU, or the
CPU) and records, per **distinct** block (blocks keyed by :func:`block_signature`; on a GPU a run of
identical layers is timed on the first two members only, :mod:`whalepy.passes.truncate` cutting the run
down while the model runs; on the CPU the whole model runs, :data:`TRUNCATE_ON_CPU`, and the members'
times are averaged):

- forward and backward seconds of one micro-batch, at each micro-batch size and tensor-parallel
  degree asked for, in the plan's precision (``torch.autocast`` for bf16/fp16, as the runtime does it).
  A block's time is read between module hooks: forward from the pre-hook of its first module to the
  next block's, backward from the gradient of its last module's output (a tensor hook: no autograd
  function of its own, so the graph timed is the model's) to the previous block's; the
  loss (``loss_fn``; by default cross-entropy of logits against token ids, else the mean square of the
  output) is charged to the last block. Recomputation runs the forward again and is charged its time.
- tensor parallelism without extra devices: the block is timed with **TP-sharded weight shapes on one
  device**: every COLWISE module's output features, every ROWWISE module's input features and a
  VOCAB embedding's rows divided by the degree, head-count attributes made local as the runtime does
  (``whalepy.runtime.tensor_parallel``). The TP collectives are not in this time; the planner adds them
  from the communication model, as for modelled blocks;
- the optimizer step of the implementation the runtime builds (``torch.optim.AdamW`` with its
  defaults unless ``optimizer`` is given), per block, over that block's parameters;
- the activation bytes one block's forward saves for backward (:func:`whalepy.frontend.trace.trace_memory`'s
  saved-tensor accounting, the warm-up trace), which replace the profile's estimate.

The result is a :class:`MeasuredCosts` table; its JSON form (:meth:`MeasuredCosts.to_dict`) is the
``measured`` section of a device profile (docs/profiling.md, "Measured planning").
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from whalepy.errors import WhalepyError
from whalepy.frontend.measure_checks import checked_loss
from whalepy.ir.measured import MeasuredCosts, block_signature

__all__ = ["BlockClock", "apply_measured_activations", "block_parameters", "cpu_peers_running", "measure_costs",
           "micro_batch_sizes"]


# ---------------------------------------------------------------------------------------------- inputs


def _batch_of(example_inputs: Any) -> int:
    first = next(iter(example_inputs.values())) if isinstance(example_inputs, dict) else example_inputs[0]
    return int(first.shape[0])


def _resize(example_inputs: Any, mb: int, device: torch.device) -> Any:
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        reps = -(-mb // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:mb].to(device)

    if isinstance(example_inputs, dict):
        return {k: one(v) for k, v in example_inputs.items()}
    return tuple(one(t) for t in example_inputs)


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def grad_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors needing a gradient in a module's inputs or outputs (tuples, lists, dicts, HF outputs):
    where the block clocks (here and the runtime's, ``runtime/_block_timing.py``) hook the backward."""
    if isinstance(x, torch.Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, dict) or (hasattr(x, "values") and not isinstance(x, nn.Module)):
        try:
            x = list(x.values())
        except TypeError:
            return []
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in grad_tensors(v)]
    return []


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):
        out = list(out.values())
    for o in out:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            return o
    raise WhalepyError("measure: the model's output holds no floating tensor to take a loss of; pass "
                       "loss_fn=lambda output, inputs: <scalar loss>")


def default_loss(out: Any, inputs: Any) -> torch.Tensor:
    """Cross-entropy of ``[..., V]`` logits against the integer token ids of the first input when their
    shapes match (a language model), else the mean square of the first floating output."""
    y = _first_tensor(out)
    ids = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    if (isinstance(ids, torch.Tensor) and not ids.is_floating_point() and y.dim() == ids.dim() + 1
            and tuple(y.shape[:-1]) == tuple(ids.shape)):
        return nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]).float(), ids.reshape(-1) % y.shape[-1])
    return y.float().pow(2).mean()


# ------------------------------------------------------------------------------------------ tables


class _MeanRow(dict):  # type: ignore[type-arg]
    """A table row (``key -> seconds``, ``(forward, backward)`` or bytes) in which a key assigned again keeps
    the mean of every value assigned: the members of a run of identical blocks (one signature) each
    report their time, and the signature's row is their mean, not the last member's."""

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[Any, int] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        n = self._count.get(key, 0)
        if n:
            old = dict.__getitem__(self, key)
            value = (tuple((o * n + v) / (n + 1) for o, v in zip(old, value)) if isinstance(value, tuple)
                     else (old * n + value) / (n + 1))
        self._count[key] = n + 1
        super().__setitem__(key, value)


def _plain_rows(table: dict) -> dict:  # type: ignore[type-arg]
    return {k: dict(v) for k, v in table.items()}


# ---------------------------------------------------------------------------------------- CPU peers

PEER_START_TIMEOUT_S = 120.0
"""Seconds a peer process of :func:`cpu_peers_running` may take to start (import torch, unpickle the
model) and run its first step before the measurement is refused as unable to start them."""


def _peer_main(model: nn.Module, inputs: Any, ready: Any, stop: Any) -> None:
    """A peer of :func:`cpu_peers_running`: forward and backward of ``model`` on one thread until ``stop``."""
    torch.set_num_threads(1)
    model.train()
    first = True
    try:
        while not stop.is_set():
            default_loss(_call(model, inputs), inputs).backward()
            for prm in model.parameters():
                prm.grad = None
            if first:
                ready.put(None)
                first = False
    except Exception as e:  # noqa: BLE001 - said by the parent in one line
        ready.put(f"{type(e).__name__}: {str(e).strip()[:160]}")


@contextlib.contextmanager
def cpu_peers_running(model: nn.Module, inputs: Any, peers: int) -> Iterator[None]:
    """While inside, ``peers`` other processes run ``model``'s forward and backward on ``inputs`` (one
    intra-op thread each), as the other ranks of a node of CPU ranks do while a rank computes.

    A CPU rank is one core of a socket whose other cores run the job's other ranks: they share its
    last-level cache and memory bandwidth, and a block timed with those cores idle runs faster than in
    the job (on the 2-core machine of ``benchmarks/bench_predict_cpu.py``: the blocks' sum 33.3-33.9 ms
    alone, 35.6-35.7 ms beside one peer; docs/benchmarks.md, session 17). Measured planning on the CPU
    with ``cpu_peers=n`` times the blocks beside ``n`` such peers (``n + 1`` ranks per node). The peers
    are started with ``spawn`` (the model and inputs are pickled to them) and stopped on leaving."""
    if peers <= 0:
        yield
        return
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Queue()
    procs: list[Any] = []
    try:
        for _ in range(peers):
            proc = ctx.Process(target=_peer_main, args=(model, inputs, ready, stop), daemon=True)
            try:
                proc.start()
            except Exception as e:  # noqa: BLE001 - pickling the user's model: said in one line
                raise WhalepyError(f"measure: cpu_peers={peers} runs the model in {peers} other process(es) "
                                   f"and it could not be sent to them ({type(e).__name__}: {str(e)[:120]}); "
                                   "give cpu_peers=0, or a model that pickles") from None
            procs.append(proc)
        started, deadline = 0, time.monotonic() + PEER_START_TIMEOUT_S
        while started < peers:
            why = None
            try:
                got = ready.get(timeout=1.0)
                started += got is None
                why = got
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive()]
                if dead:  # died before running the model: most often a script without a main guard
                    why = (f"exit code {dead[0].exitcode} before its first step; a script that measures with "
                           "cpu_peers must call it under `if __name__ == \"__main__\":`, as the peers start "
                           "with spawn and import the script")
                elif time.monotonic() > deadline:
                    why = f"not ready in {PEER_START_TIMEOUT_S:.0f} s"
            if why is not None:
                raise WhalepyError(f"measure: a peer process of cpu_peers={peers} failed to run the model "
                                   f"({why}); give cpu_peers=0 to measure without them") from None
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


# ------------------------------------------------------------------------------------- tensor parallel


def _shrink_linear(m: nn.Module, dim: str, tp: int) -> None:
    """Resize a Linear / HF Conv1D / Embedding in place to its local shard's shape: ``dim`` is ``"out"``
    (column-parallel), ``"in"`` (row-parallel) or ``"rows"`` (vocab-parallel embedding)."""
    from whalepy.ir.rules import is_conv1d

    w = m.weight
    conv1d = is_conv1d(m)
    if isinstance(m, nn.Embedding) or dim == "rows":
        axis = 0
    elif dim == "out":
        axis = 1 if conv1d else 0
    else:
        axis = 0 if conv1d else 1
    shape = list(w.shape)
    if shape[axis] % tp:
        raise WhalepyError(f"measure: {type(m).__name__} dimension {shape[axis]} does not divide by tp={tp}")
    shape[axis] //= tp
    with torch.no_grad():
        m.weight = nn.Parameter(w.detach()[tuple(slice(0, s) for s in shape)].clone(), requires_grad=w.requires_grad)
        bias = getattr(m, "bias", None)
        if bias is not None and dim == "out":
            m.bias = nn.Parameter(bias.detach()[: bias.shape[0] // tp].clone(), requires_grad=bias.requires_grad)
    if conv1d:
        m.nf = shape[1]
    for attr, val in (("out_features", shape[0]), ("in_features", shape[1])) if isinstance(m, nn.Linear) else ():
        setattr(m, attr, val)
    if isinstance(m, nn.Embedding):
        m.num_embeddings = shape[0]
        rows = shape[0]
        # token ids index the local vocabulary shard as the runtime's masked lookup does
        m.register_forward_pre_hook(lambda _m, a: (a[0] % rows, *a[1:]))


def localize_tp(model: nn.Module, rules: Iterable[Any], tp: int) -> None:
    """Give ``model``'s TP-ruled modules their local shard's shapes for degree ``tp`` (module docstring)."""
    from whalepy.ir.rules import localize_counts
    from whalepy.ir.types import TPStyle

    def _parent(name: str) -> str:
        return name.rpartition(".")[0]

    present = dict(model.named_modules())
    rules = [r for r in rules if r.module in present]
    rowwise_parents = {_parent(r.module) for r in rules if r.style is TPStyle.ROWWISE}
    adjusted: set[str] = set()
    for r in rules:
        m = present[r.module]
        parent_name = _parent(r.module)
        if r.style is TPStyle.COLWISE:
            if parent_name in rowwise_parents and parent_name not in adjusted:
                localize_counts(present.get(parent_name, model), parent_name, tp)
                adjusted.add(parent_name)
            _shrink_linear(m, "out", tp)
        elif r.style is TPStyle.ROWWISE:
            _shrink_linear(m, "in", tp)
        elif r.style is TPStyle.VOCAB:
            _shrink_linear(m, "rows", tp)


# ------------------------------------------------------------------------------------------- timing


class BlockClock:
    """Module hooks that cut one forward + backward into per-block intervals (module docstring)."""

    def __init__(self, model: nn.Module, blocks: dict[int, tuple[str, ...]], sync: Callable[[], None],
                 device: torch.device | None = None) -> None:
        self.sync = sync
        self.cuda = device is not None and device.type == "cuda"
        """On a GPU the marks are CUDA events on the current stream, synchronised once when the step's
        intervals are read, as the runtime's own block timing does (runtime/_block_timing.py): a host
        synchronisation at every block boundary drains the launch queue the step keeps full. (On an
        H200 the difference was small: a GPT-1.4B's compiled blocks summed to 76.5 ms synchronised,
        75.3 ms in the run's event-timed step. Both carried the hooks' own cost then: the step without hooks
        ran its forward and backward in about 72 ms; the backward marks were full backward pre-hooks,
        which add an autograd function per module call, and are tensor hooks now, :meth:`_on_outputs`.)"""
        self.events: list[tuple[Any, int | None, str]] = []
        self.handles: list[Any] = []
        named = dict(model.named_modules())
        self._targets = [(named[path], idx) for idx, paths in blocks.items() for path in paths if path in named]
        self.attach()

    def attach(self) -> None:
        """Register the hooks (done by the constructor; again after :meth:`remove`)."""
        if self.handles:
            return
        for mod, idx in self._targets:
            self.handles.append(mod.register_forward_pre_hook(lambda m, a, i=idx: self.mark(i, "f")))
            # first among the forward hooks, so that the output's tensor hook runs before FSDP2's
            # (its pre-backward all-gather is then inside the block's backward, as it runs there)
            self.handles.append(mod.register_forward_hook(lambda m, a, out, i=idx: self._on_outputs(i, out),
                                                          prepend=True))

    def _on_outputs(self, block: int, out: Any) -> None:
        """The block's backward starts when the gradient of one of its module's outputs is complete: a
        hook on each output tensor. (A full backward pre-hook marks the same moment but wraps every
        input and output in an extra autograd function: 2% of a small GPT's step on a CPU,
        benchmarks/bench_block_clock.py, about 4% on an H200, which the measured blocks then carried;
        tensor hooks cost a Python call each.)"""
        for t in grad_tensors(out):
            t.register_hook(lambda g, i=block: self.mark(i, "b"))

    def mark(self, block: int | None, phase: str) -> None:
        if self.events and self.events[-1][1] == block and self.events[-1][2] == phase:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append((ev, block, phase))
            return
        self.sync()
        self.events.append((time.perf_counter(), block, phase))

    def intervals(self) -> dict[tuple[int, str], float]:
        """Seconds per (block, phase) between consecutive marks; marks with block None close a phase."""
        out: dict[tuple[int, str], float] = {}
        if self.cuda and self.events:
            self.events[-1][0].synchronize()
        for (t0, b, p), (t1, _, _) in zip(self.events, self.events[1:]):
            if b is not None:
                dt = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
                out[(b, p)] = out.get((b, p), 0.0) + dt
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _one_step(model: nn.Module, inputs: Any, clock: BlockClock, loss_fn: Callable, autocast: Any,
              last: int) -> dict[tuple[int, str], float]:
    import warnings

    clock.events = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with autocast():
            out = _call(model, inputs)
            loss = checked_loss(loss_fn, out, inputs)  # charged to the last block's forward
        clock.mark(None, "f")
        del out
        clock.mark(last, "b")  # the loss's backward: the last block's
        loss.backward()
        clock.mark(None, "b")
    for p in model.parameters():
        p.grad = None
    return clock.intervals()


def saved_per_block(model: nn.Module, inputs: Any, blocks: dict[int, tuple[str, ...]], loss_fn: Callable,
                    autocast: Any) -> dict[int, int]:
    """Bytes each block's forward saves for backward in one forward + backward of ``model`` (block index
    -> bytes): distinct storages given to ``saved_tensors_hooks`` while the block's modules run,
    parameters and views of them excluded, as :func:`whalepy.frontend.trace.trace_memory` counts them.
    Unlike that trace it runs no ``TorchDispatchMode``, under which ``torch.compile`` runs its code
    eagerly: a compiled block saves through its ``CompiledFunction``'s ``ctx.save_for_backward``, which the
    hooks see (with no recompilation), so this counts what the compiled blocks themselves keep."""
    import warnings

    current: list[int | None] = [None]
    named = dict(model.named_modules())
    handles = []
    for idx, paths in blocks.items():
        for path in paths:
            mod = named.get(path)
            if mod is not None:
                handles.append(mod.register_forward_pre_hook(lambda m, a, i=idx: current.__setitem__(0, i)))
                handles.append(mod.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"}
    seen: set[int] = set()
    out: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is None or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        local = getattr(t, "_local_tensor", t)  # a DTensor saves its local shard
        st = local.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr not in seen:  # saved tensors live until backward: no address reuse
            seen.add(ptr)
            out[current[0]] = out.get(current[0], 0) + st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with autocast():
                out_ = _call(model, inputs)
                current[0] = None
                loss = checked_loss(loss_fn, out_, inputs)
            del out_
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = None
    return out


WARMUP_STEPS = (2, 6)
"""Least and most warm-up steps before timing a shape: the first steps of a new shape (and of a fresh
process: kernel selection, allocator growth, lazy initialisation) run slower than the steady state the
runtime reaches; warm-up continues past the least until a step is within :data:`WARMUP_SETTLED` of the
one before."""

WARMUP_SETTLED = 0.1


def _warm_up(model: nn.Module, inputs: Any, clock: BlockClock, loss_fn: Callable, autocast: Any, last: int) -> None:
    prev = None
    for i in range(WARMUP_STEPS[1]):
        t = sum(_one_step(model, inputs, clock, loss_fn, autocast, last).values())
        if i + 1 >= WARMUP_STEPS[0] and prev is not None and abs(t / prev - 1) <= WARMUP_SETTLED:
            return
        prev = t


def _plain_step(model: nn.Module, inputs: Any, loss_fn: Callable, autocast: Any, sync: Callable[[], None]) -> float:
    """Seconds of one forward, loss and backward of ``model`` with no clock on it (the span the block
    clock's marks cover: from before the first block to the end of the backward)."""
    sync()
    t0 = time.perf_counter()
    with autocast():
        out = _call(model, inputs)
        loss = checked_loss(loss_fn, out, inputs)
    del out
    loss.backward()
    sync()
    t = time.perf_counter() - t0
    for p in model.parameters():
        p.grad = None
    return t


def _timed_steps(model: nn.Module, inputs: Any, clock: BlockClock, loss_fn: Callable, autocast: Any, last: int,
                 repeats: int) -> dict[tuple[int, str], float]:
    """Per (block index, phase) the median seconds of ``repeats`` steps after warm-up, scaled so that
    they sum to the step as it runs without the clock.

    The hooks cost host time at every block boundary (a Python call, an event record); where the step
    is bound by the host's kernel launches (a small model on a GPU) that time is the device's too: on an
    H200 a GPT of 8 layers of width 512 at batch 4 x 256 summed to 17.9 ms under the clock against 14.5 ms
    without it (tests/test_cuda_measure.py). So each repeat runs a clocked step and a step with the hooks
    removed, one after the other (the same load on both), and the clocked intervals are scaled by the
    ratio of the plain steps' median to the intervals' medians summed: the clock gives the split
    between blocks, the plain step the total."""
    _warm_up(model, inputs, clock, loss_fn, autocast, last)
    runs, plain = [], []
    for _ in range(repeats):
        runs.append(_one_step(model, inputs, clock, loss_fn, autocast, last))
        clock.remove()
        try:
            plain.append(_plain_step(model, inputs, loss_fn, autocast, clock.sync))
        finally:
            clock.attach()
    med = _median_times(runs)
    clocked = sum(med.values())
    scale = statistics.median(plain) / clocked if clocked > 0 else 1.0
    return {k: v * scale for k, v in med.items()}


def _median_times(runs: list[dict[tuple[int, str], float]]) -> dict[tuple[int, str], float]:
    keys = set().union(*runs) if runs else set()
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


TRUNCATE_ON_CPU = False
"""Whether measured planning truncates runs of identical blocks by default on the CPU (on a GPU it
does). On a GPU a block streams its weights from device memory whatever ran before it, and a run cut to
its first members times the same per block while taking a fraction of the time and memory. On the CPU
it does not: a core's L2 (1 MiB here) keeps the weights of a short run between its forward and backward
and not those of the whole model, so blocks of a truncated run time fast; on this 2-core machine
``gpt-deep`` (8 blocks of 0.79 MB of weights) at micro-batch 2 summed to 18.1 ms from its truncated
run against 19.6-19.9 ms timed in the whole model (-9%; head -24%), and the ranks' micro-batch-2 rows
of ``bench_predict_cpu.py`` ran 15-35% above the truncated profile (docs/benchmarks.md, session 17).
``truncate=True`` keeps the short run for a CPU model too large to time whole."""


@contextlib.contextmanager
def _maybe_truncated(model: nn.Module, truncate: bool) -> Iterator[None]:
    from whalepy.passes.truncate import plan_truncation, truncated

    runs = plan_truncation(model)[0] if truncate else []
    with truncated(model, runs):
        yield


def _materialized(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of (the truncated) ``model`` on ``device``."""
    return copy.deepcopy(model).to(device)


def _time_optimizer(params: list[nn.Parameter], optimizer: Callable[[list], torch.optim.Optimizer],
                    sync: Callable[[], None], repeats: int) -> float:
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = optimizer(params)
    opt.step()  # states created
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        ts.append(time.perf_counter() - t0)
    for p in params:
        p.grad = None
    return statistics.median(ts)


def measure_costs(model: nn.Module, example_inputs: Any, profile: Any, *, device: str | torch.device | None = None,
                  precision: str = "fp32", micro_batches: Iterable[int] | None = None,
                  tp_degrees: Iterable[int] = (1,), repeats: int = 3, loss_fn: Callable | None = None,
                  optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
                  device_type: str | None = None, lowered: bool = True, compile: bool = False,
                  cpu_peers: int = 0, truncate: bool | None = None) -> MeasuredCosts:
    """Time ``model``'s distinct blocks on ``device`` (module docstring) and return the table.

    ``micro_batches``: sizes to time (default the example inputs' batch); ``tp_degrees``: TP degrees
    to time with sharded shapes (those no block divides by are skipped); ``device_type``: the catalog
    type the times are filed under (default the local device's). ``lowered``: also time the blocks as
    the runtime lowers them, under FSDP2 and DTensor tensor parallelism on a fake process group
    (``whalepy.runtime.measure_lowered``; the TP times then are those, and the wrappers' host work is
    recorded apart); not possible inside a ``torch.distributed`` job, which is said in the log.
    ``compile``: the lowered timings run with the blocks compiled as the runtime compiles them
    (``Plan.compile``), filed as :attr:`MeasuredCosts.compiled` and ``"<wrapper>/compiled"`` (the plain,
    eager times are measured as well). ``cpu_peers`` (CPU only): time everything beside this many other
    processes running the model, as the other ranks of a node of CPU ranks do (:func:`cpu_peers_running`).
    ``truncate``: time a run of identical blocks on its first members only (:mod:`whalepy.passes.truncate`);
    default on a GPU, not on the CPU, where a block's time depends on what its neighbours leave in the
    core's cache (:data:`TRUNCATE_ON_CPU`). Members of one signature timed apart are averaged.
    """
    from whalepy.frontend.measure_checks import check_measurable_model, check_measure_options
    from whalepy.frontend.trace import trace_memory

    dev = check_measure_options(device=device, precision=precision, micro_batches=micro_batches,
                                tp_degrees=tp_degrees, repeats=repeats, loss_fn=loss_fn, optimizer=optimizer,
                                lowered=lowered, compile=compile, device_type=device_type, cpu_peers=cpu_peers,
                                truncate=truncate)
    check_measurable_model(model)
    row, reported = local_device_type(dev)
    mbs = sorted({int(m) for m in (micro_batches or [_batch_of(example_inputs)])})
    loss_fn = loss_fn or default_loss
    optimizer = optimizer or _default_optimizer
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(dev.type, dtype=low)) if low is not None else contextlib.nullcontext
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sigs = {b.index: block_signature(profile, b) for b in profile.blocks}
    times: dict[str, dict[tuple[str, int, float], tuple[float, float]]] = {}
    updates: dict[str, float] = {}
    acts: dict[str, dict[str, float]] = {}
    saved: dict[str, dict[tuple[str, bool, float], float]] = {}
    names: dict[str, str] = {}
    optimizer_step: tuple[float, int] | None = None
    recompute_ratio: dict[str, dict[float, float]] = {}
    last = profile.blocks[-1].index
    peer_inputs = _resize(example_inputs, mbs[-1], torch.device("cpu")) if cpu_peers else None
    if truncate is None:
        truncate = dev.type != "cpu" or TRUNCATE_ON_CPU
    with cpu_peers_running(model, peer_inputs, cpu_peers), _maybe_truncated(model, truncate=truncate):
        present = dict(model.named_modules())
        blocks = {b.index: tuple(p for p in b.modules if p in present) for b in profile.blocks}
        blocks = {i: ps for i, ps in blocks.items() if ps}
        for tp in sorted(set(int(t) for t in tp_degrees)):
            from whalepy.ir.rules import tp_splits

            ruled = [b for b in profile.blocks if b.index in blocks and tp_splits(b, tp)]
            if tp > 1 and not ruled:
                import logging

                logging.getLogger("whalepy.measure").warning(
                    "whalepy measure: tp_degrees holds %d, but no block's tensor-parallel layers divide by it "
                    "(heads, features); it is not timed", tp)
                continue
            work = _materialized(model, dev)
            if tp > 1:
                localize_tp(work, [r for b in ruled for r in b.tp_rules], tp)
            work.train()
            clock = BlockClock(work, blocks, sync, dev)
            try:
                for mb in mbs:
                    inputs = _resize(example_inputs, mb, dev)
                    med = _timed_steps(work, inputs, clock, loss_fn, autocast, last, repeats)
                    for i in blocks:
                        b = profile.blocks[i]
                        if tp > 1 and not tp_splits(b, tp):
                            continue
                        times.setdefault(sigs[i], _MeanRow())[(precision, tp, float(mb))] = (
                            med.get((i, "f"), 0.0), med.get((i, "b"), 0.0))
                        names.setdefault(sigs[i], b.name)
                    if tp == 1:  # what each block saves for backward at this size (split by MeasuredCosts.saved_fit)
                        got = saved_per_block(work, inputs, blocks, loss_fn, autocast)
                        for i in blocks:
                            saved.setdefault(sigs[i], _MeanRow())[(precision, False, float(mb))] = float(got.get(i, 0))
            finally:
                clock.remove()
            if tp == 1:
                ratios = _recompute_ratios(model, work, blocks, example_inputs, mbs, dev=dev, precision=precision,
                                           times=times, sigs=sigs, loss_fn=loss_fn, autocast=autocast, sync=sync,
                                           repeats=repeats)
                if ratios:
                    recompute_ratio[precision] = ratios
                owned = block_parameters(work, blocks)
                for i in sorted(blocks):
                    if sigs[i] not in updates:
                        updates[sigs[i]] = _time_optimizer(owned[i], optimizer, sync, repeats)
                # the step as the runtime runs it: one optimizer over every block's parameters
                every = [p for i in sorted(blocks) for p in owned[i]]
                if every:
                    optimizer_step = (_time_optimizer(every, optimizer, sync, repeats), sum(p.numel() for p in every))
                inputs = _resize(example_inputs, mbs[-1], dev)
                with autocast():
                    trace = trace_memory(work, (inputs,) if isinstance(inputs, dict) else inputs,
                                         loss_fn=lambda out, _y, x=inputs: loss_fn(out, x),
                                         blocks={profile.blocks[i].name: paths for i, paths in blocks.items()}) \
                        if not isinstance(inputs, dict) else None
                if trace is not None:
                    for i in blocks:
                        name = profile.blocks[i].name
                        if name in trace.activation_bytes:
                            acts.setdefault(sigs[i], _MeanRow())[precision] = trace.activation_bytes[name] / mbs[-1]
            del work
        wrapped, wrapped_updates, compiled, tp_colls, units, saved_c = {}, {}, {}, {}, {}, {}
        if lowered:
            wrapped, wrapped_updates, compiled, tp_colls, units, saved_c = _measure_as_lowered(
                model, example_inputs, profile, blocks, sigs, times, dev=dev, precision=precision, mbs=mbs,
                tp_degrees=tp_degrees, repeats=repeats, loss_fn=loss_fn, optimizer=optimizer, compile=compile)
        if compile and not any(k[1] == 1 for rows in compiled.values() for k in rows):
            # the lowered timing could not run (said in the log): the compiled blocks timed here, whole
            alone, saved_c = _compiled_in_process(model, example_inputs, profile, blocks, sigs, dev=dev,
                                                  precision=precision, mbs=mbs, repeats=repeats, loss_fn=loss_fn,
                                                  autocast=autocast, sync=sync)
            compiled = {**compiled, **alone}
        for sig, rows in saved_c.items():
            saved.setdefault(sig, {}).update(rows)
    times, acts, saved = _plain_rows(times), _plain_rows(acts), _plain_rows(saved)
    wrapped, wrapped_updates, compiled = _plain_rows(wrapped), _plain_rows(wrapped_updates), _plain_rows(compiled)
    return MeasuredCosts(device_type=device_type or row.name, device_name=reported,
                         threads=torch.get_num_threads() if dev.type == "cpu" else None,
                         source=f"whalepy measure on {reported}, torch {torch.__version__}"
                                + (f", beside {cpu_peers} busy peer process(es)" if cpu_peers else ""),
                         optimizer=_optimizer_name(optimizer), times=times, updates=updates,
                         activation_bytes=acts, names=names, wrapped=wrapped, wrapped_updates=wrapped_updates,
                         compiled=compiled, tp_collectives=tp_colls, fsdp_units=units,
                         optimizer_step=optimizer_step, saved=saved, recompute_ratio=recompute_ratio)


def _recompute_ratios(model: nn.Module, work: nn.Module, blocks: dict[int, tuple[str, ...]], example_inputs: Any,
                      mbs: list[int], *, dev: torch.device, precision: str, times: dict, sigs: dict[int, str],
                      loss_fn: Callable, autocast: Any, sync: Callable[[], None], repeats: int) -> dict[float, float]:
    """``micro_batch -> ratio``: the seconds a step with every block checkpointed takes beyond the plain
    step, per second of the blocks' measured forward (:attr:`MeasuredCosts.recompute_ratio`). The blocks
    are checkpointed as the runtime checkpoints them (``torch.distributed._composable.checkpoint``,
    non-reentrant: ``whalepy.runtime._activations``) on a copy; the two models' steps are timed in
    alternation, ``max(repeats, 3)`` each after two warm-up steps, medians. A size whose forward is not
    measured, or whose checkpointed step is not slower, gets no ratio."""
    from torch.distributed._composable import checkpoint

    ck = _materialized(model, dev)
    named = dict(ck.named_modules())
    for paths in blocks.values():
        for path in paths:
            if path in named:
                checkpoint(named[path], use_reentrant=False)
    ck.train()
    out: dict[float, float] = {}
    for mb in mbs:
        fwd = sum(times.get(sigs[i], {}).get((precision, 1, float(mb)), (0.0, 0.0))[0] for i in blocks)
        if fwd <= 0:
            continue
        inputs = _resize(example_inputs, mb, dev)
        for _ in range(2):
            _plain_step(work, inputs, loss_fn, autocast, sync)
            _plain_step(ck, inputs, loss_fn, autocast, sync)
        plain, checked = [], []
        for _ in range(max(repeats, 3)):
            plain.append(_plain_step(work, inputs, loss_fn, autocast, sync))
            checked.append(_plain_step(ck, inputs, loss_fn, autocast, sync))
        extra = statistics.median(checked) - statistics.median(plain)
        if extra > 0:
            out[float(mb)] = extra / fwd
    del ck
    return out


def block_parameters(root: nn.Module, blocks: dict[int, tuple[str, ...]]) -> dict[int, list[nn.Parameter]]:
    """``block index -> the trainable parameters it owns`` under ``root``: a parameter two blocks hold (a
    tied embedding and LM head) belongs to the first of them in block order only, so that an optimizer
    timed per block, or over all of them, steps it once, as the runtime's one optimizer does."""
    named = dict(root.named_modules())
    seen: set[int] = set()
    out: dict[int, list[nn.Parameter]] = {}
    for i in sorted(blocks):
        own = []
        for path in blocks[i]:
            for p in (named[path].parameters() if path in named else ()):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    own.append(p)
        out[i] = own
    return out


def _compiled_in_process(model: nn.Module, example_inputs: Any, profile: Any, blocks: dict[int, tuple[str, ...]],
                         sigs: dict[int, str], *, dev: torch.device, precision: str, mbs: list[int], repeats: int,
                         loss_fn: Callable, autocast: Any, sync: Callable[[], None]) -> tuple[dict, dict]:
    """``sig -> (precision, 1, micro_batch) -> (forward_s, backward_s)`` of the blocks compiled as the
    runtime compiles them (``runtime.compile_blocks``), timed in this process without the runtime's
    wrappers: what stands in when the lowered timing could not run; and ``sig -> (precision, True,
    micro_batch) -> bytes`` they save for backward (:func:`saved_per_block`). Each micro-batch size is
    compiled on its own (static shapes, as the runtime's one size is). Empty if the compiler fails here."""
    import logging

    import torch._dynamo

    from whalepy.ir.extensions import block_compiler

    compile_blocks = block_compiler()
    out: dict[str, dict] = {}
    saved: dict[str, dict] = {}
    if compile_blocks is None:
        return out, saved
    last = profile.blocks[-1].index
    work = _materialized(model, dev)
    work.train()
    named = dict(work.named_modules())
    stats = compile_blocks([(profile.blocks[i].name, [named[p] for p in paths if p in named])
                            for i, paths in sorted(blocks.items())])
    clock = BlockClock(work, blocks, sync, dev)
    try:
        for mb in mbs:
            torch._dynamo.reset()
            inputs = _resize(example_inputs, mb, dev)
            med = _timed_steps(work, inputs, clock, loss_fn, autocast, last, repeats)
            kept = saved_per_block(work, inputs, blocks, loss_fn, autocast)
            for i in blocks:
                out.setdefault(sigs[i], _MeanRow())[(precision, 1, float(mb))] = (med.get((i, "f"), 0.0), med.get((i, "b"), 0.0))
                saved.setdefault(sigs[i], _MeanRow())[(precision, True, float(mb))] = float(kept.get(i, 0))
    except Exception as e:  # noqa: BLE001 - then the eager times stand in (the planner says so)
        logging.getLogger("whalepy.measure").warning("whalepy measure: the compiled blocks could not be timed "
                                                     "(%s: %s)", type(e).__name__, str(e).splitlines()[0][:200])
        return {}, {}
    finally:
        clock.remove()
    if stats.fell_back:
        logging.getLogger("whalepy.measure").warning("whalepy measure: %d block(s) ran eagerly when timed compiled "
                                                     "(torch.compile failed: the runtime falls back the same way)",
                                                     len(stats.fell_back))
    return out, saved


def _measure_as_lowered(model: nn.Module, example_inputs: Any, profile: Any, blocks: dict[int, tuple[str, ...]],
                        sigs: dict[int, str], times: dict, *, dev: torch.device, precision: str, mbs: list[int],
                        tp_degrees: Iterable[int], repeats: int, loss_fn: Callable, optimizer: Callable,
                        compile: bool = False) -> tuple[dict, dict, dict, dict, dict, dict]:
    """The blocks as the runtime lowers them (``whalepy.runtime.measure_lowered``): FSDP2 wrappers'
    times and DTensor optimizer steps recorded apart, TP times replacing the sharded-shape ones (with
    ``compile``: the compiled blocks' times in a table of their own, the third returned) and the TP
    collectives each block issues (the fourth), its FSDP2 units (the fifth) and (with ``compile``) the
    bytes the compiled blocks save for backward (the sixth, ``MeasuredCosts.saved``'s rows). Inside a
    ``torch.distributed`` job this runs in another process (:func:`_lowered_in_subprocess`)."""
    import torch.distributed as dist

    from whalepy.ir.extensions import lowered_measure

    fn = lowered_measure()
    if fn is None or isinstance(example_inputs, dict):
        return {}, {}, {}, {}, {}, {}
    from whalepy.ir.rules import tp_splits

    names = {profile.blocks[i].name: paths for i, paths in sorted(blocks.items())}
    sig_of = {profile.blocks[i].name: sigs[i] for i in blocks}
    rules = [r for i in sorted(blocks) for r in profile.blocks[i].tp_rules]
    work = _materialized(model, dev)  # the caller holds the model truncated
    job = dict(names=names, rules=rules, device=str(dev), precision=precision, mbs=list(mbs),
               tp_degrees=[int(t) for t in tp_degrees], repeats=repeats, loss_fn=loss_fn, optimizer=optimizer,
               compile=compile)
    if dist.is_initialized():  # FSDP2 and DTensor need a fake process group of their own: another process
        got = _lowered_in_subprocess(work, _resize(example_inputs, mbs[-1], torch.device("cpu")), job)
    else:
        got = _run_lowered(work, _resize(example_inputs, mbs[-1], dev), **job)
    if not got:
        return {}, {}, {}, {}, {}, {}
    wrapped: dict[str, dict] = {}
    for (wrapper, mb), row in got["wrapped"].items():
        for name, t in row.items():
            wrapped.setdefault(sig_of[name], _MeanRow())[(precision, f"{wrapper}/compiled" if compile else wrapper,
                                                  float(mb))] = t
    by_name = {b.name: b for b in profile.blocks}
    compiled: dict[str, dict] = {}
    lowered_tp: dict[str, dict] = {}  # the members' mean, then replacing the sharded-shape rows (not averaged in)
    for (tp, mb), row in got["tp"].items():
        for name, t in row.items():
            if tp_splits(by_name[name], tp):
                lowered_tp.setdefault(sig_of[name], _MeanRow())[(precision, tp, float(mb))] = t
    target = compiled if compile else times
    for sig, row in lowered_tp.items():
        merged = _MeanRow()
        dict.update(merged, {**target.get(sig, {}), **row})  # as assigned once: later rows average among themselves
        target[sig] = merged
    for mb, row in got["plain"].items():
        for name, t in row.items():
            compiled.setdefault(sig_of[name], _MeanRow())[(precision, 1, float(mb))] = t
    ups: dict[str, dict] = {}
    for key, row in got["updates"].items():
        for name, t in row.items():
            ups.setdefault(sig_of[name], _MeanRow())[key] = t
    tpc: dict[str, dict] = {}
    for tp, per_block in got.get("tp_collectives", {}).items():
        for name, phases in per_block.items():
            if name in sig_of and tp_splits(by_name[name], tp):
                tpc.setdefault(sig_of[name], {})[int(tp)] = phases
    units = {sig_of[n]: u for n, u in got.get("fsdp_units", {}).items() if n in sig_of and u > 0}
    saved: dict[str, dict] = {}
    for mb, row in got.get("saved", {}).items():
        for name, n in row.items():
            saved.setdefault(sig_of[name], _MeanRow())[(precision, True, float(mb))] = float(n)
    return wrapped, ups, compiled, tpc, units, saved


def _run_lowered(work: nn.Module, inputs: tuple, *, names: dict[str, tuple[str, ...]], rules: list, device: str,
                 precision: str, mbs: list[int], tp_degrees: list[int], repeats: int, loss_fn: Callable | None,
                 optimizer: Callable | None, compile: bool) -> dict | None:
    """``whalepy.runtime.measure_lowered`` on ``work`` (the truncated model on ``device``) with this module's
    block timing: warm-up until a step settles, then the median of ``repeats`` steps."""
    from whalepy.ir.extensions import lowered_measure

    fn = lowered_measure()
    if fn is None:
        return None
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    loss_fn = loss_fn or default_loss
    optimizer = optimizer or _default_optimizer

    def time_step(root: nn.Module, mb: int, by_index: dict[int, tuple[str, ...]], loss: Callable,
                  ctx: Any) -> dict[tuple[int, str], float]:
        x = _resize(inputs, mb, dev)
        last = max(by_index)
        clock = BlockClock(root, by_index, sync, dev)
        try:
            return _timed_steps(root, x, clock, loss, ctx, last, repeats)
        finally:
            clock.remove()

    def time_opt(params: list, opt: Callable) -> float:
        return _time_optimizer(params, opt, sync, repeats)

    def count_saved(root: nn.Module, mb: int, by_index: dict[int, tuple[str, ...]], loss: Callable,
                    ctx: Any) -> dict[int, int]:
        return saved_per_block(root, _resize(inputs, mb, dev), by_index, loss, ctx)

    return fn(work, _resize(inputs, mbs[-1], dev), names, device=dev, precision=precision, micro_batches=mbs,
              tp_rules=rules, tp_degrees=tp_degrees, repeats=repeats, loss_fn=loss_fn, optimizer=optimizer,
              time_step=time_step, time_optimizer=time_opt, compile=compile, count_saved=count_saved)


def _default_optimizer(params: list) -> torch.optim.Optimizer:
    """The optimizer measured when none is given: ``AdamW`` as torch builds it."""
    return torch.optim.AdamW(params)


def _lowered_in_subprocess(work: nn.Module, inputs: tuple, job: dict) -> dict | None:
    """:func:`_run_lowered` in a fresh Python process (``python -m whalepy.frontend.measure IN OUT``):
    inside a ``torch.distributed`` job this process's default group is the job's, and FSDP2 and DTensor
    need a fake one of their own. The model and the job travel by ``torch.save`` (the model's classes must
    be importable there: a class defined in the launching script is not); what cannot travel or fails
    there is said in the log and the wrappers are modelled."""
    import logging
    import subprocess
    import sys
    import tempfile

    from whalepy.files import atomic_path

    log = logging.getLogger("whalepy.measure")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    job = dict(job, optimizer=portable_optimizer(job["optimizer"]))
    with tempfile.TemporaryDirectory(prefix="whalepy-measure-") as tmp:
        src, dst = os.path.join(tmp, "job.pt"), os.path.join(tmp, "out.pt")
        try:
            with atomic_path(src, what="measurement job") as tmp_src:
                torch.save({"model": work.cpu(), "inputs": inputs, "job": job}, tmp_src)
        except Exception as e:  # noqa: BLE001 - a lambda or a local class does not pickle
            log.warning("whalepy measure: the blocks are not timed as lowered (inside a torch.distributed job "
                        "they are timed in another process, and the model or its loss / optimizer does not "
                        "pickle: %s); the wrappers' host work is modelled", str(e).splitlines()[0][:200])
            return None
        done = subprocess.run([sys.executable, "-m", "whalepy.frontend.measure", src, dst], env=env,
                              capture_output=True, text=True)
        for line in (done.stderr or "").splitlines():  # what the lowered timing said there (a wrapper that
            if line.startswith("whalepy measure:"):      # could not be measured) is said here too
                log.warning("%s", line)
        if done.returncode != 0 or not os.path.exists(dst):
            tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
            log.warning("whalepy measure: timing the blocks as lowered in another process failed (%s); the "
                        "wrappers' host work is modelled", tail[0][:300])
            return None
        return torch.load(dst, weights_only=False)


def portable_optimizer(factory: Callable | None) -> Callable | None:
    """``factory`` if it pickles, else one that does and builds the same optimizer: its class and the
    hyper-parameters it was built with (``defaults``, those its constructor takes). A factory written as
    a lambda or a local function (the usual way to pass one) cannot travel to another process as is."""
    import functools
    import inspect
    import pickle

    if factory is None:
        return None
    try:
        pickle.dumps(factory)
        return factory
    except Exception:  # noqa: BLE001 - a lambda or a local function: rebuilt below
        pass
    probe = factory([nn.Parameter(torch.zeros(1))])
    cls = type(probe)
    try:
        takes = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        takes = {}
    kwargs = {k: v for k, v in probe.defaults.items() if k in takes}
    return functools.partial(cls, **kwargs)


def _child_main(src: str, dst: str) -> None:
    """``python -m whalepy.frontend.measure IN OUT``: :func:`_run_lowered` of a saved job."""
    from whalepy.files import atomic_path

    import logging

    handler = logging.StreamHandler()  # the parent relays these lines (its log, not this process's, is seen)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("whalepy.measure").addHandler(handler)
    spec = torch.load(src, weights_only=False)
    job = spec["job"]
    got = _run_lowered(spec["model"].to(torch.device(job["device"])), spec["inputs"], **job)
    with atomic_path(dst, inputs=(src,), what="measurement result") as tmp:
        torch.save(got, tmp)


def _optimizer_name(optimizer: Callable) -> str:
    try:
        opt = optimizer([nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - a name for people only
        return "custom"
    d = opt.defaults
    kind = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default (for-each on CUDA, per-tensor on CPU)"
    return f"{type(opt).__name__} {kind}"


def apply_measured_activations(profile: Any, measured: MeasuredCosts, precision: str, *, compiled: bool = False) -> Any:
    """``profile`` with the activation bytes of blocks whose signature was measured replaced by the
    measurement (bytes per sample x the profile's batch, rescaled from the measured precision to the
    profile's dtype as :func:`whalepy.frontend.trace.apply_memory_trace` does).

    The bytes per sample are :meth:`MeasuredCosts.saved_fit`'s (``compiled``: the compiled blocks', where
    they were measured; the plan compiles them): the part of what a block saves that does not grow with
    the micro-batch (autocast's 16-bit weight copies) is left out here, and the planner charges it per
    parameter (``CostContext.autocast_copy_bytes``) where the runtime keeps it. A table without
    :attr:`MeasuredCosts.saved` (written before) gives its ``activation_bytes``, copies included."""
    from whalepy.cost_models.compute import precision_bytes

    scale = (torch.finfo(getattr(torch, profile.dtype)).bits // 8) / precision_bytes(precision)
    blocks = []
    for b in profile.blocks:
        sig = block_signature(profile, b)
        fit = (measured.saved_fit(sig, precision, compiled=True) if compiled else None) \
            or measured.saved_fit(sig, precision)
        per = fit[1] if fit is not None else measured.activation_bytes.get(sig, {}).get(precision)
        blocks.append(b if per is None else replace(b, activation_bytes=int(round(per * profile.batch_size * scale))))
    return replace(profile, blocks=tuple(blocks))


def micro_batch_sizes(global_batch: int, max_size: int | None = None) -> tuple[int, ...]:
    """The micro-batch sizes :func:`whalepy.plan` times by default: powers of two up to the global
    batch (or ``max_size``) and the global batch itself; sizes between are interpolated."""
    top = min(global_batch, max_size or global_batch)
    out = {1 << k for k in range(int(math.log2(top)) + 1)} | {top}
    return tuple(sorted(out))


def local_device_type(device: torch.device) -> tuple[Any, str]:
    """The catalog row of ``device`` (a CUDA GPU by its reported name, else the ``CPU`` type) and the
    name it reports."""
    from whalepy.cost_models.devices import CATALOG, match_device_name

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        row = match_device_name(name, torch.cuda.get_device_properties(device).total_memory)
        if row is None:
            raise WhalepyError(f"GPU {name!r} is not in the device catalog; add it under 'devices:' in the "
                               "cluster spec first, then calibrate")
        return row, name
    return CATALOG["CPU"], f"CPU ({os.cpu_count()} threads)"


if __name__ == "__main__":
    import sys

    _child_main(sys.argv[1], sys.argv[2])
