"""Profile a 175B GPT-3-shaped model built on the meta device: wall time, CPU time, peak RSS.

    python benchmarks/bench_profile.py            # median of 3 runs, each in a fresh process
    python benchmarks/bench_profile.py --runs 1 --layers 24

Each run builds HF ``GPT2LMHeadModel(GPT2Config(n_layer=96, n_embd=12288, n_head=96,
n_positions=2048, vocab_size=50257, use_cache=False))`` under ``torch.device("meta")`` and calls
``whalepy.profile`` on ``input_ids`` of shape ``[1, 2048]``. A fresh process per run makes the peak
RSS (``resource.getrusage``) that of one profile and includes the first-export warm-up a user pays.
Targets on the 2-core development machine: under 15 s and under 4 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one_run(layers: int, hidden: int, heads: int, seq: int, batch: int) -> dict:
    import resource

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import whalepy

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                     vocab_size=50257, use_cache=False)
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    build_s = time.perf_counter() - start
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    cpu0, start = time.process_time(), time.perf_counter()
    prof = whalepy.profile(model, {"input_ids": ids}, model_name=f"gpt3-{layers}x{hidden}")
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    passes = prof.graph.meta.get("whalepy.pass_times", {})
    return {
        "profile_s": wall, "profile_cpu_s": cpu, "capture_s": prof.capture_time_s,
        "passes_s": sum(passes.values()), "model_build_s": build_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "nodes": len(prof.graph.graph.nodes), "blocks": len(prof.blocks),
        "params": prof.total_params, "train_tflops": prof.train_flops / 1e12,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (args.layers, args.hidden, args.heads, args.seq, args.batch)
    if args.one:
        print(json.dumps(one_run(*shape)))
        return
    results = []
    for i in range(args.runs):
        cmd = [sys.executable, __file__, "--one", "--layers", str(args.layers), "--hidden",
               str(args.hidden), "--heads", str(args.heads), "--seq", str(args.seq), "--batch",
               str(args.batch)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        r = results[-1]
        print(f"run {i + 1}: profile {r['profile_s']:.2f} s (cpu {r['profile_cpu_s']:.2f} s; capture "
              f"{r['capture_s']:.2f} s, passes {r['passes_s']:.2f} s), peak RSS "
              f"{r['peak_rss_gb']:.2f} GB, {r['nodes']} nodes, {r['blocks']} blocks", flush=True)
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"\nGPT-3-shaped {args.layers}x{args.hidden} ({med['params'] / 1e9:.1f}B params), batch "
          f"{args.batch} x seq {args.seq}, median of {len(results)} runs:")
    print(f"  whalepy.profile: {med['profile_s']:.2f} s wall, {med['profile_cpu_s']:.2f} s CPU "
          f"(capture {med['capture_s']:.2f} s, passes {med['passes_s']:.2f} s)")
    print(f"  peak RSS: {med['peak_rss_gb']:.2f} GB; meta model build {med['model_build_s']:.2f} s")
    print(f"  {med['train_tflops']:,.0f} TFLOPs per training step")


if __name__ == "__main__":
    main()
