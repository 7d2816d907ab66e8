"""How much of ZeRO-Offload's host optimizer step hides behind the backward, on CPU processes (gloo).

Two models in the same processes, steps alternating: every block ``optimizer_tier = cpu`` (the host
optimizer: fused CPU AdamW per block on a background thread, started as FSDP2 hands over each block's
reduced gradients) and the same plan with every tier on the device (AdamW stepped after the backward).
Per step of the offloaded model the timeline is read from the host optimizer: the backward ends when the
training step calls ``HostOptimizer.finish``; each block's host step has a start and an end. Reported
(medians over the steps):

- ``opt``: the host steps' total time (sum over blocks, copies back included);
- ``hidden``: the part of it that ran before the backward ended;
- ``exposed``: from the end of the backward to the end of the last host step (what the step waits);
- the step times of both models, and the device optimizer's ``step()`` time of the other.

On a CPU the "device" and the host are the same memory and the same cores: the optimizer thread runs
on a core the backward leaves free only if the process has one (``torch.set_num_threads``, default 1
per process here, so on a 2-core machine one process has a core for each).

    python benchmarks/bench_offload_overlap.py [--world 1] [--layers 8] [--hidden 512] [--steps 10]
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


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(args, optimizer_tier, prof):
    from whalepy.models import GPT, GPTConfig
    from whalepy.runtime import make_plan, parallelize

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, num_layers=args.layers, num_heads=8,
                          hidden_size=args.hidden))
    plan = make_plan([b.name for b in prof.blocks], dp=args.world, zero_stage=args.zero, global_batch=args.batch,
                     optimizer_tier=optimizer_tier, model_fingerprint=prof.fingerprint)
    x = torch.randint(0, args.vocab, (2, args.seq))
    return parallelize(model, None, example_inputs=(x,), loss_fn=loss_fn,
                       optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1),
                       global_batch=args.batch, plan=plan, profile=prof)


def worker(rank, world, store_path, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    from whalepy.models import GPT, GPTConfig
    from whalepy.frontend.profile import profile

    with torch.device("meta"):
        meta = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, num_layers=args.layers, num_heads=8,
                             hidden_size=args.hidden))
    prof = profile(meta, (torch.randint(0, args.vocab, (2, args.seq), device="meta"),))
    off, dev = build(args, "cpu", prof), build(args, "gpu", prof)
    host = off.host_optimizer
    marks: dict[str, float] = {}
    finish = host.finish

    def timed_finish():
        marks["backward_end"] = time.perf_counter()
        finish()
        marks["finish_end"] = time.perf_counter()

    host.finish = timed_finish
    dev_step = dev.optimizer.step

    def timed_step(*a, **k):
        t = time.perf_counter()
        out = dev_step(*a, **k)
        marks["device_opt"] = time.perf_counter() - t
        return out

    dev.optimizer.step = timed_step
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        off.train_step(x, y)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        dev.train_step(x, y)
        t3 = time.perf_counter()
        if i < args.warmup:
            continue
        end = marks["backward_end"]
        opt = sum(e - s for _, s, e in host.timeline)
        hidden = sum(max(0.0, min(e, end) - s) for _, s, e in host.timeline)
        last = max(e for _, _, e in host.timeline)
        rows.append({"offload_step": t1 - t0, "device_step": t3 - t2, "opt": opt, "hidden": hidden,
                     "exposed": max(0.0, last - end), "finish_wait": marks["finish_end"] - end,
                     "backward": end - t0, "device_opt": marks["device_opt"], "blocks": len(host.timeline)})
    results.put((rank, rows))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=worker, args=(r, args.world, os.path.join(d, "store"), args, results))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    rows = got[0]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"world {args.world}, ZeRO-{args.zero}, GPT {args.layers} layers hidden {args.hidden} seq {args.seq} "
          f"vocab {args.vocab} batch {args.batch}, {args.threads} thread(s) per process, {args.steps} steps "
          f"(rank 0, medians, ms)")
    print("| step, offloaded | step, device optimizer | backward | host optimizer | hidden | exposed | "
          "device optimizer step |")
    print("|---|---|---|---|---|---|---|")
    ms = {k: 1e3 * v for k, v in med.items()}
    print(f"| {ms['offload_step']:.1f} | {ms['device_step']:.1f} | {ms['backward']:.1f} | {ms['opt']:.1f} | "
          f"{ms['hidden']:.1f} ({100 * med['hidden'] / med['opt']:.0f}%) | {ms['exposed']:.1f} | "
          f"{ms['device_opt']:.1f} |")
    print(f"host steps per training step: {int(med['blocks'])} blocks", file=sys.stderr)


if __name__ == "__main__":
    main()
