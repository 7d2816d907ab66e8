"""Predicted vs measured step time and peak memory of measured-planned layouts on this machine's CPU.

Two gloo processes (one intra-op thread each, as ``torchrun`` gives a rank on a CPU) run, for each
model, a set of forced layouts (DP with ZeRO-0/1/2/3, TP, PP with GPipe and 1F1B, activation
checkpointing, CPU offload, gradient accumulation):

1. the gloo "link" is measured: all-reduce time against message size as a step issues it (after a
   burst of compute; :func:`measure_link`), fitted to the ring model ``2(p-1)(a + n/(pB))`` (p = 2), and
   given to the cluster spec as ``intra_node: {bandwidth_gbs: B, latency_us: a}``;
2. before the ranks start, this process measures the model's distinct blocks on its CPU
   (``whalepy.profile(..., measure=True)``, one thread) at the micro-batch sizes and TP degrees the
   layouts use, plain and as the runtime lowers them (FSDP2 and DTensor on a fake process group, which
   needs a process outside the gloo job), and rank 0 predicts each layout's step time and per-rank peak
   memory from that profile on the measured cluster (``estimate_from_profile``);
3. both ranks train each layout with ``whalepy.parallelize(plan=...)`` for ``--warmup`` + ``--steps``
   steps (mean step time of the timed steps, the slowest rank's), and one more step under
   :func:`whalepy.trace_memory` gives each rank's peak tensor bytes (parameters, gradients, optimizer
   states, activations, temporaries; the CPU has no allocator peak to read).

Printed: one row per layout, the median and largest |error| of step time and memory, and the
Spearman rank correlation of predicted vs measured step times.

    python benchmarks/bench_predict_cpu.py [--steps 6] [--warmup 2] [--models gpt-deep,gpt-wide]
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

MODELS = {
    # name: (layers, hidden, heads, vocab, seq)
    "gpt-deep": (8, 128, 4, 512, 64),
    "gpt-wide": (4, 256, 8, 1024, 64),
}

LAYOUTS = [
    # label, ParallelConfig fields
    ("DP2 ZeRO-0", dict(dp=2)),
    ("DP2 ZeRO-1", dict(dp=2, zero_stage=1)),
    ("DP2 ZeRO-2", dict(dp=2, zero_stage=2)),
    ("DP2 ZeRO-3", dict(dp=2, zero_stage=3)),
    ("DP2 M2 (accumulation)", dict(dp=2, num_microbatches=2)),
    ("DP2 checkpoint all", dict(dp=2, checkpoint=True)),
    ("DP2 ZeRO-3 CPU offload", dict(dp=2, zero_stage=3, offload="cpu")),
    ("TP2", dict(dp=1, tp=2)),
    ("PP2 1F1B M4", dict(dp=1, pp=2, num_microbatches=4, schedule="1f1b")),
    ("PP2 GPipe M2", dict(dp=1, pp=2, num_microbatches=2, schedule="gpipe")),
]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(name):
    from whalepy.models import GPT, GPTConfig

    layers, hidden, heads, vocab, seq = MODELS[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads, hidden_size=hidden))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
    y = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
    return model, x, y


def _fit(rows):
    """Least-squares fit of ``t = 2a + n/B`` (ring all-reduce, p = 2) to ``(bytes, seconds)`` rows."""
    xs, ys = [n for n, _ in rows], [t for _, t in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 1e-6)
    return intercept / 2, 1 / max(slope, 1e-15)


def _fit_in_step(ar, ag):
    """Least squares of the cost model's own formula for two ranks (``communication.estimate_collective_time``
    with a per-call cost ``L``): all-reduce of ``n`` bytes ``L + 2a + n/B``, all-gather of ``n`` output
    bytes ``L + a + n/(2B)``; ``(L, a, B)`` with ``L, a >= 0`` (a negative one is dropped and the rest refit)."""
    rows = [(1.0, 2.0, n, t) for n, t in ar] + [(1.0, 1.0, n / 2, t) for n, t in ag]

    def solve(cols):
        x = torch.tensor([[r[c] for c in cols] for r in rows], dtype=torch.float64)
        y = torch.tensor([r[3] for r in rows], dtype=torch.float64).unsqueeze(1)
        return torch.linalg.lstsq(x, y).solution.squeeze(1).tolist()

    for cols in ((0, 1, 2), (0, 2), (1, 2)):
        sol = dict(zip(cols, solve(cols)))
        if all(v >= 0 for v in sol.values()) and sol.get(2, 0) > 0:
            return sol.get(0, 0.0), sol.get(1, 0.0), 1 / sol[2]
    return 0.0, 0.0, 1e9


def measure_link(sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22), repeats=15, burst_gemms=6, runs=5):
    """Gloo collectives between the 2 ranks, measured two ways:

    - idle: an all-reduce alone, both ranks waiting for it (a barrier before each), fitted to the ring model;
    - in a step, as the runtime issues them: each rank first computes (``burst_gemms`` 256x256 GEMMs, about
      the work of one small block) and then issues the collective; its cost is the time of the pair minus
      the compute alone (medians of ``runs`` runs of ``repeats`` back-to-back pairs), for an all-reduce and an
      all-gather of each size. On CPU ranks that share the cores, gloo's threads wake after the compute
      and the ranks arrive apart: each call costs about the same whatever its kind and size, which the
      idle figure does not see, so the fit has a per-call cost ``L`` besides the per-step latency ``a``
      and the bandwidth ``B`` (:func:`_fit_in_step`). A third figure issues the all-reduce asynchronously
      before the compute and waits after it (FSDP2's prefetch, DDP's buckets): its excess over the compute
      alone is what overlap hides (none on CPU, ``cost_models.communication.CPU_OVERLAP_LOSS``), and it
      joins the all-reduce rows of the fit, as a step issues most of its collectives that way.

    The in-step fit is the link given to the cluster spec: the planner charges what the step sees."""
    import torch.distributed as dist

    a = torch.randn(256, 256)

    def burst():
        for _ in range(burst_gemms):
            a @ a

    def per_iter(fn):
        for _ in range(2):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    def in_step(fn):
        comp = statistics.median(per_iter(burst) for _ in range(runs))
        return max(statistics.median(per_iter(lambda: (burst(), fn())) for _ in range(runs)) - comp, 1e-6), comp

    idle, ar, ag, overlapped = [], [], [], []
    for n in sizes:
        t = torch.ones(n // 4)
        half = torch.ones(n // 8)
        dist.all_reduce(t)
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            ts.append(time.perf_counter() - t0)
        idle.append((n, statistics.median(ts)))
        s_ar, comp = in_step(lambda: dist.all_reduce(t))
        s_ag, _ = in_step(lambda: dist.all_gather_into_tensor(t, half))

        def async_pair():
            w = dist.all_reduce(t, async_op=True)
            burst()
            w.wait()

        asy = statistics.median(per_iter(async_pair) for _ in range(runs))
        ar.append((n, s_ar))
        ag.append((n, s_ag))
        overlapped.append((n, max(asy - comp, 0.0)))
    # the fit takes the all-reduces both ways a step issues them: synchronously after compute (tensor
    # parallelism) and asynchronously before compute, waited after it (FSDP2's prefetch, DDP's buckets)
    call, lat, bw = _fit_in_step(ar + overlapped, ag)
    idle_lat, idle_bw = _fit(idle)
    return {"latency_s": lat, "bandwidth": bw, "call_latency_s": call, "idle_latency_s": idle_lat,
            "idle_bandwidth": idle_bw,
            "rows": [(n, i, s, g, o) for (n, i), (_, s), (_, g), (_, o) in zip(idle, ar, ag, overlapped)]}


def cluster_for(link):
    from whalepy import ClusterSpec

    return ClusterSpec.from_dict({"groups": [{"name": "cpu", "gpu": "CPU", "gpus_per_node": 2, "nodes": 1, "cpu_memory_gb": 8,
                                              "intra_node": {"bandwidth_gbs": link["bandwidth"] / 1e9,
                                                             "latency_us": link["latency_s"] * 1e6,
                                                             "call_latency_us": link.get("call_latency_s", 0.0) * 1e6}}]})


def measure(name, repeats=5):
    """Measured planning of ``name`` in this (non-distributed) process, one intra-op thread as a rank has:
    the blocks plain and as the runtime lowers them (FSDP2 and DTensor on a fake process group, which
    needs a process outside the gloo job)."""
    import whalepy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, _ = build(name)
        t0 = time.perf_counter()
        # device="cpu": the ranks' device; left out, a machine with a GPU would time the blocks there
        prof = whalepy.profile(model, (x,), measure=True, device="cpu", micro_batches=(1, 2, 4, 8), tp_degrees=(1, 2),
                               repeats=repeats)
        took = time.perf_counter() - t0
        import dataclasses

        return dataclasses.replace(prof, graph=None), took  # the graph does not pickle to the ranks
    finally:
        torch.set_num_threads(threads)


def predict(prof, cluster):
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    out = []
    for label, cfg in LAYOUTS:
        est = estimate_from_profile(prof, cluster, ParallelConfig(**cfg), global_batch=GLOBAL_BATCH)
        rank_mem = {}
        for st in est.plan.stages:
            for r in st.all_ranks:
                # a CPU rank's "device" and "host" are the same memory: offloaded states count too,
                # less the host gradients the backward makes after the device's peak
                rank_mem[r] = st.cost.memory_bytes + st.cost.cpu_bytes - st.cost.cpu_grads_bytes
        out.append((label, est.plan, est.step_time_s, rank_mem))
    return out


def train(name, plan, cluster, steps, warmup):
    import torch.distributed as dist

    import whalepy

    model, x, y = build(name)
    pm = whalepy.parallelize(model, cluster, plan=plan, example_inputs=(x,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=GLOBAL_BATCH)
    for _ in range(warmup):
        pm.train_step((x,), y)
    ts = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step((x,), y)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(float(t))
    peak = whalepy.trace_memory(pm, (x,), y).peak_bytes
    close = getattr(pm, "close", None)
    if close is not None:
        close()
    return statistics.median(ts), peak


def worker(names, profiles, steps, warmup):
    import torch.distributed as dist

    rank = dist.get_rank()
    link = measure_link()
    cluster = cluster_for(link)
    rows = []
    for name in names:
        box = [None]
        prof, took = profiles[name]
        if rank == 0:
            try:
                box = [predict(prof, cluster)]
            except Exception:  # noqa: BLE001 - rank 1 must not wait forever for the plans
                import traceback

                box = [traceback.format_exc()]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise RuntimeError(f"rank 0 failed to predict {name}:\n{box[0]}")
        preds = box[0]
        for label, plan, pred_s, rank_mem in preds:
            step_s, peak = train(name, plan, cluster, steps, warmup)
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, peak)
            err_mem = max(abs(rank_mem[r] / peaks[r] - 1) for r in range(len(peaks)))
            worst = max(range(len(peaks)), key=lambda r: abs(rank_mem[r] / peaks[r] - 1))
            rows.append(dict(model=name, layout=label, pred_s=pred_s, meas_s=step_s, pred_mem=rank_mem[worst],
                             meas_mem=peaks[worst], err_mem=rank_mem[worst] / peaks[worst] - 1, measure_s=took))
            if rank == 0:
                r = rows[-1]
                print(f"  {name:9s} {label:24s} predicted {1e3 * pred_s:7.1f} ms measured {1e3 * step_s:7.1f} ms "
                      f"({100 * (pred_s / step_s - 1):+.0f}%), memory {r['pred_mem'] / 2**20:6.1f} vs "
                      f"{r['meas_mem'] / 2**20:6.1f} MiB ({100 * r['err_mem']:+.0f}%)", file=sys.stderr, flush=True)
    return {"link": link, "rows": rows}


def spearman(a, b):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> None:
    from dist_harness import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per measured block shape (median)")
    args = ap.parse_args()
    names = args.models.split(",")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    t0 = time.perf_counter()
    profiles = {name: measure(name, args.repeats) for name in names}
    out = run_distributed(worker, 2, names, profiles, args.steps, args.warmup, timeout=3000)[0]
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    link, rows = out["link"], out["rows"]
    print(f"command: python benchmarks/bench_predict_cpu.py --steps {args.steps} --warmup {args.warmup} "
          f"--models {args.models} --repeats {args.repeats}")
    print(f"load (1/5/15 min) before {' '.join(load_before)}, after {' '.join(load_after)}; "
          f"{os.cpu_count()} cores; torch {torch.__version__}; wall {time.perf_counter() - t0:.0f} s")
    print(f"gloo all-reduce fit, idle: latency {link['idle_latency_s'] * 1e6:.1f} us per step, bandwidth "
          f"{link['idle_bandwidth'] / 1e9:.2f} GB/s; in a step (given to the cluster spec): per call "
          f"{link['call_latency_s'] * 1e6:.1f} us, latency {link['latency_s'] * 1e6:.1f} us per step, bandwidth "
          f"{link['bandwidth'] / 1e9:.2f} GB/s")
    print("ms by size (all-reduce idle / all-reduce after compute / all-gather after compute / all-reduce issued "
          "before compute, beyond the compute):",
          "; ".join(f"{n >> 10} KiB {1e3 * i:.2f} / {1e3 * s:.2f} / {1e3 * g:.2f} / {1e3 * o:.2f}"
                    for n, i, s, g, o in link["rows"]))
    print("\n| model | layout | predicted ms | measured ms | error | predicted MiB | measured MiB | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layout']} | {1e3 * r['pred_s']:.1f} | {1e3 * r['meas_s']:.1f} | "
              f"{100 * (r['pred_s'] / r['meas_s'] - 1):+.1f}% | {r['pred_mem'] / 2**20:.1f} | "
              f"{r['meas_mem'] / 2**20:.1f} | {100 * r['err_mem']:+.1f}% |")
    errs = [abs(r["pred_s"] / r["meas_s"] - 1) for r in rows]
    mems = [abs(r["err_mem"]) for r in rows]
    print(f"\nstep time |error|: median {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%; "
          f"memory |error|: median {100 * statistics.median(mems):.1f}%, max {100 * max(mems):.1f}%")
    for name in names:
        sub = [r for r in rows if r["model"] == name]
        print(f"Spearman {name}: {spearman([r['pred_s'] for r in sub], [r['meas_s'] for r in sub]):.3f} "
              f"(measuring its blocks took {sub[0]['measure_s']:.1f} s)")
    print(f"Spearman all: {spearman([r['pred_s'] for r in rows], [r['meas_s'] for r in rows]):.3f}")


if __name__ == "__main__":
    main()
