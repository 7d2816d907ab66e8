"""Overhead of whalepy's lowering against the same layout written by hand with the same PyTorch APIs,
in fp32 and in bf16.

DP x TP 2 x 2 on 4 CPU processes (gloo): the hand-written version is ``parallelize_module`` with
Colwise/Rowwise styles on the same modules, ``fully_shard`` per block and root over the ``dp`` axis
(reshard_after_forward=False, what whalepy lowers ZeRO-0 to under TP), AdamW, a plain step; in bf16
``fully_shard`` gets ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` and the
forward and loss run under ``torch.autocast``, as whalepy lowers a bf16 plan. whalepy's plan uses the
tensor-parallel rules its front end finds (``whalepy.profile``). The four models (whalepy and hand,
fp32 and bf16) live in the same processes and their steps alternate, so machine noise hits all alike;
the report is the median step time of each and the ratios (goal <= 1.03).

    python benchmarks/bench_runtime_overhead.py [--steps 30] [--layers 4] [--hidden 256]

``--compile``: instead, whalepy's fp32 step on the same plan eager and with compiled blocks
(``compile=True``: each block's modules under ``torch.compile``, inductor's C++ backend on CPU), the
two models in the same processes from the same weights on the same batches, steps alternating; it
reports the medians and their ratio, each compiled model's first step (the compile) apart, the blocks
that fell back to eager, and the largest loss difference between the two runs.

    python benchmarks/bench_runtime_overhead.py --compile [--steps 20]
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


def hand_written(model, mesh, num_layers, low):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for n in names:
        fully_shard(model.get_submodule(n), mesh=mesh["dp"], reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def worker(rank, world, store, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import whalepy
    from whalepy.models import GPT, GPTConfig
    from whalepy.runtime import make_plan, parallelize

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = GPTConfig(vocab_size=512, block_size=args.seq, num_layers=args.layers, num_heads=8,
                    hidden_size=args.hidden)
    example = (torch.zeros(2, args.seq, dtype=torch.long),)
    prof = whalepy.profile(GPT(cfg), example)
    rules = tuple(r for b in prof.blocks for r in b.tp_rules)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    replica = mesh["dp"].get_local_rank()
    share = args.batch // 2
    steps = {}
    if args.compile:
        return compile_worker(rank, args, cfg, example, prof, rules, results)
    for precision, low in (("fp32", None), ("bf16", torch.bfloat16)):
        plan = make_plan([b.name for b in prof.blocks], dp=2, tp=2, global_batch=args.batch,
                         tensor_parallel=rules, precision=precision, model_fingerprint=prof.fingerprint)
        torch.manual_seed(0)
        pm = parallelize(GPT(cfg), None, example_inputs=example, loss_fn=loss_fn,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=args.batch,
                         plan=plan, profile=prof)
        torch.manual_seed(0)
        model, opt = hand_written(GPT(cfg), mesh, cfg.num_layers, low)

        def hand_step(x, y, model=model, opt=opt, low=low):
            x, y = x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]
            with torch.autocast("cpu", dtype=low, enabled=low is not None):
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            report = loss.detach() / 2  # mean over the 2 replicas, as whalepy reports it
            dist.all_reduce(report)
            return report

        steps[f"whalepy {precision}"] = pm.train_step
        steps[f"hand {precision}"] = hand_step

    g = torch.Generator().manual_seed(1)
    times = {name: [] for name in steps}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        y = torch.roll(x, -1, dims=1)
        order = list(steps.items())
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


def compile_worker(rank, args, cfg, example, prof, rules, results):
    """``--compile``: whalepy eager and compiled on the same plan, alternating steps (module docstring)."""
    import torch.distributed as dist

    from whalepy.models import GPT
    from whalepy.runtime import make_plan, parallelize

    models = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        plan = make_plan([b.name for b in prof.blocks], dp=2, tp=2, global_batch=args.batch, tensor_parallel=rules,
                         model_fingerprint=prof.fingerprint, compile=compiled)
        torch.manual_seed(0)
        models[name] = parallelize(GPT(cfg), None, example_inputs=example, loss_fn=loss_fn,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=args.batch,
                                   plan=plan, profile=prof)
    g = torch.Generator().manual_seed(1)
    times = {name: [] for name in models}
    first = {}
    losses = {name: [] for name in models}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        y = torch.roll(x, -1, dims=1)
        order = list(models.items())
        if step % 2:
            order.reverse()
        for name, pm in order:
            dist.barrier()
            t = time.perf_counter()
            losses[name].append(pm.train_step(x, y).item())
            dt = time.perf_counter() - t
            if step == 0:
                first[name] = dt
            if step >= args.warmup:
                times[name].append(dt)
    stats = models["compiled"].compile_stats
    if rank == 0:
        results.put({"times": times, "first": first, "fell_back": stats.fell_back, "modules": stats.modules,
                     "loss_diff": max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))})
    dist.barrier()
    dist.destroy_process_group()


def print_compile(args, out):
    e, c = (statistics.median(out["times"][n]) for n in ("eager", "compiled"))
    print(f"DP x TP 2 x 2, 4 gloo processes, GPT {args.layers} layers hidden {args.hidden} seq {args.seq} "
          f"batch {args.batch}, fp32, {args.steps} interleaved steps each after {args.warmup} warm-up (medians); "
          f"torch {torch.__version__}, inductor CPU backend")
    print(f"  eager {e * 1e3:.2f} ms, compiled {c * 1e3:.2f} ms, ratio compiled / eager {c / e:.3f}")
    print(f"  first step (compiling): compiled {out['first']['compiled']:.1f} s, eager {out['first']['eager']:.2f} s")
    print(f"  compiled modules {out['modules']}, fell back to eager: {out['fell_back'] or 'none'}")
    print(f"  largest loss difference eager vs compiled over {args.warmup + args.steps} steps: {out['loss_diff']:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="eager vs compiled blocks (module docstring)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, 4, os.path.join(tmp, "s"), args, results))
                 for r in range(4)]
        for p in procs:
            p.start()
        times = results.get(timeout=3600)
        for p in procs:
            p.join()
    if args.compile:
        return print_compile(args, times)
    print(f"DP x TP 2 x 2, 4 gloo processes, GPT {args.layers} layers hidden {args.hidden} seq {args.seq} "
          f"batch {args.batch}, {args.steps} interleaved steps each (medians)")
    print(f"  {'precision':<10}{'whalepy ms':>12}{'hand ms':>12}{'ratio':>8}")
    for precision in ("fp32", "bf16"):
        w, h = (statistics.median(times[f"{who} {precision}"]) for who in ("whalepy", "hand"))
        print(f"  {precision:<10}{w * 1e3:12.2f}{h * 1e3:12.2f}{w / h:8.3f}")
    print("  (goal: ratio <= 1.03)")

if __name__ == "__main__":
    main()
