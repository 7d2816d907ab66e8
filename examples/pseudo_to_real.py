"""Pseudo-to-Real training (M6-10T) on CPU: a small GPT whose 6 layers share one set of weights trains
for a while, is delinked into the real 6-layer model (each layer its own copy of the shared weights and
optimizer state), re-planned, and trains on. Two gloo processes, spawned here (no torchrun needed);
the planner picks the layout of each phase for a 2-device CPU "cluster".

    python examples/pseudo_to_real.py [--pseudo-steps 40] [--real-steps 40]

The task is learnable (each sequence is an arithmetic progression modulo the vocabulary: the next
token follows from the previous two), so the loss curve shows both phases learning and runs on across
the switch without a jump: the real model starts from the pseudo model's weights and optimizer state.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import tempfile

import torch
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=32, num_layers=6, num_heads=4, hidden_size=64)
BATCH = 16
WORLD = 2


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences ``a, a+b, a+2b, ...`` modulo the vocabulary (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    a = torch.randint(0, CFG.vocab_size, (BATCH, 1), generator=g)
    b = torch.randint(1, 8, (BATCH, 1), generator=g)
    seq = (a + b * torch.arange(CFG.block_size + 1)) % CFG.vocab_size
    return seq[:, :-1], seq[:, 1:]


def layout(plan: whalepy.Plan) -> str:
    return (f"pp={plan.pp_degree} dp={plan.dp_degree} tp={plan.stages[0].tp_degree} "
            f"ZeRO-{int(plan.stages[0].zero_stage)}")


def worker(rank: int, store: str, pseudo_steps: int, real_steps: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)
    model = whalepy.pseudo_to_real(GPT(CFG), layers="transformer.h")
    cluster = whalepy.ClusterSpec.local(WORLD)
    example = (torch.zeros(2, CFG.block_size, dtype=torch.long),)
    # ZeRO-1 as ZeroRedundancyOptimizer cannot be checkpointed, so delink could not hand it over
    no_zero1 = {"zero_stages": (0, 2, 3)}
    pm = whalepy.parallelize(model, cluster, example_inputs=example, loss_fn=loss_fn,
                             optimizer=optimizer, global_batch=BATCH, **no_zero1)
    params = sum(p.numel() for p in model.parameters())
    say(f"pseudo model: {params:,} parameters ({CFG.num_layers} layers sharing one set), "
        f"plan {layout(pm.plan)}")
    say(f"{'step':>5}  {'phase':<7} {'loss':>8}")
    for step in range(pseudo_steps):
        loss = pm.train_step(*batch(step)).item()
        say(f"{step:>5}  {'pseudo':<7} {loss:>8.4f}")
    real = whalepy.delink(pm, **no_zero1)  # re-planned for the real model; its plan may differ
    params = sum(p.numel() for p in GPT(CFG).parameters())
    say(f"--- delinked: real model {params:,} parameters, plan {layout(real.plan)} ---")
    for step in range(pseudo_steps, pseudo_steps + real_steps):
        loss = real.train_step(*batch(step)).item()
        say(f"{step:>5}  {'real':<7} {loss:>8.4f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pseudo-steps", type=int, default=40)
    parser.add_argument("--real-steps", type=int, default=40)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "store"), args.pseudo_steps,
                                                   args.real_steps)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit("pseudo_to_real: a worker process failed (see its traceback above)")


if __name__ == "__main__":
    main()
