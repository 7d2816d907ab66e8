"""Measured vs predicted step time and peak memory on the CUDA GPUs of this machine, and whalepy's step
against a plain PyTorch loop in the same precision.

Two models: a ~1.4B GPT (``whalepy.models.GPT``: hidden 2048, 24 layers, 16 heads, seq 1024, vocab
50257, untied head) and a ~1.2B HF Llama (Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads, 8
key/value heads, FFN 8192, vocab 128256, tied embeddings), global batch 4, AdamW. For each: whalepy
plans for ``ClusterSpec.local()`` (the visible GPUs, typed from their names; precision resolved from
the device: bf16 where supported, fp16 with loss scaling otherwise) and trains through
``parallelize``; then the same model trains in a plain loop (``torch.autocast`` in the plan's
precision, DDP when there are several GPUs, the same AdamW). Per step it prints the measured step time
and peak memory (``torch.cuda.max_memory_allocated``), the plan's predicted step time and memory for
this rank's stage, and the ratios; then the medians.

    python benchmarks/bench_gpu_step.py                       # one GPU
    torchrun --nproc-per-node 8 benchmarks/bench_gpu_step.py  # several
    python benchmarks/bench_gpu_step.py --smoke               # tiny models on CPU (CI: no rot)
    python benchmarks/bench_gpu_step.py --measure             # plan from the blocks measured here

``--smoke`` runs the same code on tiny models on the CPU (gloo, one process, the plan's default
precision for a CPU device type, fp32) so a test keeps the script working where no GPU is.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

GIB = 2**30


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def build(name: str, smoke: bool) -> tuple[torch.nn.Module, int, int]:
    """``(model, vocab, seq)`` built on the CPU in fp32 with seed 0."""
    torch.manual_seed(0)
    if name == "gpt":
        from whalepy.models import GPT, GPTConfig

        h, layers, heads, seq, vocab = (64, 2, 4, 32, 128) if smoke else (2048, 24, 16, 1024, 50257)
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads,
                             hidden_size=h)), vocab, seq
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, heads, kv, ffn, vocab, seq = ((64, 2, 4, 2, 128, 128, 32) if smoke
                                             else (2048, 16, 32, 8, 8192, 128256, 1024))
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                      max_position_embeddings=seq, tie_word_embeddings=True, use_cache=False,
                      attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg), vocab, seq


class Meter:
    """Step time (synchronised) and peak allocated memory on this rank's device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def time(self, fn: Any, *args: Any) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        fn(*args)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    def peak(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else float("nan")

    def say_held(self, what: str) -> None:
        """Say what is still allocated before a run: every byte of it is in that run's peak (the H200 run of
        2026-11-26 carried 5.28 GiB of the first model's parameters into every later peak)."""
        held = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        if held > 2**26:
            print(f"{what}: {held / GIB:.2f} GiB still allocated before the run; its peak includes them", flush=True)


