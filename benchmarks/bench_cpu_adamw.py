"""torch's AdamW on host tensors, its three implementations side by side: ``fused=True`` (one vectorised
pass per tensor: what whalepy's ZeRO-Offload host optimizer steps with, ``runtime/host_optimizer.py``),
``foreach=True`` (what ``whalepy calibrate`` measured as ``adamw_cpu_s_per_1e8`` before it measured the
fused kernel too) and the default for CPU tensors (``foreach`` and ``fused`` unset: torch's single-tensor
loop; what a user's plain ``torch.optim.AdamW`` runs over FSDP2's host-offloaded shards).

Each step is timed in turn (fused, foreach, single, fused, ...) over the same number of fp32
parameters, split into ``--tensors`` tensors (a block's parameters), after one warm-up step each;
reported: the median seconds per 1e8 parameters and the ratios to foreach. ``cost_models/offload.py``'s
``FUSED_OVER_FOREACH_CPU_ADAMW`` is the fused / foreach ratio this prints (docs/cost_model.md, "Offload").

    python benchmarks/bench_cpu_adamw.py [--threads N] [--params 2e7] [--tensors 8] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

KINDS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}


def measure(num_params: int, tensors: int, repeats: int) -> dict[str, float]:
    """Median seconds per 1e8 parameters of one ``step()`` of each kind (module docstring)."""
    size = num_params // tensors
    opts = {}
    for kind, flags in KINDS.items():
        ps = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.randn(size)
        opts[kind] = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **flags)
        opts[kind].step()  # warm-up; the states are allocated here
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(repeats):
        for kind, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e8 / (size * tensors) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--params", type=float, default=2e7)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    s = measure(int(args.params), args.tensors, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.params:.3g} fp32 parameters in "
          f"{args.tensors} tensors, median of {args.repeats}")
    print("| kind | s per 1e8 parameters | / foreach |\n|---|---|---|")
    for kind, v in s.items():
        print(f"| {kind} | {v:.4f} | {v / s['foreach']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "s_per_1e8": s}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
