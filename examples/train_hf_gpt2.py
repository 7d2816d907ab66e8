"""Train an unmodified HuggingFace ``GPT2LMHeadModel`` (small config) with whalepy.

    torchrun --nproc-per-node 4 examples/train_hf_gpt2.py            # DP x TP 2 x 2
    torchrun --nproc-per-node 4 examples/train_hf_gpt2.py --layout pp2xdp2

The model code is HF's own, tied embeddings included. The layout's degrees are fixed by hand and
``whalepy.estimate`` turns them into a plan, with the blocks and tensor-parallel rules that the front
end finds in the model's FX graph (GPT-2's ``Conv1D`` projections and fused ``c_attn`` included; see
docs/runtime.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import whalepy

LAYOUTS = {"dp2xtp2": dict(dp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2, num_microbatches=2),
           "dp4zero3": dict(dp=4, zero_stage=3)}


def loss_fn(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2xtp2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=4, n_head=4, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    example = torch.zeros(2, 32, dtype=torch.long)
    cluster = whalepy.ClusterSpec.local(4)
    plan = whalepy.estimate(model, cluster, LAYOUTS[args.layout], example_inputs=(example,),
                            global_batch=args.batch).plan
    pm = whalepy.parallelize(model, cluster, example_inputs=(example,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=args.batch,
                             plan=plan)
    if not hasattr(pm, "meshes"):
        return
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, 32), generator=g)
        loss = pm.train_step(x, torch.roll(x, -1, dims=1))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
