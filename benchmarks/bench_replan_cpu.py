"""The closed loop on this machine's CPU: how much closer re-planning from a run's measurements predicts.

Two gloo processes (one intra-op thread each) train a small GPT under a set of forced layouts. For each
layout:

1. ``whalepy.estimate`` predicts the step from the plain profile (the analytic model: ``before``);
2. both ranks train it with ``whalepy.parallelize(plan=...)``: the plan check times steps 3-5, step 6
   is timed per block (``pm.measured_profile()``), and steps 7 to 6 + ``--steps`` are timed apart
   (the slowest rank's mean, hooks off): the ``measured`` step;
3. ``estimate_from_profile`` predicts the same layout again from ``pm.measured_profile()`` (``after``).

Printed: one row per layout with both predictions, the measured step and the two errors, and the
median |error| before and after.

    python benchmarks/bench_replan_cpu.py [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

GLOBAL_BATCH = 8
SHAPE = dict(vocab_size=512, block_size=64, num_layers=8, num_heads=4, hidden_size=128)

LAYOUTS = [
    ("DP2 ZeRO-0", dict(dp=2)),
    ("DP2 ZeRO-3", dict(dp=2, zero_stage=3)),
    ("DP2 checkpoint all", dict(dp=2, checkpoint=True)),
    ("TP2", dict(dp=1, tp=2)),
    ("PP2 1F1B M4", dict(dp=1, pp=2, num_microbatches=4, schedule="1f1b")),
    ("PP2 GPipe M2", dict(dp=1, pp=2, num_microbatches=2, schedule="gpipe")),
]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _build():
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SHAPE["vocab_size"], (GLOBAL_BATCH, SHAPE["block_size"]), generator=g)
    return model, x, torch.roll(x, -1, dims=1)


def worker(steps: int) -> list[dict]:
    import torch.distributed as dist

    import whalepy
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    model, x, y = _build()
    prof = whalepy.profile(model, (x[:1],))
    cluster = whalepy.ClusterSpec.local(2)
    rows = []
    for label, fields in LAYOUTS:
        cfg = ParallelConfig(**fields)
        before = estimate_from_profile(prof, cluster, cfg, global_batch=GLOBAL_BATCH)
        model, x, y = _build()
        pm = whalepy.parallelize(model, None, plan=before.plan, example_inputs=(x[:1],), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=GLOBAL_BATCH)
        for _ in range(6):
            pm.train_step((x,), y)
        measured_prof = pm.measured_profile()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            pm.train_step((x,), y)
        dist.barrier()
        wall = torch.tensor([(time.perf_counter() - t0) / steps])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        after = estimate_from_profile(measured_prof, cluster, cfg, global_batch=GLOBAL_BATCH)
        rows.append({"layout": label, "before": before.step_time_s, "after": after.step_time_s,
                     "measured": float(wall), "check": pm.observed.step_s,
                     "sampled": pm.observed.timing.step_s,
                     "kept": len(measured_prof.measured.times)})
        pm.close()
    return rows


def main() -> None:
    from dist_harness import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    t0 = time.perf_counter()
    rows = run_distributed(worker, 2, args.steps, timeout=3000)[0]
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    print(f"command: python benchmarks/bench_replan_cpu.py --steps {args.steps}")
    print(f"load (1/5/15 min) before {' '.join(load_before)}, after {' '.join(load_after)}; "
          f"{os.cpu_count()} cores; torch {torch.__version__}; wall {time.perf_counter() - t0:.0f} s")
    print("\n| layout | before ms | after ms | measured ms | error before | error after | plan check ms | "
          "step 6 ms | distinct blocks kept |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {1e3 * r['before']:.1f} | {1e3 * r['after']:.1f} | {1e3 * r['measured']:.1f} | "
              f"{100 * (r['before'] / r['measured'] - 1):+.1f}% | {100 * (r['after'] / r['measured'] - 1):+.1f}% | "
              f"{1e3 * r['check']:.1f} | {1e3 * r['sampled']:.1f} | {r['kept']} |")
    b = [abs(r["before"] / r["measured"] - 1) for r in rows]
    a = [abs(r["after"] / r["measured"] - 1) for r in rows]
    print(f"\nmedian |error|: before {100 * statistics.median(b):.1f}%, after {100 * statistics.median(a):.1f}%")


if __name__ == "__main__":
    main()