def batches(vocab: int, seq: int, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def run_whalepy(name: str, args: argparse.Namespace, cluster: Any, meter: Meter) -> tuple[list, list, Any]:
    import whalepy

    model, vocab, seq = build(name, args.smoke)
    data = batches(vocab, seq, args.batch, args.warmup + args.steps)
    prof = None
    t0 = time.perf_counter()
    if args.measure and args.dump:  # what plan(measure=True) measures, kept: the tables and the plan go to --dump
        from whalepy.planner import planning_profile

        prof = planning_profile(model, cluster, example_inputs=(data[0][0][:1],), global_batch=args.batch,
                                measure=True, time_limit_s=args.plan_time_limit)
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, f"{name}_measured.json"), "w") as f:
            json.dump(prof.measured.to_dict(), f, indent=1)
    t_plan = time.perf_counter()
    pm = whalepy.parallelize(model, cluster, example_inputs=(data[0][0][:1],), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), global_batch=args.batch,
                             time_limit_s=args.plan_time_limit, measure=args.measure and prof is None,
                             **({"profile": prof} if prof is not None else {}))
    if dist.get_rank() == 0:  # where the bench's time goes (measuring, planning, lowering), and what the plan says
        print(f"{name}: measured {t_plan - t0:.1f} s, planned and lowered {time.perf_counter() - t_plan:.1f} s"
              f"{' (measured planning)' if args.measure else ''}", flush=True)
        for note in pm.plan.notes:
            print(f"{name}: plan note: {note}", flush=True)
    if args.dump:
        pm.plan.save(os.path.join(args.dump, f"{name}_plan.json"))
    del model
    times, peaks = [], []
    for i, (x, y) in enumerate(data):
        if i == args.warmup:
            meter.reset()
        dt = meter.time(pm.train_step, x, y)
        if i == 0 and dist.get_rank() == 0:
            print(f"{name}: whalepy first step {dt:.1f} s (compile={pm.plan.compile}, "
                  f"optimizer {pm.plan.optimizer_impl.value})", flush=True)
        if i >= args.warmup:
            times.append(dt)
            peaks.append(meter.peak())
    plan = pm.plan
    try:  # the block times the run itself measured on its 6th step, next to what the planner measured
        seen = pm.measured_profile() if args.dump else None
    except whalepy.WhalepyError:
        seen = None
    if seen is not None and seen.measured is not None and dist.get_rank() == 0:
        with open(os.path.join(args.dump, f"{name}_run_measured.json"), "w") as f:
            json.dump(seen.measured.to_dict(), f, indent=1)
    del pm
    return times, peaks, plan


