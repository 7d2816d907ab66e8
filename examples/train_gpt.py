"""Train the small GPT of ``whalepy.models`` with a whalepy plan on 4 CPU processes.

    torchrun --nproc-per-node 4 examples/train_gpt.py          # or: whalepy run -n 4 examples/train_gpt.py
    torchrun --nproc-per-node 4 examples/train_gpt.py --layout pp2xdp2

Without ``--layout`` the planner chooses (``whalepy.plan``); a layout fixes the degrees by hand:
``whalepy.estimate`` costs that configuration and returns it as a plan (blocks and tensor-parallel rules
from the model's profile). Every rank builds the same model and feeds the same global batch; whalepy
gives each replica its share.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig

LAYOUTS = {"dp4": dict(dp=4), "dp2xtp2": dict(dp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2, num_microbatches=2),
           "tp2xpp2": dict(tp=2, pp=2, num_microbatches=2, dp=1)}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    cfg = GPTConfig(vocab_size=128, block_size=32, num_layers=4, num_heads=4, hidden_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    example = torch.zeros(2, cfg.block_size, dtype=torch.long)
    cluster = whalepy.ClusterSpec.local(4)
    plan = None
    if args.layout:
        plan = whalepy.estimate(model, cluster, LAYOUTS[args.layout], example_inputs=(example,),
                                global_batch=args.batch).plan
    pm = whalepy.parallelize(model, cluster, example_inputs=(example,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=args.batch,
                             plan=plan, max_grad_norm=1.0, log_every=1)
    if not hasattr(pm, "meshes"):
        return  # not launched: parallelize printed how to launch
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):  # each step logs itself on rank 0 (log_every=1)
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)
        pm.train_step(x, torch.roll(x, -1, dims=1))
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)
    val = pm.evaluate(x, torch.roll(x, -1, dims=1))  # forward only, no update
    if dist.get_rank() == 0:
        print(f"held-out loss {val.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
