"""Chunked, trace-driven placement of model data (PatrickStar) against static per-block placement,
replayed on a measured warm-up trace.

    python benchmarks/bench_chunk_placement.py [--layers 8] [--hidden 128] [--batch 8] [--seq 128]

One real training iteration of a GPT is traced on CPU (``whalepy.trace_memory``): the order in which
blocks run (forward, then backward) and, while each runs, the non-model bytes alive (activations,
temporaries, gradients). A device of capacity C then holds the parameters that fit beside them; the
others come from host memory when used. Bytes fetched per iteration, for capacities between "one
block's parameters fit" and "everything fits":

- static: a fixed set of blocks stays resident for the whole iteration; it must fit beside the
  iteration's peak non-model bytes and a buffer for the largest fetched block. Every use of another
  block fetches it (forward and backward).
- chunked (PatrickStar, Fang et al. 2021, Sec. 4-5): parameters packed into fixed-size chunks in first
  use order (a chunk size of a quarter of a transformer block's parameters by default); the budget for chunks follows the trace (C minus the non-model bytes of the moment), and
  when a chunk must come in, the resident chunks used furthest in the future leave first (Belady's
  rule, which the warm-up trace makes possible). Parameters are not modified in forward/backward, so
  an eviction moves nothing back.

Both count a steady-state iteration (no first fill). The replay counts bytes; it does not time
copies. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import whalepy
from whalepy.models import GPT, GPTConfig

MIB = 1 << 20


def uses_from_trace(trace: whalepy.MemoryTrace) -> list[tuple[str, int]]:
    """(block, non-model bytes while it runs) for every block use of the iteration, in order."""
    peaks = trace.by_block()
    return [(b, peaks.get((phase, b), 0)) for phase in ("forward", "backward") for b in trace.block_order[phase]]


def static_fetched(uses: list[tuple[str, int]], sizes: dict[str, int], capacity: int) -> int | None:
    """Bytes fetched with the largest resident set (largest blocks first) that fits beside the peak
    non-model bytes and a buffer for the largest non-resident block; None when nothing fits."""
    peak = max(n for _, n in uses)
    order = sorted(sizes, key=sizes.get, reverse=True)
    best = None
    for k in range(len(order) + 1):
        resident = set(order[:k])
        buffer = max((sizes[b] for b in order[k:]), default=0)
        if peak + sum(sizes[b] for b in resident) + buffer <= capacity:
            best = sum(sizes[b] for b, _ in uses if b not in resident)
    return best


def chunk_layout(uses: list[tuple[str, int]], sizes: dict[str, int], chunk: int) -> dict[str, list[int]]:
    """Chunks each block's parameters occupy, packed in first-use order."""
    out: dict[str, list[int]] = {}
    offset = 0
    for b, _ in uses:
        if b in out:
            continue
        first, last = offset // chunk, (offset + max(sizes[b], 1) - 1) // chunk
        out[b] = list(range(first, last + 1))
        offset += sizes[b]
    return out


def chunked_fetched(uses: list[tuple[str, int]], sizes: dict[str, int], capacity: int, chunk: int) -> int | None:
    """Bytes fetched in a steady-state iteration: the trace replayed twice (the device starts empty),
    the second counted, as the static count has no first fill either."""
    layout = chunk_layout(uses, sizes, chunk)
    twice = uses + uses
    need = [layout[b] for b, _ in twice]
    resident: set[int] = set()
    fetched = 0
    for i, ((_, nonmodel), chunks) in enumerate(zip(twice, need)):
        if i == len(uses):
            fetched = 0
        budget = (capacity - nonmodel) // chunk
        if len(chunks) > budget:
            return None

        def next_use(c: int, i: int = i) -> int:
            return next((j for j in range(i + 1, len(need)) if c in need[j]), len(need))

        for c in chunks:
            if c in resident:
                continue
            while len(resident) >= budget:
                victim = max((r for r in resident if r not in chunks), key=next_use)
                resident.discard(victim)
            resident.add(c)
            fetched += chunk
        while len(resident) > budget:  # the moment's budget shrank: leave as Belady says
            resident.discard(max((r for r in resident if r not in chunks), key=next_use))
    return fetched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--chunks-per-block", type=int, default=4, help="chunk size = one transformer block / this")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=args.seq, num_layers=args.layers, num_heads=4,
                          hidden_size=args.hidden))
    x = torch.randint(0, 512, (args.batch, args.seq))
    trace = whalepy.trace_memory(model, x, x, loss_fn=lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()))
    uses = uses_from_trace(trace)
    sizes = trace.block_param_bytes
    chunk = max(sizes["transformer.h.0"] // args.chunks_per_block, 1)
    total = sum(sizes.values())
    peak = max(n for _, n in uses)
    low = min(n for _, n in uses)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}: parameters "
          f"{total / MIB:.1f} MiB in {len(sizes)} blocks, non-model bytes {low / MIB:.1f} to {peak / MIB:.1f} MiB "
          f"over the iteration, chunk {chunk / MIB:.2f} MiB")
    print(f"{'capacity MiB':>12} {'static MiB':>11} {'chunked MiB':>12} {'chunked/static':>15}")
    for frac in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0):
        capacity = int(peak + max(sizes.values()) + frac * total)
        s = static_fetched(uses, sizes, capacity)
        c = chunked_fetched(uses, sizes, capacity, chunk)
        fmt = lambda v: "does not fit" if v is None else f"{v / MIB:.1f}"  # noqa: E731
        ratio = f"{c / s:.2f}" if s and c is not None else ("-" if s != 0 else "both 0" if c == 0 else "-")
        print(f"{capacity / MIB:>12.1f} {fmt(s):>11} {fmt(c):>12} {ratio:>15}")


if __name__ == "__main__":
    main()
