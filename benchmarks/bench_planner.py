"""Planner benchmarks: end-to-end planning time (capture included, median of 3) and the mixed-cluster
comparison of hardware-aware planning against the homogeneous-slowest baseline.

    python benchmarks/bench_planner.py            # everything
    python benchmarks/bench_planner.py --quick    # one repetition, synthetic profiles (no capture)
    python benchmarks/bench_planner.py --mixed-tiers --reps 2   # granular tiers on / off, side by side

Results go into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ROOT / "examples" / "clusters"

CASES = [
    # (label, model, cluster file, global batch, seq_len, target seconds)
    ("gpt3-175b on 1,024 A100-80GB", "gpt3-175b", "a100_128x8.yaml", 1536, 2048, 10.0),
    ("gpt3-175b on 4,096 A100-80GB", "gpt3-175b", "a100_512x8.yaml", 1536, 2048, 30.0),
    ("llama3-8b seq 8192 batch 16 on 8x8 H100", "llama3-8b", "h100_8x8.yaml", 16, 8192, 5.0),
    ("llama-70b on 32 A100 + 32 L40S", "llama-70b", "mixed_a100_l40s_70b.yaml", 64, 4096, 5.0),
]

MIXED = [
    ("8 V100-32GB + 8 T4", "mixed_v100_t4.yaml"),
    ("16 A100-80GB + 16 V100-32GB", "mixed_a100_v100.yaml"),
    ("4 H100 + 12 A10", "mixed_h100_a10.yaml"),
    ("2 nodes P100 + 2 nodes V100", "mixed_p100_v100.yaml"),
]


def _profile(model: str, seq_len: int, synthetic: bool):  # type: ignore[no-untyped-def]
    if synthetic:
        from whalepy.planner.synthetic import gpt_profile

        return gpt_profile(model, seq_len=seq_len)
    from whalepy.frontend.profile import profile
    from whalepy.models.zoo import build

    m, inputs = build(model, batch=1, seq_len=seq_len)
    return profile(m, inputs)


def bench_end_to_end(reps: int, synthetic: bool) -> list[str]:
    from whalepy import ClusterSpec
    from whalepy.planner import plan_from_profile

    rows = ["| case | capture s | plan s | total s (median of %d) | target | plan |" % reps,
            "|---|---|---|---|---|---|"]
    for label, model, cfile, gb, seq, target in CASES:
        cluster = ClusterSpec.load(CLUSTERS / cfile)
        caps, plans, totals, desc = [], [], [], ""
        for _ in range(reps):
            t0 = time.perf_counter()
            prof = _profile(model, seq, synthetic)
            t1 = time.perf_counter()
            plan = plan_from_profile(prof, cluster, global_batch=gb)
            t2 = time.perf_counter()
            caps.append(t1 - t0)
            plans.append(t2 - t1)
            totals.append(t2 - t0)
            desc = (f"pp={plan.pp_degree} tp={max(plan.tp_degrees)} dp={plan.dp_degree} M={plan.num_microbatches} "
                    f"{plan.schedule.value}, {plan.cost.step_time_s:.3g} s/step, MFU {100 * plan.cost.mfu:.0f}%")
        med = statistics.median
        rows.append(f"| {label} | {med(caps):.2f} | {med(plans):.2f} | {med(totals):.2f} | < {target:g} | {desc} |")
        print(rows[-1], flush=True)
    return rows


def bench_mixed_tiers(reps: int) -> list[str]:
    """Search seconds with granular tiers (``mixed_tiers``, the default) and without, side by side on
    synthetic profiles, runs alternated; and the plans each finds."""
    from whalepy import ClusterSpec
    from whalepy.planner import plan_from_profile

    rows = [f"| case | mixed_tiers=False s ({reps} runs) | mixed_tiers=True s | plan (False) | plan (True) |",
            "|---|---|---|---|---|"]
    for label, model, cfile, gb, seq, _ in CASES:
        cluster = ClusterSpec.load(CLUSTERS / cfile)
        prof = _profile(model, seq, True)
        times: dict[bool, list[float]] = {False: [], True: []}
        desc = {}
        for _ in range(reps):
            for mixed in (False, True):
                t0 = time.perf_counter()
                plan = plan_from_profile(prof, cluster, global_batch=gb, mixed_tiers=mixed)
                times[mixed].append(time.perf_counter() - t0)
                tiers = sorted({f"{b.param_tier.value}/{b.optimizer_tier.value}" for s in plan.stages for b in s.blocks})
                desc[mixed] = (f"pp={plan.pp_degree} tp={max(plan.tp_degrees)} dp={plan.dp_degree} "
                               f"M={plan.num_microbatches}, {plan.cost.step_time_s:.3g} s/step, tiers {','.join(tiers)}")
        rows.append(f"| {label} | {', '.join(f'{x:.2f}' for x in times[False])} | "
                    f"{', '.join(f'{x:.2f}' for x in times[True])} | {desc[False]} | {desc[True]} |")
        print(rows[-1], flush=True)
    return rows


def bench_mixed(model: str, gb: int) -> list[str]:
    from whalepy import ClusterSpec
    from whalepy.planner import homogeneous_baseline, plan_from_profile
    from whalepy.planner.synthetic import gpt_profile

    prof = gpt_profile(model)
    rows = [f"| cluster ({model}, global batch {gb}) | baseline samples/s | hardware-aware samples/s | ratio | aware plan |",
            "|---|---|---|---|---|"]
    for label, cfile in MIXED:
        cluster = ClusterSpec.load(CLUSTERS / cfile)
        base = homogeneous_baseline(prof, cluster, global_batch=gb)
        aware = plan_from_profile(prof, cluster, global_batch=gb)
        ratio = aware.cost.samples_per_s / base.cost.samples_per_s
        desc = (f"pp={aware.pp_degree} dp={aware.dp_degree} tp={max(aware.tp_degrees)} shares "
                f"{sorted(set(aware.batch_shares))}")
        rows.append(f"| {label} | {base.cost.samples_per_s:.1f} | {aware.cost.samples_per_s:.1f} | {ratio:.2f}x | {desc} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 repetition, synthetic profiles")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--mixed-model", default="gpt2-xl")
    ap.add_argument("--mixed-batch", type=int, default=256)
    ap.add_argument("--mixed-tiers", action="store_true",
                    help="only: search time with and without granular tiers, side by side (synthetic profiles)")
    args = ap.parse_args()
    if args.mixed_tiers:
        print("\n".join(bench_mixed_tiers(args.reps)))
        return 0
    out = []
    if not args.skip_e2e:
        out += bench_end_to_end(1 if args.quick else args.reps, synthetic=args.quick)
        out.append("")
    out += bench_mixed(args.mixed_model, args.mixed_batch)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
