"""A training script with one user mistake, launched by tests/test_bad_inputs_launch.py under torchrun.

``python -m torch.distributed.run --nproc-per-node 2 tests/bad_launch_script.py CASE``; CASE is
``nonscalar_loss`` (every rank's loss_fn returns a vector), ``one_rank_batch`` (rank 1 passes a batch of
the wrong size while rank 0 trains normally, so rank 0 waits in a collective for it) or ``ok`` (no mistake).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig


def main(case: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, num_layers=2, num_heads=2, hidden_size=16))
    cluster = whalepy.ClusterSpec.local(2)
    tokens = torch.zeros(1, 8, dtype=torch.long)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return loss if case == "nonscalar_loss" else loss.mean()

    est = whalepy.estimate(model, cluster, whalepy.ParallelConfig(dp=2), example_inputs=(tokens,), global_batch=4)
    pm = whalepy.parallelize(model, cluster, example_inputs=(tokens,), loss_fn=loss_fn,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), global_batch=4, plan=est.plan)
    batch = torch.randint(0, 32, (4, 8))
    if case == "one_rank_batch" and dist.get_rank() == 1:
        batch = batch[:3]
    for _ in range(2):
        pm.train_step(batch, batch)
    if dist.get_rank() == 0:
        print("whalepy-test: trained", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
