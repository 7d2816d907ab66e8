"""What measured planning's block clock adds to the step it times, on this machine's CPU.

Measured planning (``whalepy.frontend.measure.BlockClock``) cuts one forward + backward into per-block
intervals with hooks; whatever the hooks cost lands in the measured block times and so in every
prediction made from them. Three ways of running the same step of a GPT, alternated in rounds (one
intra-op thread, as a rank has), median seconds per step:

- plain: no hooks;
- clock: the block clock as measured planning uses it (forward pre-hooks, tensor hooks on each block's
  outputs for the backward);
- full backward hooks: forward pre-hooks and ``register_full_backward_pre_hook`` per block module, the
  way the clock marked backward before (each hooked module call gets an autograd function of its own).

    python benchmarks/bench_block_clock.py [--layers 8 --hidden 128 --heads 4 --vocab 512 --seq 64 --batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F


def main() -> None:
    from whalepy.frontend.measure import BlockClock
    from whalepy.models import GPT, GPTConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="steps per round and way")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, num_layers=args.layers,
                          num_heads=args.heads, hidden_size=args.hidden))
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    y = torch.randint(0, args.vocab, (args.batch, args.seq))
    blocks = {i: (f"transformer.h.{i}",) for i in range(args.layers)}
    named = dict(model.named_modules())

    def step() -> None:
        out = model(x)
        F.cross_entropy(out.reshape(-1, args.vocab), y.reshape(-1)).backward()
        for p in model.parameters():
            p.grad = None

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        return (time.perf_counter() - t0) / args.steps

    stamps: list[float] = []

    def stamp(*_: object) -> None:  # a hook that returns None leaves the arguments as they are
        stamps.append(time.perf_counter())

    def full_hooks() -> list:
        hs = []
        for path, in blocks.values():
            hs.append(named[path].register_forward_pre_hook(stamp))
            hs.append(named[path].register_full_backward_pre_hook(stamp))
        return hs

    for _ in range(3):
        step()
    ways: dict[str, list[float]] = {"plain": [], "clock": [], "full backward hooks": []}
    with open("/proc/loadavg") as f:
        load_before = " ".join(f.read().split()[:3])
    for _ in range(args.rounds):
        ways["plain"].append(timed())
        clock = BlockClock(model, blocks, lambda: None)
        ways["clock"].append(timed())
        clock.remove()
        hs = full_hooks()
        ways["full backward hooks"].append(timed())
        for h in hs:
            h.remove()
    with open("/proc/loadavg") as f:
        load_after = " ".join(f.read().split()[:3])
    base = statistics.median(ways["plain"])
    print(f"GPT {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}; {args.rounds} rounds "
          f"of {args.steps} steps per way; load before {load_before}, after {load_after}")
    for name, ts in ways.items():
        med = statistics.median(ts)
        print(f"  {name:20s} {1e3 * med:8.2f} ms per step  ({med / base:.3f} x plain)")


if __name__ == "__main__":
    main()
