"""``whalepy check`` on the full-size plans of issue 23, every rank role lowered at full depth.

    python benchmarks/bench_rank_check.py gpt3 llama70b interleaved      # all three, every role
    python benchmarks/bench_rank_check.py gpt3 --ranks 0,517,1023        # chosen ranks
    python benchmarks/bench_rank_check.py gpt3 --layers 8                # CI's depth

The plans are tests/rank_check_cases.py's (GPT-3 175B on 1,024 A100, pp 8 x dp 16 x tp 8; Llama-70B
on 32 A100 + 32 L40S, uneven stages and batch shares; GPT-3 interleaved with tied embeddings on 1,024
A100); tests/test_rank_check_full.py lowers them in CI with 8 and 6 layers. Prints per rank its seconds
and what does not match the plan, then one line per case: roles, seconds (capture and plan / lowering),
ranks that match. docs/benchmarks.md has the figures with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def run(name: str, layers: int | None, ranks: str) -> str:
    from rank_check_cases import case

    from whalepy.tools.rank_check import check_ranks, roles, rank_layout, simulated

    t0 = time.perf_counter()
    c = case(name, layers)
    t1 = time.perf_counter()
    chosen: object = ranks if ranks in ("roles", "all") else [int(r) for r in ranks.split(",")]
    reports = check_ranks(c.plan.to_dict(), c.build, ranks=chosen, profile=c.profile,  # type: ignore[arg-type]
                          cluster=simulated(c.cluster), progress=lambda m: print(f"  {m}", flush=True))
    t2 = time.perf_counter()
    for rep in reports:
        print(f"  rank {rep.layout.rank} (stage {rep.layout.stage}, {rep.layout.device_type}, "
              f"{sum(len(ch) for ch in rep.layout.chunks)} blocks): {rep.seconds:.1f} s"
              + "".join(f"\n    MISMATCH {m}" for m in rep.mismatches), flush=True)
    n_roles = len(roles(rank_layout(c.plan.to_dict())))
    ok = sum(r.ok for r in reports)
    depth = "full depth" if layers is None else f"{layers} layers"
    return (f"{name} ({depth}): {c.plan.world_size} ranks, {n_roles} roles, lowered {len(reports)} "
            f"({', '.join(str(r.layout.rank) for r in reports)}); capture and plan {t1 - t0:.1f} s, lowering "
            f"{t2 - t1:.1f} s (slowest rank {max(r.seconds for r in reports):.1f} s); {ok} of {len(reports)} "
            "match the plan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", choices=("gpt3", "llama70b", "interleaved"))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    ap.add_argument("--ranks", default="roles", help="'roles' (default), 'all' or ranks such as 0,517,1023")
    args = ap.parse_args()
    lines = []
    for name in args.cases:
        print(f"{name}:", flush=True)
        lines.append(run(name, args.layers, args.ranks))
        print(lines[-1], flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print("\n".join(["", *lines, f"load average at the end: {' '.join(load)}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
