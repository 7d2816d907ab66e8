"""Overhead of whalepy's lowering against the same layout written by hand with the same PyTorch APIs.

DP x TP 2 x 2 on 4 CPU processes (gloo): the hand-written version is ``parallelize_module`` with
Colwise/Rowwise styles on the same modules, ``fully_shard`` per block and root over the ``dp`` axis
(reshard_after_forward=False, what whalepy lowers ZeRO-0 to under TP), AdamW, a plain step. Both models
live in the same processes and their steps alternate, so machine noise hits both alike; the report is
the median step time of each and their ratio (target <= 1.05).

    python benchmarks/bench_runtime_overhead.py [--steps 30] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def hand_written(model, mesh, num_layers):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
              "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(num_layers):
        p = f"transformer.h.{i}"
        styles.update({f"{p}.attn.q_proj": ColwiseParallel(), f"{p}.attn.k_proj": ColwiseParallel(),
                       f"{p}.attn.v_proj": ColwiseParallel(), f"{p}.attn.o_proj": RowwiseParallel(),
                       f"{p}.mlp.fc_in": ColwiseParallel(), f"{p}.mlp.fc_out": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], styles)
    names = (["transformer.wte", "transformer.wpe"] + [f"transformer.h.{i}" for i in range(num_layers)]
             + ["transformer.ln_f", "lm_head"])
    for n in names:
        fully_shard(model.get_submodule(n), mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def worker(rank, world, store, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from train_gpt import tp_rules

    from whalepy.models import GPT, GPTConfig
    from whalepy.runtime import make_plan, parallelize

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = GPTConfig(vocab_size=512, block_size=args.seq, num_layers=args.layers, num_heads=8,
                    hidden_size=args.hidden)
    names = (["transformer.wte", "transformer.wpe"] + [f"transformer.h.{i}" for i in range(cfg.num_layers)]
             + ["transformer.ln_f", "lm_head"])
    plan = make_plan(names, dp=2, tp=2, global_batch=args.batch, tensor_parallel=tp_rules(cfg.num_layers))
    torch.manual_seed(0)
    pm = parallelize(GPT(cfg), None, example_inputs=(torch.zeros(2, args.seq, dtype=torch.long),),
                     loss_fn=loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                     global_batch=args.batch, plan=plan)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, opt = hand_written(GPT(cfg), mesh, cfg.num_layers)
    replica = mesh["dp"].get_local_rank()
    share = args.batch // 2

    def hand_step(x, y):
        x, y = x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        report = loss.detach() / 2  # mean over the 2 replicas, as whalepy reports it
        dist.all_reduce(report)
        return report

    g = torch.Generator().manual_seed(1)
    times = {"whalepy": [], "hand": []}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        y = torch.roll(x, -1, dims=1)
        order = [("whalepy", pm.train_step), ("hand", hand_step)]
        if step % 2:
            order.reverse()
        for name, fn in order:
            dist.barrier()
            t = time.perf_counter()
            fn(x, y)
            dt = time.perf_counter() - t
            if step >= args.warmup:
                times[name].append(dt)
    if rank == 0:
        results.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, 4, os.path.join(tmp, "s"), args, results))
                 for r in range(4)]
        for p in procs:
            p.start()
        times = results.get(timeout=600)
        for p in procs:
            p.join()
    w, h = statistics.median(times["whalepy"]), statistics.median(times["hand"])
    print(f"DP x TP 2 x 2, 4 gloo processes, GPT {args.layers} layers hidden {args.hidden} seq {args.seq} "
          f"batch {args.batch}, {args.steps} interleaved steps each")
    print(f"  whalepy     median {w * 1e3:8.2f} ms/step")
    print(f"  hand-written median {h * 1e3:8.2f} ms/step")
    print(f"  ratio {w / h:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
