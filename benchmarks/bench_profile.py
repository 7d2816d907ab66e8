"""Profile GPT-3-175B- and Llama-3-shaped models built on the meta device: wall, CPU, peak RSS.

    python benchmarks/bench_profile.py                    # all three models, median of 3 runs each
    python benchmarks/bench_profile.py --model gpt3-175b --runs 1 --layers 24
    python benchmarks/bench_profile.py --full             # without truncated capture

Models (meta device, batch 1; ``--layers`` / ``--seq`` / ``--batch`` override):

- ``gpt3-175b``: HF ``GPT2LMHeadModel(GPT2Config(n_layer=96, n_embd=12288, n_head=96,
  n_positions=2048, vocab_size=50257, use_cache=False))``, ``input_ids`` ``[1, 2048]``;
- ``llama3-8b``: HF ``LlamaForCausalLM`` with hidden 4096, 32 layers, 32 heads, 8 KV heads,
  intermediate 14336, vocab 128256, ``input_ids`` ``[1, 8192]``;
- ``llama3-70b``: hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate 28672, vocab 128256,
  ``input_ids`` ``[1, 8192]``.

Each run is a fresh process, so the peak RSS (``resource.getrusage``) is that of one profile and
the first-export warm-up a user pays is included. Targets: under 10 s for the 175B model, under
5 s for the Llama models, end to end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


MODELS = ("gpt3-175b", "llama3-8b", "llama3-70b")


def build(name: str, layers: int | None, seq: int | None):
    import torch
    import transformers

    with torch.device("meta"):
        if name == "gpt3-175b":
            seq = seq or 2048
            cfg = transformers.GPT2Config(n_layer=layers or 96, n_embd=12288, n_head=96,
                                          n_positions=seq, vocab_size=50257, use_cache=False)
            return transformers.GPT2LMHeadModel(cfg), seq
        big = name == "llama3-70b"
        seq = seq or 8192
        cfg = transformers.LlamaConfig(
            hidden_size=8192 if big else 4096, num_hidden_layers=layers or (80 if big else 32),
            num_attention_heads=64 if big else 32, num_key_value_heads=8,
            intermediate_size=28672 if big else 14336, vocab_size=128256,
            max_position_embeddings=max(seq, 8192), rope_theta=500000.0, use_cache=False)
        return transformers.LlamaForCausalLM(cfg), seq


def one_run(name: str, layers: int | None, seq: int | None, batch: int, truncate: bool) -> dict:
    import resource

    import torch

    import whalepy

    start = time.perf_counter()
    model, seq = build(name, layers, seq)
    build_s = time.perf_counter() - start
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    cpu0, start = time.process_time(), time.perf_counter()
    prof = whalepy.profile(model, {"input_ids": ids}, model_name=name, truncate_repeated=truncate)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    passes = prof.graph.meta.get("whalepy.pass_times", {})
    return {
        "profile_s": wall, "profile_cpu_s": cpu, "capture_s": prof.capture_time_s,
        "passes_s": sum(passes.values()), "model_build_s": build_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "nodes": len(prof.graph.graph.nodes), "blocks": len(prof.blocks),
        "params": prof.total_params, "train_tflops": prof.train_flops / 1e12,
        "method": prof.capture_method,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=MODELS, action="append",
                    help="model(s) to profile (default: all three)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--full", action="store_true", help="capture every layer (truncate_repeated=False)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.model or list(MODELS)
    if args.one:
        print(json.dumps(one_run(names[0], args.layers, args.seq, args.batch, not args.full)))
        return
    for name in names:
        results = []
        for i in range(args.runs):
            cmd = [sys.executable, __file__, "--one", "--model", name, "--batch", str(args.batch)]
            cmd += ["--layers", str(args.layers)] if args.layers else []
            cmd += ["--seq", str(args.seq)] if args.seq else []
            cmd += ["--full"] if args.full else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            r = results[-1]
            print(f"{name} run {i + 1}: profile {r['profile_s']:.2f} s (cpu {r['profile_cpu_s']:.2f} s; "
                  f"capture {r['capture_s']:.2f} s, passes {r['passes_s']:.2f} s), peak RSS "
                  f"{r['peak_rss_gb']:.2f} GB, {r['nodes']} nodes, {r['blocks']} blocks, "
                  f"{r['method']}", flush=True)
        med = {k: statistics.median(r[k] for r in results) for k in results[0] if k != "method"}
        print(f"{name} ({med['params'] / 1e9:.2f}B params, {med['blocks']:.0f} blocks), median of "
              f"{len(results)} runs: whalepy.profile {med['profile_s']:.2f} s wall, "
              f"{med['profile_cpu_s']:.2f} s CPU (capture {med['capture_s']:.2f} s, passes "
              f"{med['passes_s']:.2f} s); peak RSS {med['peak_rss_gb']:.2f} GB; meta model build "
              f"{med['model_build_s']:.2f} s; {med['train_tflops']:,.0f} TFLOPs per training step\n",
              flush=True)


if __name__ == "__main__":
    main()
