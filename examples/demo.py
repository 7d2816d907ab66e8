"""whalepy in one minute: plan a small GPT for 4 A100-80GB GPUs, print the plan, train it on 4 CPU
processes standing in for them (gloo; spawned here, no torchrun needed) and compare each step's loss with
one process.

    python examples/demo.py

Why A100s on a CPU machine: the cluster spec (``ClusterSpec.local(4, device_type="A100-80GB")``) says
what to plan FOR, so the plan is costed with A100 numbers and trains in their precision, bf16; the
ranks are simulated (run on this machine's CPU, where bf16 autocast works), so the numerics can be
checked anywhere. The one-process reference trains in fp32, so the losses agree to bf16 rounding.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

from whalepy.models import GPT, GPTConfig

STEPS = 4
BATCH = 8
CFG = GPTConfig(vocab_size=128, block_size=32, num_layers=4, num_heads=4, hidden_size=64)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def cluster():
    from whalepy import ClusterSpec

    return ClusterSpec.local(4, device_type="A100-80GB")  # 4 simulated A100s, run on CPU with gloo


def make_demo_plan():
    """``(plan, profile)``: the profile is made once here and shipped to the workers (the graph left
    out), so they need not trace the model again."""
    import dataclasses

    import whalepy

    example = (torch.zeros(2, CFG.block_size, dtype=torch.long),)
    prof = whalepy.profile(build_model(), example)
    plan = whalepy.plan_from_profile(prof, cluster(), global_batch=BATCH)
    return plan, dataclasses.replace(prof, graph=None)


def worker(rank: int, world: int, store: str, plan, prof, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from whalepy import parallelize

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    pm = parallelize(build_model(), cluster(), example_inputs=(torch.zeros(2, CFG.block_size,
                     dtype=torch.long),), loss_fn=loss_fn, optimizer=optimizer, global_batch=BATCH,
                     plan=plan, profile=prof)
    losses = [pm.train_step(x, y).item() for x, y in data()]
    if rank == 0:
        results.put(losses)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    plan, prof = make_demo_plan()
    print(f"planning for {plan.world_size} x A100-80GB (simulated: the ranks run on this machine's CPU with "
          f"gloo), so the plan is costed as A100s and trains in {plan.precision.value}; the 1-process "
          "reference trains in fp32")
    print(plan)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, plan.world_size, os.path.join(tmp, "store"), plan,
                                                   prof, results)) for r in range(plan.world_size)]
        for p in procs:
            p.start()
        model = build_model()
        opt = optimizer(model.parameters())
        reference = []
        for x, y in data():
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            reference.append(loss.item())
        import queue
        import time

        deadline = time.monotonic() + 300
        while True:
            try:
                losses = results.get(timeout=1.0)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise SystemExit("demo: a worker process failed (see its traceback above)")
        for p in procs:
            p.join()
    print(f"{'step':>4}  {'whalepy (%d procs)' % plan.world_size:>20}  {'1 process':>10}")
    for i, (a, b) in enumerate(zip(losses, reference)):
        print(f"{i:>4}  {a:>20.6f}  {b:>10.6f}")


if __name__ == "__main__":
    main()
