"""A training job from a dataset on disk: each rank reads only its share, a cosine LR schedule, periodic
checkpoints (the last 2 kept), metrics to a JSONL file, and a restart that resumes where the last
checkpoint left it. On CPU with gloo:

    torchrun --nproc-per-node 2 examples/train_from_disk.py --out run --steps 6
    torchrun --nproc-per-node 2 examples/train_from_disk.py --out run --steps 9   # resumes at step 6

The first run writes ``run/tokens.pt`` (random token ids standing in for a tokenised corpus; rank 0
writes it once), memory-maps it, and reads training windows of it through ``pm.batch_sampler``: a
replica's loader fetches its own rows of each global batch, nothing else. Every ``--every`` steps it
saves ``run/ckpt/step-<n>`` (model, optimizer, step, LR schedule, RNG states and the loader's
position); a second run with the same ``--out`` resumes from the newest one, so a job killed at any
point loses at most ``--every`` steps. The metrics of every logged step go to ``run/metrics.jsonl``.
Any number of processes works (``ClusterSpec.local(WORLD_SIZE)``; the planner picks the layout).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig
from whalepy.runtime import Checkpointer, JsonlSink

CFG = GPTConfig(vocab_size=128, block_size=32, num_layers=2, num_heads=4, hidden_size=64)
NUM_TOKENS = 64 * 33 + 1
"""Corpus size: 64 training windows of ``block_size + 1`` tokens (8 global batches of 8: an epoch)."""


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens of a 1-D token file: (inputs, next tokens)."""

    def __init__(self, path: Path, block_size: int) -> None:
        self.tokens = torch.load(path, mmap=True)  # memory-mapped: only the windows read are paged in
        self.block = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // (self.block + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * (self.block + 1):(i + 1) * (self.block + 1)].long()
        return w[:-1], w[1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def warmup_cosine(total: int, warmup: int = 2):
    """LR factor: linear warm-up, then a cosine decay to 10% (a factory of LambdaLR schedules)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(t, 1.0)))

    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("run"), help="dataset, checkpoints and metrics go here")
    ap.add_argument("--steps", type=int, default=6, help="train until this many steps in total")
    ap.add_argument("--every", type=int, default=3, help="save a checkpoint every this many steps")
    ap.add_argument("--keep", type=int, default=2, help="keep this many newest checkpoints")
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples per step, all ranks)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = GPT(CFG)
    example = torch.zeros(2, CFG.block_size, dtype=torch.long)
    pm = whalepy.parallelize(model, whalepy.ClusterSpec.local(world), example_inputs=(example,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                             lr_scheduler=warmup_cosine(args.steps), global_batch=args.batch,
                             max_grad_norm=1.0, log_every=1, total_steps=args.steps,
                             metrics=[JsonlSink(args.out / "metrics.jsonl")])
    if not hasattr(pm, "meshes"):
        return  # not launched: parallelize printed how to launch

    corpus = args.out / "tokens.pt"
    if dist.get_rank() == 0 and not corpus.exists():
        args.out.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(1)
        torch.save(torch.randint(0, CFG.vocab_size, (NUM_TOKENS,), generator=g, dtype=torch.int16), corpus)
    dist.barrier()  # the file exists before any rank opens it
    data = TokenWindows(corpus, CFG.block_size)
    sampler = pm.batch_sampler(data, seed=0)  # this replica's rows of each global batch, shuffled per epoch
    # num_workers=0: the sampler's position is what the loop consumed, so it is the loader's state
    # (with workers, use torchdata's StatefulDataLoader and pass it as the loader instead)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    ckpt = Checkpointer(pm, args.out / "ckpt", every=args.every, keep=args.keep, loader=sampler)
    start = ckpt.resume()  # 0 on the first run
    share = pm.local_share
    step = start
    while step < args.steps:
        for x, y in loader:  # one epoch from the sampler's position
            pm.train_step(x if share.needs_inputs else None, y if share.needs_targets else None)
            step += 1
            ckpt.step()
            if step == args.steps:
                break  # before the loader fetches a batch this run will not train
    ckpt.close()
    if dist.get_rank() == 0:
        print(f"trained steps {start + 1}..{args.steps}; checkpoints: "
              f"{sorted(p.name for p in (args.out / 'ckpt').iterdir())}")
    pm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