def layers_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer layers of either model (what torchtitan compiles one by one)."""
    return model.model.layers if hasattr(model, "model") else model.transformer.h  # type: ignore[return-value]


def run_plain(name: str, args: argparse.Namespace, plan: Any, device: torch.device, meter: Meter,
              tuned: bool = False) -> tuple[list, list, float]:
    """The hand-written loop; ``tuned``: each transformer layer ``torch.compile``d (regional
    compilation) and torch's fused AdamW, as a user who tunes the loop by hand sets it up (torchtitan's
    defaults). Returns step times, peaks and the first (compiling) step's time."""
    model, vocab, seq = build(name, args.smoke)
    model.to(device)
    if tuned:
        for layer in layers_of(model):
            layer.compile()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, gradient_as_bucket_view=True)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision.value)
    scaler = torch.amp.GradScaler(device.type) if low is torch.float16 else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if tuned and device.type == "cuda" else None)
    share = args.batch // world
    data = batches(vocab, seq, args.batch, args.warmup + args.steps)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x[rank * share:(rank + 1) * share].to(device), y[rank * share:(rank + 1) * share].to(device)
        with torch.autocast(device.type, dtype=low, enabled=low is not None):
            loss = loss_fn(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    times, peaks, first = [], [], float("nan")
    for i, (x, y) in enumerate(data):
        if i == args.warmup:
            meter.reset()
        dt = meter.time(step, x, y)
        if i == 0:
            first = dt
        if i >= args.warmup:
            times.append(dt)
            peaks.append(meter.peak())
    return times, peaks, first


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fmt_gib(x: float) -> str:
    return "-" if x != x else f"{x / GIB:.2f}"  # nan: no CUDA


def report(name: str, plan: Any, rank: int, w: tuple[list, list], p: tuple[list, list],
           t: tuple[list, list, float] | None = None) -> None:
    stage = plan.stage_of_rank(rank)[0]
    pred_t, pred_m = plan.cost.step_time_s, stage.cost.memory_bytes
    print(f"{name}: plan pp={plan.pp_degree} dp={plan.dp_degree} tp={stage.tp_degree} ZeRO-{int(stage.zero_stage)} "
          f"{plan.precision.value} on {plan.rank_device_types[rank]}; predicted {pred_t * 1e3:.1f} ms/step, "
          f"{pred_m / GIB:.2f} GiB (rank {rank})")
    print(f"  {'step':>4} {'whalepy ms':>11} {'plain ms':>9} {'w/plain':>8} {'pred/w':>7} "
          f"{'whalepy GiB':>12} {'plain GiB':>10} {'pred/w mem':>11}")
    for i, (wt, wm, pt, pm) in enumerate(zip(*w, *p)):
        print(f"  {i:>4} {wt * 1e3:11.1f} {pt * 1e3:9.1f} {wt / pt:8.3f} {pred_t / wt:7.3f} "
              f"{_fmt_gib(wm):>12} {_fmt_gib(pm):>10} {pred_m / wm if wm == wm else float('nan'):11.3f}")
    wt, pt = statistics.median(w[0]), statistics.median(p[0])
    wm, pm = max(w[1]), max(p[1])
    print(f"  median {wt * 1e3:.1f} ms (whalepy) vs {pt * 1e3:.1f} ms (plain): ratio {wt / pt:.3f}; "
          f"predicted/measured time {pred_t / wt:.3f}; peak {_fmt_gib(wm)} vs {_fmt_gib(pm)} GiB, "
          f"predicted/measured memory {pred_m / wm if wm == wm else float('nan'):.3f}", flush=True)
    if t is not None:
        tt, tm = statistics.median(t[0]), max(t[1])
        print(f"  tuned hand loop (compiled layers, fused AdamW): median {tt * 1e3:.1f} ms, peak {_fmt_gib(tm)} GiB, "
              f"first step {t[2]:.1f} s; whalepy/tuned {wt / tt:.3f}, plain/tuned {pt / tt:.3f}", flush=True)


def _single_process_env() -> None:
    """Outside torchrun: one rank, so ``parallelize`` sees an ordinary launch."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _bad_flag(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags (None: nothing): counts below their least, a file where --dump's directory
    goes (found only after the run otherwise)."""
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--batch", args.batch, 1)):
        if value < least:
            return f"{flag} {value}: give {least} or more"
    if not args.plan_time_limit > 0:
        return f"--plan-time-limit {args.plan_time_limit}: give the planner's budget in seconds, e.g. 60"
    if args.dump is not None and os.path.isfile(args.dump):
        return f"--dump {args.dump} is a file; give a directory (created if missing)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("gpt", "llama", "both"), default="both")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="global batch")
    ap.add_argument("--plan-time-limit", type=float, default=60.0)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, 2 steps (CI)")
    ap.add_argument("--measure", action="store_true",
                    help="plan with measure=True: the blocks timed on this device first (docs/profiling.md)")
    ap.add_argument("--tuned", action="store_true",
                    help="a third column: the hand loop with compiled layers and fused AdamW (torchtitan's setup)")
    ap.add_argument("--only-whalepy", action="store_true", help="skip the plain (and tuned) loops")
    ap.add_argument("--dump", default=None, help="with --measure: write the measured tables and the plan here")
    args = ap.parse_args(argv)
    bad = _bad_flag(args)
    if bad:  # before the CUDA check and any work: one line, as argparse's own refusals exit
        print(f"bench_gpu_step.py: {bad}", file=sys.stderr)
        return 2
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    elif not torch.cuda.is_available():
        print("bench_gpu_step.py needs CUDA GPUs (none visible); --smoke runs tiny models on the CPU",
              file=sys.stderr)
        return 2
    _single_process_env()
    from whalepy import ClusterSpec

    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and not args.smoke:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    cluster = ClusterSpec.local(world) if device.type == "cuda" else ClusterSpec.local(world, device_type="CPU")
    meter = Meter(device)
    rank = dist.get_rank()
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
        print(f"{world} x {name}, torch {torch.__version__}, global batch {args.batch}, "
              f"{args.steps} timed steps after {args.warmup} warm-up")
    for name in (("gpt", "llama") if args.model == "both" else (args.model,)):
        meter.say_held(f"{name} whalepy")
        w_times, w_peaks, plan = run_whalepy(name, args, cluster, meter)
        _free()
        if args.only_whalepy:
            p_times, p_peaks = w_times, w_peaks
        else:
            meter.say_held(f"{name} plain loop")
            p_times, p_peaks, _ = run_plain(name, args, plan, device, meter)
            _free()
        tuned = None
        if args.tuned and not args.only_whalepy:
            meter.say_held(f"{name} tuned loop")
            tuned = run_plain(name, args, plan, device, meter, tuned=True)
            _free()
        if rank == 0:
            report(name, plan, rank, (w_times, w_peaks), (p_times, p_peaks), tuned)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
