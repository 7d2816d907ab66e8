"""Chunked, trace-driven parameter placement (PatrickStar) against static per-block placement: parameter
bytes fetched over the host link per iteration, for a GPT whose parameters do not all fit next to its
activations. Both replay the same warm-up trace (``whalepy.trace_memory``) on CPU; the device budget is
the activation peak plus a fraction of the parameters. Results go into docs/benchmarks.md.

    python benchmarks/bench_chunk_placement.py
"""

from __future__ import annotations

import torch

import whalepy
from whalepy._chunk_placement import block_module_accesses, chunk_traffic, static_block_traffic
from whalepy.models import GPT, GPTConfig
from whalepy.profile import profile


def run(layers: int = 8, hidden: int = 512, seq: int = 128, batch: int = 2) -> list[str]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, block_size=seq, num_layers=layers, num_heads=4, hidden_size=hidden))
    x = torch.randint(0, 1024, (batch, seq))
    prof = profile(model, (x,))
    trace = whalepy.trace_memory(model, x)
    acc, sizes = block_module_accesses(model, prof, trace)
    total = sum(sizes.values())
    chunk = max(sizes.values()) // 2
    rows = [f"GPT {layers} layers, hidden {hidden}, seq {seq}, batch {batch}: parameters {total / 2**20:.1f} MiB, "
            f"activation peak {trace.peak_saved_bytes / 2**20:.1f} MiB, chunk {chunk / 2**20:.2f} MiB",
            "| budget: peak + share of params | static per-block MiB fetched | chunked MiB fetched | ratio |",
            "|---|---|---|---|"]
    for frac in (0.2, 0.4, 0.6, 0.8):
        budget = int(trace.peak_saved_bytes + frac * total)
        try:
            st = static_block_traffic(acc, sizes, budget)
        except ValueError:
            st = None
        try:
            ch = chunk_traffic(acc, sizes, budget, chunk)
        except ValueError:
            ch = None
        fmt = lambda b: "does not fit" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
        ratio = f"{ch / st:.2f}" if st and ch is not None else "-"
        rows.append(f"| {frac:.0%} | {fmt(st)} | {fmt(ch)} | {ratio} |")
    return rows


if __name__ == "__main__":
    print("\n".join(run()))
