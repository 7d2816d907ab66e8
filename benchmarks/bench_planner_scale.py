"""Planning time at scale (issue 26): CPU seconds of one in-process ``plan_from_profile`` on a captured
profile (the capture is made once per model, outside the timing), median of ``--reps``; the plan it finds
and what the search proved.

    python benchmarks/bench_planner_scale.py                 # every case, median of 3
    python benchmarks/bench_planner_scale.py --case 175b-1024 --reps 1 --profile   # cProfile of one case
    python benchmarks/bench_planner_scale.py --reps 1 --work     # and HiGHS's work (iterations, nodes)

CPU time (``time.process_time``), not wall time: the machines these run on are shared, and the search is
limited by work, not by the clock, so its CPU time does not depend on the load. Results go into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

A100 = {"gpu": "A100-80GB", "gpus_per_node": 8, "intra_node": "nvswitch", "cpu_memory_gb": 2048,
        "network": {"bandwidth_gbps": 1600}}


def _a100(nodes: int) -> dict:
    return {"network": {"bandwidth_gbps": 1600}, "groups": [{"name": "a100", "nodes": nodes, **A100}]}


_TYPES = [  # (name, gpu, intra-node link, host GiB, node network Gb/s)
    ("a100", "A100-80GB", "nvswitch", 2048, 1600),
    ("l40s", "L40S", "pcie4", 1024, 400),
    ("h100", "H100-SXM", "nvswitch", 2048, 3200),
    ("a100s", "A100-40GB", "nvswitch", 1024, 1600),
]


def _mixed(kinds: int) -> dict:
    """64 GPUs (8 nodes of 8) of ``kinds`` types: 4+4, 4+2+2, 2+2+2+2 nodes."""
    nodes = {2: (4, 4), 3: (4, 2, 2), 4: (2, 2, 2, 2)}[kinds]
    groups = [{"name": n, "gpu": g, "gpus_per_node": 8, "nodes": k, "intra_node": link, "cpu_memory_gb": mem,
               "network": {"bandwidth_gbps": bw}} for (n, g, link, mem, bw), k in zip(_TYPES, nodes)]
    return {"network": {"bandwidth_gbps": 400}, "groups": groups}


CASES = {  # key: (label, model, seq_len, cluster dict, global batch)
    "175b-64": ("GPT-3 175B on 64 A100", "gpt3-175b", 2048, _a100(8), 1536),
    "175b-256": ("GPT-3 175B on 256 A100", "gpt3-175b", 2048, _a100(32), 1536),
    "175b-1024": ("GPT-3 175B on 1,024 A100", "gpt3-175b", 2048, _a100(128), 1536),
    "175b-4096": ("GPT-3 175B on 4,096 A100", "gpt3-175b", 2048, _a100(512), 1536),
    "175b-16384": ("GPT-3 175B on 16,384 A100", "gpt3-175b", 2048, _a100(2048), 1536),
    "175b-1024-b512": ("GPT-3 175B on 1,024 A100, global batch 512", "gpt3-175b", 2048, _a100(128), 512),
    "70b-2types": ("Llama-70B on 64 GPUs of 2 types", "llama-70b", 4096, _mixed(2), 64),
    "70b-3types": ("Llama-70B on 64 GPUs of 3 types", "llama-70b", 4096, _mixed(3), 64),
    "70b-4types": ("Llama-70B on 64 GPUs of 4 types", "llama-70b", 4096, _mixed(4), 64),
}


@functools.cache
def profile_of(model: str, seq_len: int):  # type: ignore[no-untyped-def]
    from whalepy.frontend.profile import profile
    from whalepy.models.zoo import build

    m, inputs = build(model, batch=1, seq_len=seq_len)
    return profile(m, inputs)


def cluster_of(spec: dict):  # type: ignore[no-untyped-def]
    from whalepy.hardware.cluster import ClusterSpec

    return ClusterSpec.from_dict(spec)


WORK: dict[str, int] = {}
"""With ``--work``: HiGHS runs, simplex iterations and branch-and-bound nodes of the last repetition, the
search's work in units that do not depend on the machine's load (HiGHS runs deterministically)."""


def count_work() -> None:
    """Wrap the solver call of the ILPs and of the bound (planner/_solvers.py) to add up its work."""
    import whalepy.planner._bound as bound
    import whalepy.planner._solvers as solvers
    import whalepy.planner.ilp as ilp

    made = []
    new_highs = solvers._highs

    def highs():  # type: ignore[no-untyped-def]
        h = new_highs()
        made.append(h)
        return h

    solvers._highs = highs
    for mod, tag in ((ilp, "ilp"), (bound, "bound")):
        def counted(*args, _solve=mod._solve_highs, _tag=tag, **kwargs):  # type: ignore[no-untyped-def]
            out = _solve(*args, **kwargs)
            info = made[-1].getInfo()
            for k, x in (("runs", 1), ("iterations", info.simplex_iteration_count),
                         ("nodes", max(0, info.mip_node_count))):
                WORK[f"{_tag} {k}"] = WORK.get(f"{_tag} {k}", 0) + x
            return out
        mod._solve_highs = counted


def run_case(key: str, reps: int) -> dict:
    from whalepy.planner import plan_from_profile

    label, model, seq, spec, gb = CASES[key]
    prof = profile_of(model, seq)
    cluster = cluster_of(spec)
    cpu, wall, plan = [], [], None
    for _ in range(reps):
        WORK.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        plan = plan_from_profile(prof, cluster, global_batch=gb)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    assert plan is not None
    s = plan.solver
    return {"case": label, "cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
            "step_s": plan.cost.step_time_s, "candidates": s.num_candidates, "status": s.status,
            "gap": s.mip_gap, "work": dict(WORK),
            "plan": (f"pp{plan.pp_degree} tp{max(plan.tp_degrees)} dp{plan.dp_degree} M{plan.num_microbatches} "
                     f"{plan.schedule.value}{' v' + str(plan.virtual_stages) if plan.virtual_stages > 1 else ''} "
                     f"zero{max(st.zero_stage for st in plan.stages)}")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (repeatable)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the search of each case, top 25 by cumtime")
    ap.add_argument("--work", action="store_true", help="also the HiGHS work: runs, simplex iterations and "
                    "branch-and-bound nodes of the ILPs and of the bound (the same on any machine load)")
    args = ap.parse_args()
    if args.work:
        count_work()
    keys = args.case or list(CASES)
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().strip()}", file=sys.stderr)
    print("| case | CPU s (median) | wall s | plan | step s | candidates | status |")
    print("|---|---|---|---|---|---|---|")
    for key in keys:
        if args.profile:
            import cProfile
            import pstats

            label, model, seq, _, _ = CASES[key]
            profile_of(model, seq)
            pr = cProfile.Profile()
            pr.enable()
            r = run_case(key, 1)
            pr.disable()
            pstats.Stats(pr, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        else:
            r = run_case(key, args.reps)
        gap = f" gap {100 * r['gap']:.2g}%" if r["gap"] else ""
        print(f"| {r['case']} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | {r['plan']} | {r['step_s']:.4g} | "
              f"{r['candidates']} | {r['status']}{gap} |"
              + (" " + ", ".join(f"{k} {x}" for k, x in r["work"].items()) + " |" if args.work else ""), flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().strip()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
