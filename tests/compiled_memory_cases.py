"""A small GPT planned with measure=True, compile=True in bf16, and the peak its compiled run holds
(tests/test_memory_compiled.py; benchmarks/ figures in docs/benchmarks.md use the same functions).

The compiled run's peak is read from the CPU allocator (``torch.profiler`` with ``profile_memory``: every
allocation and free of one ``train_step``, summed in time order) on top of the storages alive before the
step (parameters, optimizer states, inputs): ``whalepy.trace_memory`` cannot measure a compiled run, as
``torch.compile`` runs its code eagerly under the ``TorchDispatchMode`` that trace follows storages with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, BATCH = 1024, 64, 64, 2, 4, 4


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build() -> tuple[torch.nn.Module, torch.Tensor]:
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, num_layers=LAYERS, num_heads=HEADS, hidden_size=HIDDEN))
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, x


def _storages(tensors) -> int:  # type: ignore[no-untyped-def]
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = getattr(t, "_local_tensor", t).untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def allocator_peak(pm, inputs: tuple, targets: torch.Tensor) -> int:  # type: ignore[no-untyped-def]
    """Peak bytes of one ``pm.train_step`` on the CPU: the storages alive before it plus the largest sum
    of the allocator's allocations less its frees during it (``torch.profiler``'s memory events)."""
    from torch.profiler import ProfilerActivity, profile

    roots = pm.module if isinstance(pm.module, list) else [pm.module]
    params = [p for r in roots for p in r.parameters()]
    opt = getattr(pm.optimizer, "optim", pm.optimizer)
    states = [v for s in opt.state.values() for v in s.values()] if opt is not None else []
    before = _storages([*params, *[p.grad for p in params if p.grad is not None], *states, *inputs, targets])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pm.train_step(inputs, targets)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return before + peak


def run_plan(plan, backend: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(predicted peak, the run's allocator peak) of ``plan`` (compiled with ``backend`` where it compiles)
    on this rank (one process)."""
    import whalepy
    from whalepy.runtime import compile_blocks

    compile_blocks.BACKEND = backend
    model, x = build()
    pm = whalepy.parallelize(model, whalepy.ClusterSpec.local(1), plan=plan, example_inputs=(x,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=BATCH)
    for _ in range(2):  # compiled, and the optimizer's states made, as in every later step
        pm.train_step((x,), x)
    peak = allocator_peak(pm, (x,), x)
    pm.close()
    return float(plan.stages[0].cost.memory_bytes), float(peak)
